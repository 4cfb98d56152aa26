"""The CPU's chunk loop as tasks (LogitsChunks::as_tasks in csrc/vocab_parallel/chunk_loop.h) on 1, 2 and
3 threads (3: more threads than CI's two cores, so tasks wait for pieces that a descheduled thread
holds): the same bits whatever the threads, and the gradients of float64 autograd, for each way the
loop walks the rows: one pass with the gradients over the logits (two workspaces), a narrower last
chunk (its tasks wait for the workspace to drain), several passes summed, a gradient buffer of several
chunks, and bf16 weights copied to fp32 per group with main_grad; and in blocks of 2048 rows and
more, whose pieces are 256 rows (the last of a block shorter, or in a padded last block)."""
import pytest
import torch

import fused_rl_ops  # noqa: F401  (registers the ops)
from tests.ops.test_chosen_logprob import make_inputs, per_token_inputs

ops = torch.ops.fused_rl_ops

# (dtype, token rows, hidden, vocab rows, chunk, row block, rows per pass, chunks per gradient GEMM, main_grad)
CASES = [
    (torch.float32, 600, 32, 1100, 256, 0, 0, 1, False),
    (torch.float32, 600, 32, 1100, 128, 128, 256, 1, False),
    (torch.float32, 600, 32, 1100, 128, 0, 0, 3, False),
    (torch.float32, 600, 400, 1100, 128, 128, 256, 2, False),  # every pass's gradients held (H large)
    (torch.bfloat16, 600, 32, 1100, 256, 0, 0, 1, True),
    (torch.bfloat16, 600, 32, 1100, 128, 128, 256, 1, True),
    (torch.float32, 2100, 32, 1100, 256, 0, 0, 1, False),
    (torch.bfloat16, 2100, 32, 600, 128, 2048, 4096, 1, True),
]


def run_on_threads(threads, hidden, weight, tokens, options, grad_chunks, upstream, main_grad):
    """Forward stats and backward (hidden gradient, weight gradient or main_grad) on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stats = ops.chosen_logprob_stats(hidden, weight, tokens, *options, grad_chunks=grad_chunks)
        main = torch.zeros(weight.shape, dtype=torch.float32) if main_grad else None
        grad_h, grad_w = ops.chosen_logprob_backward(hidden, weight, tokens, *upstream(stats), main, *options,
                                                     grad_chunks=grad_chunks)
        return stats, grad_h, main if main_grad else grad_w
    finally:
        torch.set_num_threads(before)


def float64_gradients(hidden, weight, tokens, grad_logprob, grad_entropy):
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    log_p = torch.log_softmax(h @ w.T, -1)
    logprob = log_p.gather(1, tokens[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    (grad_logprob.double() * logprob + grad_entropy.double() * entropy).sum().backward()
    return h.grad, w.grad


@pytest.mark.parametrize("dtype,N,H,V,chunk,row_block,pass_rows,grad_chunks,main_grad", CASES)
def test_tasks_give_the_same_bits_on_any_threads(dtype, N, H, V, chunk, row_block, pass_rows, grad_chunks, main_grad):
    hidden, weight, tokens = make_inputs(N, H, V, dtype, "cpu")
    tokens = tokens.clamp(min=0)  # no ignored position: every row is scored
    options = (1.0, None, 0, None, chunk, row_block, pass_rows)
    stats = ops.chosen_logprob_stats(hidden, weight, tokens, *options, grad_chunks=grad_chunks)
    upstream_inputs = per_token_inputs(stats)
    results = [run_on_threads(t, hidden, weight, tokens, options, grad_chunks, lambda s: per_token_inputs(s)[:3] +
                              upstream_inputs[3:], main_grad) for t in (1, 2, 3)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    _, grad_h, grad_w = results[0]
    want_h, want_w = float64_gradients(hidden, weight, tokens, *upstream_inputs[3:])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4  # the CPU hands main_grad a bf16-rounded gradient
    torch.testing.assert_close(grad_h.double(), want_h, rtol=tol, atol=tol * want_h.abs().max().item())
    torch.testing.assert_close(grad_w.double(), want_w, rtol=tol, atol=tol * want_w.abs().max().item())
