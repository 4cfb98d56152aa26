"""Vocab-parallel chosen-token log-softmax and entropy, without a [tokens, vocab] tensor.

Each rank holds rows [vocab_start, vocab_start + V_local) of the output layer. The kernels walk the
local vocabulary in chunks (one GEMM per chunk into a bounded workspace, then a row kernel that
folds the chunk into per-token partials: max, sum of exp, sum of exp-weighted shifted logits, and
the chosen logit). Ranks exchange those [N, 4] partials with one all-gather and merge them in a
fixed order; the backward recomputes each chunk's logits and turns them into logit gradients in
the dtype its GEMMs take (in place, or into a buffer of several chunks' gradients on CUDA). Memory
beyond inputs, outputs and gradients: the workspace (`workspace_bytes`, by default
default_workspace_bytes(hidden)) plus O(tokens) state, independent of the vocabulary size. Rows whose
token is ignore_index are left out before the kernels (skip_ignored): the work, and the workspace's
size, follow the scored rows.
"""
import dataclasses
import math
import struct
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from . import _sampler_filter
from ._library import acc_dtype, check_device, check_float_dtype, ops
from ._checks import check_hidden_size, values_readable
from ._options import (NON_NEGATIVE_INTEGER, POSITIVE_FINITE, POSITIVE_INTEGER, PROBABILITY, check_option,
                       check_options, op_arguments, option, options_dataclass)

DEFAULT_WORKSPACE_BYTES = 64 * 2**20  # the largest default workspace
_MIN_DEFAULT_WORKSPACE_BYTES = 2**20
_MIN_CHUNK = 128
# batch_invariant=True: (token rows per GEMM, vocab rows per chunk) by device, fixed so that every
# GEMM has one shape whatever the batch (see RowTiling in csrc/chosen_logprob/chunks.h). Row blocks are
# multiples of 128, so every block of an aligned hidden starts aligned (aligned_rows there).
INVARIANT_TILING = {"cpu": (512, 2048), "cuda": (512, 4096)}
# Chunks per gradient GEMM where the logit gradients have a buffer of their own (CUDA, bfloat16 or
# float16 inputs: the GEMMs take them in the inputs' dtype, half the bytes of the fp32 logits). Two
# give that buffer as many bytes as the logits and halve the gradient GEMMs of a chunk-per-GEMM
# loop, each of which reads and writes the whole fp32 hidden gradient (docs/chosen_logprob.md,
# "Memory" and "Speed on CUDA").
SEPARATE_GRAD_CHUNKS = 2


@options_dataclass
class ChosenLogprobOptions:
    """The options of the ops chosen_logprob_stats and chosen_logprob_backward, after their tensors,
    in the ops' order (declared for C++ in csrc/chosen_logprob/options.h). Constructing it checks
    them (the only check of these arguments); chosen_logprob builds one per call.

    temperature: the softmax takes the logits divided by it.
    vocab_start: the global id of weight's row 0.
    chunk_size, row_block, pass_rows: vocab rows per chunk; token rows per GEMM and per workspace
        pass, 0: all rows (tiling_for).
    softcap: the logits are capped as softcap * tanh(logits / softcap) first; None: no cap.
    valid_rows: weight's first rows that are vocabulary, the rest padding; None: all of them.
    grad_chunks: the backward's gradient GEMMs take the logit gradients of this many chunks at once
        (tiling_for); the stats op ignores it.
    top_k, top_p: the sampler's filter (fused_rl_ops/_sampler_filter.py); None: none. The ops take
        its kept set as per-token thresholds; with top_k the stats op returns each row's top (its
        top_k largest logits) besides the partials.
    The ranks of a tensor-parallel group must agree on the options marked agreed (temperature,
    softcap, top_k, top_p); chosen_logprob's group check compares them.
    """
    temperature: float = option(POSITIVE_FINITE, agreed=True)
    vocab_start: int = option(NON_NEGATIVE_INTEGER)
    chunk_size: int = option(POSITIVE_INTEGER)
    row_block: int = option(NON_NEGATIVE_INTEGER, default=0)
    pass_rows: int = option(NON_NEGATIVE_INTEGER, default=0)
    softcap: Optional[float] = option(POSITIVE_FINITE, default=None, agreed=True)
    valid_rows: Optional[int] = option(NON_NEGATIVE_INTEGER, default=None)
    grad_chunks: int = option(POSITIVE_INTEGER, default=1)
    top_k: Optional[int] = option(POSITIVE_INTEGER, default=None, agreed=True)
    top_p: Optional[float] = option(PROBABILITY, default=None, agreed=True)

    def __post_init__(self):
        check_options("chosen_logprob", self)


