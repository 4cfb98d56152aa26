"""attach / detach: make every forward (and schedule plan) of a Megatron model use an output processor.

`attach` unwraps Megatron's DDP / FSDP / Float16Module wrappers to the language model (a megatron-core
LanguageModule: anything else is refused, a Hugging Face model pointed to causal_lm_logprobs), refuses
a model whose configured SwiGLU clamp some module would ignore (mlp.check_clamp_not_dropped), then:

- GPTModel with the native hook (megatron-core >= 0.18): a forward pre-hook adds
  `output_processor=processor` to every call, and the model's `build_schedule_plan` gets the same
  processor. On the schedule-plan path megatron-core 0.19.2 forces two differences: its nodes carry
  only tensors, so the plan returns the tuple of the dict's values (in `output_names` order); and a
  dense last layer skips `decoder.final_layernorm`, so it is applied here before the processor.
  With MTP layers their heads' losses go through chosen_logprob too (mtp.route_mtp_loss).
- Models without the hook (HybridModel in 0.19.2): during each forward the output layer module is
  swapped for a stand-in that runs the processor, and the model returns the processor's dict. The
  tokens come through `output_processor_context={"tokens": ...}`; `labels` is refused (the model
  would compute its cross entropy over the stand-in's output). Models with MTP are refused.

A value head on the processor (`processor.value_head`: a module, or a weight nn.Parameter) becomes
the language model's submodule `value_head` on the stage that holds the output layer, so
`parameters()`, `state_dict()`, optimizers, Megatron's DDP and checkpoints see it; its parameters
are marked replicated over TP (each TP rank computes the values of the whole sequence, so their
gradients are complete and equal there), and must be the same on every TP rank (checked, a
collective over the TP group). Hence attach before wrapping the model in Megatron's
DistributedDataParallel (attach refuses a wrapped one), after Float16Module (the first forward warns
about a head whose dtype changed since attach: value_head_checks). A value head has one model at a
time: attach refuses one that another model owns, detach releases it; and a forward after an
optimizer step warns once if the head is in no optimizer that stepped (value_head_owner).

The processor and the MTP loss read the output weight (the tied embedding's) and a weight value head
without their modules' forwards; they run those modules' forward pre-hooks first, so that Megatron
DDP's overlapped parameter all-gather is waited for (output_layer).

Hooks run on `model(...)` calls, as Megatron's schedules make them; `model.forward(...)` bypasses them.
"""
import functools
import inspect

import torch
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.utils import unwrap_model

from .mlp import check_clamp_not_dropped
from .mtp import route_mtp_loss
from .output_layer import register_read_modules
from .value_head_checks import DtypeCheck, check_same_on_tensor_parallel_ranks
from .value_head_owner import TrainingCheck, claim, refuse_if_owned

__all__ = ["attach", "detach"]

_ATTACHMENT = "_fused_rl_ops_output_processor_undo"
_VALUE_HEAD = "value_head"  # the submodule name a processor's value head gets


def attach(model, processor):
    """Makes every forward (and schedule plan) of `model` use `processor`; see the module docstring."""
    language_model = unwrap_model(model)
    if not isinstance(language_model, LanguageModule):
        raise TypeError(
            f"attach: expected a megatron-core GPTModel or HybridModel (bare or inside Megatron's DDP, FSDP or "
            f"Float16Module), got {type(language_model).__module__}.{type(language_model).__qualname__}; for a "
            "Hugging Face model use fused_rl_ops.transformers.causal_lm_logprobs"
        )
    if getattr(language_model, _ATTACHMENT, None) is not None:
        raise RuntimeError("attach: this model already has an output processor attached; detach it first")
    check_clamp_not_dropped(language_model)
    value_head = _value_head_to_register(model, language_model, processor)
    if "output_processor" in inspect.signature(language_model.forward).parameters:
        undo = route_mtp_loss(language_model, processor) + _attach_through_native_hook(language_model, processor)
    else:
        undo = _attach_by_substituting_output_layer(language_model, processor)
    if value_head is not None:
        undo += _register_value_head(language_model, value_head)
    if getattr(language_model, "post_process", True):
        undo.append(register_read_modules(language_model.output_layer, _read_without_forward(language_model)))
    setattr(language_model, _ATTACHMENT, undo)


