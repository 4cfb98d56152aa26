"""A model's own top tokens: the k most likely ids of each position and their logprobs over the
(vocab-parallel) vocabulary, without a [tokens, vocab] tensor (docs/chosen_logprob.md, "A model's own
top tokens"). One pass over the vocabulary finds each row's partials and its k largest logits with
their ids (csrc/chosen_logprob/top_ids.h); the ranks' tops merge by the same order; the backward is
chosen_logprob's, with the selected ids as the tokens (the selection is a constant of the gradient)."""
from typing import Optional

import torch
import torch.distributed as dist

from ._checks import values_readable
from ._library import acc_dtype, check_device, ops
from ._options import POSITIVE_INTEGER, check_options, groups_from_arguments, op_arguments, option, options_dataclass
from ._vocab_parallel import agreement
from ._vocab_parallel.group import TensorParallelGroup
from ._vocab_parallel.shard import resolve_shard
from ._vocab_parallel.tiling import default_workspace_bytes, tiling_for
from .chosen_logprob import SEARCH_GROUPS, ChosenLogprobOptions, check_tensors
from .logit_options import LogitOptions

__all__ = ["scored_top_logprobs", "top_logprobs"]

_OP = "top_logprobs"


@options_dataclass
class TopLogprobsOptions:
    """top_logprobs_stats' own option group, after LogitMap, VocabShard and Tiling (declared for C++
    in csrc/chosen_logprob/options.h): k, the ids kept per row."""
    k: int = option(POSITIVE_INTEGER, default=1)

    def __post_init__(self):
        check_options(type(self).__name__, self)


# The top_logprobs_stats op's option groups, in its schema's order.
TOP_LOGPROBS_GROUPS = SEARCH_GROUPS + (TopLogprobsOptions,)
_AGREED_FIELDS = [("token count", agreement.INTEGER), ("hidden size", agreement.INTEGER),
                  ("dtype", agreement.DTYPE), ("k", agreement.INTEGER),
                  ("vocab_size", agreement.INTEGER)] + agreement.agreed_fields(LogitOptions)


def merge_tops(values: torch.Tensor, ids: torch.Tensor, k: int):
    """The first k of the union of the ranks' tops (values, ids [ranks, N, k] each) in the order of
    csrc/chosen_logprob/top_ids.h: descending value, the lower id first between equal values."""
    n = values.shape[1]
    values, ids = values.permute(1, 0, 2).reshape(n, -1), ids.permute(1, 0, 2).reshape(n, -1)
    by_id = ids.argsort(dim=1, stable=True)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = values.argsort(dim=1, descending=True, stable=True)[:, :k]
    return values.gather(1, by_value), ids.gather(1, by_value)


class TopLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, k, arguments, tp, reduce_hidden_grad):
        """hidden [N, H]; arguments: the options of the groups the ops share (LogitMap, VocabShard,
        Tiling). Returns ids [N, k] int64 and their logprobs [N, k]."""
        stats, values, ids = ops.top_logprobs_stats(hidden, weight, *arguments, *op_arguments(TopLogprobsOptions(k)))
        merged = tp.combine(stats)
        values, ids = merge_tops(tp.gather(values), tp.gather(ids), k)
        logprobs = (values - merged.row_max[:, None]) - merged.log_sum[:, None]
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(hidden, weight, ids, merged.row_max, merged.log_sum, merged.entropy)
        ctx.arguments, ctx.tp, ctx.reduce_hidden_grad = arguments, tp, reduce_hidden_grad
        return ids, logprobs

    @staticmethod
    def backward(ctx, grad_ids, grad_logprobs):
        hidden, weight, ids, row_max, log_sum, entropy = ctx.saved_tensors
        grad_logprobs = torch.zeros_like(ids, dtype=row_max.dtype) if grad_logprobs is None else grad_logprobs
        own = op_arguments(ChosenLogprobOptions(None, 0))  # every row computed, no filter
        grad_hidden, grad_weight = ops.chosen_logprob_backward(
            hidden, weight, ids, row_max, log_sum, log_sum - entropy, grad_logprobs.to(row_max.dtype).contiguous(),
            torch.zeros_like(row_max), None, *ctx.arguments, *own)
        if ctx.reduce_hidden_grad and ctx.tp.distributed:
            dist.all_reduce(grad_hidden, group=ctx.tp.group)  # fp32: the sum is taken before rounding
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None


