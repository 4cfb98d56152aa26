"""A model's own top tokens: the k most likely ids of each position and their logprobs over the
(vocab-parallel) vocabulary, without a [tokens, vocab] tensor (docs/chosen_logprob.md, "A model's own
top tokens"). One pass over the vocabulary finds each row's partials and its k largest logits with
their ids, in a strict order by which the ranks' tops merge; the backward is chosen_logprob's, with
the selected ids as the tokens (the selection is a constant of the gradient). The rows a mask leaves
out are left out inside the op, so that a traced caller keeps the saving."""
from typing import Optional

import torch
import torch.distributed as dist

from ._checks import check_mask, values_readable
from ._library import acc_dtype, check_device, ops
from ._options import POSITIVE_INTEGER, check_options, groups_from_arguments, option, options_dataclass
from ._vocab_parallel import agreement
from ._vocab_parallel.group import TensorParallelGroup
from ._vocab_parallel.kernel_options import SHARED_GROUPS, KernelOptions
from ._vocab_parallel.shard import resolve_shard
from ._vocab_parallel.tiling import default_workspace_bytes, tiling_for
from .chosen_logprob import ChosenLogprobOptions, check_tensors
from .logit_options import LogitMap, LogitOptions, given_once

__all__ = ["scored_top_logprobs", "top_logprobs"]

_OP = "top_logprobs"
# The id of the rows not computed (mask False), as top_logprobs_stats gives them (kNotComputed in
# the C++ op): before every real id, so that the ranks' merged tops keep it.
NOT_COMPUTED = -1


@options_dataclass
class TopLogprobsOptions:
    """top_logprobs_stats' own option group, after LogitMap, VocabShard and Tiling (declared for C++
    as FRL_TOP_LOGPROBS_OPTIONS): k, the ids kept per row."""
    k: int = option(POSITIVE_INTEGER, default=1)

    def __post_init__(self):
        check_options(type(self).__name__, self)


# The top_logprobs_stats op's option groups, in its schema's order.
TOP_LOGPROBS_GROUPS = SHARED_GROUPS + (TopLogprobsOptions,)
_AGREED_FIELDS = [("token count", agreement.INTEGER), ("hidden size", agreement.INTEGER),
                  ("dtype", agreement.DTYPE), ("k", agreement.INTEGER), ("vocab_size", agreement.INTEGER),
                  ("mask", agreement.FINGERPRINT)] + agreement.agreed_fields(LogitMap)


def merge_tops(values: torch.Tensor, ids: torch.Tensor, k: int):
    """The first k of the union of the ranks' tops (values, ids [ranks, N, k] each) in the order of
    op's top ids: descending value, the lower id first between equal values."""
    n = values.shape[1]
    values, ids = values.permute(1, 0, 2).reshape(n, -1), ids.permute(1, 0, 2).reshape(n, -1)
    by_id = ids.argsort(dim=1, stable=True)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = values.argsort(dim=1, descending=True, stable=True)[:, :k]
    return values.gather(1, by_value), ids.gather(1, by_value)


class TopLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, mask, kernel_options, tp, reduce_hidden_grad):
        """hidden [N, H], mask [N] bool or None (True: computed); kernel_options the op's
        (KernelOptions, own: TopLogprobsOptions). Returns ids [N, k] int64 and their logprobs [N, k];
        NOT_COMPUTED and 0 at the rows mask leaves out."""
        k = kernel_options.own.k
        stats, values, ids = ops.top_logprobs_stats(hidden, weight, mask, *kernel_options.arguments())
        merged = tp.combine(stats)
        values, ids = merge_tops(tp.gather(values), tp.gather(ids), k)
        logprobs = (values - merged.row_max[:, None]) - merged.log_sum[:, None]
        if mask is not None:
            logprobs = torch.where(mask[:, None], logprobs, 0.0)  # an empty row's -inf - -inf
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(hidden, weight, ids, merged.row_max, merged.log_sum, merged.entropy)
        ctx.kernel_options, ctx.tp, ctx.reduce_hidden_grad = kernel_options, tp, reduce_hidden_grad
        ctx.masked = mask is not None
        return ids, logprobs

    @staticmethod
    def backward(ctx, grad_ids, grad_logprobs):
        hidden, weight, ids, row_max, log_sum, entropy = ctx.saved_tensors
        grad_logprobs = torch.zeros_like(ids, dtype=row_max.dtype) if grad_logprobs is None else grad_logprobs
        # chosen_logprob's backward op, no filter: the rows not computed (all k ids NOT_COMPUTED, which
        # no computed row has) left out as it leaves out ignored tokens.
        chosen = ctx.kernel_options._replace(own=ChosenLogprobOptions(NOT_COMPUTED if ctx.masked else None, 0))
        grad_hidden, grad_weight = ops.chosen_logprob_backward(
            hidden, weight, ids, row_max, log_sum, log_sum - entropy, grad_logprobs.to(row_max.dtype).contiguous(),
            torch.zeros_like(row_max), None, *chosen.arguments())
        if ctx.reduce_hidden_grad and ctx.tp.distributed:
            dist.all_reduce(grad_hidden, group=ctx.tp.group)  # fp32: the sum is taken before rounding
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None


