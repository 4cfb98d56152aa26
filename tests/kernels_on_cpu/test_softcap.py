"""chosen_logprob's CUDA row kernels with a softcap, executed on the CPU by the kernels-on-CPU
harness (tests/helpers/kernels_on_cpu.py: its drivers, builds and sanitizers): the stats and grad
kernels on raw logits x, z = c tanh(x / c) / T, against float64, with several grid-stride passes
and one, column tails, saturated and non-finite logits; and without a softcap the kernels launch without
tanh. The row kernels read the fp32 logits the GEMMs write for every input dtype, so fp32 is their
only dtype."""
import math

import pytest
import torch

from tests.helpers.kernels_on_cpu import (FP32_EPS, Buf, assert_within, combined_stats64, drivers,  # noqa: F401
                                    logit_grads64, logit_map_scalars, lse_entropy64, pytestmark, run_case,
                                    run_grad_rows, run_stats_rows, running_stats, stats_tolerance)

COL0 = 100  # the chunk holds global ids [COL0, COL0 + C)
STATS_SHAPES = [
    (21, 45, "several"),  # 3 tiles of 8 rows on one block, a lane tail
    (21, 45, "one"),      # 3 blocks, the last with 3 idle warps
    (13, 7, "several"),   # fewer columns than lanes
    (8, 96, "one"),       # one full block, C a multiple of the warp
]
GRAD_SHAPES = [
    (20, 45, "several"),  # block (64, 4): 5 row tiles on one block, a column tail
    (20, 45, "one"),
    (9, 300, "several"),  # block (256, 1): two column passes per row
    (33, 3, "one"),       # block (4, 64): a partial row tile
]


def capped64(x, softcap, temperature):
    return softcap * torch.tanh(x.double() / softcap) / temperature