def _resolve(hidden, weight, k, options, rank, world, vocab_start, vocab_size):
    check_tensors(hidden, weight, None, op=_OP)
    shard, vocab_size = resolve_shard(_OP, weight.shape[0], rank, world, vocab_start, vocab_size)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"{_OP}: k must be an integer in [1, vocab_size = {vocab_size}], got {k!r}")
    rows = hidden.numel() // hidden.shape[-1]
    tiling = tiling_for(rows, hidden.shape[-1], hidden.element_size(), default_workspace_bytes(hidden),
                        hidden.device, False)
    return op_arguments(options.logit_map, shard, tiling), vocab_size


def top_logprobs(hidden: torch.Tensor, weight: torch.Tensor, k: int, *, temperature: float = 1.0,
                 softcap: Optional[float] = None, vocab_size: Optional[int] = None,
                 tp_group: Optional[dist.ProcessGroup] = None, vocab_start: Optional[int] = None,
                 reduce_hidden_grad: bool = True):
    """The k most likely tokens of each position of hidden [..., H] under z = map(hidden @ weight.T)
    (temperature, softcap as chosen_logprob's), over the (vocab-parallel) vocabulary: returns (ids,
    logprobs), int64 global ids [..., k] in descending logprob order (between equal logprobs the
    lower id first) and their logprobs [..., k] (fp32; float64 for float64 inputs), differentiable
    in hidden and weight (the selection is a constant). weight [V_local, H], vocab_start,
    vocab_size (the rows past it padding, never selected) and tp_group as chosen_logprob's; k an
    integer in [1, vocab_size]. With tp_group every rank returns the same ids and logprobs, and the
    hidden gradient is summed over the group unless reduce_hidden_grad=False (as chosen_logprob's).
    No [tokens, vocab] tensor is made."""
    tp = TensorParallelGroup(tp_group)
    world, rank = (dist.get_world_size(tp_group), dist.get_rank(tp_group)) if tp_group is not None else (1, 0)
    error = None
    try:
        options = LogitOptions(temperature=temperature, softcap=softcap)
        arguments, vocab_size = _resolve(hidden, weight, k, options, rank, world, vocab_start, vocab_size)
    except (TypeError, ValueError) as exc:
        error = exc
    if world > 1 and values_readable(hidden, weight):
        values = None if error is not None else [
            hidden.numel() // hidden.shape[-1], hidden.shape[-1], hidden.dtype, k, vocab_size] + [
                getattr(options, name) for name, _ in agreement.agreed_fields(LogitOptions)]
        shard = None if error is not None else (arguments[len(options.logit_map.OPTIONS)], weight.shape[0])
        agreement.check_agreement(_OP, tp_group, _AGREED_FIELDS, error, shard, values)
    elif error is not None:
        raise error
    ids, logprobs = TopLogprobsFunction.apply(hidden.reshape(-1, hidden.shape[-1]), weight, k, arguments, tp,
                                              bool(reduce_hidden_grad))
    shape = (*hidden.shape[:-1], k)
    return ids.reshape(shape), logprobs.reshape(shape)


def scored_top_logprobs(hidden: torch.Tensor, weight: torch.Tensor, k: int, scored: torch.Tensor, ignore_index: int,
                        **options):
    """top_logprobs (with options) of the positions of hidden [..., H] where scored ([...] bool)
    alone, computed on those rows only (a host read of their count); the other positions get ids
    ignore_index and logprobs 0 (and pass no gradient)."""
    rows = scored.reshape(-1).nonzero().squeeze(1)
    ids, logprobs = top_logprobs(hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), weight, k, **options)
    positions = scored.numel()
    all_ids = ids.new_full((positions, k), ignore_index).index_copy(0, rows, ids)
    all_logprobs = logprobs.new_zeros(positions, k).index_copy(0, rows, logprobs)
    return all_ids.reshape(*scored.shape, k), all_logprobs.reshape(*scored.shape, k)


@torch.library.register_fake("fused_rl_ops::top_logprobs_stats")
def _(hidden, weight, *args, **kwargs):
    (*_, own), _ = groups_from_arguments(TOP_LOGPROBS_GROUPS, args, kwargs)
    k = own.k
    check_device("chosen_logprob", hidden=hidden, weight=weight)
    acc = acc_dtype(hidden.dtype)
    n = hidden.shape[0]
    return (hidden.new_empty(n, 3, dtype=acc), hidden.new_empty(n, k, dtype=acc),
            hidden.new_empty(n, k, dtype=torch.int64))
