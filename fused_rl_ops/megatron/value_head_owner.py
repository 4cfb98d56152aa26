"""What `attach` keeps about a value head: the one model that owns it, and whether an optimizer trains it.

Ownership: attached, a value head is its model's submodule. Attached to a second model too (a
reference model given the policy's processor), it would be shared, and the second model's
`requires_grad_(False)` would freeze the policy's critic without a word. So `attach` claims the
head's parameters for its model, refuses a head whose parameters another live model owns, and
`detach` releases them. The owners are kept by weak references here, not on the parameters (an
attribute would travel into pickles and copies).

Training: an optimizer built from `model.parameters()` before `attach` does not hold the head, and
the head silently keeps its initial weights. `TrainingCheck` notices it: torch.optim's global step
hook records each optimizer step (Megatron's optimizers step a torch optimizer inside theirs). At
the model's first forward after a stepped optimizer holds some of the model's other parameters
themselves, the head's trainable parameters must be in an optimizer that stepped since `attach`,
themselves or as the fp32 main parameters Megatron's mixed-precision optimizers keep
(`param.main_param`); if not, one warning names them. Then the check ends. Limits: optimizers that
hold only copies of the model's parameters (Megatron's DistributedOptimizer: shards;
Float16OptimizerWithFloat16Params: fp32 copies of the bf16 / fp16 ones) start no check. They need
none: get_megatron_optimizer takes the model wrapped in Megatron's DDP, which `attach` must precede,
so they hold the head. A head trained by an optimizer of its own that steps less often than the
trunk's, with a forward in between, gets the warning too.
"""
import functools
import warnings
import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["TrainingCheck", "claim", "refuse_if_owned"]

_owners = WeakIdKeyDictionary()  # value-head parameter -> weakref.ref to the language model that owns it

_steps = 0  # optimizer steps in this process, so that "stepped since attach" is a comparison
_last_step = weakref.WeakKeyDictionary()  # optimizer -> the value of _steps after its last step
_step_hook = None  # registered by the first TrainingCheck


def refuse_if_owned(value_head):
    """A ValueError if another live model owns one of value_head's parameters."""
    for param in value_head.parameters():
        owner = _owners.get(param)
        if owner is not None and owner() is not None:
            raise ValueError(
                "attach: this value head is already attached to another model; give the reference "
                "model its own rl_output_processor without value_head (a value head trains with one "
                "model: detach that model first to move the head)"
            )


def claim(language_model, value_head):
    """Records language_model as the owner of value_head's parameters; returns the release step."""
    params = list(value_head.parameters())
    for param in params:
        _owners[param] = weakref.ref(language_model)
    return functools.partial(_release, params)


def _release(params):
    for param in params:
        _owners.pop(param, None)


def _record_step(optimizer, args, kwargs):
    global _steps
    _steps += 1
    _last_step[optimizer] = _steps


def _optimizer_params(optimizer):
    return [param for group in optimizer.param_groups for param in group["params"]]


class TrainingCheck:
    """A forward pre-hook on the language model that warns once if the value head is in no
    optimizer that trains (module docstring). `remove` takes it off."""

    def __init__(self, language_model, value_head):
        global _step_hook
        if _step_hook is None:
            _step_hook = register_optimizer_step_post_hook(_record_step)
        self.value_head = value_head
        self.attached_after_step = _steps
        self.optimizers_of_other_models = weakref.WeakSet()
        self.handle = language_model.register_forward_pre_hook(self)

    def remove(self):
        self.handle.remove()

    def __call__(self, language_model, args):
        stepped = [opt for opt, step in list(_last_step.items()) if step > self.attached_after_step]
        if not any(self._trains(language_model, optimizer) for optimizer in stepped):
            return
        self.remove()
        held = {id(param) for optimizer in stepped for param in _optimizer_params(optimizer)}
        untrained = [
            f"value_head.{name}" for name, param in self.value_head.named_parameters()
            if param.requires_grad and not {id(param), id(getattr(param, "main_param", param))} & held
        ]
        if untrained:
            warnings.warn(
                f"{type(language_model).__name__} with an attached value head: an optimizer holding "
                f"the model's parameters has stepped, but the value head's parameters ({', '.join(untrained)}) "
                "are in no optimizer that stepped since attach, so the value head does not train. "
                "Build the optimizer after attach (model.parameters() then includes the head), or "
                "add the head's parameters to it (optimizer.add_param_group)"
            )

    def _trains(self, language_model, optimizer):
        """Whether optimizer holds one of the model's parameters outside the head (cached as no)."""
        if optimizer in self.optimizers_of_other_models:
            return False
        head = {id(param) for param in self.value_head.parameters()}
        model = {id(param) for param in language_model.parameters()} - head
        if any(id(param) in model for param in _optimizer_params(optimizer)):
            return True
        self.optimizers_of_other_models.add(optimizer)
        return False