def _resolve(hidden, weight, k, mask, logit_map, rank, world, vocab_start, vocab_size):
    """(kernel options, vocab_size) of a call, after its checks."""
    check_tensors(hidden, weight, None, op=_OP)
    check_mask(_OP, mask, hidden)
    check_device(_OP, hidden=hidden, weight=weight, mask=mask)
    shard, vocab_size = resolve_shard(_OP, weight.shape[0], rank, world, vocab_start, vocab_size)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"{_OP}: k must be an integer in [1, vocab_size = {vocab_size}], got {k!r}")
    rows = hidden.numel() // hidden.shape[-1]
    tiling = tiling_for(rows, hidden.shape[-1], hidden.element_size(), default_workspace_bytes(hidden),
                        hidden.device, False)
    return KernelOptions(logit_map, shard, tiling, TopLogprobsOptions(k)), vocab_size


def top_logprobs(hidden: torch.Tensor, weight: torch.Tensor, k: int, *, temperature: float = 1.0,
                 softcap: Optional[float] = None, logit_map: Optional[LogitMap] = None,
                 mask: Optional[torch.Tensor] = None, vocab_size: Optional[int] = None,
                 tp_group: Optional[dist.ProcessGroup] = None, vocab_start: Optional[int] = None,
                 reduce_hidden_grad: bool = True):
    """The k most likely tokens of each position of hidden [..., H] under z = map(hidden @ weight.T)
    (temperature, softcap as chosen_logprob's; or both as one logit_map=LogitMap(...), not both),
    over the (vocab-parallel) vocabulary: returns (ids, logprobs), int64 global ids [..., k] in
    descending logprob order (between equal logprobs the lower id first) and their logprobs [..., k]
    (fp32; float64 for float64 inputs), differentiable in hidden and weight (the selection is a
    constant). mask ([...] bool, hidden's leading shape; True: computed): the False positions get
    ids -1 and logprobs 0 and pass no gradient, and the op leaves their rows out (inside it: no host
    read here, so torch.compile keeps the saving). weight [V_local, H], vocab_start, vocab_size (the
    rows past it padding, never selected) and tp_group as chosen_logprob's; k an integer in
    [1, vocab_size]. With tp_group every rank returns the same ids and logprobs (the ranks' masks
    must agree), and the hidden gradient is summed over the group unless reduce_hidden_grad=False
    (as chosen_logprob's). No [tokens, vocab] tensor is made."""
    tp = TensorParallelGroup(tp_group)
    world, rank = (dist.get_world_size(tp_group), dist.get_rank(tp_group)) if tp_group is not None else (1, 0)
    error = None
    try:
        logit_map = given_once(_OP, "logit_map", logit_map,
                               LogitOptions(temperature=temperature, softcap=softcap).logit_map,
                               LogitOptions().logit_map)
        kernel_options, vocab_size = _resolve(hidden, weight, k, mask, logit_map, rank, world, vocab_start,
                                              vocab_size)
    except (TypeError, ValueError) as exc:
        error = exc
    if world > 1 and values_readable(hidden, weight, mask):
        values = None if error is not None else [
            hidden.numel() // hidden.shape[-1], hidden.shape[-1], hidden.dtype, k, vocab_size,
            -1 if mask is None else agreement.token_fingerprint(mask)
        ] + agreement.agreed_values(logit_map)
        shard = None if error is not None else (kernel_options.shard.vocab_start, weight.shape[0])
        agreement.check_agreement(_OP, tp_group, _AGREED_FIELDS, error, shard, values)
    elif error is not None:
        raise error
    ids, logprobs = TopLogprobsFunction.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                              None if mask is None else mask.reshape(-1), kernel_options, tp,
                                              bool(reduce_hidden_grad))
    shape = (*hidden.shape[:-1], k)
    return ids.reshape(shape), logprobs.reshape(shape)


def scored_top_logprobs(hidden: torch.Tensor, weight: torch.Tensor, k: int, scored: torch.Tensor, ignore_index: int,
                        **options):
    """top_logprobs (with options) of the positions of hidden [..., H] where scored ([...] bool),
    computed on those rows alone (its mask: no host read); the other positions get ids ignore_index
    and logprobs 0 (and pass no gradient)."""
    ids, logprobs = top_logprobs(hidden, weight, k, mask=scored, **options)
    return torch.where(scored[..., None], ids, ignore_index), logprobs


@torch.library.register_fake("fused_rl_ops::top_logprobs_stats")
def _(hidden, weight, mask, *args, **kwargs):
    (*_, own), _ = groups_from_arguments(TOP_LOGPROBS_GROUPS, args, kwargs)
    k = own.k
    check_device("chosen_logprob", hidden=hidden, weight=weight, mask=mask)
    acc = acc_dtype(hidden.dtype)
    n = hidden.shape[0]
    return (hidden.new_empty(n, 3, dtype=acc), hidden.new_empty(n, k, dtype=acc),
            hidden.new_empty(n, k, dtype=torch.int64))
