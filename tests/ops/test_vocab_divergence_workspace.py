"""vocab_divergence's workspace on the CPU: what its chunk loops allocate (the student's through
csrc/vocab_parallel/chunk_loop.h, two logits workspaces in the backward; the teacher's logits workspace
and weight rows, TeacherLogits in csrc/vocab_divergence/vocab_passes.h), measured through the profiler's
record of every allocation, against the accounting the tiling is planned with (_resolve in
fused_rl_ops/vocab_divergence.py: chunk_loop_bytes of both hidden sizes within half the workspace);
on CUDA, the peak of torch's allocator at a large vocabulary against the workspace."""
import pytest
import torch

import fused_rl_ops
from fused_rl_ops._vocab_parallel.tiling import DEFAULT_CUDA_WORKSPACE_BYTES, chunk_loop_bytes, tiling_for
from benchmarks.peak_memory import peak_allocated
from tests.ops.test_chosen_logprob_workspace import cuda_tiling_bytes
from tests.ops.test_vocab_divergence import make_inputs

ops = torch.ops.fused_rl_ops
OWN = dict(kind=2, beta=0.3)

# (student dtype, teacher dtype, row block, rows per pass, chunk, main_grad): one pass; bf16 (both
# models' weight rows converted to fp32) over several passes with a padded last block; a bf16 teacher
# beside an fp32 student; float64.
CASES = [
    (torch.float32, torch.float32, 0, 0, 256, False),
    (torch.bfloat16, torch.bfloat16, 64, 128, 128, True),
    (torch.float32, torch.bfloat16, 0, 0, 128, False),
    (torch.float64, torch.float64, 0, 0, 256, False),
]