class StatsColumns(NamedTuple):
    """The columns of chosen_logprob_stats' [N, 4] output: a vocab shard's partials of each token's
    row (csrc/chosen_logprob/math.h, stats_column): the max m of its logits, s = sum exp(z - m),
    t = sum exp(z - m) (z - m), and the chosen logit (0 when another shard holds the token). With
    top_k the row's top follows them (_sampler_filter.TOP_HEADER + top_k columns)."""
    max: torch.Tensor
    sum: torch.Tensor
    ent: torch.Tensor
    chosen: torch.Tensor


class CombinedColumns(NamedTuple):
    """The columns of chosen_logprob_combine's [N, 4] output: the shards' partials merged
    (combined_column): the row max, the log-sum relative to it (lse = row_max + log_sum), the
    entropy and the chosen logit."""
    row_max: torch.Tensor
    log_sum: torch.Tensor
    entropy: torch.Tensor
    chosen: torch.Tensor


def default_workspace_bytes(hidden: torch.Tensor, rows: Optional[int] = None) -> int:
    """The workspace when workspace_bytes is None: the size of the rows of hidden the kernels get
    (rows of them; None: all), within [1 MiB, DEFAULT_WORKSPACE_BYTES]. The extra memory then stays
    below the input's size at small shapes (as torch's chunked linear_cross_entropy sizes its
    chunks), while training-sized inputs (8192 tokens x 4096 in bf16 is 64 MiB) get the largest
    workspace and so the widest GEMMs."""
    elements = hidden.numel() if rows is None else rows * hidden.shape[-1]
    return min(DEFAULT_WORKSPACE_BYTES, max(_MIN_DEFAULT_WORKSPACE_BYTES, elements * hidden.element_size()))


def chunk_loop_bytes(device_type: str, element_size: int, hidden_size: int, pass_rows: int, chunk: int,
                     grad_chunks: int, several_passes: bool = False) -> int:
    """The bytes of the buffers csrc/chosen_logprob/chunks.h allocates whose size follows the chunk
    width, on device_type ("cpu" or "cuda") for inputs of element_size bytes, passes of pass_rows
    token rows, chunks of `chunk` vocab rows and groups of grad_chunks chunks (group = chunk *
    grad_chunks rows; at most the vocabulary's, which these bytes assume it has): the backward's,
    which hold the forward's. In the accumulation dtype (acc: fp32, fp64 for float64 inputs):
      - the logits, [pass_rows, chunk] acc (the forward's too);
      - the logit gradients, in the dtype the gradient GEMMs take (CUDA: the inputs'; CPU: acc):
        written over the logits when that is acc and grad_chunks is 1, else [pass_rows, group];
      - on the CPU with reduced-precision inputs, the group's weight rows converted for the GEMMs,
        [group, H] acc (the forward's: [chunk, H]);
      - the group's weight gradient before it is rounded, [group, H] acc, when the rows take
        several passes (summed over them) or on the CPU with reduced-precision inputs.
    Not counted: what follows the tokens or the row block alone (a hidden copy in acc on the CPU,
    the hidden-gradient accumulator, a padded last block), and main_grad's [group, H] buffer in
    the weight's dtype, left out so that main_grad changes no chunk width (its sums are then
    bitwise those of the returned weight gradient)."""
    acc_size = 8 if element_size == 8 else 4
    cuda = device_type == "cuda"
    grad_size = element_size if cuda else acc_size
    group = chunk * grad_chunks
    reduced_cpu_copy = not cuda and element_size != acc_size
    logits = acc_size * pass_rows * chunk
    grads = 0 if grad_size == acc_size and grad_chunks == 1 else grad_size * pass_rows * group
    weight_rows = acc_size * hidden_size * group if reduced_cpu_copy else 0
    weight_grad = acc_size * hidden_size * group if several_passes or reduced_cpu_copy else 0
    return logits + grads + weight_rows + weight_grad


