"""vocab_divergence's CPU chunk loop as tasks of row pieces (LogitsChunks::as_tasks in
csrc/vocab_parallel/chunk_loop.h, the teacher's logits by the piece: TeacherLogits in
csrc/vocab_divergence/vocab_passes.h) on 1, 2 and 3 threads (3: more threads than CI's two cores): the same
bits whatever the threads for the stats, jsd's mixture and the backward, and float64 autograd's
gradients, for one pass with a narrower last chunk, several passes with a padded last row block,
bf16 weights copied to fp32 per group (the groups in turn) with main_grad, a bf16 teacher beside an
fp32 student (the teacher's copies alone), float64 inputs, and blocks of 2048 rows and more (pieces
of 256 rows); and batch invariance over row blocks and pieces."""
import pytest
import torch

import fused_rl_ops
from fused_rl_ops._vocab_parallel.tiling import INVARIANT_TILING
from tests.ops.test_vocab_divergence import make_inputs, reference_run, run

ops = torch.ops.fused_rl_ops
BETA = 0.3
OWN = dict(kind=2, beta=BETA)  # jsd: the stats, the mixture and a row term in the backward

# (student dtype, teacher dtype, token rows, vocab rows per chunk, row block, rows per pass,
# main_grad); 600 token rows (a last row block of 88 where blocks are 128), 1100 vocab rows (a last
# chunk of 76)
CASES = [
    (torch.float32, torch.float32, 600, 256, 0, 0, False),
    (torch.float32, torch.float32, 600, 128, 128, 256, False),
    (torch.bfloat16, torch.bfloat16, 600, 256, 0, 0, True),
    (torch.bfloat16, torch.bfloat16, 600, 128, 128, 256, True),
    (torch.float32, torch.bfloat16, 600, 128, 128, 256, False),
    (torch.float64, torch.float64, 600, 256, 0, 0, False),
    (torch.float32, torch.float32, 2100, 256, 0, 0, False),
    (torch.bfloat16, torch.bfloat16, 2100, 128, 2048, 4096, True),
]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def run_on_threads(threads, hidden, weight, teacher_hidden, teacher_weight, grad, options, main_grad):
    """Stats, mixture, hidden gradient and weight gradient (or main_grad) on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tensors = (hidden, weight, teacher_hidden, teacher_weight, None)
        stats = ops.vocab_divergence_stats(*tensors, *options, **OWN)
        rows = ops.vocab_divergence_combine(stats[None])
        mixture = ops.vocab_divergence_mixture(*tensors, rows, *options, **OWN)
        term = mixture[:, 1].contiguous()  # KL(student || M)
        main = torch.zeros(weight.shape, dtype=torch.float32) if main_grad else None
        grad_h, grad_w = ops.vocab_divergence_backward(*tensors, rows, term, grad.to(rows.dtype), main, *options,
                                                       **OWN)
        return stats, mixture, grad_h, main if main_grad else grad_w
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype,teacher_dtype,N,chunk,row_block,pass_rows,main_grad", CASES)
def test_tasks_give_the_same_bits_on_any_threads(dtype, teacher_dtype, N, chunk, row_block, pass_rows, main_grad):
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((N,), 32, 48, 1100, dtype, "cpu")
    teacher_hidden, teacher_weight = teacher_hidden.to(teacher_dtype), teacher_weight.to(teacher_dtype)
    options = (1.0, None, 1.0, None, 0, None, chunk, row_block, pass_rows)  # both maps, shard, tiling
    results = [run_on_threads(t, hidden, weight, teacher_hidden, teacher_weight, grad, options, main_grad)
               for t in (1, 2, 3)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    _, mixture, grad_h, grad_w = results[0]
    want = reference_run(hidden, weight, teacher_hidden, teacher_weight, grad, kind="jsd", beta=BETA)
    divergence = BETA * mixture[:, 0] + (1 - BETA) * mixture[:, 1]
    tol = TOLERANCE[dtype]  # bf16: the CPU hands main_grad a bf16-rounded gradient
    for ours, reference in zip((divergence, grad_h, grad_w), want):
        torch.testing.assert_close(ours.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())


@pytest.mark.parametrize("workspace_bytes", [None, 1])  # one pass; passes of one row block
def test_batch_invariant_rows_over_blocks_and_pieces(workspace_bytes):
    """batch_invariant=True: three rows alone give the bits they give at rows 700-702 of 1127 (the
    second row block, its pieces of 128 rows, a padded last block), over two full chunks of the
    vocabulary and a narrower one, with the teacher's logits computed by the piece."""
    row_block, chunk = INVARIANT_TILING["cpu"]
    others = 2 * row_block + 100
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((3 + others,), 16, 24, 2 * chunk + 300,
                                                                       torch.float32, "cpu")
    order = torch.cat([torch.arange(3, 703), torch.arange(3), torch.arange(703, 3 + others)])
    kw = dict(kind="jsd", softcap=5.0, teacher_softcap=3.0, batch_invariant=True, workspace_bytes=workspace_bytes)
    alone = run(fused_rl_ops.vocab_divergence, hidden[:3], weight, teacher_hidden[:3], teacher_weight, grad[:3], **kw)
    together = run(fused_rl_ops.vocab_divergence, hidden[order], weight, teacher_hidden[order], teacher_weight,
                   grad[order], **kw)
    assert torch.equal(alone[0], together[0][700:703]) and torch.equal(alone[1], together[1][700:703])
