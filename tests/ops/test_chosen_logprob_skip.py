"""chosen_logprob's skip_ignored (the default): the ops get every row and ignore_index, and leave
out the rows whose token is ignore_index themselves (the count read inside the op), checked by
the GEMMs they run (torch.profiler sees the aten calls inside an op, with their shapes), eager and
under torch.compile(fullgraph=True); those rows give logprob 0, entropy 0 and zero gradient rows;
the scored rows are the float64 reference's. skip_ignored=False computes every row as it is."""
import math

import pytest
import torch
from torch.testing import assert_close

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops._vocab_parallel.tiling import default_workspace_bytes, tiling_for
from tests.helpers.kernel_calls import KernelCalls, gemm_dims, scored

H, V, VOCAB = 24, 300, 290
KERNELS = ("chosen_logprob_stats", "chosen_logprob_backward")
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def rl_batch(device, dtype=torch.float32, batch=3, seq=20, seed=0):
    """hidden [b, s, H], weight [V, H] (rows past VOCAB padding), labels [b, s] with -100 on each
    row's prompt (a different length per row), on its last position and here and there in the
    completion, and upstream gradients of logprob and entropy."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (3.0 / H**0.5)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    for row, prompt in enumerate((5, 12, 0)[:batch]):
        labels[row, :prompt] = -100
    labels[:, -1] = -100
    labels[0, 9] = labels[2, 3] = -100
    grads = torch.randn(2, batch, seq, generator=g)
    to = dict(device=device)
    return hidden.to(device, dtype), weight.to(device, dtype), labels.to(**to), grads[0].to(**to), grads[1].to(**to)


def run(hidden, weight, labels, grad_lp, grad_ent, **options):
    """logprob, entropy and the gradients of sum(grad_lp * logprob + grad_ent * entropy), and the
    kernel calls of forward and backward."""
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    with KernelCalls() as calls:
        lp, ent = fused_rl_ops.chosen_logprob(h, w, labels, temperature=0.8, vocab_size=VOCAB, return_entropy=True,
                                              **options)
        (lp * grad_lp + ent * grad_ent).sum().backward()
    return (lp.detach(), ent.detach(), h.grad, w.grad), calls


def float64(hidden, weight, labels, grad_lp, grad_ent, **options):
    h = hidden.detach().double().cpu().requires_grad_(True)
    w = weight.detach().double().cpu().requires_grad_(True)
    lp, ent = reference.chosen_logprob(h, w, labels.cpu(), temperature=0.8, vocab_size=VOCAB, **options)
    (lp * grad_lp.double().cpu() + ent * grad_ent.double().cpu()).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def assert_close_to(ours, want, tolerance):
    for name, a, b in zip(("logprob", "entropy", "hidden grad", "weight grad"), ours, want):
        assert_close(a.double().cpu(), b, **tolerance, msg=lambda m: f"{name}: {m}")


def assert_ignored_rows_give_nothing(results, labels):
    lp, ent, grad_h, _ = results
    ignored = labels == -100
    assert lp[ignored].eq(0).all() and ent[ignored].eq(0).all() and grad_h[ignored].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_ops_get_every_row_and_leave_out_the_ignored_ones(device, dtype, batch_invariant):
    batch = rl_batch(device, dtype)
    labels = batch[2]
    results, calls = run(*batch, batch_invariant=batch_invariant, workspace_bytes=1)
    assert 0 < len(scored(labels)) < labels.numel() // 2 + 10
    for op in KERNELS:
        # One call per op; batch-invariant: one per virtual shard of the vocabulary, each with every row.
        op_calls = [call for call in calls.calls if call.op == op]
        assert len(op_calls) == 1 or (batch_invariant and len(op_calls) > 1)
        for call in op_calls:
            assert torch.equal(call.args["tokens"].cpu(), labels.reshape(-1).cpu()) and call.args["ignore_index"] == -100
    assert_close_to(results, float64(*batch), TOLERANCE[dtype])
    assert_ignored_rows_give_nothing(results, labels)
    assert results[3][VOCAB:].eq(0).all()


def compiled_call(hidden, weight, labels, grad_lp, grad_ent):
    """The defaults under torch.compile(fullgraph=True): no host read in the traced code."""
    def step(h, w):
        lp, ent = fused_rl_ops.chosen_logprob(h, w, labels, temperature=0.8, vocab_size=VOCAB, return_entropy=True)
        return lp, ent, (lp * grad_lp + ent * grad_ent).sum()

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent, loss = torch.compile(step, fullgraph=True, backend="aot_eager")(h, w)
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("call", ["eager", "torch.compile"])
def test_the_work_follows_the_scored_rows_inside_the_op(call):
    """Forward and backward, every GEMM of the ops takes the scored rows only: 3 of 4 positions
    ignored, eager and compiled with fullgraph=True (the count is read inside the op, where the
    traced graph cannot see it); the results are the eager call's."""
    hidden, weight, labels, grad_lp, grad_ent = rl_batch("cpu", seq=40)
    labels[:, :30] = -100
    count = len(scored(labels))
    assert count == 3 * 9  # the last position of each row is ignored too
    calls = {"eager": lambda: run(hidden, weight, labels, grad_lp, grad_ent)[0],
             "torch.compile": lambda: compiled_call(hidden, weight, labels, grad_lp, grad_ent)}
    calls[call]()  # compiles, where it does
    results = []
    gemms = gemm_dims(lambda: results.append(calls[call]()))
    # The logits GEMM per chunk, and the two gradient GEMMs: each takes the scored rows, none all 120.
    assert len(gemms) >= 3 and all(count in sizes and labels.numel() not in sizes for sizes in gemms), gemms
    eager, _ = run(hidden, weight, labels, grad_lp, grad_ent)
    for got, want in zip(results[0], eager):
        assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_the_default_workspace_follows_the_scored_rows(device):
    """Where the token check counts the scored rows, the chunk width the ops get is the one for
    their count and their size."""
    batch = rl_batch(device, batch=3, seq=400)
    hidden, labels = batch[0], batch[2]
    labels[:, :300] = -100
    _, calls = run(*batch)
    count = len(scored(labels))
    chunk_size = tiling_for(count, H, 4, default_workspace_bytes(hidden, count), hidden.device, False).chunk_size
    assert chunk_size != tiling_for(labels.numel(), H, 4, default_workspace_bytes(hidden), hidden.device,
                                    False).chunk_size
    for call in calls.calls:
        if call.op in KERNELS:
            assert call.args["chunk_size"] == chunk_size


