"""chosen_logprob's kernels for the sampler's filter (top_k, top_p) on the CPU
(tests/helpers/kernels_on_cpu.py), against float64: top_rows (a row's top of its K largest logits),
hist_rows (the masses of a search window's logits in bins), and the thresholds stats_rows and
grad_rows take (csrc/chosen_logprob/sampler_filter.h)."""
import math

import pytest
import torch

from fused_rl_ops._vocab_parallel.sampler_filter import SEARCH_BINS, TOP_HEADER
from tests.helpers.kernels_on_cpu import (Buf, assert_passes, assert_within, combined_stats64, drivers,  # noqa: F401
                                    grad_rows_reference, logit_map_scalars, lse_entropy64, pytestmark, run_case,
                                    run_grad_rows, run_stats_rows, running_stats, stats_tolerance)

FP32_INV = {0.7: float(torch.tensor(1 / 0.7, dtype=torch.float32)), 1.0: 1.0}


def tied_logits(N, C, seed=0):
    """[N, C] logits in steps of 1/4 (many ties, exact in fp32 after a temperature of 1), a -inf and a
    NaN row among them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-12, 12, (N, C), generator=g).float() / 4
    logits[1, :: 3] = -math.inf
    return logits


def top_of(values, K):
    """float64 reference of a row's top: (seen, held, ties, sorted values held) of a 1-d tensor."""
    ordered = values.sort(descending=True).values
    held = min(K, len(values))
    kept = ordered[:held]
    ties = int((ordered[held:] == kept[-1]).sum()) if held == K and len(values) > K else 0
    return len(values), held, ties, kept


