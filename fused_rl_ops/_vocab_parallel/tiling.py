"""How the ops' chunk loop (the C++ for_each_logits_chunk) walks the rows, and the memory that
takes: the Tiling option group, the workspace model (chunk_loop_bytes) and the tiling a workspace
allows (tiling_for)."""
import functools
import itertools
from typing import Optional

import torch

from .._options import NON_NEGATIVE_INTEGER, POSITIVE_INTEGER, check_options, option, options_dataclass

DEFAULT_WORKSPACE_BYTES = 64 * 2**20  # the largest default workspace (CPU)
# On CUDA: long inputs take passes, whose accumulator traffic falls as their workspace grows
# (cuda_tiling; docs/chosen_logprob.md, "Memory").
DEFAULT_CUDA_WORKSPACE_BYTES = 256 * 2**20
_MIN_DEFAULT_WORKSPACE_BYTES = 2**20
_MIN_CHUNK = 128
# batch_invariant=True: (token rows per GEMM, vocab rows per chunk) by device, fixed so that every
# GEMM has one shape whatever the batch (see the C++ RowTiling). Row blocks are
# multiples of 128, so every block of an aligned hidden starts aligned (aligned_rows there).
INVARIANT_TILING = {"cpu": (512, 2048), "cuda": (512, 4096)}
# Chunks per gradient GEMM where the logit gradients have a buffer of their own (CUDA, bfloat16 or
# float16 inputs: the GEMMs take them in the inputs' dtype, half the bytes of the fp32 logits). Two
# give that buffer as many bytes as the logits and halve the gradient GEMMs of a chunk-per-GEMM
# loop, each of which reads and writes the whole fp32 hidden gradient (docs/chosen_logprob.md,
# "Memory" and "Speed on CUDA").
SEPARATE_GRAD_CHUNKS = 2


@options_dataclass
class Tiling:
    """An option group of the vocab-parallel ops (declared for C++ as FRL_TILING), read by the
    chunk loop alone: chunk_size vocab rows per chunk
    (one logits GEMM each); row_block and pass_rows token rows per GEMM and per workspace pass, 0:
    all rows; grad_chunks chunks per gradient GEMM (a backward's; the forward ignores it)."""
    chunk_size: int = option(POSITIVE_INTEGER)
    row_block: int = option(NON_NEGATIVE_INTEGER, default=0)
    pass_rows: int = option(NON_NEGATIVE_INTEGER, default=0)
    grad_chunks: int = option(POSITIVE_INTEGER, default=1)

    def __post_init__(self):
        check_options(type(self).__name__, self)


def default_workspace_bytes(hidden: torch.Tensor, rows: Optional[int] = None,
                            device: Optional[torch.device] = None) -> int:
    """The workspace when workspace_bytes is None: the size of the rows of hidden the kernels
    compute (rows of them; None: all), within [1 MiB, DEFAULT_WORKSPACE_BYTES] (on CUDA, hidden's
    device unless device says otherwise: DEFAULT_CUDA_WORKSPACE_BYTES). The extra memory then stays below the input's size at small
    shapes (as torch's chunked linear_cross_entropy sizes its chunks), while training-sized inputs
    (8192 tokens x 4096 in bf16 is 64 MiB) get the largest workspace and so the widest GEMMs."""
    elements = hidden.numel() if rows is None else rows * hidden.shape[-1]
    largest = DEFAULT_CUDA_WORKSPACE_BYTES if (device or hidden.device).type == "cuda" else DEFAULT_WORKSPACE_BYTES
    return min(largest, max(_MIN_DEFAULT_WORKSPACE_BYTES, elements * hidden.element_size()))


