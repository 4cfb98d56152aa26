"""Vocab-parallel chosen-token log-softmax and entropy, without a [tokens, vocab] tensor: the public
function, the resolution of its arguments into the ops' options, and the ops' fake kernels. How it
works, and what every argument does in full: docs/chosen_logprob.md."""
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ._checks import values_readable
from ._chosen_logprob_function import CHOSEN, ChosenLogprobFunction, CombinedColumns
from ._kept_set import KeptSet
from ._library import acc_dtype, check_device
from ._options import INTEGER, NON_NEGATIVE_INTEGER, check_options, groups_from_arguments, option, options_dataclass
from ._vocab_parallel import agreement
from ._vocab_parallel.agreement import AgreedCall, agreed, agreed_dataclass, agreed_options
from ._vocab_parallel.call import ResolvedCall, check_output_layer, resolve_call
from ._vocab_parallel.group import TensorParallelGroup
from ._vocab_parallel.kernel_options import SHARED_GROUPS, KernelOptions
from ._vocab_parallel.main_grad import check_main_grad, weight_placeholder
from ._vocab_parallel.pieces import VocabPieces, check_virtual_shards
from ._vocab_parallel.sampler_filter import TOP_HEADER
from ._vocab_parallel.shard import resolve_shard
from ._vocab_parallel.tiling import DEFAULT_WORKSPACE_BYTES, default_workspace_bytes, tiling_for
from ._vocab_parallel.tokens import check_token_range, mark_out_of_range
from .logit_options import LogitOptions, given_once

__all__ = ["ChosenLogprobOptions", "CombinedColumns", "DEFAULT_WORKSPACE_BYTES", "chosen_logprob"]


@options_dataclass
class ChosenLogprobOptions:
    """chosen_logprob's own option group, after LogitMap, VocabShard and Tiling in its stats and
    backward ops (declared for C++ as FRL_CHOSEN_LOGPROB_OPTIONS): the ops leave out the rows
    whose token equals ignore_index (None: every row is computed); the stats op returns each row's
    top_width largest logits after its partials (top_k; 0: none)."""
    ignore_index: Optional[int] = option(INTEGER, default=None)
    top_width: int = option(NON_NEGATIVE_INTEGER, default=0)

    def __post_init__(self):
        check_options(type(self).__name__, self)


# The option groups of the ops, in their schemas' order: the stats and backward ops', the search op's.
OP_GROUPS = SHARED_GROUPS + (ChosenLogprobOptions,)
SEARCH_GROUPS = SHARED_GROUPS


@agreed_dataclass
class _Agreed(AgreedCall):
    """What every rank of tp_group must pass alike besides its shard, each by the name its error uses:
    the call's own arguments (token_count: the token entries), then the logit options."""
    ignore_index: int = agreed("ignore_index", agreement.INTEGER)
    reduce_hidden_grad: bool = agreed("reduce_hidden_grad", agreement.INTEGER)
    skip_ignored: bool = agreed("skipping of ignored rows (skip_ignored)", agreement.INTEGER)
    tokens: torch.Tensor = agreed("token ids", agreement.FINGERPRINT)
    logit_options: LogitOptions = agreed_options()


def _check_tensors(hidden, weight, tokens):
    op = "chosen_logprob"
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{op}: tokens must be a tensor, got {type(tokens).__name__}")
    check_output_layer(op, hidden, weight)
    if tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: tokens must be int64 or int32, got {tokens.dtype}")
    leading = tuple(hidden.shape[:-1])
    if tuple(tokens.shape) != leading and not (tokens.dim() == len(leading) + 1 and tuple(tokens.shape[:-1]) == leading
                                               and tokens.shape[-1] >= 1):
        raise ValueError(f"{op}: tokens must have hidden's leading shape {leading} (one token per position) or "
                         f"{leading + ('k',)} (k >= 1 tokens per position), got {tuple(tokens.shape)} "
                         f"with hidden {tuple(hidden.shape)}")
    check_device(op, hidden=hidden, weight=weight, tokens=tokens)


