"""Vocab-parallel chosen-token log-softmax and entropy, without a [tokens, vocab] tensor.

Each rank holds rows [vocab_start, vocab_start + V_local) of the output layer. The kernels walk the
local vocabulary in chunks (one GEMM per chunk into a bounded workspace, then a row kernel that
folds the chunk into per-token partials: max, sum of exp, sum of exp-weighted shifted logits, and
the chosen logit). Ranks exchange those [N, 4] partials with one all-gather and merge them in a
fixed order; the backward recomputes each chunk's logits and turns them into logit gradients in
place. Memory beyond inputs, outputs and gradients: the workspace (`workspace_bytes`, default
DEFAULT_WORKSPACE_BYTES) plus O(tokens) state, independent of the vocabulary size.
"""
from typing import Optional

import torch
import torch.distributed as dist

from ._library import acc_dtype, check_device, check_float_dtype, ops

DEFAULT_WORKSPACE_BYTES = 64 * 2**20
_MIN_CHUNK = 128
# batch_invariant=True: (token rows per GEMM, vocab rows per chunk) by device, fixed so that every
# GEMM has one shape whatever the batch (see RowTiling in csrc/logprob_chunks.h). Row blocks are
# multiples of 128, so every block of an aligned hidden starts aligned (aligned_rows there).
INVARIANT_TILING = {"cpu": (512, 2048), "cuda": (512, 4096)}