def tiling_for(num_tokens: int, hidden_size: int, element_size: int, workspace_bytes: int, device: torch.device,
               batch_invariant: bool) -> tuple[int, int, int, int]:
    """(chunk_size, row_block, pass_rows, grad_chunks) for the kernels, so that the chunk loop's
    buffers on hidden's device (chunk_loop_bytes) fit in workspace_bytes. By default one GEMM per
    chunk takes all tokens (row_block = pass_rows = 0) and the chunk is the widest multiple of 128
    that fits (at least 128), with SEPARATE_GRAD_CHUNKS chunks per gradient GEMM where the logit
    gradients have a buffer of their own (CUDA, bfloat16 / float16), else one. Batch-invariant:
    the device's fixed row block and chunk width, one chunk per gradient GEMM, and as many row
    blocks per pass as fit (at least one); the pass size changes no result."""
    device_type = "cuda" if device.type == "cuda" else "cpu"
    if batch_invariant:
        row_block, chunk = INVARIANT_TILING[device_type]
        fixed, with_one_row = (chunk_loop_bytes(device_type, element_size, hidden_size, rows, chunk, 1,
                                                several_passes=True) for rows in (0, 1))
        fitting_rows = (workspace_bytes - fixed) // (with_one_row - fixed)
        return chunk, row_block, max(row_block, fitting_rows // row_block * row_block), 1
    grad_chunks = SEPARATE_GRAD_CHUNKS if device_type == "cuda" and element_size < 4 else 1
    per_vocab_row = chunk_loop_bytes(device_type, element_size, hidden_size, num_tokens, 1, grad_chunks)
    rows = workspace_bytes // max(per_vocab_row, 1)
    return max(_MIN_CHUNK, rows // _MIN_CHUNK * _MIN_CHUNK), 0, 0, grad_chunks


def _check_args(hidden, weight, tokens):
    op = "chosen_logprob"
    for name, t in (("hidden", hidden), ("weight", weight), ("tokens", tokens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    cpu = hidden.device.type == "cpu"
    check_float_dtype(op, "hidden", hidden, allow_float64=cpu)
    check_float_dtype(op, "weight", weight, allow_float64=cpu)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: tokens must be int64 or int32, got {tokens.dtype}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{op}: expected hidden [..., H] and weight [V_local, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if tuple(tokens.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{op}: tokens must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(tokens.shape)}")
    check_hidden_size(op, hidden)
    check_device(op, hidden=hidden, weight=weight, tokens=tokens)


def _check_vocab(local_vocab, world, vocab_start, vocab_size):
    """vocab_size, and vocab_start (checked alone by ChosenLogprobOptions) against it, as far as
    this rank can see."""
    if vocab_size < 1:
        raise ValueError(f"chosen_logprob: vocab_size must be >= 1, got {vocab_size}")
    if world == 1 and (vocab_start != 0 or vocab_size > local_vocab):
        raise ValueError(f"chosen_logprob: without a tensor-parallel group the weight holds the whole vocabulary: "
                         f"vocab_start must be 0 and vocab_size <= {local_vocab} (its rows), got vocab_start "
                         f"{vocab_start} and vocab_size {vocab_size}")


def _check_main_grad(main_grad, weight):
    if main_grad is None:
        return
    if (not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape
            or main_grad.device != weight.device or main_grad.dtype not in (torch.float32, weight.dtype)):
        got = (f"{tuple(main_grad.shape)} {main_grad.dtype} on {main_grad.device}"
               if isinstance(main_grad, torch.Tensor) else type(main_grad).__name__)
        raise ValueError(f"chosen_logprob: main_grad must be a float32 (or weight-dtype) tensor of weight's shape "
                         f"{tuple(weight.shape)} on {weight.device}, got {got}")


# What every rank of tp_group must agree on, in the order _check_group gathers it: the call's own
# fields (the wrapper's arguments, skip_ignored as it takes effect), then the agreed options of
# ChosenLogprobOptions (the ops' arguments).
_AGREED_OPTIONS = {o.name: o for o in ChosenLogprobOptions.OPTIONS if o.agreed}
_SKIPPING = "skipping of ignored rows (skip_ignored and check_tokens)"
_GROUP_FIELDS = ("token count", "hidden size", "dtype", "ignore_index", "vocab_size", "reduce_hidden_grad",
                 _SKIPPING, "token ids", *_AGREED_OPTIONS)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _option_bits(value) -> int:
    """An option's value as one int64: the bits of float(value), None as those of NaN, which no
    option takes."""
    return _float_bits(math.nan if value is None else float(value))


def _group_fields(hidden, tokens, ignore_index, vocab_size, reduce_hidden_grad, skipping, options):
    flat = tokens.reshape(-1).long()
    # A cheap fingerprint of the ids and their order (distinct weights per position).
    fingerprint = int((flat * (torch.arange(flat.numel(), device=flat.device) % 8191 + 1)).sum())
    return [flat.numel(), hidden.shape[-1], _DTYPES.index(hidden.dtype), ignore_index, vocab_size,
            int(reduce_hidden_grad), int(skipping), fingerprint] + [
                _option_bits(getattr(options, name)) for name in _AGREED_OPTIONS]


def _check_group(tp_group, error, shard_and_fields):
    """Raises on every rank of tp_group, with the same message, when any rank rejected its arguments
    (error; shard_and_fields is then None) or the ranks disagree: on _GROUP_FIELDS, or on shards
    [vocab_start, vocab_start + V_local) (shard_and_fields = [vocab_start, V_local, *fields]) that
    do not tile [0, total rows) with vocab_size <= total rows. One all-gather of a
    few int64 per rank (a host synchronisation on CUDA); a second, only when some rank failed, to
    share the messages. Without it a failing rank would leave the others waiting in the all-gather."""
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(tp_group)) else "cpu"
    mine = [int(error is not None)] + (shard_and_fields or [0] * (2 + len(_GROUP_FIELDS)))
    gathered = [torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=device), group=tp_group)
    rows = torch.stack(gathered).tolist()
    if any(row[0] for row in rows):
        messages = [None] * len(rows)
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=tp_group)
        if error is not None:
            raise error
        failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
        raise ValueError(f"chosen_logprob: other ranks of tp_group rejected their arguments ({failed})")
    for k, name in enumerate(_GROUP_FIELDS):
        values = [row[3 + k] for row in rows]
        if len(set(values)) > 1:
            if name == "dtype":
                values = [_DTYPES[v] for v in values]
            elif name in _AGREED_OPTIONS:
                kind = _AGREED_OPTIONS[name].kind
                values = [None if math.isnan(_bits_float(v)) else kind(_bits_float(v)) for v in values]
            shown = "differ" if name == "token ids" else f"per rank: {values}"
            raise ValueError(f"chosen_logprob: the ranks of tp_group disagree on the {name} ({shown})")
    total = 0
    for start, rows_here in sorted((row[1], row[2]) for row in rows):
        if start != total:
            shards = [(row[1], row[1] + row[2]) for row in rows]
            raise ValueError(f"chosen_logprob: the ranks' vocab shards [vocab_start, vocab_start + V_local) must "
                             f"tile [0, total rows) without gaps or overlaps; got {shards} by rank")
        total += rows_here
    vocab_size = rows[0][3 + _GROUP_FIELDS.index("vocab_size")]
    if vocab_size > total:
        raise ValueError(f"chosen_logprob: vocab_size {vocab_size} is beyond the {total} rows the ranks hold")


def _check_token_range(tokens, vocab_size, ignore_index) -> int:
    """Raises when an id is neither in [0, vocab_size) nor ignore_index; returns the number of
    scored ids (the others). One host read of two integers (a synchronisation on CUDA)."""
    ignored = tokens == ignore_index
    invalid = ~ignored & ((tokens < 0) | (tokens >= vocab_size))
    # One copy to the host, then item() on host tensors, which a dispatch mode sees (tolist() it does not).
    num_invalid, num_scored = (int(n) for n in torch.stack([invalid.sum(), (~ignored).sum()]).cpu())
    if num_invalid:
        bad = tokens[invalid][:5].tolist()
        raise ValueError(f"chosen_logprob: token ids must lie in [0, {vocab_size}) or equal ignore_index "
                         f"({ignore_index}); found {bad}")
    return num_scored


def _main_grad_placeholder(weight, main_grad):
    """What the backward returns as the weight's gradient when it adds that gradient into main_grad,
    as megatron-core's linear layers (LinearWithGradAccumulationAndAsyncCommunication) do: under
    Megatron's DDP (the weight carries grad_added_to_main_grad) a placeholder of the weight's shape,
    "zeros" when weight.zero_out_wgrad else "empty", which DDP's hook then drops without adding;
    otherwise None (no gradient). Sets grad_added_to_main_grad here, when the call is recorded for
    a backward, rather than in the backward, which dynamo traces without attribute side effects;
    DDP's hook reads the flag only after the backward."""
    if main_grad is None or not hasattr(weight, "grad_added_to_main_grad"):
        return None
    if torch.is_grad_enabled() and weight.requires_grad:
        weight.grad_added_to_main_grad = True
    return "zeros" if getattr(weight, "zero_out_wgrad", False) else "empty"


@dataclass(frozen=True)
class _Autograd:
    """What _ChosenLogprob needs besides the tensors and the ops' options, resolved by chosen_logprob."""
    tp_group: Optional[dist.ProcessGroup]
    reduce_hidden_grad: bool
    weight_placeholder: Optional[str]  # with main_grad: as _main_grad_placeholder gives

    @property
    def distributed(self) -> bool:
        return self.tp_group is not None and dist.get_world_size(self.tp_group) > 1

    def gather(self, t):
        """The ranks' t stacked, [ranks, ...] ([1, ...] without a group)."""
        if not self.distributed:
            return t.unsqueeze(0)
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(gathered, t.contiguous(), group=self.tp_group)
        return torch.stack(gathered)

    def all_reduce(self, t):
        if self.distributed:
            dist.all_reduce(t, group=self.tp_group)

    def combine(self, stats):
        """The ranks' partials of chosen_logprob_stats merged: CombinedColumns. lse = row_max +
        log_sum, kept apart: z - row_max is exact near the top of the row."""
        return CombinedColumns(*ops.chosen_logprob_combine(self.gather(stats)).unbind(1))


def _kept_set(hidden, weight, stats, row, options, call):
    """The tokens' thresholds of the sampler's filter and with top_k the kept set's partials
    (_sampler_filter.thresholds), from the stats pass's tops, with search passes where top_p alone
    needs them."""

    def search(window, hist, top):
        ops.chosen_logprob_search(hidden, weight, row.row_max, window, hist, top, *op_arguments(options))

    tops = stats[:, len(StatsColumns._fields):] if options.top_k is not None else None
    return _sampler_filter.thresholds(tops, row.row_max, row.log_sum, options.top_k, options.top_p, search,
                                      call.gather, call.all_reduce)


def _gather(t, rows):
    """t's entries at rows (an index), or t itself when rows (or t) is None."""
    return t if rows is None or t is None else t.index_select(0, rows)


def _scatter(t, rows, num_rows):
    """A [num_rows, ...] tensor holding t's entries at rows and zeros elsewhere (copied, not added:
    every bit of t kept); t itself when rows is None."""
    return t if rows is None else t.new_zeros((num_rows, *t.shape[1:])).index_copy_(0, rows, t)


class _ChosenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, ignore, scored_rows, main_grad, options, call):
        """scored_rows: the rows of hidden the ops get (an index; the other rows' results are zeros
        and their gradient rows too), or None: all of them."""
        num_rows = hidden.shape[0]
        hidden, tokens, ignore = (_gather(t, scored_rows) for t in (hidden, tokens, ignore))
        stats = ops.chosen_logprob_stats(hidden, weight, tokens, *op_arguments(options))
        row = call.combine(stats[:, :len(StatsColumns._fields)])
        threshold = None
        if options.top_k is not None or options.top_p is not None:
            # The kept set's threshold, then the partials of the logits at or above it.
            threshold, kept = _kept_set(hidden, weight, stats, row, options, call)
            if kept is None:
                unfiltered = dataclasses.replace(options, top_k=None, top_p=None)
                row = call.combine(ops.chosen_logprob_stats(hidden, weight, tokens, *op_arguments(unfiltered),
                                                            threshold))
            else:  # from the tops; rows that are not filtered (threshold -inf: a NaN or inf) as they are
                filtered = torch.isfinite(threshold)
                row = CombinedColumns(*(torch.where(filtered, k.to(c.dtype), c) for k, c in zip(kept, row[:3])),
                                      row.chosen)
        logprob = torch.where(ignore, 0.0, (row.chosen - row.row_max) - row.log_sum)
        # Both come from the same fp32 logit buffer, so a chosen maximum compares equal exactly; and
        # the threshold is one of those logits.
        is_max = (row.chosen == row.row_max) & ~ignore
        dropped = torch.zeros_like(ignore) if threshold is None else (row.chosen < threshold) & ~ignore
        logprob = torch.where(dropped, -math.inf, logprob)
        is_max, is_kept = _scatter(is_max, scored_rows, num_rows), _scatter(~(ignore | dropped), scored_rows, num_rows)
        ctx.mark_non_differentiable(is_max, is_kept)
        # Ignored tokens and tokens outside the kept set (logprob -inf) pass no logprob gradient.
        no_logprob_grad = ignore | dropped
        ctx.save_for_backward(hidden, weight, tokens, no_logprob_grad, scored_rows, row.row_max, row.log_sum,
                              row.entropy, threshold)
        ctx.options, ctx.call, ctx.num_rows = options, call, num_rows
        # main_grad is the backward's output buffer, not an input of its math: kept on ctx, not saved
        # (autograd's version check would trip on its in-place updates).
        ctx.main_grad = main_grad
        return (_scatter(logprob, scored_rows, num_rows), _scatter(row.entropy, scored_rows, num_rows), is_max,
                is_kept)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_is_max, grad_is_kept):
        hidden, weight, tokens, no_logprob_grad, scored_rows, row_max, log_sum, entropy, threshold = ctx.saved_tensors
        call = ctx.call
        grad_logprob, grad_entropy = _gather(grad_logprob, scored_rows), _gather(grad_entropy, scored_rows)
        grad_logprob = (torch.zeros_like(entropy) if grad_logprob is None
                        else torch.where(no_logprob_grad, 0.0, grad_logprob))
        grad_entropy = torch.zeros_like(entropy) if grad_entropy is None else grad_entropy
        # One [V_local, H] weight gradient, padded rows zeroed by the op; or none, added into main_grad.
        grad_hidden, grad_weight = ops.chosen_logprob_backward(
            hidden, weight, tokens, row_max, log_sum, log_sum - entropy, grad_logprob.to(entropy.dtype).contiguous(),
            grad_entropy.to(entropy.dtype).contiguous(), ctx.main_grad, *op_arguments(ctx.options), threshold)
        if ctx.main_grad is not None:
            grad_weight = None
            if call.weight_placeholder == "zeros":
                grad_weight = torch.zeros_like(weight)
            elif call.weight_placeholder == "empty":
                grad_weight = torch.empty_like(weight)
        if call.reduce_hidden_grad and call.distributed:
            dist.all_reduce(grad_hidden, group=call.tp_group)  # fp32: the sum is taken before rounding
        grad_hidden = _scatter(grad_hidden.to(hidden.dtype), scored_rows, ctx.num_rows)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chosen_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
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
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    return_is_kept: bool = False,
):
    """log softmax(z / temperature)[tokens] over the (vocab-parallel) vocabulary, z = hidden @ weight.T,
    or z = softcap * tanh(hidden @ weight.T / softcap) with a softcap (a positive finite number;
    None, the default, caps nothing).

    hidden [..., H] and weight [V_local, H] (this rank's rows of the output layer, global ids
    vocab_start .. vocab_start + V_local - 1; default vocab_start = rank * V_local in tp_group)
    share a dtype: float32, bfloat16 or float16 (float64 on CPU). tokens [...] (int64 or int32)
    are global ids. Logits are accumulated in fp32.

    Returns fp32 logprob [...] (float64 for float64 inputs), or a tuple: logprob, then entropy with
    return_entropy=True, then is_max with return_is_max=True (bool [...]: the token's logit equals
    its row's maximum over the valid rows, i.e. a greedy pick; every token tied for the maximum is
    True; ignored positions, out-of-range ids and rows with a NaN logit are False), then is_kept
    with return_is_kept=True (bool [...]: the token is in the kept set of top_k / top_p; ignored
    positions and out-of-range ids are False). vocab_size is
    the real vocabulary size: rows with global id >= vocab_size are padding and take no part in the
    softmax or entropy (default: every row of every rank).
    Positions whose token is ignore_index get logprob 0, entropy 0 and zero gradient rows, and never
    reach the kernels (skip_ignored=True, the default): their rows are left out of hidden before the
    kernels and the results put back, so the work, forward and backward, and the default workspace
    follow the scored rows. This needs the number of scored rows on the host: it is read with
    check_tokens' read (one synchronisation on CUDA, no more). Where no value may be read (with
    check_tokens=False, while torch.compile traces the call or a CUDA graph is captured, on meta
    tensors) every row is computed instead, the ignored ones on zeroed hidden rows, with the same
    results (bitwise with batch_invariant=True), at the full cost. skip_ignored=False computes every
    row as it is: ignored positions get logprob 0 and no logprob gradient, and keep their entropy
    and its gradient. Differentiable in hidden and weight for any upstream gradients. With
    tp_group the hidden gradient is summed over the group, unless reduce_hidden_grad=False (for a
    sequence-parallel gather whose backward reduce-scatters it).

    Non-finite values give what float64 log_softmax over the valid rows gives: a NaN logit (from
    hidden or any valid weight row) or a +inf one makes the token's logprob and entropy NaN, and
    its gradients NaN (its hidden-gradient row and every valid weight-gradient row); a -inf logit
    has probability 0 and adds nothing. With a softcap a +inf or -inf logit is capped to +softcap or
    -softcap (so it has probability > 0) and passes no gradient through tanh; a NaN stays NaN.
    Padding rows never take part, whatever they hold.

    check_tokens validates token ids against [0, vocab_size) (a host synchronisation on CUDA;
    False skips it: an out-of-range id then matches no row, never an out-of-bounds read, and its
    logprob and gradients are NaN). check_group (with a tp_group of more than one rank) makes every
    rank raise the same clear error when any rank's arguments are invalid, or when the ranks
    disagree on the tokens, hidden size, dtype, temperature, softcap, ignore_index, vocab_size,
    reduce_hidden_grad or skipping (skip_ignored and check_tokens), or hold vocab shards that do not
    tile [0, total rows): one all-gather of a few integers per call and a host synchronisation;
    False skips it (a rank with invalid arguments then raises alone while the others wait in the
    collective). Both checks read tensor values on the host, so they are skipped while
    torch.compile or torch.export traces the call (fullgraph works with the defaults), while a CUDA
    graph is captured and for meta tensors: an out-of-range id then gets the NaN logprob and
    gradients of check_tokens=False, and the ranks of tp_group are not compared. main_grad
    ([V_local, H], float32 or weight's dtype: Megatron's gradient-accumulation buffer) makes the
    backward add the weight gradient into it, chunk by chunk, instead of returning one (see
    _main_grad_placeholder for what the weight receives).
    workspace_bytes bounds the buffers whose size follows the chunk width, as each device allocates
    them (chunk_loop_bytes; with main_grad add a [chunk * grad_chunks, H] buffer in the weight's
    dtype); None: default_workspace_bytes(hidden, rows the kernels get).

    top_k (a positive integer) and top_p (a number in (0, 1]) score the tokens under the distribution
    a sampler with those settings drew them from: the softmax restricted to the tokens it keeps
    (its top_k largest logits, ties included, then the most likely of those up to a cumulative
    probability of top_p, ties decided together; the rule: fused_rl_ops/_sampler_filter.py) and
    renormalised over them, logprob and entropy alike; the gradients treat the kept set as fixed.
    Pass the rollout engine's values. A token outside the kept set gets logprob -inf and no logprob
    gradient (is_kept counts them). None, top_k >= vocab_size and top_p = 1 filter nothing (today's
    results, bitwise). top_k adds no pass over the vocabulary (the stats pass keeps each row's top
    and the kept set's sums come from it; top_p with top_k is decided on it too). top_p without
    top_k searches its threshold, typically two more passes, each with a host synchronisation (so
    not under torch.compile(fullgraph=True) or CUDA graph capture), and one for the kept set.

    batch_invariant=True makes each token's logprob, entropy and hidden gradient bitwise
    independent of the other tokens of the call (their number, order, leading shape, ignored
    positions, whether they are skipped) and of workspace_bytes, on one machine with one library
    build and thread count: GEMMs of fixed shape (INVARIANT_TILING) over vocab chunks merged in
    vocab order. The weight
    gradient, a sum over tokens, stays deterministic but not batch-invariant. The workspace then
    holds at least one [row_block, chunk] block.
    """
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    # Traced, captured or meta tensors: both host checks are skipped, out-of-range ids get NaN (below).
    check_tokens = check_tokens and values_readable(hidden, weight, tokens)
    check_group = check_group and values_readable(hidden, weight, tokens)
    # Skipping needs the number of scored rows on the host, which the token check reads with the ids.
    skipping = bool(skip_ignored) and check_tokens
    error = None
    try:
        _check_args(hidden, weight, tokens)
        local_vocab = weight.shape[0]
        vocab_start = rank * local_vocab if vocab_start is None else vocab_start
        vocab_size = world * local_vocab if vocab_size is None else vocab_size
        check_option("chosen_logprob", ChosenLogprobOptions, "vocab_start", vocab_start)  # _check_vocab reads it
        _check_vocab(local_vocab, world, vocab_start, vocab_size)
        _check_main_grad(main_grad, weight)
        kernel_rows = tokens.numel()  # the rows the kernels get
        if check_tokens:
            scored_count = _check_token_range(tokens, vocab_size, ignore_index)
            kernel_rows = scored_count if skipping else kernel_rows
        if workspace_bytes is None:
            workspace_bytes = default_workspace_bytes(hidden, kernel_rows)
        chunk_size, row_block, pass_rows, grad_chunks = tiling_for(
            kernel_rows, hidden.shape[-1], hidden.element_size(), workspace_bytes, hidden.device, batch_invariant)
        # The weight's rows before vocab_size are vocabulary, the rest padding.
        valid_rows = min(max(vocab_size - vocab_start, 0), local_vocab)
        check_option("chosen_logprob", ChosenLogprobOptions, "top_k", top_k)
        check_option("chosen_logprob", ChosenLogprobOptions, "top_p", top_p)
        top_k = None if top_k is None or top_k >= vocab_size else top_k
        top_p = None if top_p is None or top_p == 1 else top_p
        options = ChosenLogprobOptions(temperature, vocab_start, chunk_size, row_block, pass_rows, softcap, valid_rows,
                                       grad_chunks, top_k, top_p)
    except (TypeError, ValueError) as exc:
        error = exc
    if world > 1 and check_group:
        shard_and_fields = None if error is not None else [options.vocab_start, weight.shape[0]] + _group_fields(
            hidden, tokens, ignore_index, vocab_size, reduce_hidden_grad, skipping, options)
        _check_group(tp_group, error, shard_and_fields)
    elif error is not None:
        raise error

    lead = tokens.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    tokens1d = tokens.reshape(-1).to(torch.int64)
    ignored = tokens1d == ignore_index
    scored_rows = None
    if skipping and kernel_rows < tokens1d.numel():
        scored_rows = torch.nonzero_static(~ignored, size=kernel_rows).squeeze(1)  # no second host read
    elif skip_ignored and not skipping:
        # Every row is computed: the ignored ones on zeros, so that nothing in them (a NaN in a padding
        # position's hidden state) reaches the weight gradient; their results are dropped below.
        hidden2d = hidden2d.masked_fill(ignored[:, None], 0)
    call = _Autograd(tp_group, bool(reduce_hidden_grad), _main_grad_placeholder(weight, main_grad))
    logprob, entropy, is_max, is_kept = _ChosenLogprob.apply(hidden2d, weight, tokens1d, ignored, scored_rows,
                                                             main_grad, options, call)
    if skip_ignored:
        entropy = torch.where(ignored, 0.0, entropy)  # and no entropy gradient into the rows computed anyway
    if not check_tokens:
        # An unchecked id outside [0, vocab_size) matches no row and would get a finite -lse: NaN
        # marks it instead (and, through the product, its gradients), with no host synchronisation.
        out_of_range = ~ignored & ((tokens1d < 0) | (tokens1d >= vocab_size))
        logprob = logprob * torch.where(out_of_range, float("nan"), 1.0)
        is_max = is_max & ~out_of_range
        is_kept = is_kept & ~out_of_range
    outputs = [logprob] + [entropy] * return_entropy + [is_max] * return_is_max + [is_kept] * return_is_kept
    outputs = tuple(t.reshape(lead) for t in outputs)
    return outputs if len(outputs) > 1 else outputs[0]