def _resolve(hidden, weight, tokens, options, rank, world, *, ignore_index, skip_ignored, vocab_start, vocab_size,
             reduce_hidden_grad, main_grad, workspace_bytes, batch_invariant, check_tokens, kept) -> ResolvedCall:
    """The call on this rank, after its checks: top_k at or beyond the vocabulary filters nothing
    (None); with a KeptSet (kept) the ops score its entries. The tiling is planned for the rows the
    ops compute: the scored ones when the token check has counted them, else all (the ops then use
    less); with kept those of the scored tokens, skip_ignored leaving out the others' entries."""
    _check_tensors(hidden, weight, tokens)
    shard, vocab_size = resolve_shard("chosen_logprob", weight.shape[0], rank, world, vocab_start, vocab_size)
    check_main_grad("chosen_logprob", main_grad, weight)
    if batch_invariant:
        check_virtual_shards("chosen_logprob", weight.shape[0], rank, world, shard.vocab_start)
    planned_rows = hidden.numel() // hidden.shape[-1]
    if check_tokens:
        scored_rows = check_token_range("chosen_logprob", tokens, vocab_size, ignore_index,
                                        per_position=tokens.dim() < hidden.dim())
        if kept is not None:
            kept.check_range(vocab_size)
        planned_rows = scored_rows if skip_ignored else planned_rows
    if workspace_bytes is None:
        workspace_bytes = default_workspace_bytes(hidden, planned_rows)
    tiling = tiling_for(planned_rows, hidden.shape[-1], hidden.element_size(), workspace_bytes, hidden.device,
                        batch_invariant)
    if options.top_k is not None and options.top_k >= vocab_size:
        options = dataclasses.replace(options, top_k=None)
    tokens = tokens if kept is None else kept.entries
    own = ChosenLogprobOptions(ignore_index if skip_ignored else None, options.top_k or 0)
    agreed_values = _Agreed(token_count=tokens.numel(), hidden_size=hidden.shape[-1], dtype=hidden.dtype,
                            ignore_index=ignore_index, vocab_size=vocab_size, reduce_hidden_grad=reduce_hidden_grad,
                            skip_ignored=skip_ignored, tokens=tokens, logit_options=options)
    return ResolvedCall(KernelOptions(options.logit_map, shard, tiling, own), weight.shape[0], agreed_values)


def chosen_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    logit_options: Optional[LogitOptions] = None,
    ignore_index: int = -100,
    skip_ignored: bool = True,
    vocab_size: Optional[int] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    return_entropy: bool = False,
    check_tokens: bool = True,
    check_group: bool = True,
    main_grad: Optional[torch.Tensor] = None,
    workspace_bytes: Optional[int] = None,
    batch_invariant: bool = False,
    return_is_max: bool = False,
    return_is_kept: bool = False,
    kept_ids: Optional[torch.Tensor] = None,
):
    """log softmax(z)[tokens] over the (vocab-parallel) vocabulary, z = map(hidden @ weight.T) under
    the logit options, without a [tokens, vocab] tensor (docs/chosen_logprob.md has every detail).

    hidden [..., H] and weight [V_local, H] (this rank's rows of the output layer, global ids from
    vocab_start, default rank * V_local in tp_group) share a dtype: float32, bfloat16 or float16
    (float64 on CPU); tokens (int64 or int32) are global ids, [...] (one per position) or [..., k]
    (k >= 1 per position, scored under the position's one distribution, in one pass over the
    vocabulary): logprob, is_max and is_kept then have tokens' shape, entropy is [...]. vocab_size: the real vocabulary,
    the rows past it padding (default: every row of every rank).
    Logit options (LogitOptions documents them): temperature, softcap (None or c: logits capped to
    c * tanh(x / c) first), top_k, top_p (the rollout sampler's filter: scores of the distribution
    it drew from; a token it drops gets logprob -inf and no logprob gradient); or all four as one
    logit_options=LogitOptions(...) (not both).
    Returns fp32 logprob [...] (float64 for float64 inputs), or a tuple: logprob, then entropy
    (return_entropy), is_max (return_is_max: the token's logit is its row's maximum), is_kept
    (return_is_kept: the token is in the sampler filter's kept set). Differentiable in hidden and
    weight; with tp_group the hidden gradient is summed over the group unless reduce_hidden_grad=False.
    Entries whose token is ignore_index get logprob 0 and no gradient; positions whose entries are
    all ignored get entropy 0 and zero gradient rows, and the ops compute nothing for them
    (skip_ignored=True; False computes every row and keeps their entropy). check_tokens validates the ids (a host synchronisation on CUDA; False: an out-of-range
    id gets NaN); check_group makes every rank of tp_group raise the same error on bad arguments.
    Both are skipped under torch.compile, CUDA graph capture and for meta tensors.
    main_grad ([V_local, H], Megatron's gradient-accumulation buffer) takes the weight gradient
    instead of returning one. workspace_bytes bounds the chunk loop's buffers (default: the size of
    the scored rows of hidden, within [1 MiB, DEFAULT_WORKSPACE_BYTES]; on CUDA up to 256 MiB, where
    long inputs take passes of rows). batch_invariant=True: each
    token's logprob, entropy and hidden gradient are bitwise independent of the other tokens.
    kept_ids [..., k] (int, padded with ignore_index; the positions' leading shape): the ids the
    rollout sampler kept at each position, in place of top_k / top_p: logprob renormalised over
    them (-inf, is_kept False for a token outside), entropy over them; an id given twice counts once.
    """
    # Traced, captured or meta tensors: both host checks are skipped, out-of-range ids get NaN (below).
    readable = values_readable(hidden, weight, tokens, kept_ids)
    check_tokens = check_tokens and readable
    kept = None

    def resolve(rank, world):
        nonlocal kept
        options = given_once("chosen_logprob", "logit_options", logit_options,
                             LogitOptions(temperature=temperature, softcap=softcap, top_k=top_k, top_p=top_p),
                             LogitOptions())
        if kept_ids is not None:
            _check_tensors(hidden, weight, tokens)
            kept = KeptSet.of(hidden, tokens, kept_ids, options, ignore_index, skip_ignored)
        return _resolve(hidden, weight, tokens, options, rank, world, ignore_index=ignore_index,
                        skip_ignored=skip_ignored, vocab_start=vocab_start, vocab_size=vocab_size,
                        reduce_hidden_grad=reduce_hidden_grad, main_grad=main_grad, workspace_bytes=workspace_bytes,
                        batch_invariant=batch_invariant, check_tokens=check_tokens, kept=kept)

    call = resolve_call("chosen_logprob", tp_group, check_group and readable, _Agreed, resolve)

    positions = hidden.shape[:-1]
    # The ops' tokens: [N] for one per position, [N, k] for k (with kept_ids: the kept set's entries).
    scored = tokens if kept is None else kept.entries
    flat = scored.reshape(positions.numel(), *scored.shape[len(positions):]).to(torch.int64)
    ignored = flat == ignore_index
    logprob, entropy, is_max, is_kept = ChosenLogprobFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, flat, ignored, main_grad, call.agreed.logit_options,
        call.kernel_options, VocabPieces.of(TensorParallelGroup(tp_group), call.local_rows, batch_invariant),
        bool(reduce_hidden_grad),
        weight_placeholder(weight, main_grad))
    if skip_ignored:  # the ops left out the rows of no scored entry: their partials are empty
        entropy = torch.where(ignored if ignored.dim() == 1 else ignored.all(1), 0.0, entropy)
    if not check_tokens:
        logprob, out_of_range = mark_out_of_range(flat, ignored, call.vocab_size, logprob)
        is_max, is_kept = is_max & ~out_of_range, is_kept & ~out_of_range
    if kept is not None:
        logprob, entropy, is_max, is_kept = kept.renormalised(logprob, is_max, is_kept)
    per_entry = [logprob] + [is_max] * return_is_max + [is_kept] * return_is_kept
    outputs = [t.reshape(tokens.shape) for t in per_entry]
    outputs[1:1] = [entropy.reshape(positions)] * return_entropy
    return tuple(outputs) if len(outputs) > 1 else outputs[0]


