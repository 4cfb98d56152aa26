"""The workspace accounting of chosen_logprob (chunk_loop_bytes, tiling_for in
fused_rl_ops/_vocab_parallel/tiling.py) against what the chunk loop (csrc/vocab_parallel/chunk_loop.h) allocates:
measured on the CPU through the profiler's record of every allocation, and for CUDA against the
buffers vocab_passes.h creates there (CudaKernels in csrc/chosen_logprob/cuda.cpp: the GEMMs take the
inputs as they are and the logit gradients in the inputs' dtype); and batch_invariant=True's extra
memory over the default path, the same at two vocabulary sizes (every vocab-parallel op)."""
import sys

import pytest
import torch

import fused_rl_ops  # noqa: F401  (registers the ops)
from fused_rl_ops._vocab_parallel.tiling import (DEFAULT_CUDA_WORKSPACE_BYTES, GEMM_FLOPS_PER_BYTE, INVARIANT_TILING,
                                                 SEPARATE_GRAD_CHUNKS, Tiling, accumulator_bytes_per_flop,
                                                 chunk_loop_bytes, default_workspace_bytes, tiling_for)
from benchmarks.peak_memory import peak_allocated
from tests.ops.test_chosen_logprob import make_inputs, per_token_inputs

ops = torch.ops.fused_rl_ops
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# (dtype, token rows, row block, rows per pass, chunk, chunks per gradient GEMM): one pass in place;
# a buffer of three chunks' gradients; bf16 (the weight rows and their gradient converted to fp32);
# several passes of row blocks with a padded last block; float64 (fp64 logits).
CASES = [
    (torch.float32, 300, 0, 0, 256, 1),
    (torch.float32, 300, 0, 0, 128, 3),
    (torch.bfloat16, 300, 0, 0, 256, 1),
    (torch.bfloat16, 300, 64, 128, 128, 3),
    (torch.float64, 300, 0, 0, 128, 2),
]


