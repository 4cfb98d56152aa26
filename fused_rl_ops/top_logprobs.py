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
from ._vocab_parallel.agreement import AgreedCall, agreed, agreed_dataclass, agreed_options
from ._vocab_parallel.call import ResolvedCall, check_output_layer, resolve_call
from ._vocab_parallel.group import TensorParallelGroup
from ._vocab_parallel.kernel_options import SHARED_GROUPS, KernelOptions
from ._vocab_parallel.pieces import VocabPieces, check_virtual_shards
from ._vocab_parallel.shard import resolve_shard
from ._vocab_parallel.tiling import default_workspace_bytes, tiling_for
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


@agreed_dataclass
class _Agreed(AgreedCall):
    """What every rank of tp_group must pass alike besides its shard, each by the name its error uses:
    the call's own arguments (token_count: hidden's rows), then the logit map."""
    k: int = agreed("k", agreement.INTEGER)
    mask: Optional[torch.Tensor] = agreed("mask", agreement.FINGERPRINT)
    logit_map: LogitMap = agreed_options()


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
    def forward(ctx, hidden, weight, mask, kernel_options, pieces, reduce_hidden_grad):
        """hidden [N, H], mask [N] bool or None (True: computed); kernel_options the op's
        (KernelOptions, own: TopLogprobsOptions), pieces its VocabPieces. Returns ids [N, k] int64
        and their logprobs [N, k]; NOT_COMPUTED and 0 at the rows mask leaves out."""
        k = kernel_options.own.k
        stats, values, ids = (torch.stack(t) for t in zip(*(
            ops.top_logprobs_stats(hidden, w, mask, *o.arguments()) for o, w in pieces.each(kernel_options, weight))))
        # The merged partials as chosen_logprob_combine gives them, with no chosen column.
        row_max, log_sum, entropy = ops.chosen_logprob_combine(pieces.gather(stats)).unbind(1)
        values, ids = merge_tops(pieces.gather(values), pieces.gather(ids), k)
        logprobs = (values - row_max[:, None]) - log_sum[:, None]
        if mask is not None:
            logprobs = torch.where(mask[:, None], logprobs, 0.0)  # an empty row's -inf - -inf
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(hidden, weight, ids, row_max, log_sum, entropy)
        ctx.kernel_options, ctx.pieces, ctx.reduce_hidden_grad = kernel_options, pieces, reduce_hidden_grad
        ctx.masked = mask is not None
        return ids, logprobs

    @staticmethod
    def backward(ctx, grad_ids, grad_logprobs):
        hidden, weight, ids, row_max, log_sum, entropy = ctx.saved_tensors
        grad_logprobs = torch.zeros_like(ids, dtype=row_max.dtype) if grad_logprobs is None else grad_logprobs
        grad_logprobs, grad_weights = grad_logprobs.to(row_max.dtype).contiguous(), []
        buffer = ctx.pieces.weight_grad_buffer(weight, None)

        def hidden_grads():
            # chosen_logprob's backward op per piece, no filter: the rows not computed (all k ids
            # NOT_COMPUTED, which no computed row has) left out as it leaves out ignored tokens.
            for o, w, g in ctx.pieces.each(ctx.kernel_options, weight, buffer):
                grad_hidden, grad_weight = ops.chosen_logprob_backward(
                    hidden, w, ids, row_max, log_sum, log_sum - entropy, grad_logprobs, torch.zeros_like(row_max),
                    g, *o.shared_arguments(), ignore_index=NOT_COMPUTED if ctx.masked else None)
                grad_weights.append(grad_weight)
                yield grad_hidden

        grad_hidden = ctx.pieces.sum(hidden_grads(), ctx.reduce_hidden_grad)
        return grad_hidden.to(hidden.dtype), ctx.pieces.weight_grad(buffer, grad_weights), None, None, None, None