@pytest.mark.parametrize("megatron_ddp", [False, True])
def test_every_row_ignored(device, megatron_ddp):
    """The ops compute no row (no GEMM runs); the outputs still carry autograd history: the hidden
    and weight gradients are zeros, and main_grad is left as it was, with Megatron's placeholder
    when the weight carries grad_added_to_main_grad."""
    hidden, weight, labels, grad_lp, grad_ent = rl_batch(device)
    labels[:] = -100
    if device == "cpu":
        assert gemm_dims(lambda: run(hidden, weight, labels, grad_lp, grad_ent)) == []
    (lp, ent, grad_h, grad_w), _ = run(hidden, weight, labels, grad_lp, grad_ent)
    assert lp.eq(0).all() and ent.eq(0).all() and grad_h.eq(0).all() and grad_w.eq(0).all()

    h = hidden.clone().requires_grad_(True)
    w = torch.nn.Parameter(weight.clone())
    main_grad = torch.randn(weight.shape, device=device)
    start = main_grad.clone()
    if megatron_ddp:
        w.grad_added_to_main_grad = False
    lp, ent = fused_rl_ops.chosen_logprob(h, w, labels, return_entropy=True, main_grad=main_grad)
    assert lp.grad_fn is not None and ent.grad_fn is not None
    (lp * grad_lp + ent * grad_ent).sum().backward()
    assert h.grad.eq(0).all() and torch.equal(main_grad, start)
    if megatron_ddp:
        assert w.grad_added_to_main_grad and w.grad.shape == w.shape
    else:
        assert w.grad is None