# The fake kernels check the options (building their groups) and the devices as the ops do.
@torch.library.register_fake("fused_rl_ops::chosen_logprob_stats")
def _(hidden, weight, tokens, *args, **kwargs):
    (_, _, _, own), (rest, named) = groups_from_arguments(OP_GROUPS, args, kwargs)
    threshold = rest[0] if rest else named.get("threshold")
    check_device("chosen_logprob", hidden=hidden, weight=weight, tokens=tokens, threshold=threshold)
    per_position = tokens.shape[1] if tokens.dim() == 2 else 1
    columns = CHOSEN + per_position + (TOP_HEADER + own.top_width if own.top_width else 0)
    return hidden.new_empty(hidden.shape[0], columns, dtype=acc_dtype(hidden.dtype))


@torch.library.register_fake("fused_rl_ops::chosen_logprob_search")
def _(hidden, weight, row_max, window, hist, top, *args, **kwargs):
    groups_from_arguments(SEARCH_GROUPS, args, kwargs)
    check_device("chosen_logprob", hidden=hidden, weight=weight, row_max=row_max, window=window, hist=hist, top=top)


@torch.library.register_fake("fused_rl_ops::chosen_logprob_combine")
def _(partials):
    return partials.new_empty(partials.shape[1], partials.shape[2])


@torch.library.register_fake("fused_rl_ops::chosen_logprob_backward")
def _(hidden, weight, tokens, row_max, log_sum, log_sum_minus_entropy, grad_logprob, grad_entropy, main_grad,
      *args, **kwargs):
    _, (rest, named) = groups_from_arguments(OP_GROUPS, args, kwargs)
    threshold = rest[0] if rest else named.get("threshold")
    check_device("chosen_logprob", hidden=hidden, weight=weight, tokens=tokens, main_grad=main_grad,
                 threshold=threshold)
    grad_weight = weight.new_empty(0, weight.shape[1]) if main_grad is not None else torch.empty_like(weight)
    return hidden.new_empty(hidden.shape, dtype=acc_dtype(hidden.dtype)), grad_weight
