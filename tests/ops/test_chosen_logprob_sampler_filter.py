"""chosen_logprob under the sampler's filter (top_k, top_p): logprob, entropy and both gradients
against float64 PyTorch that applies vLLM's masking to the full logits (fused_rl_ops.reference),
at TP 1 / 2 / 4, with temperature, softcap, padded vocabulary, bf16, batch_invariant, ties at the
boundaries, tokens outside the kept set, non-finite logits, and disabled filters giving today's
results bit for bit."""
import math

import pytest
import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops._vocab_parallel.sampler_filter import TOP_HEADER, TOP_P_CANDIDATES
from fused_rl_ops.testing.distributed import run_distributed
from tests.helpers.kernel_calls import KernelCalls
from tests.ops.test_chosen_logprob_skip import gemm_dims

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
             torch.float64: dict(atol=1e-10, rtol=1e-10)}
FILTERS = [dict(top_k=7), dict(top_p=0.8), dict(top_k=40, top_p=0.9), dict(top_k=1), dict(top_p=0.05)]
# The test data keep every cumulative mass this far from top_p: the kernels decide on fp32 logits
# (about 1e-7 relative off float64's) and the row's fp32 log-sum.
MARGIN = 2e-6


def make_inputs(N, H, V, scale, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (scale / H**0.5)
    tokens = torch.randint(0, V, (N,), generator=g)
    return hidden.to(dtype), weight.to(dtype), tokens


def reference_logits(hidden, weight, temperature=1.0, softcap=None, vocab_size=None):
    logits = hidden.double() @ weight.double().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return (logits / temperature)[:, :vocab_size]


def assert_clear_boundaries(logits, top_k=None, top_p=None):
    """The test data leave no boundary to rounding: the k-th and (k+1)-th largest logits differ by
    more than 1e-5 (or tie exactly), and top_p lies MARGIN away from every cumulative mass."""
    if top_k is not None:
        ordered = logits.sort(1, descending=True).values
        gap = ordered[:, top_k - 1] - ordered[:, top_k]
        assert ((gap > 1e-5) | (gap == 0)).all(), "test data: a top-k boundary within rounding"
    if top_p is not None:
        kept = reference.sampler_filter(logits, top_k, None)
        cumulative = torch.softmax(kept.sort(1, descending=True).values, 1).cumsum(1)
        assert ((cumulative - top_p).abs() > MARGIN).all(), "test data: a top-p boundary within rounding"


def run_ours(hidden, weight, tokens, grad_lp, grad_ent, device="cpu", **kw):
    """logprob, entropy, both gradients and is_kept of a call on device, on the CPU."""
    h = hidden.detach().clone().to(device).requires_grad_(True)
    w = weight.detach().clone().to(device).requires_grad_(True)
    lp, ent, kept = fused_rl_ops.chosen_logprob(h, w, tokens.to(device), return_entropy=True, return_is_kept=True,
                                                **kw)
    (torch.where(kept, lp, 0.0) * grad_lp.to(device) + ent * grad_ent.to(device)).sum().backward()
    return tuple(t.cpu() for t in (lp, ent, h.grad, w.grad, kept))


def run_reference(hidden, weight, tokens, grad_lp, grad_ent, **kw):
    """float64 logprob, entropy and gradients; a token outside the kept set passes no logprob
    gradient (its logprob is -inf)."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    lp, ent = reference.chosen_logprob(h, w, tokens, **kw)
    (torch.where(lp.isfinite(), lp, 0.0) * grad_lp.double() + ent * grad_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad, lp.isfinite() & (tokens != -100)


def assert_matches(ours, ref, tol):
    for a, b in zip(ours[:4], ref[:4]):
        torch.testing.assert_close(a.detach().double(), b, **tol)
    assert torch.equal(ours[4], ref[4]), "is_kept"


@pytest.mark.parametrize("filter_", FILTERS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("temperature,softcap,vocab_size", [(1.0, None, None), (0.7, None, 290), (1.3, 4.0, 297)])
def test_matches_float64_reference(device, filter_, temperature, softcap, vocab_size):
    """Every filter at several temperatures, with a softcap and a padded vocabulary (rows past
    vocab_size are padding), chunks of 128 vocab rows."""
    N, H, V = 48, 32, 300
    hidden, weight, tokens = make_inputs(N, H, V, scale=6.0, seed=1)
    tokens = tokens.clamp(max=(vocab_size or V) - 1)
    tokens[-1] = -100
    kw = dict(temperature=temperature, softcap=softcap, vocab_size=vocab_size, **filter_)
    assert_clear_boundaries(reference_logits(hidden, weight, temperature, softcap, vocab_size), **filter_)
    grad_lp, grad_ent = torch.randn(N), torch.randn(N)
    ours = run_ours(hidden, weight, tokens, grad_lp, grad_ent, device, workspace_bytes=1, **kw)
    ref = run_reference(hidden, weight, tokens, grad_lp, grad_ent, **kw)
    assert_matches(ours, ref, TOLERANCE[torch.float32])
    assert ours[0][~ours[4] & (tokens != -100)].eq(-math.inf).all()
    assert ours[2].isfinite().all() and ours[3].isfinite().all()
    if vocab_size is not None:
        assert ours[3][vocab_size:].eq(0).all()


def test_float64_inputs_match_to_rounding():
    hidden, weight, tokens = make_inputs(30, 16, 400, scale=5.0, seed=2, dtype=torch.float64)
    grads = torch.randn(30, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
    for filter_ in FILTERS:
        ours = run_ours(hidden, weight, tokens, *grads, temperature=0.9, **filter_)
        ref = run_reference(hidden, weight, tokens, *grads, temperature=0.9, **filter_)
        assert_matches(ours, ref, TOLERANCE[torch.float64])


@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_top_p_over_more_tokens_than_the_candidates(device, top_p):
    """A flat distribution: the nucleus holds more tokens than the stats pass's candidates, so the
    threshold is searched window by window."""
    N, H, V = 12, 16, 4000
    hidden, weight, tokens = make_inputs(N, H, V, scale=0.5, seed=7)
    logits = reference_logits(hidden, weight, temperature=0.8)
    assert_clear_boundaries(logits, top_p=top_p)
    assert (reference.sampler_filter(logits, None, top_p).isfinite().sum(1) > TOP_P_CANDIDATES).any()
    grads = torch.randn(N), torch.randn(N)
    kw = dict(temperature=0.8, top_p=top_p)
    assert_matches(run_ours(hidden, weight, tokens, *grads, device, workspace_bytes=1, **kw),
                   run_reference(hidden, weight, tokens, *grads, **kw), TOLERANCE[torch.float32])


def test_tokens_outside_the_kept_set(device):
    """A sampled token outside the kept set (the engines disagree at the boundary) gets logprob -inf,
    is_kept False and no logprob gradient; its entropy and the entropy's gradient stay the kept
    set's, finite."""
    N, H, V = 16, 24, 200
    hidden, weight, _ = make_inputs(N, H, V, scale=6.0, seed=4)
    logits = reference_logits(hidden, weight)
    order = logits.argsort(1, descending=True)
    tokens = torch.where(torch.arange(N) % 2 == 0, order[:, 0], order[:, 150])  # kept; dropped
    grads = torch.randn(N), torch.randn(N)
    for filter_ in [dict(top_k=20), dict(top_p=0.7)]:
        assert_clear_boundaries(logits, **filter_)
        ours = run_ours(hidden, weight, tokens, *grads, device, **filter_)
        assert torch.equal(ours[4], torch.arange(N) % 2 == 0)
        assert ours[0][1::2].eq(-math.inf).all() and ours[0][::2].isfinite().all()
        assert_matches(ours, run_reference(hidden, weight, tokens, *grads, **filter_), TOLERANCE[torch.float32])
        # Only the entropy reaches the gradients of the dropped tokens' rows.
        h = hidden.to(device).requires_grad_(True)
        lp = fused_rl_ops.chosen_logprob(h, weight.to(device), tokens.to(device), **filter_)
        lp[1::2].sum().backward()  # -inf, by design: no gradient
        assert h.grad.eq(0).all()


def tied_inputs():
    """Logits with exact ties: small integers times 1/4 (exact in fp32 whatever the GEMM's order of
    additions), so the k-th largest logit and the token where the cumulative mass reaches top_p
    have copies."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randint(-2, 3, (10, 8), generator=g).float()
    weight = torch.randint(-2, 3, (127, 8), generator=g).float() / 4
    tokens = torch.randint(0, 127, (10,), generator=g)
    return hidden, weight, tokens


def test_ties_are_kept_or_dropped_together(device):
    hidden, weight, tokens = tied_inputs()
    logits = (hidden @ weight.T).double()
    grads = torch.randn(10), torch.randn(10)
    for filter_ in [dict(top_k=4), dict(top_k=5), dict(top_p=0.3), dict(top_p=0.6), dict(top_k=10, top_p=0.5)]:
        ours = run_ours(hidden, weight, tokens, *grads, device, **filter_)
        ref = run_reference(hidden, weight, tokens, *grads, **filter_)
        assert_matches(ours, ref, TOLERANCE[torch.float32])
        # The kept sets themselves: an upper set of the logits holding every copy of its smallest.
        kept = reference.sampler_filter(logits, filter_.get("top_k"), filter_.get("top_p")).isfinite()
        smallest = torch.where(kept, logits, math.inf).min(1).values
        assert torch.equal(kept, logits >= smallest[:, None])
        if "top_k" in filter_ and "top_p" not in filter_:
            assert (kept.sum(1) >= filter_["top_k"]).all()
            assert (kept.sum(1) > filter_["top_k"]).any(), "a tie at the k-th largest"


@pytest.mark.parametrize("filter_", [dict(top_k=12), dict(top_p=0.7), dict(top_k=40, top_p=0.9)],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_the_ops_leave_the_ignored_rows_out(device, filter_):
    """With ignored positions (half of them) every op gets every row, and leaves the ignored ones
    out itself: every GEMM, the search's included, forward and backward, takes the scored rows, and
    their results are the float64 reference's; without the wrapper's host read (check_tokens=False)
    the same results."""
    N, H, V = 40, 16, 300
    hidden, weight, tokens = make_inputs(N, H, V, scale=6.0, seed=14)
    tokens[::2] = -100
    assert_clear_boundaries(reference_logits(hidden[1::2], weight, 0.9), **filter_)
    grads = torch.randn(N), torch.randn(N)
    kw = dict(temperature=0.9, **filter_)
    results = []
    with KernelCalls() as calls:
        gemms = gemm_dims(lambda: results.append(run_ours(hidden, weight, tokens, *grads, device, **kw)))
    skipped = results[0]
    for call in calls.calls:
        rows = call.args.get("hidden", call.args.get("partials"))
        assert rows.shape[-2 if call.op == "chosen_logprob_combine" else 0] == N, call.op
    assert {call.op for call in calls.calls} >= {"chosen_logprob_stats", "chosen_logprob_backward"}
    searches = sum(call.op == "chosen_logprob_search" for call in calls.calls)
    assert searches > 0 if "top_k" not in filter_ else searches == 0
    assert gemms and all(N // 2 in sizes and N not in sizes for sizes in gemms), gemms
    assert_matches(skipped, run_reference(hidden, weight, tokens, *grads, **kw), TOLERANCE[torch.float32])
    assert skipped[0][::2].eq(0).all() and skipped[1][::2].eq(0).all() and skipped[2][::2].eq(0).all()
    computed = run_ours(hidden, weight, tokens, *grads, device, check_tokens=False, **kw)
    for a, b in zip(computed, skipped):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    main_grad = torch.randn(V, H, device=device)
    start = main_grad.clone()
    h = hidden.to(device).requires_grad_(True)
    lp, ent, kept = fused_rl_ops.chosen_logprob(h, weight.to(device), tokens.to(device), return_entropy=True,
                                                return_is_kept=True, main_grad=main_grad, **kw)
    (torch.where(kept, lp, 0.0) * grads[0].to(device) + ent * grads[1].to(device)).sum().backward()
    torch.testing.assert_close((main_grad - start).cpu(), skipped[3], atol=1e-6, rtol=1e-6)


def test_disabled_filters_are_todays_path_bitwise(device):
    hidden, weight, tokens = make_inputs(40, 16, 300, scale=4.0, seed=6)
    tokens = tokens.clamp(max=289)
    grads = torch.randn(40), torch.randn(40)
    plain = run_ours(hidden, weight, tokens, *grads, device, temperature=0.9, vocab_size=290)
    for off in [dict(top_k=None, top_p=None), dict(top_k=290), dict(top_k=10**9), dict(top_p=1.0), dict(top_p=1),
                dict(top_k=290, top_p=1.0)]:
        ours = run_ours(hidden, weight, tokens, *grads, device, temperature=0.9, vocab_size=290, **off)
        for a, b in zip(ours, plain):
            assert torch.equal(a, b), off


def test_reduced_precision_and_batch_invariance(device):
    """bf16 inputs against float64 of the same bf16 values; with batch_invariant each token's
    logprob, entropy and hidden gradient are bitwise the same alone and in a batch."""
    N, H, V = 64, 32, 600
    hidden, weight, tokens = make_inputs(N, H, V, scale=6.0, seed=7, dtype=torch.bfloat16)
    grads = torch.randn(N), torch.randn(N)
    for filter_ in [dict(top_k=30), dict(top_p=0.85), dict(top_k=30, top_p=0.85)]:
        assert_clear_boundaries(reference_logits(hidden, weight, 0.9), **filter_)
        kw = dict(temperature=0.9, **filter_)
        batch = run_ours(hidden, weight, tokens, *grads, device, batch_invariant=True, **kw)
        assert_matches(batch, run_reference(hidden, weight, tokens, *grads, **kw), TOLERANCE[torch.bfloat16])
        for rows in (slice(0, 1), slice(5, 9)):
            alone = run_ours(hidden[rows], weight, tokens[rows], grads[0][rows], grads[1][rows], device,
                             batch_invariant=True, **kw)
            for a, b in zip(alone[:3] + alone[4:], batch[:3] + batch[4:]):
                assert torch.equal(a, b[rows])


def test_nonfinite_logits(device):
    """A NaN row stays NaN (never filtered), as without the filter; -inf logits are values (of
    mass 0): top_k counts them, top_p drops them, as the float64 reference does."""
    N, H, V = 8, 16, 200
    hidden, weight, tokens = make_inputs(N, H, V, scale=6.0, seed=8)
    tokens = tokens.clamp(min=150)  # finite logits
    hidden[0, 3] = math.nan
    hidden[1:, 0] = 1.0
    weight[:150, 0] = -math.inf  # 150 -inf logits in rows 1..7
    grads = torch.randn(N), torch.randn(N)
    for filter_ in [dict(top_k=60), dict(top_p=0.9), dict(top_k=60, top_p=0.9)]:
        ours = run_ours(hidden, weight, tokens, *grads, device, **filter_)
        assert ours[0][0].isnan() and ours[1][0].isnan() and ours[2][0].isnan().all()
        ref = run_reference(hidden[1:], weight, tokens[1:], grads[0][1:], grads[1][1:], **filter_)
        for a, b in zip(ours[:2], ref[:2]):
            torch.testing.assert_close(a[1:].double(), b, **TOLERANCE[torch.float32])
        assert torch.equal(ours[4][1:], ref[4])


@pytest.mark.parametrize("bad", [dict(top_k=0), dict(top_k=-3), dict(top_k=2.0), dict(top_k=True), dict(top_k="5"),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.1), dict(top_p=math.nan),
                                 dict(top_p=True), dict(top_p="0.9")])
def test_invalid_filters_are_refused(bad):
    hidden, weight, tokens = make_inputs(4, 8, 50, scale=1.0)
    (name, value), = bad.items()
    requirement = "a positive integer" if name == "top_k" else r"a number in \(0, 1\]"
    with pytest.raises(ValueError, match=rf"LogitOptions: {name} must be None or {requirement}, got"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens, **bad)


def test_stats_op_returns_the_candidates(device):
    """Called directly, the stats op appends each row's top to its partials with a top width (top_k):
    its top_width largest logits and their counts."""
    hidden, weight, tokens = make_inputs(6, 8, 3000, scale=3.0, seed=9)
    ops = torch.ops.fused_rl_ops
    for width in (5, 1200, 0):
        stats = ops.chosen_logprob_stats(hidden.to(device), weight.to(device), tokens.to(device), 1.0, None, 0, None,
                                         128, top_width=width).cpu()
        assert stats.shape == (6, 4 + (TOP_HEADER + width if width else 0))
        if width:
            top = stats[:, 4:]
            assert top[:, 0].eq(3000).all() and top[:, 1].eq(width).all()  # seen, held
            expected = (hidden.double() @ weight.double().T).topk(width, 1).values
            torch.testing.assert_close(top[:, TOP_HEADER:].sort(1, descending=True).values.double(), expected,
                                       **TOLERANCE[torch.float32])


def tensor_parallel_checks(rank, world):
    """Each rank holds a shard of a padded vocabulary (at 4 ranks the last is wholly padding); the
    ranks' kept sets, logprob, entropy and gradients are the single-process float64 reference's. The
    last case's nucleus holds more tokens than the candidates: the search's histograms are summed
    over the ranks."""
    group = dist.group.WORLD
    for seed, local, scale, filter_, temperature, softcap in [
            (10, 100, 6.0, dict(top_k=9), 0.8, None), (11, 100, 6.0, dict(top_p=0.75), 1.0, 5.0),
            (12, 100, 6.0, dict(top_k=50, top_p=0.9), 1.2, None), (13, 800, 0.3, dict(top_p=0.9), 0.9, None)]:
        vocab_size = world * local - (local + 10 if world == 4 else 10)
        shard = slice(rank * local, (rank + 1) * local)
        hidden, weight, tokens = make_inputs(16, 16, world * local, scale=scale, seed=seed)
        tokens = tokens.clamp(max=vocab_size - 1)
        kw = dict(temperature=temperature, softcap=softcap, vocab_size=vocab_size, **filter_)
        assert_clear_boundaries(reference_logits(hidden, weight, temperature, softcap, vocab_size), **filter_)
        grads = torch.randn(16, generator=torch.Generator().manual_seed(seed)), torch.full((16,), 0.5)
        ours = run_ours(hidden, weight[shard], tokens, *grads, tp_group=group, workspace_bytes=1, **kw)
        ref = run_reference(hidden, weight, tokens, *grads, **kw)
        assert_matches(ours, (*ref[:3], ref[3][shard], ref[4]), TOLERANCE[torch.float32])


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_float64_reference(world):
    run_distributed(tensor_parallel_checks, world)


def test_ranks_must_agree_on_the_filter():
    run_distributed(disagreeing_ranks, 2)


def disagreeing_ranks(rank, world):
    hidden, weight, tokens = make_inputs(6, 8, 2 * 50, scale=2.0)
    shard = weight[rank * 50:(rank + 1) * 50]
    for name, values in [("top_k", [5, 6]), ("top_p", [0.9, None])]:
        with pytest.raises(ValueError, match=f"disagree on the {name}"):
            fused_rl_ops.chosen_logprob(hidden, shard, tokens, tp_group=dist.group.WORLD, **{name: values[rank]})