def _options_and_threshold(args, kwargs) -> tuple:
    """(ChosenLogprobOptions, threshold) from the arguments after an op's tensors: its options, then
    the optional threshold."""
    count = len(ChosenLogprobOptions.OPTIONS)
    threshold = args[count] if len(args) > count else kwargs.pop("threshold", None)
    return ChosenLogprobOptions(*args[:count], **kwargs), threshold


# The fake kernels check the options and the devices as the ops do.
@torch.library.register_fake("fused_rl_ops::chosen_logprob_stats")
def _(hidden, weight, tokens, *args, **kwargs):
    options, threshold = _options_and_threshold(args, kwargs)
    check_device("chosen_logprob", hidden=hidden, weight=weight, tokens=tokens, threshold=threshold)
    top = 0 if options.top_k is None else _sampler_filter.TOP_HEADER + options.top_k
    columns = len(StatsColumns._fields) + top
    return hidden.new_empty(hidden.shape[0], columns, dtype=acc_dtype(hidden.dtype))


@torch.library.register_fake("fused_rl_ops::chosen_logprob_search")
def _(hidden, weight, row_max, window, hist, top, *options, **named_options):
    ChosenLogprobOptions(*options, **named_options)
    check_device("chosen_logprob", hidden=hidden, weight=weight, row_max=row_max, window=window, hist=hist, top=top)


@torch.library.register_fake("fused_rl_ops::chosen_logprob_combine")
def _(partials):
    return partials.new_empty(partials.shape[1], len(CombinedColumns._fields))


@torch.library.register_fake("fused_rl_ops::chosen_logprob_backward")
def _(hidden, weight, tokens, row_max, log_sum, log_sum_minus_entropy, grad_logprob, grad_entropy, main_grad,
      *args, **kwargs):
    _, threshold = _options_and_threshold(args, kwargs)
    check_device("chosen_logprob", hidden=hidden, weight=weight, tokens=tokens, main_grad=main_grad,
                 threshold=threshold)
    grad_weight = weight.new_empty(0, weight.shape[1]) if main_grad is not None else torch.empty_like(weight)
    return hidden.new_empty(hidden.shape, dtype=acc_dtype(hidden.dtype)), grad_weight