def detach(model):
    """Removes what `attach` added; the model computes its own output again."""
    language_model = unwrap_model(model)
    undo = getattr(language_model, _ATTACHMENT, None)
    if undo is None:
        raise RuntimeError("detach: no output processor is attached to this model")
    for step in undo:
        step()
    delattr(language_model, _ATTACHMENT)


def _read_without_forward(language_model):
    """The modules besides the output layer whose parameters the processor (or the MTP loss) reads
    without calling them: the one holding a tied output weight, a value head's weight holder."""
    modules = []
    if getattr(language_model, "share_embeddings_and_output_weights", False):
        tied = language_model.shared_embedding_or_output_weight()
        modules += [m for m in language_model.modules() if any(p is tied for p in m.parameters(recurse=False))]
    if isinstance(getattr(language_model, _VALUE_HEAD, None), _ValueHeadWeight):
        modules.append(language_model.value_head)
    return [module for module in modules if module is not language_model.output_layer]


def _value_head_to_register(model, language_model, processor):
    """The processor's value head as a module if this stage computes values, else None; refuses a
    value head given as a plain tensor (not a parameter), one another model owns, and a model whose
    parameters a data-parallel wrapper has already bucketed (the head would get no gradient reduction)."""
    value_head = getattr(processor, "value_head", None)
    if value_head is None or not getattr(language_model, "post_process", True):
        return None
    if isinstance(value_head, torch.nn.Parameter):
        value_head = _ValueHeadWeight(value_head)
    elif not isinstance(value_head, torch.nn.Module):
        raise TypeError(
            "attach: the processor's value_head is a plain tensor, which the model cannot own (its "
            "parameters(), state_dict() and optimizer would miss it); pass a module such as "
            "fused_rl_ops.ValueHead(hidden_size), or an nn.Parameter"
        )
    refuse_if_owned(value_head)
    if _wrapped_for_data_parallel(model, language_model):
        raise RuntimeError(
            "attach: the model is already wrapped in a data-parallel wrapper (Megatron's "
            "DistributedDataParallel or FSDP), whose buffers would leave the value head out; attach "
            "the processor before wrapping the model"
        )
    if hasattr(language_model, _VALUE_HEAD):
        raise RuntimeError(f"attach: the model already has an attribute {_VALUE_HEAD!r}; the value head would replace it")
    check_same_on_tensor_parallel_ranks(value_head, language_model.output_layer.tp_group)  # last: collective
    return value_head


def _register_value_head(language_model, value_head):
    """Adds value_head as the submodule `value_head`, its parameters marked replicated over TP and
    owned by this model, with the check that an optimizer trains it; returns the undo steps."""
    for param in value_head.parameters():
        param.tensor_model_parallel = False
        # Complete on every TP rank, unlike sequence-parallel norms' partial sums: no TP all-reduce.
        param.sequence_parallel = False
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    language_model.add_module(_VALUE_HEAD, value_head)
    release = claim(language_model, value_head)
    training_check = TrainingCheck(language_model, value_head)
    dtype_check = DtypeCheck(language_model, value_head)
    return [functools.partial(delattr, language_model, _VALUE_HEAD), release, training_check.remove, dtype_check.remove]


