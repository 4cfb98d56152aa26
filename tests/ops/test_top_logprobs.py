"""fused_rl_ops.top_logprobs against float64 over the materialised logits: ids, order and ties,
values and gradients, padded rows, the logit map as one object, bad k, the mask (its rows left out
inside the op, eager and under torch.compile(fullgraph=True)), bad masks, opcheck, and tensor
parallel on gloo."""
import math

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops.logit_options import LogitMap, LogitOptions
from fused_rl_ops.testing.distributed import run_distributed
from tests.helpers.kernel_calls import KernelCalls, gemm_dims
from fused_rl_ops._vocab_parallel.tiling import default_workspace_bytes, tiling_for
from fused_rl_ops.top_logprobs import scored_top_logprobs

ops = torch.ops.fused_rl_ops
H = 12


# fp32 on CUDA (no float64 kernels there) against float64: its logprobs, and its ids up to swaps of
# logprobs that close.
FP32_TOLERANCE = dict(atol=2e-5, rtol=2e-5)


def float64_logprobs(hidden, weight, vocab_size, temperature=1.0, softcap=None):
    """The float64 log-softmax over the real vocabulary, on the CPU."""
    z = hidden.double().cpu() @ weight[:vocab_size].double().cpu().T
    return reference.apply_logit_map(z, LogitMap(temperature, softcap)).log_softmax(-1)


def float64_top(hidden, weight, k, vocab_size, temperature=1.0, softcap=None):
    """(ids, logprobs) by sorting the float64 log-softmax: descending, the lower id first (a stable sort)."""
    logp = float64_logprobs(hidden, weight, vocab_size, temperature, softcap)
    ids = logp.detach().sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return ids, logp.gather(-1, ids)