@pytest.mark.parametrize("dtype,teacher_dtype,row_block,pass_rows,chunk,main_grad", CASES)
def test_the_cpu_chunk_loops_allocate_what_the_tiling_plans_for(dtype, teacher_dtype, row_block, pass_rows,
                                                                chunk, main_grad):
    N, H, H_t, V = 300, 24, 40, 1100
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((N,), H, H_t, V, dtype, "cpu")
    teacher_hidden, teacher_weight = teacher_hidden.to(teacher_dtype), teacher_weight.to(teacher_dtype)
    tensors = (hidden, weight, teacher_hidden, teacher_weight, None)
    e, e_t, acc = hidden.element_size(), teacher_hidden.element_size(), 8 if dtype == torch.float64 else 4
    options = (1.0, None, 1.0, None, 0, None, chunk, row_block, pass_rows)  # both maps, shard, tiling
    block = row_block or N
    rows = min(pass_rows // block * block if pass_rows else N, -(-N // block) * block)
    several_passes = rows < N
    student_loop = chunk_loop_bytes("cpu", e, H, rows, chunk, 1, several_passes)
    teacher_loop = rows * chunk * acc + (chunk * H_t * acc if e_t != acc else 0)  # its logits, its weight rows
    # The tiling's plan: both models' buffers within twice chunk_loop_bytes of both hidden sizes.
    assert student_loop + teacher_loop <= 2 * chunk_loop_bytes("cpu", max(e, e_t), H + H_t, rows, chunk, 1,
                                                               several_passes)
    tail = (N % block > 0) * block * acc  # per hidden column: a padded last block of rows
    # What follows the tokens: each model's hidden copy in acc, its padded last block.
    per_token = (N * H * acc if e != acc else 0) + (N * H_t * acc if e_t != acc else 0) + tail * (H + H_t)

    stats = ops.vocab_divergence_stats(*tensors, *options, **OWN)
    stats_peak = peak_allocated(lambda: ops.vocab_divergence_stats(*tensors, *options, **OWN))
    assert stats_peak <= stats.numel() * acc + per_token + student_loop + teacher_loop

    rows_merged = ops.vocab_divergence_combine(stats[None])
    term = ops.vocab_divergence_mixture(*tensors, rows_merged, *options, **OWN)[:, 1].contiguous()
    grad = grad.to(term.dtype)
    main = torch.zeros(V, H, dtype=torch.float64 if dtype == torch.float64 else torch.float32) if main_grad else None
    peak = peak_allocated(lambda: ops.vocab_divergence_backward(
        *tensors, rows_merged, term, grad, main, *options, **OWN))
    outputs = N * H * acc + (0 if main_grad else V * H * e)  # grad_h in acc, grad_w in weight's dtype
    # main_grad's buffers, not counted by chunk_loop_bytes (chosen_logprob's workspace test)
    main_grad_rows = main_grad * (chunk * H * e + (chunk * H * 4 if several_passes and e != 4 else 0))
    counted = outputs + per_token + tail * H + main_grad_rows + student_loop + teacher_loop
    # Reduced-precision weights: each model's fp32 weight rows of a group and the student's weight
    # gradient of the group before may be alive at once (counted), or not, as the CPU's tasks meet.
    overlap = chunk * (H * (e != acc) + H_t * (e_t != acc)) * acc
    assert counted - overlap <= peak <= counted



@pytest.mark.parametrize("N", [65536, 100000, 131072])
def test_cuda_tiling_fits_both_models_at_long_context(N):
    """Student and teacher of hidden size 4096, bf16: in half the old 64 MiB default, one pass at
    65536 tokens took chunks at the 128-row floor, 64 MiB of the student's logits and gradients and 32
    MiB of the teacher's logits against 64; the default CUDA workspace in passes holds both models'
    buffers (the student's as _resolve plans them, with the padded copies of a last pass, both
    models' hidden rows in them; the teacher's logits workspace, no larger than the student's logits)."""
    H = H_t = 4096
    assert chunk_loop_bytes("cuda", 2, H + H_t, 65536, 128, 2) + 4 * 65536 * 128 == 96 * 2**20
    workspace = DEFAULT_CUDA_WORKSPACE_BYTES
    tiling = tiling_for(N, H + H_t, 2, workspace // 2, torch.device("cuda"), False)
    assert tiling.pass_rows and tiling.chunk_size > 128
    teacher_logits = 4 * tiling.pass_rows * tiling.chunk_size
    assert cuda_tiling_bytes(tiling, N, H + H_t, 2) + teacher_logits <= workspace

@pytest.mark.per_device
@pytest.mark.skipif(not (torch.cuda.is_available() and fused_rl_ops.has_cuda_kernels()), reason="needs a GPU")
def test_cuda_peak_memory_within_workspace_at_large_vocab():
    """bf16, 2048 tokens, V 131072, forward_kl and jsd (its second pass): the fused call's extra
    memory, forward and backward, is the workspace (both models' chunk buffers) and the fp32
    hidden-gradient accumulator, where both models' logits alone would be 2 GiB."""
    N, H, H_t, V, workspace = 2048, 1024, 1536, 131072, 32 * 2**20
    hidden, weight, teacher_hidden, teacher_weight, _ = make_inputs((N,), H, H_t, V, torch.bfloat16, "cuda")
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    for kind in ("forward_kl", "jsd"):
        # A small call first: cuBLAS's workspace, made at a stream's first GEMM of a kind, is not the op's.
        fused_rl_ops.vocab_divergence(hidden[:8].detach().requires_grad_(True),
                                      weight[:64].detach().requires_grad_(True), teacher_hidden[:8],
                                      teacher_weight[:64], kind=kind).sum().backward()
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() + 2 * N * H + 2 * V * H  # and the bf16 gradients returned
        fused_rl_ops.vocab_divergence(hidden, weight, teacher_hidden, teacher_weight, kind=kind,
                                      workspace_bytes=workspace).sum().backward()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        # Besides the workspace: the fp32 hidden-gradient accumulator (4 bytes per element) and the
        # per-token state (a few dozen [N] tensors of at most 16 bytes a row) within 1 MiB.
        assert extra <= workspace + 4 * N * H + 2**20, (kind, extra)