def raw_logits(N, C, softcap, nonfinite, seed=0):
    """Raw logits from well inside tanh's linear part to 20 caps out, the last row 40 caps out
    (saturated); with nonfinite, row 0 NaN at one column, row 1 +inf, row 2 -inf, row 3 all +-inf."""
    g = torch.Generator().manual_seed(seed)
    scale = softcap * 10.0 ** (torch.rand(N, 1, generator=g) * 2.3 - 1)  # 0.1 to 20 caps
    x = torch.randn(N, C, generator=g) * scale
    x[-1] = 40 * softcap * x[-1].sign()
    if nonfinite:
        x[0, C // 2], x[1, 0], x[2, C - 1] = math.nan, math.inf, -math.inf
        x[3] = torch.where(torch.arange(C) % 2 == 0, math.inf, -math.inf)
    return x


def tokens_for(N, C, x):
    """The chunk's first and last column, just outside it on both sides, ignore_index, then each
    row's largest raw logit (a greedy pick, whose chosen logit must equal the row max exactly)."""
    tokens = COL0 + x.nan_to_num(nan=-math.inf).argmax(1)
    tokens[4:9] = torch.tensor([COL0, COL0 + C - 1, COL0 - 1, COL0 + C, -100])[: max(0, min(5, N - 4))]
    return tokens


@pytest.mark.parametrize("N,C,passes", STATS_SHAPES)
@pytest.mark.parametrize("softcap,temperature", [(1.5, 0.7), (30.0, 1.0)])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_stats_rows_with_softcap(drivers, tmp_path, N, C, passes, softcap, temperature, nonfinite):  # noqa: F811
    x = raw_logits(N, C, softcap, nonfinite)
    tokens = tokens_for(N, C, x)
    earlier = torch.randn(N, 30, dtype=torch.float64) * 3  # an earlier chunk's capped logits (rows 0..N/2)
    has_earlier = torch.arange(N) < N // 2
    stats = running_stats(earlier, has_earlier)
    got = run_stats_rows(drivers, tmp_path, x, tokens, stats, COL0, temperature, passes, softcap=softcap)

    z = capped64(x, softcap, temperature)
    seen = torch.where(has_earlier[:, None], torch.cat([earlier, z], 1),
                       torch.cat([torch.full_like(earlier, -math.inf), z], 1))
    lse, ent = lse_entropy64(seen)
    zmax = float(seen[seen.isfinite()].abs().max())
    # The kernel's own z: tanhf within 2 ulp and two products, a few fp32 ulps of zmax per logit.
    tol = stats_tolerance(C / 32 + 9, zmax) + 8 * FP32_EPS * zmax * (2 + 2 * zmax)
    assert_within(got[:, 0] + got[:, 1].log(), lse, tol, "lse")
    assert_within(got[:, 1].log() - got[:, 2] / got[:, 1], ent, tol, "entropy")
    inside = (tokens >= COL0) & (tokens < COL0 + C)
    expected_chosen = stats[:, 3].double().clone()
    expected_chosen[inside] = z[inside.nonzero()[:, 0], tokens[inside] - COL0]
    assert_within(got[:, 3], expected_chosen, 4 * FP32_EPS * zmax, "chosen")
    assert torch.equal(got[~inside, 3], stats[~inside, 3].double())
    # A greedy pick's chosen logit is the row maximum bit for bit (return_is_max compares them),
    # where this chunk holds the maximum.
    greedy = torch.zeros(N, dtype=torch.bool)
    greedy[9:] = True
    greedy &= ~has_earlier & x.isfinite().all(1)
    assert torch.equal(got[greedy, 3], got[greedy, 0])
    if nonfinite:
        assert got[0].isnan()[:3].all() and got[1:4, :3].isfinite().all()  # a capped +-inf is finite


def grad_reference(x, tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge, softcap, temperature):
    """float64 d(gl logprob + ge entropy)/dx from the fp32 per-row values, through z = c tanh(x / c) / T
    (dz/dx = 1 / (T cosh^2(x / c))), and its tolerance: logit_grads64's fp32 roundings with the
    kernel's z off by a few ulps of c / T, and the slope's exp (relative 2 |x / c| + 8 ulps,
    above fp32's normals: 1e-36 absolute)."""
    d, scale = logit_grads64(capped64(x, softcap, temperature), tokens, row_max, log_sum, log_sum_minus_entropy, gl,
                             ge, COL0, z_error=4 * softcap / temperature)
    u = x.double() / softcap
    slope = 1 / (temperature * torch.cosh(u) ** 2)
    u_f = torch.where(u.isfinite(), u, 0.0)
    tol = 8 * FP32_EPS * scale * slope + (d * slope).abs() * (2 * u_f.abs() + 8) * FP32_EPS + 1e-36
    return d * slope, tol.nan_to_num(nan=0.0)


@pytest.mark.parametrize("N,C,passes", GRAD_SHAPES)
@pytest.mark.parametrize("softcap,temperature", [(1.5, 1.3), (30.0, 1.0)])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_grad_rows_with_softcap(drivers, tmp_path, N, C, passes, softcap, temperature, nonfinite):  # noqa: F811
    x = raw_logits(N, C, softcap, nonfinite, seed=1)
    tokens = tokens_for(N, C, x)
    z = capped64(x, softcap, temperature)
    # Per-row values over this chunk and others (z - m computed against a larger vocabulary).
    row_max, log_sum, ent = combined_stats64(torch.cat([z, torch.randn(N, 50, dtype=torch.float64)], 1))
    log_sum_minus_entropy = log_sum - ent
    gl, ge = torch.randn(N), torch.randn(N)
    got, _ = run_grad_rows(drivers, tmp_path, x.clone(), tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge, COL0,
                           temperature, passes, softcap=softcap)
    expected, tol = grad_reference(x, tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge, softcap, temperature)
    assert_within(got, expected, tol, "raw-logit gradients")
    saturated = (x.double() / softcap).abs() > 15
    saturated &= x.isfinite() & row_max.isfinite()[:, None]  # rows with a NaN logit are NaN throughout
    assert saturated.any() and (got[saturated].abs() < 1e-10).all()
    if nonfinite:
        assert got[0].isnan().all() and got[1, 0] == 0 and got[2, C - 1] == 0 and got[3].eq(0).all()


@pytest.mark.parametrize("kernel", ["stats_rows", "grad_rows"])
def test_no_softcap_launches_the_kernel_without_tanh(drivers, tmp_path, kernel):  # noqa: F811
    N, C = 5, 40
    x = torch.randn(N, C) * 3
    tokens = tokens_for(N, C, x)
    per_row = {"stats": Buf(torch.zeros(N, 4))} if kernel == "stats_rows" else {
        name: Buf(torch.zeros(N)) for name in ("row_max", "log_sum", "log_sum_minus_entropy", "gl", "ge")}
    names = []
    for softcap in (None, 2.0):
        case_dir = tmp_path / f"softcap{softcap}"
        case_dir.mkdir()
        _, [launch] = run_case(drivers, "chosen_logprob", kernel, {"logits": Buf(x), "tokens": Buf(tokens), **per_row},
                               {"N": N, "C": C, "col0": COL0, **logit_map_scalars(0.9, softcap), "in_place": 1},
                               tmp_dir=case_dir)
        names.append(launch.template_args[0])
    assert names == ["fused_rl_ops::PlainLogit<float>", "fused_rl_ops::SoftcappedLogit<float>"]