def test_main_grad_gets_the_scored_rows_weight_gradient(device):
    batch = rl_batch(device)
    want = float64(*batch)
    h, w = batch[0].clone().requires_grad_(True), batch[1].clone().requires_grad_(True)
    main_grad = torch.zeros(batch[1].shape, device=device)
    with KernelCalls() as calls:
        lp, ent = fused_rl_ops.chosen_logprob(h, w, batch[2], temperature=0.8, vocab_size=VOCAB, return_entropy=True,
                                              main_grad=main_grad)
        (lp * batch[3] + ent * batch[4]).sum().backward()
    [call] = [call for call in calls.calls if call.op == "chosen_logprob_backward"]
    assert call.args["main_grad"] is main_grad and call.args["ignore_index"] == -100
    assert w.grad is None
    assert_close_to((lp.detach(), ent.detach(), h.grad, main_grad), want, TOLERANCE[torch.float32])


@pytest.mark.parametrize("without_a_host_read", ["check_tokens=False", "torch.compile"])
def test_without_the_token_check_the_ops_still_skip(device, without_a_host_read):
    """Without the wrapper's host read the ops still leave the ignored rows out (the tiling is then
    planned for every row): the same results, also with a NaN in an ignored position's hidden
    state (it reaches no gradient)."""
    batch = list(rl_batch(device))
    labels = batch[2]
    batch[0][0, 2, 5] = math.nan  # a prompt position
    if without_a_host_read == "check_tokens=False":
        results, calls = run(*batch, check_tokens=False)
        assert {call.args["ignore_index"] for call in calls.calls if call.op in KERNELS} == {-100}
    else:
        results = compiled_call(*batch)
    skipped, _ = run(*batch)
    for a, b in zip(results, skipped):
        assert a.isfinite().all()
        assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert_close_to(results, float64(*batch), TOLERANCE[torch.float32])
    assert_ignored_rows_give_nothing(results, labels)


def test_skip_ignored_false_computes_every_row_as_it_is(device):
    """The full computation: the ops get no ignore_index, and the ignored rows keep their entropy
    and its gradient (logprob 0, no logprob gradient), as the reference computing every row."""
    batch = rl_batch(device)
    labels = batch[2]
    results, calls = run(*batch, skip_ignored=False)
    assert {call.args["ignore_index"] for call in calls.calls if call.op in KERNELS} == {None}
    assert_close_to(results, float64(*batch, skip_ignored=False), TOLERANCE[torch.float32])
    ignored = labels == -100
    assert results[0][ignored].eq(0).all() and (results[1][ignored] > 0).all()
    assert results[2][ignored].ne(0).any(-1).all()


@pytest.mark.per_device
@pytest.mark.skipif(not (torch.cuda.is_available() and fused_rl_ops.has_cuda_kernels()), reason="needs a GPU")
def test_cuda_graph_capture_computes_every_row_with_the_same_results():
    """Under CUDA graph capture no value may be read: the ops compute every row, the ignored ones
    on zeroed hidden rows (replayed graph against the eager call that skips)."""
    hidden, weight, labels, grad_lp, grad_ent = rl_batch("cuda")
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

    def step():
        lp, ent = fused_rl_ops.chosen_logprob(h, w, labels, temperature=0.8, vocab_size=VOCAB, return_entropy=True)
        return (lp, ent) + torch.autograd.grad((lp * grad_lp + ent * grad_ent).sum(), (h, w))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    skipped, _ = run(hidden, weight, labels, grad_lp, grad_ent)
    for a, b in zip(captured, skipped):
        assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert_ignored_rows_give_nothing(captured, labels)
