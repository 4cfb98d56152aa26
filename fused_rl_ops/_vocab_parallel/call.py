"""The call path every vocab-parallel op's Python function takes before its ops run: its arguments
resolved into the ops' option groups and checked (the op's own resolve), then agreed over the ranks
of its tensor-parallel group (agreement.py), so that a bad argument on one rank raises on all."""
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from .._checks import check_hidden_size
from .._library import check_float_dtype
from . import agreement
from .kernel_options import KernelOptions


class ResolvedCall(NamedTuple):
    """A call resolved on this rank."""
    kernel_options: KernelOptions
    local_rows: int  # weight's rows: the shard is [vocab_start, vocab_start + local_rows)
    agreed: agreement.AgreedCall  # what the ranks must pass alike: a record of the op's subclass

    @property
    def vocab_size(self) -> int:
        """The real vocabulary (the rows past it padding)."""
        return self.agreed.vocab_size


def resolve_call(op: str, tp_group: Optional[dist.ProcessGroup], check_group: bool, agreed: type,
                 resolve: Callable[[int, int], ResolvedCall]) -> ResolvedCall:
    """resolve(rank, world)'s ResolvedCall, which raises TypeError or ValueError on bad arguments.
    With several ranks in tp_group and check_group, every rank raises the same error when any rank's
    arguments are bad, the ranks disagree on a field of agreed (the op's AgreedCall subclass) or their
    shards do not tile the vocabulary; otherwise a bad argument raises on its rank alone."""
    world, rank = (dist.get_world_size(tp_group), dist.get_rank(tp_group)) if tp_group is not None else (1, 0)
    call, error = None, None
    try:
        call = resolve(rank, world)
    except (TypeError, ValueError) as exc:
        error = exc
    if world > 1 and check_group:
        shard = None if error is not None else (call.kernel_options.shard.vocab_start, call.local_rows)
        agreement.check_agreement(op, tp_group, agreed, error, shard, None if error is not None else call.agreed)
    elif error is not None:
        raise error
    return call


def check_output_layer(op: str, hidden, weight, names=("hidden", "weight")) -> None:
    """hidden [..., H] and weight [V_local, H] (this rank's rows of an output layer): tensors of one
    dtype, float32, bfloat16 or float16 (float64 on the CPU), H >= 1. Their devices are checked
    with the op's other tensors."""
    for name, t in zip(names, (hidden, weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    for name, t in zip(names, (hidden, weight)):
        check_float_dtype(op, name, t, allow_float64=hidden.device.type == "cpu")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: {names[1]} must have {names[0]}'s dtype {hidden.dtype}, got {weight.dtype}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{op}: expected {names[0]} [..., H] and {names[1]} [V_local, H], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    check_hidden_size(op, hidden)
