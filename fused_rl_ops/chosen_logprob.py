"""Vocab-parallel chosen-token log-softmax and entropy, without a [tokens, vocab] tensor: the public
function, the resolution of its arguments into the ops' options, and the ops' fake kernels. How it
works, and what every argument does in full: docs/chosen_logprob.md."""
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ._checks import check_hidden_size, values_readable
from ._chosen_logprob_function import ChosenLogprobFunction
from ._library import acc_dtype, check_device, check_float_dtype
from ._options import INTEGER, NON_NEGATIVE_INTEGER, check_options, groups_from_arguments, option, options_dataclass
from ._vocab_parallel import agreement
from ._vocab_parallel.group import CHOSEN, CombinedColumns, StatsColumns, TensorParallelGroup
from ._vocab_parallel.kernel_options import SHARED_GROUPS, KernelOptions
from ._vocab_parallel.main_grad import check_main_grad, weight_placeholder
from ._vocab_parallel.sampler_filter import TOP_HEADER
from ._vocab_parallel.shard import resolve_shard
from ._vocab_parallel.tiling import DEFAULT_WORKSPACE_BYTES, default_workspace_bytes, tiling_for
from ._vocab_parallel.tokens import check_token_range, mark_out_of_range
from .logit_options import LogitOptions, given_once

__all__ = ["ChosenLogprobOptions", "CombinedColumns", "DEFAULT_WORKSPACE_BYTES", "StatsColumns", "chosen_logprob"]


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

# What every rank of tp_group must agree on besides its shard, in order: the call's own arguments,
# then the logit options.
_AGREED_FIELDS = [("token count", agreement.INTEGER), ("hidden size", agreement.INTEGER),
                  ("dtype", agreement.DTYPE), ("ignore_index", agreement.INTEGER),
                  ("vocab_size", agreement.INTEGER), ("reduce_hidden_grad", agreement.INTEGER),
                  ("skipping of ignored rows (skip_ignored)", agreement.INTEGER),
                  ("token ids", agreement.FINGERPRINT)] + agreement.agreed_fields(LogitOptions)


def check_tensors(hidden, weight, tokens, op="chosen_logprob"):
    """The checks of hidden, weight and tokens (None: the op takes none, top_logprobs)."""
    for name, t in (("hidden", hidden), ("weight", weight)) + ((("tokens", tokens),) if tokens is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    cpu = hidden.device.type == "cpu"
    check_float_dtype(op, "hidden", hidden, allow_float64=cpu)
    check_float_dtype(op, "weight", weight, allow_float64=cpu)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{op}: expected hidden [..., H] and weight [V_local, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    check_hidden_size(op, hidden)
    if tokens is None:
        check_device(op, hidden=hidden, weight=weight)
        return
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
             main_grad, workspace_bytes, batch_invariant, check_tokens):
    """(options, kernel options, vocab_size) of a call, after its checks: top_k at or beyond the
    vocabulary filters nothing (None). The tiling is planned for the rows the ops compute: the
    scored ones when the token check has counted them, else all (the ops then use less)."""
    check_tensors(hidden, weight, tokens)
    shard, vocab_size = resolve_shard("chosen_logprob", weight.shape[0], rank, world, vocab_start, vocab_size)
    check_main_grad("chosen_logprob", main_grad, weight)
    planned_rows = hidden.numel() // hidden.shape[-1]
    if check_tokens:
        scored_rows = check_token_range("chosen_logprob", tokens, vocab_size, ignore_index,
                                        per_position=tokens.dim() < hidden.dim())
        planned_rows = scored_rows if skip_ignored else planned_rows
    if workspace_bytes is None:
        workspace_bytes = default_workspace_bytes(hidden, planned_rows)
    tiling = tiling_for(planned_rows, hidden.shape[-1], hidden.element_size(), workspace_bytes, hidden.device,
                        batch_invariant)
    if options.top_k is not None and options.top_k >= vocab_size:
        options = dataclasses.replace(options, top_k=None)
    own = ChosenLogprobOptions(ignore_index if skip_ignored else None, options.top_k or 0)
    return options, KernelOptions(options.logit_map, shard, tiling, own), vocab_size


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
    the scored rows of hidden, within [1 MiB, DEFAULT_WORKSPACE_BYTES]). batch_invariant=True: each
    token's logprob, entropy and hidden gradient are bitwise independent of the other tokens.
    """
    tp = TensorParallelGroup(tp_group)
    world, rank = (dist.get_world_size(tp_group), dist.get_rank(tp_group)) if tp_group is not None else (1, 0)
    # Traced, captured or meta tensors: both host checks are skipped, out-of-range ids get NaN (below).
    readable = values_readable(hidden, weight, tokens)
    check_tokens, check_group = check_tokens and readable, check_group and readable
    error = None
    try:
        options = given_once("chosen_logprob", "logit_options", logit_options,
                             LogitOptions(temperature=temperature, softcap=softcap, top_k=top_k, top_p=top_p),
                             LogitOptions())
        options, kernel_options, vocab_size = _resolve(
            hidden, weight, tokens, options, rank, world, ignore_index=ignore_index, skip_ignored=skip_ignored,
            vocab_start=vocab_start, vocab_size=vocab_size, main_grad=main_grad, workspace_bytes=workspace_bytes,
            batch_invariant=batch_invariant, check_tokens=check_tokens)
    except (TypeError, ValueError) as exc:
        error = exc
    if world > 1 and check_group:
        values = None if error is not None else [
            tokens.numel(), hidden.shape[-1], hidden.dtype, ignore_index, vocab_size, reduce_hidden_grad,
            skip_ignored, agreement.token_fingerprint(tokens)] + agreement.agreed_values(options)
        shard = None if error is not None else (kernel_options.shard.vocab_start, weight.shape[0])
        agreement.check_agreement("chosen_logprob", tp_group, _AGREED_FIELDS, error, shard, values)
    elif error is not None:
        raise error

    positions = hidden.shape[:-1]
    # The ops' tokens: [N] for one per position, [N, k] for k.
    flat = tokens.reshape(positions.numel(), *tokens.shape[len(positions):]).to(torch.int64)
    ignored = flat == ignore_index
    logprob, entropy, is_max, is_kept = ChosenLogprobFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, flat, ignored, main_grad, options, kernel_options, tp,
        bool(reduce_hidden_grad), weight_placeholder(weight, main_grad))
    if skip_ignored:  # the ops left out the rows of no scored entry: their partials are empty
        entropy = torch.where(ignored if ignored.dim() == 1 else ignored.all(1), 0.0, entropy)
    if not check_tokens:
        logprob, out_of_range = mark_out_of_range(flat, ignored, vocab_size, logprob)
        is_max, is_kept = is_max & ~out_of_range, is_kept & ~out_of_range
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