class _ValueHeadWeight(torch.nn.Module):
    """Holds a value head given as a bare weight parameter, so that the model owns it as
    `value_head.weight` (the key fused_rl_ops.ValueHead's weight has); the processor uses the
    parameter itself."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


def _wrapped_for_data_parallel(model, language_model):
    """Whether a Megatron data-parallel wrapper holds the model: in the wrappers `model` is inside,
    or (the inner module given) as the main_grad views its buffers give the parameters."""
    wrapper = model
    while wrapper is not language_model:
        if isinstance(wrapper, _BaseDataParallel):
            return True
        wrapper = wrapper.module
    return any(hasattr(param, "main_grad") for param in language_model.parameters())


def _refuse_explicit_processor(kwargs):
    if kwargs.get("output_processor") is not None:
        raise ValueError("an output processor is attached to this model; detach it before passing output_processor=")


def _attach_through_native_hook(model, processor):
    def add_processor(module, args, kwargs):
        _refuse_explicit_processor(kwargs)
        return args, {**kwargs, "output_processor": processor}

    hook = model.register_forward_pre_hook(add_processor, with_kwargs=True)
    build_schedule_plan = model.build_schedule_plan  # the class's method, bound to this model

    def build_schedule_plan_with_processor(*args, **kwargs):
        _refuse_explicit_processor(kwargs)
        plan_processor = _SchedulePlanProcessor(processor, _final_layernorm_skipped_by_schedule_plan(model))
        return build_schedule_plan(*args, output_processor=plan_processor, **kwargs)

    # An instance attribute shadows the class's method for this model only; detach deletes it.
    model.build_schedule_plan = build_schedule_plan_with_processor
    return [hook.remove, functools.partial(delattr, model, "build_schedule_plan")]


def _final_layernorm_skipped_by_schedule_plan(model):
    """The final layernorm when megatron-core's schedule plan would skip it, else None.

    In megatron-core 0.19.2 the plan applies decoder.final_layernorm in the MoE combine node of the
    last layer, or in the post-process node when this stage has no layers; a dense last layer
    applies none (the forward path applies it in TransformerBlock).
    """
    decoder = model.decoder
    final_layernorm = getattr(decoder, "final_layernorm", None)
    if final_layernorm is None or len(decoder.layers) == 0 or getattr(decoder.layers[-1], "is_moe_layer", False):
        return None
    return final_layernorm


class _SchedulePlanProcessor:
    """What `attach` passes to build_schedule_plan: restores the skipped final layernorm, and
    returns the processor's dict as a tuple, since the plan's nodes carry only tensors."""

    def __init__(self, processor, final_layernorm):
        self.processor = processor
        self.final_layernorm = final_layernorm

    def __call__(self, *, hidden_states, **kwargs):
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        outputs = self.processor(hidden_states=hidden_states, **kwargs)
        return tuple(outputs.values()) if isinstance(outputs, dict) else outputs


class _ProcessorOutputLayer(torch.nn.Module):
    """Takes a hook-less model's output layer's place for one forward: runs the processor on the
    hidden states and keeps its outputs; returns an empty [s, b, 0] "logits" tensor to the model."""

    def __init__(self, output_layer, processor, context, loss_mask, config):
        super().__init__()
        self.output_layer = output_layer
        self.processor = processor
        self.context = context
        self.loss_mask = loss_mask
        self.config = config
        self.outputs = None

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        self.outputs = self.processor(
            hidden_states=hidden_states,
            output_layer=self.output_layer,
            output_weight=weight,
            labels=None,
            loss_mask=self.loss_mask,
            runtime_gather_output=runtime_gather_output,
            context=self.context,
            config=self.config,
        )
        return hidden_states.new_empty(*hidden_states.shape[:2], 0), None


def _attach_by_substituting_output_layer(model, processor):
    if getattr(model.config, "mtp_num_layers", None):
        raise ValueError(
            "attach: multi-token prediction calls the output layer for its own loss; a model "
            "without megatron-core's output_processor hook cannot use it with a processor"
        )
    forward_signature = inspect.signature(model.forward)

    def substitute_output_layer(module, args, kwargs):
        kwargs = dict(kwargs)
        context = kwargs.pop("output_processor_context", None)
        call = forward_signature.bind(*args, **kwargs).arguments
        if call.get("labels") is not None:
            raise ValueError(
                f"{type(module).__name__} with an attached output processor: do not pass labels "
                "(the model would compute its own loss over the processor's outputs); pass the "
                "tokens as output_processor_context={'tokens': tokens}"
            )
        if module.post_process:
            module.output_layer = _ProcessorOutputLayer(
                module.output_layer, processor, context, call.get("loss_mask"), module.config
            )
        return args, kwargs

    def restore_output_layer(module, args, output):
        substitute = module._modules.get("output_layer")
        if not isinstance(substitute, _ProcessorOutputLayer):
            return output  # a stage without an output layer: hidden states for the next stage
        module.output_layer = substitute.output_layer
        if substitute.outputs is None:
            raise RuntimeError(f"{type(module).__name__} did not reach its output layer; no processor outputs")
        return substitute.outputs

    pre_hook = model.register_forward_pre_hook(substitute_output_layer, with_kwargs=True)
    # always_call: the original output layer comes back even when forward raises.
    post_hook = model.register_forward_hook(restore_output_layer, always_call=True)
    return [pre_hook.remove, post_hook.remove]