@pytest.mark.parametrize("dtype,N,row_block,pass_rows,chunk,grad_chunks", CASES)
@pytest.mark.parametrize("main_grad", [False, True])
def test_the_cpu_chunk_loop_allocates_what_chunk_loop_bytes_counts(dtype, N, row_block, pass_rows, chunk,
                                                                   grad_chunks, main_grad):
    """The backward's peak allocation is its outputs, the buffers that follow the tokens or the
    block (listed here) and chunk_loop_bytes exactly; the forward's stays within the same."""
    H, V = 24, 1100  # the vocabulary holds several groups, the last one partial
    hidden, weight, tokens = make_inputs(N, H, V, dtype, "cpu")
    e, acc = hidden.element_size(), 8 if dtype == torch.float64 else 4
    options = (1.0, None, 0, None, chunk, row_block, pass_rows)
    block = row_block or N
    passes_rows = min(pass_rows // block * block if pass_rows else N, -(-N // block) * block)
    several_passes = passes_rows < N
    loop = chunk_loop_bytes("cpu", e, H, passes_rows, chunk, grad_chunks, several_passes)
    tail = (N % block > 0) * block * H * acc  # a padded last block of rows (hidden, and its gradient)
    hidden_copy = N * H * acc if e != acc else 0  # the CPU GEMMs take the hidden states in acc

    stats_peak = peak_allocated(lambda: ops.chosen_logprob_stats(hidden, weight, tokens, *options,
                                                                           grad_chunks=grad_chunks))
    assert stats_peak <= N * 4 * acc + hidden_copy + tail + loop

    per_token = [t.to(torch.float64 if dtype == torch.float64 else torch.float32)
                 for t in per_token_inputs(ops.chosen_logprob_stats(hidden, weight, tokens, *options))]
    main = torch.zeros(V, H, dtype=torch.float64 if dtype == torch.float64 else torch.float32) if main_grad else None
    peak = peak_allocated(lambda: ops.chosen_logprob_backward(hidden, weight, tokens, *per_token, main,
                                                                        *options, grad_chunks=grad_chunks))
    outputs = N * H * acc + (0 if main_grad else V * H * e)  # grad_h in acc, grad_w in weight's dtype
    # main_grad's buffers, not counted: the group's weight gradient in the weight's dtype, and the
    # fp32 copy of it that adding bf16 into an fp32 main_grad makes (beside the pass sum with several
    # passes; with one, after the fp32 GEMM result is freed).
    group = chunk * grad_chunks
    main_grad_rows = main_grad * (group * H * e + (group * H * 4 if several_passes and e != 4 else 0))
    counted = outputs + hidden_copy + 2 * tail + main_grad_rows + loop
    # With reduced precision a group's fp32 weight rows and the fp32 weight gradient of the group
    # before may be alive at once (counted), or not, as the CPU's tasks meet.
    overlap = chunk * grad_chunks * H * acc if e != acc else 0
    assert counted - overlap <= peak <= counted


def test_chunk_loop_bytes_on_cuda_are_the_buffers_chunks_h_creates_there():
    """On CUDA the chunk loop allocates fp32 logits [rows, chunk] and, for bf16/fp16 inputs, the
    gradients of grad_chunks chunks [rows, chunk * grad_chunks] in the inputs' dtype (fp32 ones go
    over the logits with one chunk per GEMM); the weight rows go to cuBLAS as they are, and its
    GEMMs round the weight gradient themselves. Several passes add the fp32 [group, H] weight
    gradient summed over them."""
    N, H, chunk = 8192, 4096, 1024
    assert chunk_loop_bytes("cuda", 2, H, N, chunk, 2) == 4 * N * chunk + 2 * N * 2 * chunk
    assert chunk_loop_bytes("cuda", 2, H, N, chunk, 1) == 4 * N * chunk + 2 * N * chunk
    assert chunk_loop_bytes("cuda", 4, H, N, chunk, 1) == 4 * N * chunk
    assert chunk_loop_bytes("cuda", 4, H, N, chunk, 2) == 4 * N * chunk + 4 * N * 2 * chunk
    assert chunk_loop_bytes("cuda", 2, H, N, chunk, 1, several_passes=True) == 6 * N * chunk + 4 * chunk * H
    # The CPU's: two logits workspaces (a pass's gradients over its logits in one, the next pass's
    # logits in the other), the weight rows and their gradient in fp32; a gradient buffer of its own
    # with several chunks per GEMM.
    assert chunk_loop_bytes("cpu", 2, H, N, chunk, 1) == 2 * 4 * N * chunk + 2 * 4 * chunk * H
    assert chunk_loop_bytes("cpu", 4, H, N, chunk, 1) == 2 * 4 * N * chunk
    assert chunk_loop_bytes("cpu", 4, H, N, chunk, 2) == 4 * N * chunk + 4 * N * 2 * chunk


def test_tiling_at_the_training_shape():
    """(8192, 4096) with the default 64 MiB workspace: on CUDA bf16 chunks of 1024 rows and gradient
    GEMMs over two (the workspace exactly full: 32 MiB of fp32 logits, 32 MiB of bf16 gradients),
    fp32 chunks of 2048 (logits only); no CPU-only buffer narrows either. The CPU's bf16 chunks pay
    for a second logits workspace, the fp32 weight rows and their gradient."""
    N, H = 8192, 4096
    workspace = default_workspace_bytes(torch.empty(N, H, dtype=torch.bfloat16, device="meta"))
    assert workspace == 64 * 2**20
    assert tiling_for(N, H, 2, workspace, CUDA, False) == Tiling(1024, 0, 0, SEPARATE_GRAD_CHUNKS) == Tiling(1024, 0, 0, 2)
    assert chunk_loop_bytes("cuda", 2, H, N, 1024, 2) == workspace
    assert tiling_for(N, H, 4, workspace, CUDA, False) == Tiling(2048, 0, 0, 1)
    assert tiling_for(N, H, 2, workspace, CPU, False) == Tiling(640, 0, 0, 1)  # 64 MiB / (2 * 4 N + 8 H)


@pytest.mark.parametrize("device_type,element_size", [("cpu", 2), ("cpu", 4), ("cpu", 8), ("cuda", 2), ("cuda", 4)],
                         ids=lambda value: f"{value}B" if isinstance(value, int) else f"{value}_accounting")
@pytest.mark.parametrize("N,H,workspace", [(300, 24, 1), (300, 24, 2**20), (8192, 4096, 64 * 2**20),
                                           (5000, 7168, 48 * 2**20)])
def test_tiling_fits_the_workspace(device_type, element_size, N, H, workspace):
    """The widest chunk (a multiple of 128, at least 128) whose buffers fit; batch-invariant, the
    device's fixed tiling with as many whole row blocks per pass as fit (at least one)."""
    tiling = tiling_for(N, H, element_size, workspace, torch.device(device_type), False)
    assert (tiling.row_block, tiling.pass_rows) == (0, 0) and tiling.chunk_size % 128 == 0
    assert tiling.grad_chunks == (SEPARATE_GRAD_CHUNKS if device_type == "cuda" and element_size == 2 else 1)
    fits = [c for c in range(128, 2**16, 128)
            if chunk_loop_bytes(device_type, element_size, H, N, c, tiling.grad_chunks) <= workspace]
    assert tiling.chunk_size == (fits[-1] if fits else 128)
    invariant = tiling_for(N, H, element_size, workspace, torch.device(device_type), True)
    row_block, chunk = INVARIANT_TILING[device_type]
    assert (invariant.chunk_size, invariant.row_block, invariant.grad_chunks) == (chunk, row_block, 1)
    per_pass = [p for p in range(row_block, 2**17, row_block)
                if chunk_loop_bytes(device_type, element_size, H, p, chunk, 1, several_passes=True) <= workspace]
    assert invariant.pass_rows == (per_pass[-1] if per_pass else row_block)



def cuda_tiling_bytes(tiling, N, H, element_size):
    """What a CUDA tiling's buffers take: chunk_loop_bytes, and where its passes do not divide the N
    rows the zero-padded copies of a last pass (hidden's rows and their fp32 gradient)."""
    rows = tiling.pass_rows or N
    padded = -(-N // rows) * rows
    tail = (element_size + 4) * rows * H if padded > N else 0
    return chunk_loop_bytes("cuda", element_size, H, rows, tiling.chunk_size, tiling.grad_chunks, rows < N) + tail


# Long-context RL on CUDA: (tokens on the rank, hidden size, input bytes); 100000 rows take a padded
# last pass whatever the pass size.
LONG_CONTEXT = [(N, H, e) for N in (16384, 32768, 65536, 100000, 131072) for H in (2048, 4096, 8192) for e in (2, 4)]


@pytest.mark.parametrize("N,H,element_size", LONG_CONTEXT)
def test_cuda_tiling_keeps_the_accumulator_traffic_small_at_long_context(N, H, element_size):
    """The default workspace and tiling on CUDA at 16k-128k tokens: the buffers fit, the passes are
    equal multiples of 128 rows (one GEMM each), and the gradient GEMMs' fp32 accumulators move at
    most 15% of the GEMM time at the H200's rates."""
    workspace = min(DEFAULT_CUDA_WORKSPACE_BYTES, N * H * element_size)  # default_workspace_bytes on CUDA
    tiling = tiling_for(N, H, element_size, workspace, CUDA, False)
    assert tiling.row_block == tiling.pass_rows and tiling.pass_rows % 128 == 0 and tiling.pass_rows < N
    passes = -(-N // tiling.pass_rows) if tiling.pass_rows else 1
    assert passes * (tiling.pass_rows or N) - N < 128 * passes
    assert cuda_tiling_bytes(tiling, N, H, element_size) <= workspace
    assert GEMM_FLOPS_PER_BYTE * accumulator_bytes_per_flop(tiling, N) <= 0.15


def test_cuda_tiling_at_64k_tokens():
    """(65536, 4096, V 262144) bf16: one pass in the old 64 MiB default took chunks at the 128-row
    floor (64 MiB of logits and gradients, the whole workspace), whose hidden-gradient GEMMs moved
    8 N H V / 256 = 2.2 TB of accumulator (72% of the GEMM time); 256 MiB in passes of 8192 rows
    and chunks of 2688 move 0.17 TB (5.7%)."""
    N, H, V = 65536, 4096, 262144
    old = Tiling(128, 0, 0, 2)
    assert chunk_loop_bytes("cuda", 2, H, N, 128, 2) == 64 * 2**20
    tiling = tiling_for(N, H, 2, DEFAULT_CUDA_WORKSPACE_BYTES, CUDA, False)
    assert tiling == Tiling(2688, 8192, 8192, 2)
    traffic = [8 * N * H * V * accumulator_bytes_per_flop(t, N) for t in (old, tiling)]
    assert round(traffic[0] / 1e12, 1) == 2.2 and round(traffic[1] / 1e12, 2) == 0.17
    assert [round(GEMM_FLOPS_PER_BYTE * accumulator_bytes_per_flop(t, N), 3) for t in (old, tiling)] == [0.719, 0.057]


@pytest.mark.parametrize("N,H", [(8192, 4096), (8192, 2048), (12000, 4096), (1000, 512)])
def test_cuda_tiling_takes_one_pass_where_its_chunks_are_wide(N, H):
    """Up to the training shape's traffic, one pass over every row, the widest chunk that fits:
    passes would add the weight gradient's accumulator traffic and shrink the chunk."""
    workspace = min(DEFAULT_CUDA_WORKSPACE_BYTES, N * H * 2)
    tiling = tiling_for(N, H, 2, workspace, CUDA, False)
    assert (tiling.row_block, tiling.pass_rows) == (0, 0)
    wider = chunk_loop_bytes("cuda", 2, H, N, tiling.chunk_size + 128, 2)
    assert cuda_tiling_bytes(tiling, N, H, 2) <= workspace < wider

if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


@pytest.mark.parametrize("op", ["chosen_logprob", "top_logprobs", "vocab_divergence"])
def test_batch_invariant_extra_memory_does_not_grow_with_the_vocabulary(op):
    """batch_invariant=True runs the ops once per fixed piece of the vocabulary: forward+backward
    allocates a fixed amount beyond the default path's (the pieces' fixed-width chunk buffers and
    [N, H] partials), the same at V and 2V and less than the weight gradient: the pieces add their
    weight gradients into one buffer, not put together from theirs (a second one of weight's size)."""
    N, H, k = 64, 256, 5
    g = torch.Generator().manual_seed(0)
    extra = {}
    for V in (8 * INVARIANT_TILING["cpu"][1], 16 * INVARIANT_TILING["cpu"][1]):  # pieces of whole chunks
        hidden, teacher_hidden = torch.randn(N, H, generator=g).requires_grad_(True), torch.randn(N, H, generator=g)
        weight, teacher_weight = torch.randn(V, H, generator=g).requires_grad_(True), torch.randn(V, H, generator=g)
        tokens = torch.randint(0, V, (N,), generator=g)

        def fwd_bwd(batch_invariant):
            if op == "chosen_logprob":
                outputs = fused_rl_ops.chosen_logprob(hidden, weight, tokens, return_entropy=True,
                                                      batch_invariant=batch_invariant)
            elif op == "top_logprobs":
                outputs = fused_rl_ops.top_logprobs(hidden, weight, k, batch_invariant=batch_invariant)[1:]
            else:
                outputs = (fused_rl_ops.vocab_divergence(hidden, weight, teacher_hidden, teacher_weight,
                                                         kind="forward_kl", batch_invariant=batch_invariant),)
            sum(o.sum() for o in outputs).backward()
            hidden.grad = weight.grad = None

        peaks = []
        for batch_invariant in (False, True):
            fwd_bwd(batch_invariant)  # thread pools, the op's first call
            peaks.append(peak_allocated(lambda: fwd_bwd(batch_invariant)))
        extra[V] = peaks[1] - peaks[0]
        assert extra[V] < V * H * 4, (V, extra[V])
    smaller, larger = extra.values()
    assert abs(larger - smaller) <= 2**20, extra
