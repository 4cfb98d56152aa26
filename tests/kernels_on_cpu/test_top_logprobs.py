"""top_logprobs' CUDA row kernels on the CPU (tests/helpers/kernels_on_cpu.py), against float64: the
shared softmax-stats kernel as its launcher calls it (no tokens) and top_ids_rows."""
import math

import pytest
import torch

from tests.helpers.kernels_on_cpu import (Buf, assert_passes, assert_within, drivers, logit_map_scalars,  # noqa: F401
                                    lse_entropy64, pytestmark, run_case, running_stats, stats_tolerance)


@pytest.mark.parametrize("N,C,passes", [(21, 45, "several"), (8, 96, "one")])
def test_stats_rows_without_tokens(drivers, tmp_path, N, C, passes):
    """Rows of 3 columns (m, s, t), merged into running stats (rows 0..N/2) or empty ones; a softcap."""
    temperature, softcap = 0.7, 4.0
    logits = torch.randn(N, C) * 3
    earlier = torch.randn(N, 30, dtype=torch.float64) * 3
    has_earlier = torch.arange(N) < N // 2
    stats = running_stats(earlier, has_earlier)[:, :3].contiguous()
    out, [launch] = run_case(drivers, "top_logprobs", "stats_rows", {"logits": Buf(logits), "stats": Buf(stats)},
                             {"N": N, "C": C, "col0": 0, **logit_map_scalars(temperature, softcap)}, passes=passes,
                             tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=launch.block[0] // 32)
    got = out["stats"].double()
    z = (softcap * torch.tanh(logits.double() / softcap)) / temperature
    seen = torch.where(has_earlier[:, None], torch.cat([earlier, z], 1),
                       torch.cat([torch.full_like(earlier, -math.inf), z], 1))
    lse, ent = lse_entropy64(seen)
    # tanh's fp32 error on top of the sums': a few ulp of |z| <= softcap / temperature.
    tol = stats_tolerance(C / 32 + 9, float(seen[seen.isfinite()].abs().max())) + 1e-5
    assert_within(got[:, 0] + got[:, 1].log(), lse, tol, "lse")
    assert_within(got[:, 1].log() - got[:, 2] / got[:, 1], ent, tol, "entropy")


@pytest.mark.parametrize("N,C,K,passes", [(21, 45, 5, "several"), (21, 45, 5, "one"), (9, 7, 12, "one"),
                                          (40, 200, 64, "several")])
def test_top_ids_rows(drivers, tmp_path, N, C, K, passes):
    """Two chunks given in turn (global ids [0, C) and [C, 2C)) to tops starting as placeholders:
    the K first logits in the order (descending, the lower id first), with ties across the chunks
    (values on a coarse grid), a NaN (never taken), a row of equal logits and a row of -inf."""
    temperature = 0.5
    chunks = [torch.randint(-6, 7, (N, C)).float() * 0.5 for _ in range(2)]
    chunks[0][0, 3] = math.nan
    chunks[0][1] = chunks[1][1] = 1.0
    chunks[0][2] = chunks[1][2] = -math.inf
    top, ids = torch.full((N, K), -math.inf), torch.full((N, K), 2**63 - 1)
    for i, logits in enumerate(chunks):
        out, [launch] = run_case(drivers, "top_logprobs", "top_ids_rows",
                                 {"logits": Buf(logits), "top": Buf(top), "top_ids": Buf(ids)},
                                 {"N": N, "C": C, "K": K, "col0": i * C, **logit_map_scalars(temperature)},
                                 passes=passes, tmp_dir=tmp_path / str(i))
        assert_passes(launch, N, passes, rows_per_block=launch.block[0] // 32)
        top, ids = out["top"], out["top_ids"]
    z = torch.cat(chunks, 1) / temperature
    for r in range(N):
        ordered = sorted(((-float(v), c) for c, v in enumerate(z[r].tolist()) if not math.isnan(v)))[:K]
        got = sorted(zip((-top[r]).tolist(), ids[r].tolist()))
        assert got == ordered, f"row {r}: top ids"