def chunk_loop_bytes(device_type: str, element_size: int, hidden_size: int, pass_rows: int, chunk: int,
                     grad_chunks: int, several_passes: bool = False) -> int:
    """The bytes of the buffers the chunk loop allocates whose size follows the chunk
    width, on device_type ("cpu" or "cuda") for inputs of element_size bytes, passes of pass_rows
    token rows, chunks of `chunk` vocab rows and groups of grad_chunks chunks (group = chunk *
    grad_chunks rows; at most the vocabulary's, which these bytes assume it has): the backward's,
    which hold the forward's. In the accumulation dtype (acc: fp32, fp64 for float64 inputs):
      - the logits, [pass_rows, chunk] acc (the forward's too);
      - the logit gradients, in the dtype the gradient GEMMs take (CUDA: the inputs'; CPU: acc):
        written over the logits when that is acc and grad_chunks is 1, else [pass_rows, group]; on
        the CPU, written over the logits, in a second logits workspace (the next pass's logits are
        computed beside the weight-gradient GEMMs of the last);
      - on the CPU with reduced-precision inputs, the group's weight rows converted for the GEMMs,
        [group, H] acc (the forward's: [chunk, H]);
      - the group's weight gradient before it is rounded, [group, H] acc, when the rows take
        several passes (summed over them) or on the CPU with reduced-precision inputs. With several
        passes and a gradient buffer of its own, the chunk loop may instead hold every row's logit
        gradients, [N, group], where that is no larger than this and a pass's (one weight-gradient
        GEMM per group); the count stays an upper bound.
    Not counted: what follows the tokens or the row block alone (the copy of the scored rows of
    hidden, a hidden copy in acc on the CPU, the hidden-gradient accumulator, a padded last block),
    and main_grad's [group, H] buffer in the weight's dtype, left out so that main_grad changes no
    chunk width (its sums are then bitwise those of the returned weight gradient)."""
    acc_size = 8 if element_size == 8 else 4
    cuda = device_type == "cuda"
    grad_size = element_size if cuda else acc_size
    group = chunk * grad_chunks
    reduced_cpu_copy = not cuda and element_size != acc_size
    in_place = grad_size == acc_size and grad_chunks == 1
    logits = acc_size * pass_rows * chunk * (2 if in_place and not cuda else 1)
    grads = 0 if in_place else grad_size * pass_rows * group
    weight_rows = acc_size * hidden_size * group if reduced_cpu_copy else 0
    weight_grad = acc_size * hidden_size * group if several_passes or reduced_cpu_copy else 0
    return logits + grads + weight_rows + weight_grad


# What the GPU machine measured (H200: 790 TFLOP/s of bf16 GEMM, 4.3 TB/s of copy): the FLOPs a
# GEMM does in the time one byte moves, which converts cuda_tiling's accumulator bytes into GEMM time.
GEMM_FLOPS_PER_BYTE = 184


def accumulator_bytes_per_flop(tiling: Tiling, num_tokens: int) -> float:
    """The fp32 accumulator bytes a backward's gradient GEMMs read and write per FLOP of the call's
    four GEMM kinds (8 N H V FLOPs) under a non-invariant tiling: each hidden-gradient GEMM reads and
    writes a pass's rows of the [N, H] sum once per group (8 N H V / group bytes in all), and with
    several passes each weight-gradient GEMM the group's [group, H] sum once per pass (8 N H V /
    pass_rows): 1 / group + 1 / pass_rows."""
    several_passes = 0 < tiling.pass_rows < num_tokens
    return 1 / (tiling.chunk_size * tiling.grad_chunks) + (1 / tiling.pass_rows if several_passes else 0)