def check_top_against_float64(device, hidden, weight, k, vocab_size, **settings):
    """top_logprobs' ids, logprobs and gradients against float64: float64 inputs on the CPU (the same
    ids, to 1e-12); fp32 on CUDA (the k largest float64 logprobs and the float64 logprobs of the ids
    chosen, within FP32_TOLERANCE; gradients of the float64 logprobs of those ids)."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    h = hidden.to(device, dtype).requires_grad_(True)
    w = weight.to(device, dtype).requires_grad_(True)
    ids, lp = fused_rl_ops.top_logprobs(h, w, k, vocab_size=vocab_size, **settings)
    assert ids.dtype == torch.int64 and ids.shape == (*hidden.shape[:-1], k) and lp.dtype == dtype
    assert (ids < vocab_size).all() and (ids >= 0).all()  # padded rows never selected
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp = float64_logprobs(h64, w64, vocab_size, **settings)
    want_ids, want_lp = float64_top(hidden, weight, k, vocab_size, **settings)
    ids, tolerance = ids.cpu(), dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else FP32_TOLERANCE
    if dtype == torch.float64:
        assert torch.equal(ids, want_ids)
    else:
        assert ids.sort(-1).values.diff(dim=-1).gt(0).all()  # k distinct ids
        torch.testing.assert_close(logp.detach().gather(-1, ids), want_lp, **tolerance)
    torch.testing.assert_close(lp.cpu().double(), want_lp, **tolerance)
    upstream = torch.randn(lp.shape, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    got = torch.autograd.grad((lp * upstream.to(device, dtype)).sum(), (h, w))
    want = torch.autograd.grad((logp.gather(-1, ids) * upstream).sum(), (h64, w64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu().double(), b, **tolerance)
    assert got[1][vocab_size:].eq(0).all()
    if k == vocab_size:  # the whole vocabulary: logsumexp of the logprobs is 0
        torch.testing.assert_close(lp.logsumexp(-1).cpu().double(), torch.zeros(hidden.shape[:-1], dtype=torch.float64),
                                   **tolerance)


@pytest.mark.parametrize("k,vocab_size,settings", [(1, 50, {}), (6, 50, dict(temperature=0.7, softcap=2.0)),
                                                   (9, 43, {}), (50, 50, {})])
def test_top_logprobs_match_float64(device, k, vocab_size, settings):
    g = torch.Generator().manual_seed(k)
    hidden = torch.randn(2, 7, H, generator=g, dtype=torch.float64)
    weight = torch.randn(50, H, generator=g, dtype=torch.float64)
    check_top_against_float64(device, hidden, weight, k, vocab_size, **settings)


@pytest.mark.parametrize("k", [33, 40])
def test_several_chunks_and_more_than_32_ids(device, k):
    """200 rows over 3001 vocabulary rows: several chunks (the tops carried from chunk to chunk; the
    last chunk partial, odd-sized), and more ids than a warp has lanes."""
    g = torch.Generator().manual_seed(k)
    hidden = torch.randn(200, H, generator=g, dtype=torch.float64)
    weight = torch.randn(3008, H, generator=g, dtype=torch.float64) * 0.5
    dtype = torch.float64 if device == "cpu" else torch.float32  # check_top_against_float64's
    tiling = tiling_for(200, H, dtype.itemsize, default_workspace_bytes(hidden.to(dtype)), torch.device(device), False)
    assert math.ceil(3001 / tiling.chunk_size) >= 3
    check_top_against_float64(device, hidden, weight, k, 3001, temperature=0.9, softcap=4.0)


def test_ties_put_the_lower_id_first(device):
    """Equal logits everywhere (zero hidden rows) and duplicated weight rows."""
    weight = torch.randn(40, H)
    weight[30] = weight[5]
    weight[12] = weight[5]
    hidden = torch.zeros(3, H)
    hidden[2] = weight[5] * 3  # ids 5, 12 and 30 tie at the top
    ids, lp = fused_rl_ops.top_logprobs(hidden.to(device), weight.to(device), 4)
    assert ids[0].tolist() == [0, 1, 2, 3] and ids[1].tolist() == [0, 1, 2, 3]
    assert ids[2, :3].tolist() == [5, 12, 30]
    assert lp[2, 0] == lp[2, 1] == lp[2, 2] and (lp[:, :-1] >= lp[:, 1:]).all()


def test_logit_map_object_gives_the_keywords_results(device):
    """logit_map=LogitMap(...) is temperature and softcap as one object: bitwise the keywords' ids,
    logprobs and gradients. Both at once, or another class, is refused."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, H, generator=g).to(device).requires_grad_(True)
    weight = torch.randn(40, H, generator=g).to(device).requires_grad_(True)
    upstream = torch.randn(2, 5, 4, generator=g).to(device)
    results = []
    for options in (dict(temperature=0.7, softcap=2.0), dict(logit_map=LogitMap(0.7, 2.0))):
        ids, lp = fused_rl_ops.top_logprobs(hidden, weight, 4, vocab_size=37, **options)
        results.append((ids, lp, *torch.autograd.grad((lp * upstream).sum(), (hidden, weight))))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(ValueError, match=r"top_logprobs: give the logit options either as keywords \(temperature, "
                                         r"softcap\) or as logit_map, not both"):
        fused_rl_ops.top_logprobs(hidden, weight, 4, softcap=2.0, logit_map=LogitMap(0.7, 2.0))
    with pytest.raises(TypeError, match="top_logprobs: logit_map must be a LogitMap, got LogitOptions"):
        fused_rl_ops.top_logprobs(hidden, weight, 4, logit_map=LogitOptions(temperature=0.7))


def test_bad_k_and_shapes():
    hidden, weight = torch.randn(4, H), torch.randn(30, H)
    for bad in (0, 31, -1, 2.0, True, None):
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, vocab_size = 30\]"):
            fused_rl_ops.top_logprobs(hidden, weight, bad)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, vocab_size = 20\]"):
        fused_rl_ops.top_logprobs(hidden, weight, 21, vocab_size=20)
    with pytest.raises(ValueError, match="expected hidden"):
        fused_rl_ops.top_logprobs(hidden, weight[:, :5], 2)
    with pytest.raises(TypeError, match="weight must have hidden's dtype"):
        fused_rl_ops.top_logprobs(hidden, weight.double(), 2)