def _resolve(hidden, weight, k, mask, logit_map, rank, world, vocab_start, vocab_size,
             batch_invariant) -> ResolvedCall:
    """The call on this rank, after its checks."""
    check_output_layer(_OP, hidden, weight)
    check_mask(_OP, mask, hidden)
    check_device(_OP, hidden=hidden, weight=weight, mask=mask)
    shard, vocab_size = resolve_shard(_OP, weight.shape[0], rank, world, vocab_start, vocab_size)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"{_OP}: k must be an integer in [1, vocab_size = {vocab_size}], got {k!r}")
    if batch_invariant:
        check_virtual_shards(_OP, weight.shape[0], rank, world, shard.vocab_start)
    rows = hidden.numel() // hidden.shape[-1]
    tiling = tiling_for(rows, hidden.shape[-1], hidden.element_size(), default_workspace_bytes(hidden),
                        hidden.device, batch_invariant)
    agreed_values = _Agreed(token_count=rows, hidden_size=hidden.shape[-1], dtype=hidden.dtype, k=k,
                            vocab_size=vocab_size, mask=mask, logit_map=logit_map)
    return ResolvedCall(KernelOptions(logit_map, shard, tiling, TopLogprobsOptions(k)), weight.shape[0], agreed_values)


def top_logprobs(hidden: torch.Tensor, weight: torch.Tensor, k: int, *, temperature: float = 1.0,
                 softcap: Optional[float] = None, logit_map: Optional[LogitMap] = None,
                 mask: Optional[torch.Tensor] = None, vocab_size: Optional[int] = None,
                 tp_group: Optional[dist.ProcessGroup] = None, vocab_start: Optional[int] = None,
                 reduce_hidden_grad: bool = True, batch_invariant: bool = False):
    """The k most likely tokens of each position of hidden [..., H] under z = map(hidden @ weight.T),
    over the (vocab-parallel) vocabulary, without a [tokens, vocab] tensor (docs/chosen_logprob.md,
    "A model's own top tokens").

    hidden [..., H] and weight [V_local, H] (this rank's rows of the output layer, global ids from
    vocab_start, default rank * V_local in tp_group) share a dtype: float32, bfloat16 or float16
    (float64 on CPU). The map: temperature, softcap (None or c: logits capped to c * tanh(x / c)
    first), or both as one logit_map=LogitMap(...) (not both). vocab_size: the real vocabulary, the
    rows past it padding, never selected (default: every row of every rank); k an integer in
    [1, vocab_size].
    Returns (ids, logprobs): int64 global ids [..., k] in descending logprob order (between equal
    logprobs the lower id first) and their logprobs [..., k] (fp32; float64 for float64 inputs),
    differentiable in hidden and weight (the selection is a constant). mask ([...] bool; True:
    computed): the False positions get ids -1 and logprobs 0 and pass no gradient, and the op leaves
    their rows out (inside it: no host read here, so torch.compile keeps the saving). With tp_group
    every rank returns the same ids and logprobs; the ranks must pass the same arguments and masks
    (every rank raises the same error when they do not, unless traced), and the hidden gradient is
    summed over the group unless reduce_hidden_grad=False (a sequence-parallel gather's backward
    sums it). batch_invariant=True: each position's ids, logprobs and hidden gradient are bitwise
    independent of the other positions and of the TP degree (chosen_logprob's promise)."""
    def resolve(rank, world):
        given_map = given_once(_OP, "logit_map", logit_map,
                               LogitOptions(temperature=temperature, softcap=softcap).logit_map,
                               LogitOptions().logit_map)
        return _resolve(hidden, weight, k, mask, given_map, rank, world, vocab_start, vocab_size, batch_invariant)

    call = resolve_call(_OP, tp_group, values_readable(hidden, weight, mask), _Agreed, resolve)
    ids, logprobs = TopLogprobsFunction.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                              None if mask is None else mask.reshape(-1), call.kernel_options,
                                              VocabPieces.of(TensorParallelGroup(tp_group), call.local_rows,
                                                             batch_invariant), bool(reduce_hidden_grad))
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
    check_device(_OP, hidden=hidden, weight=weight, mask=mask)
    acc = acc_dtype(hidden.dtype)
    n = hidden.shape[0]
    return (hidden.new_empty(n, 3, dtype=acc), hidden.new_empty(n, k, dtype=acc),
            hidden.new_empty(n, k, dtype=torch.int64))