@functools.lru_cache(maxsize=256)  # a pure function of its arguments, called once per op call
def cuda_tiling(num_tokens: int, hidden_size: int, element_size: int, workspace_bytes: int) -> Tiling:
    """The default (non-invariant) Tiling on CUDA. Of one pass over all rows and of passes of equal
    multiples of 128 rows (a GEMM per pass: row_block = pass_rows), each with the widest chunk that
    fits workspace_bytes (chunk_loop_bytes, and for passes that do not divide the rows the zero-padded
    copy of a last pass of hidden and its hidden gradient's rows), the one whose GEMMs take the least
    time per row computed: their FLOPs, those of a last pass's padding rows included, plus the
    accumulator traffic of accumulator_bytes_per_flop at GEMM_FLOPS_PER_BYTE; one pass on a tie. A
    tiling that fits beats one that does not (at least 128 vocab rows a chunk). One pass gives the
    widest chunks while its logits fit; long inputs take passes, whose group and pass sizes both
    bound that traffic whatever N is."""
    grad_chunks = SEPARATE_GRAD_CHUNKS if element_size < 4 else 1

    def candidate(rows: int) -> tuple:
        """(misfit, time per row, Tiling) of passes of `rows` rows (all rows: one pass)."""
        several_passes = rows < num_tokens
        padded = -(-num_tokens // rows) * rows
        tail = (element_size + 4) * rows * hidden_size if padded > num_tokens else 0
        per_vocab_row = chunk_loop_bytes("cuda", element_size, hidden_size, rows, 1, grad_chunks, several_passes)
        chunk = (workspace_bytes - tail) // max(per_vocab_row, 1) // _MIN_CHUNK * _MIN_CHUNK
        tiling = Tiling(max(_MIN_CHUNK, chunk), rows if several_passes else 0, rows if several_passes else 0,
                        grad_chunks)
        traffic = GEMM_FLOPS_PER_BYTE * accumulator_bytes_per_flop(tiling, num_tokens)
        return chunk < _MIN_CHUNK, padded / num_tokens * (1 + traffic), tiling

    best = candidate(num_tokens)
    for passes in itertools.count(2):
        rows = -(-num_tokens // passes)
        rows = -(-rows // _MIN_CHUNK) * _MIN_CHUNK
        # Fewer rows a pass only add weight-gradient traffic from here on (one pass: num_tokens <= 128).
        if rows >= num_tokens or (not best[0] and 1 + GEMM_FLOPS_PER_BYTE / rows >= best[1]):
            break
        best = min(best, candidate(rows), key=lambda c: c[:2])
        if rows == _MIN_CHUNK:
            break
    return best[2]


def tiling_for(num_tokens: int, hidden_size: int, element_size: int, workspace_bytes: int, device: torch.device,
               batch_invariant: bool) -> Tiling:
    """The Tiling for num_tokens rows, so that the chunk loop's buffers on hidden's device
    (chunk_loop_bytes) fit in workspace_bytes (fewer rows take less). By default on the CPU one GEMM
    per chunk takes all rows (row_block = pass_rows = 0) and the chunk is the widest multiple of 128
    that fits (at least 128); on CUDA cuda_tiling's, with SEPARATE_GRAD_CHUNKS chunks per gradient
    GEMM for bfloat16 / float16 inputs (the logit gradients have a buffer of their own), else one.
    Batch-invariant: the device's fixed row block and chunk width, one chunk per gradient GEMM, and
    as many row blocks per pass as fit (at least one); the pass size changes no result."""
    device_type = "cuda" if device.type == "cuda" else "cpu"
    if batch_invariant:
        row_block, chunk = INVARIANT_TILING[device_type]
        fixed, with_one_row = (chunk_loop_bytes(device_type, element_size, hidden_size, rows, chunk, 1,
                                                several_passes=True) for rows in (0, 1))
        fitting_rows = (workspace_bytes - fixed) // (with_one_row - fixed)
        return Tiling(chunk, row_block, max(row_block, fitting_rows // row_block * row_block), 1)
    if device_type == "cuda":
        return cuda_tiling(num_tokens, hidden_size, element_size, workspace_bytes)
    rows = workspace_bytes // max(chunk_loop_bytes("cpu", element_size, hidden_size, num_tokens, 1, 1), 1)
    return Tiling(max(_MIN_CHUNK, rows // _MIN_CHUNK * _MIN_CHUNK), 0, 0, 1)