def run_top(hidden, weight, k, upstream, **options):
    """ids, logprobs and the gradients of sum(upstream * logprobs) in hidden and weight."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ids, lp = fused_rl_ops.top_logprobs(h, w, k, temperature=0.8, vocab_size=47, **options)
    return (ids, lp.detach(), *torch.autograd.grad((lp * upstream).sum(), (h, w)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_mask_leaves_its_rows_out_inside_the_op(device, dtype):
    """The op gets every row and the mask, and computes the rows the mask keeps: bitwise what those
    rows alone give (ids, logprobs, both gradients), the unmasked call's within rounding (a GEMM of
    other rows may round otherwise); the rows left out give ids -1, logprobs 0 and zero hidden
    gradient rows, a NaN in one of them reaching nothing. The backward is chosen_logprob's, with
    ignore_index -1 leaving them out."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 inputs run on the CPU only")
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 8, H, generator=g).to(device, dtype)
    weight = torch.randn(50, H, generator=g).to(device, dtype)
    mask = (torch.rand(3, 8, generator=g) < 0.5).to(device)
    mask[0, 0], mask[2, 7] = True, False
    hidden[2, 7, 3] = float("nan")
    upstream = torch.randn(3, 8, 5, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    upstream = upstream.to(device)
    with KernelCalls() as calls:
        ids, lp, grad_h, grad_w = run_top(hidden, weight, 5, upstream, mask=mask)
    [stats] = [call for call in calls.calls if call.op == "top_logprobs_stats"]
    [backward] = [call for call in calls.calls if call.op == "chosen_logprob_backward"]
    assert stats.args["hidden"].shape == (24, H) and torch.equal(stats.args["mask"], mask.reshape(-1))
    assert backward.args["ignore_index"] == -1 and torch.equal(backward.args["tokens"].eq(-1).all(1), ~mask.reshape(-1))

    alone = run_top(hidden[mask], weight, 5, upstream[mask])
    for got, want in zip((ids[mask], lp[mask], grad_h[mask], grad_w), alone):
        assert torch.equal(got, want)
    assert ids[~mask].eq(-1).all() and lp[~mask].eq(0).all() and grad_h[~mask].eq(0).all()
    assert grad_h[mask].isfinite().all() and grad_w.isfinite().all()
    hidden[2, 7, 3] = 0.0  # the unmasked call computes that row too
    full_ids, full_lp, full_grad_h, full_grad_w = run_top(hidden, weight, 5, upstream * mask[..., None])
    assert torch.equal(ids[mask], full_ids[mask])
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    for got, want in ((lp[mask], full_lp[mask]), (grad_h[mask], full_grad_h[mask]), (grad_w, full_grad_w)):
        assert_close(got, want, **tolerance)

    scored_ids, scored_lp = scored_top_logprobs(hidden, weight, 5, mask, -100, temperature=0.8, vocab_size=47)
    assert torch.equal(scored_ids, torch.where(mask[..., None], full_ids, -100)) and scored_lp[~mask].eq(0).all()


def masked_call(hidden, weight, mask, upstream):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ids, lp = fused_rl_ops.top_logprobs(h, w, 4, temperature=0.8, mask=mask)
    return ids, lp, (lp * upstream).sum()


@pytest.mark.parametrize("call", ["eager", "torch.compile"])
def test_the_work_follows_the_mask_inside_the_op(device, call):
    """Forward and backward, every GEMM of the ops takes the masked-in rows only (3 of 4 positions
    left out), eager and compiled with fullgraph=True (no graph break: the count is read inside the
    op); the compiled call gives the eager call's bits."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(3, 40, H, generator=g).to(device), torch.randn(300, H, generator=g).to(device)
    mask = torch.zeros(3, 40, dtype=torch.bool, device=device)
    mask[:, 30:39] = True
    upstream = torch.randn(3, 40, 4, generator=g).to(device)

    def run():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        step = masked_call if call == "eager" else torch.compile(masked_call, fullgraph=True, backend="aot_eager")
        ids, lp, loss = step(h, w, mask, upstream)
        return (ids, lp.detach(), *torch.autograd.grad(loss, (h, w)))

    run()  # compiles, where it does
    results = []
    gemms = gemm_dims(lambda: results.append(run()))
    # The logits GEMM, and the two gradient GEMMs: each takes the 27 rows, none all 120.
    assert len(gemms) >= 3 and all(27 in sizes and 120 not in sizes for sizes in gemms), gemms
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ids, lp, loss = masked_call(h, w, mask, upstream)
    for got, want in zip(results[0], (ids, lp.detach(), *torch.autograd.grad(loss, (h, w)))):
        assert torch.equal(got, want)


def test_bad_masks():
    """The wrapper's errors, and the op's own when called directly."""
    hidden, weight = torch.randn(2, 3, H), torch.randn(30, H)
    for bad in (torch.ones(2, 3), torch.ones(6, dtype=torch.bool), torch.ones(2, 3, 1, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"top_logprobs: mask must be a bool tensor of hidden's leading shape "
                                             r"\(2, 3\), got"):
            fused_rl_ops.top_logprobs(hidden, weight, 2, mask=bad)
    with pytest.raises(TypeError, match="top_logprobs: mask must be a tensor, got list"):
        fused_rl_ops.top_logprobs(hidden, weight, 2, mask=[[True] * 3] * 2)
    with pytest.raises(ValueError, match="top_logprobs: all tensors must be on one device, got hidden on cpu, "
                                         "weight on cpu, mask on meta"):
        fused_rl_ops.top_logprobs(hidden, weight, 2, mask=torch.ones(2, 3, dtype=torch.bool, device="meta"))
    options = (1.0, None, 0, None, 32, 0, 0, 1, 2)
    for bad in (torch.ones(6), torch.ones(5, dtype=torch.bool), torch.ones(6, 1, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"top_logprobs: mask must be None or \[N\] bool \(hidden's rows\)"):
            ops.top_logprobs_stats(hidden.reshape(6, H), weight, bad, *options)


def test_opcheck_top_logprobs_stats(device):
    hidden, weight = torch.randn(9, H, device=device), torch.randn(70, H, device=device)
    torch.library.opcheck(ops.top_logprobs_stats, (hidden, weight, None, 0.8, None, 0, 64, 32, 0, 0, 1, 5))
    torch.library.opcheck(ops.top_logprobs_stats, (hidden, weight, None, 1.0, 2.0, 0, None, 16, 0, 0, 1, 3))
    for mask in (torch.arange(9, device=device) % 3 == 0, torch.zeros(9, dtype=torch.bool, device=device),
                 torch.ones(9, dtype=torch.bool, device=device)):
        torch.library.opcheck(ops.top_logprobs_stats, (hidden, weight, mask, 0.8, None, 0, 64, 32, 0, 0, 1, 5))


def tensor_parallel_checks(rank, world):
    # Small integers: every logit exact whatever the GEMM's shape on each rank, and many ties.
    g = torch.Generator().manual_seed(7)
    local = 15
    hidden = torch.randint(-2, 3, (3, 4, H), generator=g).float()
    weight = torch.randint(-2, 3, (world * local, H), generator=g).float()
    weight[local + 2] = weight[1]  # a tie across ranks: id 1 before id local + 2
    hidden[0, 0] = weight[1] * 2
    vocab_size = world * local - 4
    shard = slice(rank * local, (rank + 1) * local)
    for k in (1, 8, vocab_size):  # k = vocab_size: every rank holds fewer
        h, w = hidden.clone().requires_grad_(True), weight[shard].clone().requires_grad_(True)
        ids, lp = fused_rl_ops.top_logprobs(h, w, k, temperature=0.9, vocab_size=vocab_size,
                                            tp_group=dist.group.WORLD)
        h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        single_ids, single_lp = fused_rl_ops.top_logprobs(h1, w1, k, temperature=0.9, vocab_size=vocab_size)
        assert torch.equal(ids, single_ids)
        torch.testing.assert_close(lp, single_lp, atol=1e-5, rtol=1e-5)
        upstream = torch.randn(lp.shape, generator=torch.Generator().manual_seed(k))
        (lp * upstream).sum().backward()
        (single_lp * upstream).sum().backward()
        torch.testing.assert_close(h.grad, h1.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.grad, w1.grad[shard], atol=1e-5, rtol=1e-5)
    assert ids[0, 0, :2].tolist() == [1, local + 2]
    mask = torch.arange(12).reshape(3, 4) % 3 != 1
    h = hidden.clone().requires_grad_(True)
    ids, lp = fused_rl_ops.top_logprobs(h, weight[shard], 5, mask=mask, vocab_size=vocab_size,
                                        tp_group=dist.group.WORLD)
    single_ids, single_lp = fused_rl_ops.top_logprobs(hidden, weight, 5, mask=mask, vocab_size=vocab_size)
    assert torch.equal(ids, single_ids) and ids[~mask].eq(-1).all() and lp[~mask].eq(0).all()
    torch.testing.assert_close(lp, single_lp, atol=1e-5, rtol=1e-5)
    lp.sum().backward()
    assert h.grad[~mask].eq(0).all() and h.grad[mask].ne(0).any()
    with pytest.raises(ValueError, match="disagree on the mask"):
        fused_rl_ops.top_logprobs(hidden, weight[shard], 3, mask=mask ^ (rank == 1), tp_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="disagree on the k"):
        fused_rl_ops.top_logprobs(hidden, weight[shard], 3 + rank, tp_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="disagree on the softcap"):
        fused_rl_ops.top_logprobs(hidden, weight[shard], 3, logit_map=LogitMap(1.0, 2.0 + rank),
                                  tp_group=dist.group.WORLD)


@pytest.mark.parametrize("world", [2, 4])
def test_top_logprobs_tensor_parallel(world):
    run_distributed(tensor_parallel_checks, world)
