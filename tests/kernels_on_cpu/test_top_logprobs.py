"""top_logprobs' CUDA row kernel on the CPU (tests/helpers/kernels_on_cpu.py), against float64:
top_logprobs_stats_top_ids_rows_kernel (top_logprobs/kernel.cuh), each row's softmax partial and its
top of k logits with their ids in one read of a chunk."""
import math

import pytest
import torch

from tests.helpers.kernels_on_cpu import (Buf, assert_passes, assert_within, drivers, logit_map_scalars,  # noqa: F401
                                    lse_entropy64, pytestmark, run_case, running_stats, stats_tolerance)

WIDTH = 4  # columns per lane and access on the vector path (kTopIdsWidth)
NO_ID = 2**63 - 1  # a placeholder's id (kNoId)


def run_chunks(drivers, tmp_path, chunks, K, passes, temperature, softcap=None, offset=0):
    """The kernel given the chunks in turn (global ids [0, C), [C, 2C), ...), from placeholder tops
    and running stats (rows 0..N/2 from an earlier chunk, the rest none yet); checks the launch's
    passes and width. Returns (stats, top values, top ids, the earlier logits, which rows had them)."""
    N, C = chunks[0].shape
    earlier = torch.randn(N, 30, dtype=torch.float64) * 3
    has_earlier = torch.arange(N) < N // 2
    stats = running_stats(earlier, has_earlier)[:, :3].contiguous()
    top, ids = torch.full((N, K), -math.inf), torch.full((N, K), NO_ID)
    for i, logits in enumerate(chunks):
        out, [launch] = run_case(drivers, "top_logprobs", "stats_top_ids_rows",
                                 {"logits": Buf(logits, offset), "stats": Buf(stats), "top": Buf(top),
                                  "top_ids": Buf(ids)},
                                 {"N": N, "C": C, "K": K, "col0": i * C, **logit_map_scalars(temperature, softcap)},
                                 passes=passes, tmp_dir=tmp_path / str(i))
        assert_passes(launch, N, passes, rows_per_block=launch.block[0] // 32)  # a warp per row
        vector = C % WIDTH == 0 and offset % WIDTH == 0
        assert launch.template_args[-1] == str(WIDTH if vector else 1), launch
        stats, top, ids = out["stats"], out["top"], out["top_ids"]
    return stats.double(), top, ids, earlier, has_earlier


def mapped64(logits, temperature, softcap):
    x = logits.double()
    return (softcap * torch.tanh(x / softcap) if softcap else x) / temperature


@pytest.mark.parametrize("N,C,K,passes", [
    (21, 45, 5, "several"),   # the scalar path, a lane tail
    (21, 45, 5, "one"),
    (9, 7, 12, "one"),        # fewer columns than lanes and than the top
    (40, 200, 64, "several"),  # 50 packs, k > 32
    (8, 520, 40, "one"),      # 130 packs: 4 rounds of the warp and 2 packs
    (12, 96, 600, "several"),  # a top wider than shared memory holds: in global memory
])
def test_stats_top_ids_rows(drivers, tmp_path, N, C, K, passes):
    """Two chunks: the K first logits in the order (descending, the lower id first), with ties across
    the chunks (values on a coarse grid), a NaN (never taken), a row of equal logits and a row of
    -inf; and the rows' stats over the earlier chunk and both."""
    temperature = 0.5
    chunks = [torch.randint(-6, 7, (N, C)).float() * 0.5 for _ in range(2)]
    chunks[0][0, 3] = math.nan
    chunks[0][1] = chunks[1][1] = 1.0
    chunks[0][2] = chunks[1][2] = -math.inf
    stats, top, ids, earlier, has_earlier = run_chunks(drivers, tmp_path, chunks, K, passes, temperature)
    z = mapped64(torch.cat(chunks, 1), temperature, None)
    for r in range(N):
        ordered = sorted(((-float(v), c) for c, v in enumerate(z[r].tolist()) if not math.isnan(v)))[:K]
        ordered += [(math.inf, NO_ID)] * (K - len(ordered))
        got = sorted(zip((-top[r]).tolist(), ids[r].tolist()))
        assert got == ordered, f"row {r}: top ids"
    seen = torch.where(has_earlier[:, None], torch.cat([earlier, z], 1),
                       torch.cat([torch.full_like(earlier, -math.inf), z], 1))
    lse, ent = lse_entropy64(seen[3:])
    tol = stats_tolerance(2 * C / 32 + 9, float(seen[seen.isfinite()].abs().max()))
    assert_within(stats[3:, 0] + stats[3:, 1].log(), lse, tol, "lse")
    assert_within(stats[3:, 1].log() - stats[3:, 2] / stats[3:, 1], ent, tol, "entropy")
    assert stats[0].isnan().all()


@pytest.mark.parametrize("C,offset", [(520, 0), (520, 1)])
def test_stats_top_ids_rows_softcapped(drivers, tmp_path, C, offset):
    """Distinct logits through a softcap, aligned for the vector path or one element off it (the
    scalar path): the same top and stats either way, against float64."""
    N, K, temperature, softcap = 11, 20, 0.7, 4.0
    chunks = [torch.randn(N, C) * 3]
    stats, top, ids, earlier, has_earlier = run_chunks(drivers, tmp_path, chunks, K, "several", temperature,
                                                       softcap, offset)
    z = mapped64(chunks[0], temperature, softcap)
    expected = z.topk(K, 1).indices.sort(1).values
    assert torch.equal(ids.sort(1).values, expected), "top ids"
    seen = torch.where(has_earlier[:, None], torch.cat([earlier, z], 1),
                       torch.cat([torch.full_like(earlier, -math.inf), z], 1))
    lse, ent = lse_entropy64(seen)
    # tanh's fp32 error on top of the sums': a few ulp of |z| <= softcap / temperature.
    tol = stats_tolerance(C / 32 + 9, float(seen.abs().max())) + 1e-5
    assert_within(stats[:, 0] + stats[:, 1].log(), lse, tol, "lse")
    assert_within(stats[:, 1].log() - stats[:, 2] / stats[:, 1], ent, tol, "entropy")