def run_top_rows(drivers, tmp_path, logits, top, K, temperature, passes, threshold=None, window=None, softcap=None):
    """chosen_logprob_top_rows_kernel giving logits [N, C] to top [N, TOP_HEADER + K]; returns the tops
    (in a new folder of tmp_path each call)."""
    N, C = logits.shape
    tmp_path = tmp_path / f"top_rows_{len(list(tmp_path.iterdir()))}"
    tmp_path.mkdir()
    buffers = {"logits": Buf(logits), "top": Buf(top)}
    if threshold is not None:
        buffers["threshold"] = Buf(threshold)
    if window is not None:
        buffers["window"] = Buf(window)
    out, [launch] = run_case(drivers, "chosen_logprob", "top_rows", buffers,
                             {"N": N, "C": C, "K": K, **logit_map_scalars(temperature, softcap)},
                             passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=launch.block[0] // 32)  # a warp per row
    return out["top"]


def check_top(got, earlier, given, K):
    """A row's top after earlier values (1-d float64) were given, then `given`: counts exact, the
    values held the K largest of both (sorted, exactly) and the heap's root the smallest."""
    seen, held, ties, kept = top_of(torch.cat([earlier, given]), K)
    assert got[:TOP_HEADER].tolist() == [seen, held, ties], (got[:TOP_HEADER].tolist(), [seen, held, ties])
    values = got[TOP_HEADER:TOP_HEADER + held].double()
    assert torch.equal(values.sort(descending=True).values, kept), "top values"
    assert values[0] == kept[-1], "the heap's root is its smallest"


def top_state(values, K):
    """A top holding values (float64, given in order), as a row's top column: the heap built by the
    same pushes (a sorted ascending array is a valid min-heap)."""
    seen, held, ties, kept = top_of(values, K)
    row = torch.zeros(TOP_HEADER + K)
    row[:TOP_HEADER] = torch.tensor([seen, held, ties], dtype=torch.float32)
    row[TOP_HEADER:TOP_HEADER + held] = kept.flip(0).float()
    return row


@pytest.mark.parametrize("N,C,K,passes", [
    (21, 45, 5, "several"),   # 3 tiles of 8 rows on one block; a lane tail
    (21, 45, 5, "one"),
    (9, 70, 64, "one"),       # K between two chunks' worth of columns
    (10, 7, 20, "several"),   # fewer columns than K and than lanes
])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_rows(drivers, tmp_path, N, C, K, passes, temperature):
    """Every logit given to tops that already hold an earlier chunk's (even rows) or none (odd
    rows): ties, -inf logits, K beyond the row."""
    logits = tied_logits(N, C)
    g = torch.Generator().manual_seed(1)
    earlier = [torch.randint(-12, 12, (int(torch.randint(0, 2 * K, (1,), generator=g)),), generator=g).double() / 4
               if r % 2 == 0 else torch.zeros(0, dtype=torch.float64) for r in range(N)]
    top = torch.stack([top_state(e, K) for e in earlier])
    got = run_top_rows(drivers, tmp_path, logits, top, K, temperature, passes)
    z = (logits * FP32_INV[temperature]).double()  # the kernel's fp32 product, exactly
    for r in range(N):
        check_top(got[r], earlier[r], z[r], K)


@pytest.mark.parametrize("passes", ["several", "one"])
def test_top_rows_threshold_and_window(drivers, tmp_path, passes):
    """Only the logits at or above the row's threshold, or inside its search window (cells j = hi -
    floor(z sigma) in [0, SEARCH_BINS); sigma 0: the row is skipped), are given; a NaN is in no
    window."""
    N, C, K = 12, 100, 8
    logits = torch.randn(N, C) * 3
    threshold = torch.randn(N)
    threshold[0] = -math.inf
    got = run_top_rows(drivers, tmp_path, logits, torch.zeros(N, TOP_HEADER + K), K, 1.0, passes, threshold=threshold)
    nothing = torch.zeros(0, dtype=torch.float64)
    for r in range(N):
        z = logits[r].double()
        check_top(got[r], nothing, z[z >= threshold[r].double()], K)
    # Windows of 512 cells of 2^-13 above or below a logit, of cells of 1/16 below the row's
    # largest, and none (row 5).
    logits[4, 7] = math.nan
    window = torch.zeros(N, 2, dtype=torch.float64)
    for r in range(N):
        sigma = 16.0 if r % 3 == 0 else 2.0**13
        hi = math.floor(float(logits[r].max()) * sigma) if r % 3 == 0 else math.floor(float(logits[r, r]) * sigma)
        window[r] = torch.tensor([0.0 if r == 5 else sigma, hi + (SEARCH_BINS - 1 if r % 3 == 1 else 0)])
    got = run_top_rows(drivers, tmp_path, logits, torch.zeros(N, TOP_HEADER + K), K, 1.0, passes, window=window)
    for r in range(N):
        z = logits[r].double()
        sigma, hi = window[r].tolist()
        if sigma == 0:
            assert got[r].eq(0).all()
            continue
        cell = hi - torch.floor(z * sigma)
        check_top(got[r], nothing, z[(cell >= 0) & (cell < SEARCH_BINS)], K)


def run_hist_rows(drivers, tmp_path, logits, row_max, window, hist, temperature, passes, softcap=None):
    N, C = logits.shape
    out, [launch] = run_case(drivers, "chosen_logprob", "hist_rows",
                             {"logits": Buf(logits), "row_max": Buf(row_max), "window": Buf(window),
                              "hist": Buf(hist)},
                             {"N": N, "C": C, **logit_map_scalars(temperature, softcap)},
                             passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=1)  # a block per row
    return out["hist"]


def check_hist_rows(drivers, tmp_path, logits, sigma, temperature, passes):
    """hist_rows over logits [N, C] with windows of spacing 1 / sigma[r] (0: no window) just above
    each row's largest logit, added to an earlier chunk's histogram: each logit's mass exp(z - m) in
    units of 2^-40 (fp32 exp, then rounded) in the bin of its cell; rows without a window unchanged."""
    N, C = logits.shape
    inv = FP32_INV[temperature]
    z = (logits * inv).double()
    row_max = (z.max(1).values + torch.rand(N, dtype=torch.float64)).float()  # other chunks may hold it
    hi = torch.floor(z.max(1).values * sigma)
    window = torch.stack([sigma, hi], 1)
    earlier = torch.randint(0, 2**40, (N, SEARCH_BINS))
    got = run_hist_rows(drivers, tmp_path, logits, row_max, window, earlier.clone(), temperature, passes)

    expected, tol = earlier.double().clone(), torch.zeros(N, SEARCH_BINS, dtype=torch.float64)
    for r in range(N):
        if sigma[r] == 0:
            assert torch.equal(got[r], earlier[r])
            continue
        cell = hi[r] - torch.floor(z[r] * sigma[r])
        inside = (cell >= 0) & (cell < SEARCH_BINS)
        shifted = z[r][inside] - row_max[r].double()
        mass = torch.exp(shifted) * 2.0**40
        expected[r].index_add_(0, cell[inside].long(), mass)
        # Per logit: z - m rounded to fp32 (|z - m| eps / 2 absolute), fp32 exp (a few ulp) and the
        # rounding to a unit.
        tol[r].index_add_(0, cell[inside].long(), mass * (shifted.abs() + 4) * 2.0**-23 + 0.5)
    assert_within(got.double(), expected, tol, "search histogram")


@pytest.mark.parametrize("N,C,passes", [(5, 300, "several"), (5, 300, "one"), (3, 1000, "one"), (7, 9, "several")])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hist_rows(drivers, tmp_path, N, C, passes, temperature):
    """Windows of cells of 1/16 (row 1: 512 cells of 2^-9 below its largest logit; the last row: no
    window), -inf logits in row 0."""
    logits = torch.randn(N, C) * 4
    logits[0, :20] = -math.inf
    sigma = torch.where(torch.arange(N) == N - 1, 0.0, 16.0).double()
    sigma[1] = 2.0**9
    check_hist_rows(drivers, tmp_path, logits, sigma, temperature, passes)


@pytest.mark.parametrize("C,passes", [(300, "several"), (1000, "one"), (45, "one")])
def test_hist_rows_hot_bins(drivers, tmp_path, C, passes):
    """Many lanes of a warp in one bin (the warp's sum per bin): tied logits in steps of 1/4 and
    windows of cells of 4 (rows 0-1: every logit of the window in a handful of bins), 1 (row 2) and
    1/4 (row 3: a bin per distinct value); row 1's -inf logits in no window."""
    logits = tied_logits(4, C, seed=C)
    sigma = torch.tensor([0.25, 0.25, 1.0, 4.0], dtype=torch.float64)
    check_hist_rows(drivers, tmp_path, logits, sigma, 1.0, passes)


# ---------------------------------------------------------------------------------------------
# stats_rows and grad_rows with the tokens' thresholds


@pytest.mark.parametrize("N,C,passes", [(21, 45, "several"), (8, 96, "one")])
def test_stats_rows_threshold(drivers, tmp_path, N, C, passes):
    """The partials of the logits at or above each row's threshold (-inf: all; above the chunk's
    largest: none, the empty partial), merged into earlier stats."""
    col0, temperature = 100, 0.7
    inv = FP32_INV[temperature]
    logits = torch.randn(N, C) * 3
    tokens = torch.randint(col0, col0 + C, (N,))
    z = (logits * inv).double()
    threshold = (z.quantile(0.7, dim=1) + 0.01).float()
    threshold[0], threshold[1] = -math.inf, float(z[1].max()) + 1  # all kept; none kept
    earlier = torch.randn(N, 30, dtype=torch.float64) * 3
    has_earlier = torch.arange(N) % 2 == 0
    stats = running_stats(earlier, has_earlier)
    got = run_stats_rows(drivers, tmp_path, logits, tokens, stats, col0, temperature, passes, threshold=threshold)
    kept = torch.where(z < threshold.double()[:, None], -math.inf, z)
    seen = torch.cat([torch.where(has_earlier[:, None], earlier, -math.inf), kept], 1)
    lse, ent = lse_entropy64(seen)
    tol = stats_tolerance(C / 32 + 9, float(seen[seen.isfinite()].abs().max()))
    assert_within(got[:, 0] + got[:, 1].log(), lse, tol, "lse")
    assert_within(got[:, 1].log() - got[:, 2] / got[:, 1], ent, tol, "entropy")
    assert torch.equal(got[1, :3].float(), stats[1, :3])  # row 1 keeps nothing of this chunk


@pytest.mark.parametrize("N,C,passes", [(20, 45, "several"), (9, 300, "one")])
def test_grad_rows_threshold(drivers, tmp_path, N, C, passes):
    """A logit below its row's threshold passes no gradient (the chosen one keeps gl, which
    chosen_logprob zeroes for a token outside the kept set); the others as without a filter, from
    the kept set's log-sum and entropy."""
    col0, temperature = 64, 1.0
    logits = torch.randn(N, C) * 3
    tokens = torch.randint(col0, col0 + C, (N,))
    z = logits.double()
    threshold = z.quantile(0.8, dim=1).float()
    threshold[0] = -math.inf
    kept = torch.where(z < threshold.double()[:, None], -math.inf, z)
    row_max, log_sum, ent = combined_stats64(kept)
    gl, ge = torch.randn(N), torch.randn(N)
    out, _ = run_grad_rows(drivers, tmp_path, logits, tokens, row_max, log_sum, log_sum - ent, gl, ge, col0,
                           temperature, passes, threshold=threshold)
    expected, tol = grad_rows_reference(logits, tokens, row_max, log_sum, log_sum - ent, gl, ge, col0, 1.0)
    dropped = z < threshold.double()[:, None]
    chosen = torch.zeros(N, C, dtype=torch.bool)
    chosen[torch.arange(N), tokens - col0] = True
    expected = torch.where(dropped, 0.0, expected) + torch.where(dropped & chosen, gl.double()[:, None], 0.0)
    assert_within(out, expected, tol, "logit gradients")
    assert out[dropped & ~chosen].eq(0).all()