def chunk_size_for(num_tokens: int, hidden_size: int, element_size: int, workspace_bytes: int) -> int:
    """Vocab rows per chunk so that the chunk's buffers fit in workspace_bytes: fp32 logits
    [N, chunk], their copy in the input dtype (CUDA, reduced precision) and the fp32 weight chunk
    (CPU, reduced precision). Never below 128 rows, a multiple of 128."""
    per_row = 4 * num_tokens + element_size * num_tokens + 4 * hidden_size
    rows = workspace_bytes // max(per_row, 1)
    return max(_MIN_CHUNK, rows // _MIN_CHUNK * _MIN_CHUNK)


def tiling_for(num_tokens: int, hidden_size: int, element_size: int, workspace_bytes: int, device: torch.device,
               batch_invariant: bool) -> tuple[int, int, int]:
    """(chunk_size, row_block, pass_rows) for the kernels. By default one GEMM per chunk takes all
    tokens (row_block = pass_rows = 0) and the chunk width follows the token count. Batch-invariant:
    the device's fixed row block and chunk width, and as many row blocks per pass as fit in
    workspace_bytes (at least one); the pass size changes no result."""
    if not batch_invariant:
        return chunk_size_for(num_tokens, hidden_size, element_size, workspace_bytes), 0, 0
    row_block, chunk = INVARIANT_TILING["cuda" if device.type == "cuda" else "cpu"]
    weight_chunk_copy = 4 * hidden_size * chunk if device.type != "cuda" and element_size < 4 else 0
    fitting_rows = (workspace_bytes - weight_chunk_copy) // ((4 + element_size) * chunk)
    return chunk, row_block, max(row_block, fitting_rows // row_block * row_block)


def _check_args(hidden, weight, tokens, temperature):
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
    if not (temperature > 0 and temperature != float("inf")):
        raise ValueError(f"{op}: temperature must be a positive finite number, got {temperature}")
    check_device(op, hidden=hidden, weight=weight, tokens=tokens)


def _check_token_range(tokens, vocab_size, ignore_index):
    valid = (tokens == ignore_index) | ((tokens >= 0) & (tokens < vocab_size))
    if not bool(valid.all()):
        bad = tokens[~valid][:5].tolist()
        raise ValueError(f"chosen_logprob: token ids must lie in [0, {vocab_size}) or equal ignore_index "
                         f"({ignore_index}); found {bad}")


class _ChosenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, ignore, temperature, vocab_start, n_valid, tiling, tp_group,
                reduce_hidden_grad):
        local_weight = weight[:n_valid]
        stats = ops.logprob_stats(hidden, local_weight, tokens, temperature, vocab_start, *tiling)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(gathered, stats, group=tp_group)
            partials = torch.stack(gathered)
        else:
            partials = stats.unsqueeze(0)
        lse, entropy, chosen = ops.logprob_combine(partials).unbind(1)
        logprob = torch.where(ignore, 0.0, chosen - lse)
        ctx.save_for_backward(hidden, weight, tokens, ignore, lse, entropy)
        ctx.args = (temperature, vocab_start, n_valid, tiling, tp_group, reduce_hidden_grad)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, tokens, ignore, lse, entropy = ctx.saved_tensors
        temperature, vocab_start, n_valid, tiling, tp_group, reduce_hidden_grad = ctx.args
        grad_logprob = torch.zeros_like(lse) if grad_logprob is None else torch.where(ignore, 0.0, grad_logprob)
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
        grad_hidden, grad_local_weight = ops.logprob_backward(
            hidden, weight[:n_valid], tokens, lse, lse - entropy, grad_logprob.to(lse.dtype).contiguous(),
            grad_entropy.to(lse.dtype).contiguous(), temperature, vocab_start, *tiling)
        if reduce_hidden_grad and tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(grad_hidden, group=tp_group)  # fp32: the sum is taken before rounding
        grad_weight = grad_local_weight
        if n_valid < weight.shape[0]:  # padded rows take no part, so get no gradient
            grad_weight = torch.cat([grad_local_weight, grad_local_weight.new_zeros(weight.shape[0] - n_valid,
                                                                                    weight.shape[1])])
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None, None, None


def chosen_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: Optional[int] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    return_entropy: bool = False,
    check_tokens: bool = True,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    batch_invariant: bool = False,
):
    """log softmax(hidden @ weight.T / temperature)[tokens] over the (vocab-parallel) vocabulary.

    hidden [..., H] and weight [V_local, H] (this rank's rows of the output layer, global ids
    vocab_start .. vocab_start + V_local - 1; default vocab_start = rank * V_local in tp_group)
    share a dtype: float32, bfloat16 or float16 (float64 on CPU). tokens [...] (int64 or int32)
    are global ids. Logits are accumulated in fp32.

    Returns fp32 logprob [...] (float64 for float64 inputs), or (logprob, entropy) with
    return_entropy=True. vocab_size is the real vocabulary size: rows with global id >= vocab_size
    are padding and take no part in the softmax or entropy (default: every row of every rank).
    Positions whose token is ignore_index get logprob 0 and pass no logprob gradient; their entropy
    is still computed. Differentiable in hidden and weight for any upstream gradients. With
    tp_group the hidden gradient is summed over the group, unless reduce_hidden_grad=False (for a
    sequence-parallel gather whose backward reduce-scatters it).

    check_tokens validates token ids against [0, vocab_size) (a host synchronisation on CUDA;
    False skips it: an out-of-range id then matches no row and yields -lse, never an out-of-bounds
    read). workspace_bytes bounds the per-chunk buffers (see chunk_size_for).

    batch_invariant=True makes each token's logprob, entropy and hidden gradient bitwise
    independent of the other tokens of the call (their number, order, leading shape, ignored
    positions) and of workspace_bytes, on one machine with one library build and thread count:
    GEMMs of fixed shape (INVARIANT_TILING) over vocab chunks merged in vocab order. The weight
    gradient, a sum over tokens, stays deterministic but not batch-invariant. The workspace then
    holds at least one [row_block, chunk] block.
    """
    _check_args(hidden, weight, tokens, temperature)
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    local_vocab, hidden_size = weight.shape
    if vocab_start is None:
        vocab_start = rank * local_vocab
    if vocab_size is None:
        vocab_size = world * local_vocab
    if vocab_size < 1:
        raise ValueError(f"chosen_logprob: vocab_size must be >= 1, got {vocab_size}")
    if check_tokens:
        _check_token_range(tokens, vocab_size, ignore_index)
    n_valid = min(max(vocab_size - vocab_start, 0), local_vocab)

    lead = tokens.shape
    hidden2d = hidden.reshape(-1, hidden_size)
    tokens1d = tokens.reshape(-1).to(torch.int64)
    tiling = tiling_for(hidden2d.shape[0], hidden_size, hidden.element_size(), workspace_bytes, hidden.device,
                        batch_invariant)
    logprob, entropy = _ChosenLogprob.apply(hidden2d, weight, tokens1d, tokens1d == ignore_index, float(temperature),
                                            int(vocab_start), n_valid, tiling, tp_group, bool(reduce_hidden_grad))
    logprob, entropy = logprob.reshape(lead), entropy.reshape(lead)
    return (logprob, entropy) if return_entropy else logprob


@torch.library.register_fake("fused_rl_ops::logprob_stats")
def _(hidden, weight, tokens, temperature, vocab_start, chunk_size, row_block=0, pass_rows=0):
    return hidden.new_empty(hidden.shape[0], 4, dtype=acc_dtype(hidden.dtype))


@torch.library.register_fake("fused_rl_ops::logprob_combine")
def _(partials):
    return partials.new_empty(partials.shape[1], 3)


@torch.library.register_fake("fused_rl_ops::logprob_backward")
def _(hidden, weight, tokens, lse, mean, grad_logprob, grad_entropy, temperature, vocab_start, chunk_size, row_block=0,
      pass_rows=0):
    return hidden.new_empty(hidden.shape, dtype=acc_dtype(hidden.dtype)), torch.empty_like(weight)
