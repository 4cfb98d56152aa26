"""Megatron's output layer as the fused ops read it in its place: OutputShard.

The processor, the distillation divergence and the MTP loss do not run the output layer's forward;
they read its weight and call ops over it. What that takes, here once:

- Parameter sync. With `DistributedDataParallelConfig(use_distributed_optimizer=True,
  overlap_param_gather=True)` megatron-core's DDP all-gathers each bucket of updated parameters
  lazily: the forward pre-hook it registers on every module waits for the buckets of that module's
  own parameters (finish_param_sync) and dispatches the next bucket's all-gather. Nothing would wait
  for the output weight (or the tied embedding's, or a value head given as a weight) without those
  modules' forwards: on a GPU the read would race the all-gather, and the next step's
  start_param_sync fails its assertion. So `OutputShard.read` first runs the forward pre-hooks of
  the output layer and of the modules `attach` registered for it (`register_read_modules`: the
  embedding that owns a tied weight, the holder of a value head given as a weight), as their
  forwards would have run them; without Megatron's hooks there are none.
- The weight: this rank's vocab shard (the tied embedding's when Megatron passes output_weight),
  and its main_grad where Megatron's own output layer adds the weight gradient straight into it.
- Sequence parallel: the [s/tp, b, h] hidden states gathered along s as Megatron's gather does (the
  backward reduce-scatters, so the ops leave their hidden gradient unreduced: reduce_hidden_grad),
  and the gradient of what every TP rank computes alike from them scaled by 1/tp. With
  batch_invariant the sum over the ranks is the ops' own, in their fixed order: they reduce their
  hidden gradients, and the gather's backward takes this rank's slice of the complete gradient.
"""
import functools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["OutputShard", "gather_sequence_parallel", "register_read_modules"]

# An attached model's output layer -> weak references to the other modules whose parameters are read.
_read_modules = weakref.WeakKeyDictionary()


def register_read_modules(output_layer, modules):
    """Records modules (besides output_layer) whose parameters are read with output_layer's; returns
    the undo step."""
    _read_modules[output_layer] = [weakref.ref(module) for module in modules]
    return functools.partial(_read_modules.pop, output_layer, None)


def _run_forward_pre_hooks_of_read_modules(output_layer):
    """Runs the forward pre-hooks of output_layer and of the modules registered with it, as calling
    each module would before its forward (their results are not used)."""
    if not isinstance(output_layer, torch.nn.Module):
        return  # a stand-in holding a weight: no hooks
    for module in [output_layer, *(ref() for ref in _read_modules.get(output_layer, ()))]:
        if module is not None:
            _run_forward_pre_hooks(module)


def _run_forward_pre_hooks(module):
    # torch keeps a module's pre-hooks in _forward_pre_hooks, those registered with_kwargs marked in
    # _forward_pre_hooks_with_kwargs; there is no public way to run them without the forward.
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, (), {})
        else:
            hook(module, ())


class _GatherSequence(torch.autograd.Function):
    """Megatron's gather_from_sequence_parallel_region at its defaults: [s/tp, ...] pieces gathered
    along dim 0, the gradient reduce-scattered back. Megatron's forward fills a new tensor in place
    (all_gather_into_tensor); under torch.compile on torch 2.11.0 an autograd.Function that returns a
    tensor filled in place gets zero gradients (pytorch/pytorch#180642; not seen on 2.14.1), so this one
    concatenates the gathered pieces instead. own_slice: the backward takes this rank's slice of a
    gradient that is already complete on every rank instead."""

    @staticmethod
    def forward(ctx, x, group, own_slice):
        ctx.group, ctx.own_slice = group, own_slice
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x, group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        if ctx.own_slice:
            return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)].contiguous(), None, None
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None, None


def gather_sequence_parallel(hidden_states, group, own_slice=False):
    """[s/tp, b, h] sequence-parallel hidden states -> [s, b, h] on every rank of group; the gradient
    reduce-scattered back, or with own_slice (its gradient complete on every rank) sliced."""
    return _GatherSequence.apply(hidden_states, group, own_slice)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `factor` in backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


@dataclass(frozen=True)
class OutputShard:
    """What the ops take of Megatron's output layer on this rank (module docstring)."""
    weight: torch.Tensor  # [V_local, H], this rank's vocab rows
    tp_group: Optional[dist.ProcessGroup]
    sequence_parallel: bool
    main_grad: Optional[torch.Tensor]  # where the weight gradient goes instead of being returned
    batch_invariant: bool = False  # the ops sum the hidden gradient over TP themselves (module docstring)

    @classmethod
    def read(cls, output_layer, output_weight=None, *, detach=False, batch_invariant=False) -> "OutputShard":
        """The shard of output_layer (output_weight: the tied embedding's weight Megatron passes),
        after the forward pre-hooks of the modules whose parameters are read; detach: the weight as
        a constant (no gradient, no main_grad); batch_invariant: the ops' calls are."""
        _run_forward_pre_hooks_of_read_modules(output_layer)
        weight = output_weight if output_weight is not None else output_layer.weight
        if detach:
            return cls(weight.detach(), output_layer.tp_group, output_layer.sequence_parallel, None, batch_invariant)
        main_grad = _fused_main_grad(output_layer, weight)
        return cls(weight, output_layer.tp_group, output_layer.sequence_parallel, main_grad, batch_invariant)

    @property
    def reduce_hidden_grad(self) -> bool:
        """Whether an op sums its hidden gradient over the TP group: not with sequence parallel, whose
        gather's backward does (the gradient is summed exactly once), unless batch_invariant."""
        return not self.sequence_parallel or self.batch_invariant

    def tp_size(self) -> int:
        return dist.get_world_size(self.tp_group)

    def total_rows(self) -> int:
        """The vocab rows of all TP ranks (the padded vocabulary); a stand-in without a group: its own."""
        return self.weight.shape[0] * (self.tp_size() if self.tp_group is not None else 1)

    def gather(self, hidden_states):
        """[s(/tp), b, h] hidden states -> [s, b, h]: gathered with sequence parallel."""
        if not self.sequence_parallel:
            return hidden_states
        return gather_sequence_parallel(hidden_states, self.tp_group, own_slice=self.batch_invariant)

    def replicated(self, gathered_hidden_states):
        """The gathered hidden states as the input of a computation every TP rank does alike (the value
        head): each rank then holds the full gradient and the gather's backward sums over the ranks,
        hence 1/tp with sequence parallel (not with batch_invariant: the backward takes a slice)."""
        if not self.sequence_parallel or self.batch_invariant:
            return gathered_hidden_states
        return _ScaleGrad.apply(gathered_hidden_states, 1.0 / self.tp_size())


def _fused_main_grad(output_layer, weight):
    """The buffer the weight gradient goes straight into, as Megatron's own output layer does it
    (megatron-core's LinearWithGradAccumulationAndAsyncCommunication): weight.main_grad when the
    layer has gradient_accumulation_fusion and the weight carries one (Megatron's DDP); else None."""
    if getattr(output_layer, "gradient_accumulation_fusion", False) and hasattr(weight, "main_grad"):
        return weight.main_grad
    return None
