"""chosen_logprob's CUDA row kernels on the CPU (tests/helpers/kernels_on_cpu.py), against float64."""
import math

import pytest
import torch

from tests.helpers.kernels_on_cpu import (FP32_EPS, HALF_DTYPES, ULP, Buf, assert_passes, assert_within,  # noqa: F401
                                    combined_stats64, drivers, grad_rows_reference, lse_entropy64, nonfinite_logits,
                                    pytestmark, row_stats64, run_case, run_grad_rows, run_stats_rows, running_stats,
                                    stats_tolerance)


# ---------------------------------------------------------------------------------------------
# chosen_logprob: chosen_logprob_{stats_rows,grad_rows,combine}_kernel (chosen_logprob/kernel.cuh)


def check_stats_rows(drivers, tmp_path, logits, temperature, passes, offset=0):
    """stats_rows merging logits [N, C] (raw) into running stats, against float64: lse and entropy
    within stats_tolerance, the chosen logit exact."""
    N, C = logits.shape
    col0 = 100  # the chunk holds global ids [100, 100 + C)
    inv_temp = float(torch.tensor(1 / temperature, dtype=torch.float32))
    # Tokens at the chunk's first and last column, just outside it on both sides, an ignore_index
    # and random ids inside.
    tokens = torch.randint(col0, col0 + C, (N,))
    tokens[:5] = torch.tensor([col0, col0 + C - 1, col0 - 1, col0 + C, -100])
    # Running stats from an earlier chunk (rows 0..N/2) or none yet (the rest): the merge.
    earlier = torch.randn(N, 30, dtype=torch.float64) * 3
    has_earlier = torch.arange(N) < N // 2
    stats = running_stats(earlier, has_earlier)
    got = run_stats_rows(drivers, tmp_path, logits, tokens, stats, col0, temperature, passes, offset=offset)

    z = (logits * inv_temp).double()  # the kernel's fp32 product, exactly
    seen = torch.where(has_earlier[:, None], torch.cat([earlier, z], 1),
                       torch.cat([torch.full_like(earlier, -math.inf, dtype=torch.float64), z], 1))
    lse, ent = lse_entropy64(seen)
    got_lse = got[:, 0] + got[:, 1].log()
    got_ent = got[:, 1].log() - got[:, 2] / got[:, 1]
    tol = stats_tolerance(C / 32 + 5 + 4, float(seen[seen.isfinite()].abs().max()))
    assert_within(got_lse, lse, tol, "lse")
    assert_within(got_ent, ent, tol, "entropy")
    # The chosen logit: the kernel's fp32 z[target] exactly where the token is in the chunk, else
    # the earlier value untouched.
    inside = (tokens >= col0) & (tokens < col0 + C)
    expected_chosen = stats[:, 3].clone()
    expected_chosen[inside] = (logits * inv_temp)[inside.nonzero()[:, 0], tokens[inside] - col0]
    assert torch.equal(got[:, 3].float(), expected_chosen)


@pytest.mark.parametrize("N,C,passes", [
    (21, 45, "several"),  # 3 tiles of 8 rows on 1 block; C: a lane tail (the scalar path)
    (21, 45, "one"),      # 3 blocks, the last with 3 idle warps
    (8, 96, "one"),       # one full block; 24 packs of 4 (the vector path)
    (13, 7, "several"),   # fewer columns than lanes (a short last chunk)
    (21, 100, "several"),  # 25 packs: lanes 25-31 idle
    (9, 520, "one"),      # 130 packs: 4 rounds of the warp and 2 packs
])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chosen_logprob_stats_rows(drivers, tmp_path, N, C, passes, temperature):
    check_stats_rows(drivers, tmp_path, torch.randn(N, C) * 3, temperature, passes)


@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("C,offset", [(520, 0), (520, 1), (45, 0)])
def test_chosen_logprob_stats_rows_online(drivers, tmp_path, order, C, offset):
    """Rows in ascending order raise each lane's running maximum at every access (each rescales
    the sums), descending ones never after the first; the logits off the vector's alignment take
    the scalar path."""
    logits = (torch.randn(11, C) * 4).sort(1, descending=order == "descending").values
    check_stats_rows(drivers, tmp_path, logits, 0.7, "several", offset=offset)


@pytest.mark.parametrize("N,C,passes", [
    (20, 45, "several"),  # block (64, 4): 5 row tiles on one block, a column tail
    (20, 45, "one"),
    (9, 300, "several"),  # block (256, 1): two column passes per row
    (33, 3, "one"),       # block (4, 64): a partial row tile
])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_chosen_logprob_grad_rows(drivers, tmp_path, N, C, passes, temperature):
    col0 = 64
    inv_temp = float(torch.tensor(1 / temperature, dtype=torch.float32))
    logits = torch.randn(N, C) * 3
    tokens = torch.randint(col0, col0 + C, (N,))
    tokens[:5] = torch.tensor([col0, col0 + C - 1, col0 - 1, col0 + C, -100])
    z = (logits * inv_temp).double()
    # The row max and log-sum (relative to it) over a vocabulary larger than the chunk (other chunks
    # and ranks), and log_sum - entropy, as chosen_logprob's backward passes them.
    row_max, log_sum, ent = combined_stats64(torch.cat([z, torch.randn(N, 50, dtype=torch.float64)], 1))
    log_sum_minus_entropy = log_sum - ent
    gl, ge = torch.randn(N), torch.randn(N)
    out, _ = run_grad_rows(drivers, tmp_path, logits, tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge, col0,
                           temperature, passes)
    expected, tol = grad_rows_reference(logits, tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge, col0, inv_temp)
    assert_within(out, expected, tol, "logit gradients")


# grad_rows into the gradient GEMMs' buffer (CUDA: a group of chunks' gradients in the inputs' dtype):
# (N, C, the buffer's row stride, the chunk's first column in it, the logits' and the buffer's
# elements past a 16-byte boundary, grid-stride passes, the path the launcher must take).
GRAD_BUFFER_CASES = [
    (20, 64, 128, 64, (0, 0), "one", "vector"),       # a group's second chunk; 2 blocks of 16 row tiles
    (20, 64, 64, 0, (0, 0), "several", "vector"),     # a group of one chunk; 2 row tiles on one block
    (3, 1100, 1104, 4, (0, 0), "several", "vector"),  # 275 packs a row: a second, partial column pass
    (33, 4, 8, 4, (0, 0), "one", "vector"),           # one pack a row, a partial row tile
    (20, 45, 96, 48, (0, 0), "one", "scalar"),        # C not a whole number of packs
    (20, 64, 130, 64, (0, 0), "one", "scalar"),       # rows of the buffer off the pack's alignment
    (20, 64, 128, 2, (0, 0), "one", "scalar"),        # the chunk's columns off it
    (20, 64, 128, 64, (1, 0), "one", "scalar"),       # the logits off it
    (20, 64, 128, 64, (0, 1), "several", "scalar"),   # the buffer off it
]


@pytest.mark.parametrize("N,C,stride,col,offsets,passes,path", GRAD_BUFFER_CASES)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_chosen_logprob_grad_rows_into_a_gradient_buffer(drivers, tmp_path, N, C, stride, col, offsets, passes, path,
                                                         softcap):
    """The logit gradients written once in each gradient dtype, into a chunk's columns of a wider
    buffer: bitwise the in-place fp32 gradients rounded once to that dtype (what a separate cast
    gave), against float64 (without a softcap: test_softcap.py checks those values
    in place), and nothing outside the chunk's columns written."""
    col0, temperature = 64, 1.3
    inv_temp = float(torch.tensor(1 / temperature, dtype=torch.float32))
    logits = torch.randn(N, C) * 3
    tokens = torch.randint(col0, col0 + C, (N,))
    tokens[:5] = torch.tensor([col0, col0 + C - 1, col0 - 1, col0 + C, -100])[:N]
    z = (logits * inv_temp).double()
    row_max, log_sum, ent = combined_stats64(torch.cat([z, torch.randn(N, 50, dtype=torch.float64)], 1))
    per_row = (tokens, row_max, log_sum, log_sum - ent, torch.randn(N), torch.randn(N))
    in_place, _ = run_grad_rows(drivers, tmp_path / "in_place", logits.clone(), *per_row, col0, temperature, passes,
                                softcap=softcap)
    if softcap is None:
        expected, tol = grad_rows_reference(logits, *per_row, col0, inv_temp)
        assert_within(in_place, expected, tol, "in-place logit gradients")
    for dtype in HALF_DTYPES:
        grads = torch.full((N, stride), math.nan).to(dtype)
        got, launch = run_grad_rows(drivers, tmp_path / str(dtype), logits, *per_row, col0, temperature, passes,
                                    softcap=softcap, grads=grads, grads_col=col, offsets=offsets)
        assert launch.template_args[1:] == ({torch.float32: "float", torch.bfloat16: "__nv_bfloat16",
                                             torch.float16: "__half"}[dtype], "4" if path == "vector" else "1")
        chunk = got[:, col:col + C]
        assert torch.equal(chunk.view(torch.uint8), in_place.to(dtype).view(torch.uint8)), f"{dtype}: not bitwise"
        outside = torch.ones(N, stride, dtype=torch.bool)
        outside[:, col:col + C] = False
        assert got[outside].isnan().all(), f"{dtype}: columns outside the chunk written"


@pytest.mark.parametrize("ranks,N,passes", [(3, 300, "several"), (3, 300, "one"), (1, 5, "one"), (4, 17, "one")])
def test_chosen_logprob_combine(drivers, tmp_path, ranks, N, passes):
    # Each rank's partials from its own shard of logits; rank 1 holds only padded vocab rows (no
    # logits: empty stats) when there are several; the chosen logit sits on one rank.
    C = 20
    z = torch.randn(ranks, N, C, dtype=torch.float64) * 4
    partials = torch.zeros(ranks, N, 4, dtype=torch.float64)
    for k in range(ranks):
        padded = k == 1 and ranks > 1
        partials[k, :, 0], partials[k, :, 1], partials[k, :, 2] = row_stats64(z[k, :, :0] if padded else z[k])
    owner = torch.randint(0, ranks, (N,))
    partials[owner, torch.arange(N), 3] = torch.randn(N, dtype=torch.float64)
    partials = partials.float()
    out, [launch] = run_case(drivers, "chosen_logprob", "combine",
                             {"partials": Buf(partials), "out": Buf(torch.full((N, 4), math.nan))},
                             {"N": N, "ranks": ranks}, passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=launch.block[0])  # a thread per row

    seen = torch.cat([z[k] for k in range(ranks) if k != 1 or ranks == 1], 1)
    # The float32 partials carry their own rounding: recompute the reference from them.
    m, s, t = partials[..., 0].double(), partials[..., 1].double(), partials[..., 2].double()
    big = m.max(0).values
    live = s > 0  # the padded rank's (-inf, 0, 0) adds nothing
    S = torch.where(live, (m - big).exp() * s, 0.0).sum(0)
    T = torch.where(live, (m - big).exp() * (t + s * (m - big)), 0.0).sum(0)
    lse, ent = big + S.log(), S.log() - T / S
    tol = stats_tolerance(ranks + 4, float(seen.abs().max()))
    # out: (row max, log-sum relative to it, entropy, chosen); the max is the partials' exactly.
    got = out["out"].double()
    assert torch.equal(out["out"][:, 0], partials[..., 0].max(0).values)
    assert_within(got[:, 0] + got[:, 1], lse, tol, "lse")
    assert_within(got[:, 2], ent, tol, "entropy")
    assert torch.equal(out["out"][:, 3], partials[..., 3].sum(0))
    # And the float64 softmax of all the logits agrees to within the partials' rounding.
    assert_within(got[:, 0] + got[:, 1], lse_entropy64(seen)[0], tol + 1e-5, "lse against the logits")


# Non-finite logits (chosen_logprob/math.h): a NaN makes its row's partial NaN and every result of the
# row NaN; a -inf has probability 0 and adds nothing; a chunk of -inf only is an empty partial
# (max -inf) that merges as nothing; a NaN partial is never dropped in a merge.


@pytest.mark.parametrize("C,passes", [(45, "several"), (45, "one"), (7, "several"), (48, "several"), (200, "one")])
def test_chosen_logprob_stats_rows_nonfinite(drivers, tmp_path, C, passes):
    N, col0 = 16, 100
    inv_temp = float(torch.tensor(1 / 0.7, dtype=torch.float32))
    logits, cols = nonfinite_logits(N, C)
    tokens = col0 + cols  # the chosen logit is the non-finite one
    # Even rows merge into stats from an earlier chunk, odd rows have none; row 12's earlier
    # partial is NaN itself.
    earlier = torch.randn(N, 30, dtype=torch.float64) * 3
    earlier[12, 5] = math.nan
    has_earlier = torch.arange(N) % 2 == 0
    stats = running_stats(earlier, has_earlier)
    got = run_stats_rows(drivers, tmp_path, logits, tokens, stats, col0, 0.7, passes)
    nan_rows = torch.zeros(N, dtype=torch.bool)
    nan_rows[:4] = nan_rows[12] = True
    assert torch.equal(got[:, :3].isnan(), nan_rows[:, None].expand(N, 3)), "NaN partials"
    # A chunk of -inf only leaves the running stats as they were (empty ones included).
    assert torch.equal(got[8:12, :3].float(), stats[8:12, :3])

    z = (logits * inv_temp).double()
    seen = torch.cat([torch.where(has_earlier[:, None], earlier, -math.inf), z], 1)
    lse, ent = lse_entropy64(seen)
    finite = seen[seen.isfinite()]
    tol = stats_tolerance(C / 32 + 5 + 4, float(finite.abs().max()))
    # float64's answer, NaN where it is NaN: rows 8-11 without earlier stats have lse -inf and
    # entropy NaN (no probability at all).
    assert_within(got[:, 0] + got[:, 1].log(), lse, tol, "lse")
    assert_within(got[:, 1].log() - got[:, 2] / got[:, 1], ent, tol, "entropy")
    assert ent[4:8].isfinite().all()
    assert_within(got[:, 3], (logits * inv_temp)[torch.arange(N), cols], 0.0, "chosen")


@pytest.mark.parametrize("passes", ["several", "one"])
def test_chosen_logprob_grad_rows_nonfinite(drivers, tmp_path, passes):
    N, C, col0 = 16, 45, 64
    inv_temp = float(torch.tensor(1 / 1.3, dtype=torch.float32))
    logits, cols = nonfinite_logits(N, C)
    # Even rows choose the non-finite column, odd rows another one.
    tokens = col0 + torch.where(torch.arange(N) % 2 == 0, cols, (cols + 1) % C)
    z = (logits * inv_temp).double()
    # Per-row values over this chunk and other (finite) chunks: NaN for rows 0-3.
    row_max, log_sum, ent = combined_stats64(torch.cat([z, torch.randn(N, 50, dtype=torch.float64)], 1))
    log_sum_minus_entropy = log_sum - ent
    assert row_max[:4].isnan().all() and row_max[4:].isfinite().all()
    gl, ge = torch.randn(N), torch.randn(N)
    got, _ = run_grad_rows(drivers, tmp_path, logits.clone(), tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge,
                           col0, 1.3, passes)
    expected, tol = grad_rows_reference(logits, tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge, col0, inv_temp)
    assert expected[:4].isnan().all() and expected[4:].isfinite().all()
    assert_within(got, expected, tol, "logit gradients")
    # -inf logits pass no gradient (but gl where chosen).
    chosen = torch.zeros(N, C, dtype=torch.bool)
    chosen[torch.arange(N), tokens - col0] = True
    assert (got[4:12][~chosen[4:12] & logits[4:12].isneginf()] == 0).all()


@pytest.mark.parametrize("ranks", [3, 4])
def test_chosen_logprob_combine_nonfinite(drivers, tmp_path, ranks):
    # For each rank k and kind: a partial NaN from a NaN logit (NaN, NaN, NaN) or from a +inf
    # logit (inf, NaN, NaN) on rank k, the other ranks finite or empty (-inf, 0, 0); then finite
    # rows, and a NaN chosen logit on the last rank in the last row.
    C = 20
    kinds = [(k, bad, others) for k in range(ranks) for bad in (math.nan, math.inf) for others in ("finite", "empty")]
    N = len(kinds) + 3
    z = torch.randn(ranks, N, C, dtype=torch.float64) * 4
    live = torch.ones(ranks, N, dtype=torch.bool)
    for r, (k, bad, others) in enumerate(kinds):
        z[k, r, 3] = bad
        if others == "empty":
            live[:, r] = False
            live[k, r] = True
    partials = torch.zeros(ranks, N, 4, dtype=torch.float64)
    for k in range(ranks):
        partials[k, :, 0], partials[k, :, 1], partials[k, :, 2] = row_stats64(z[k])
    partials[~live] = torch.tensor([-math.inf, 0.0, 0.0, 0.0], dtype=torch.float64)
    owner = torch.randint(0, ranks, (N,))
    partials[owner, torch.arange(N), 3] = torch.randn(N, dtype=torch.float64)
    partials[ranks - 1, N - 1, 3] = math.nan
    partials = partials.float()
    out, [launch] = run_case(drivers, "chosen_logprob", "combine",
                             {"partials": Buf(partials), "out": Buf(torch.full((N, 4), math.nan))},
                             {"N": N, "ranks": ranks}, passes="several", tmp_dir=tmp_path)
    got = out["out"].double()

    bad_rows = torch.arange(N) < len(kinds)
    assert torch.equal((got[:, 0] + got[:, 1]).isnan(), bad_rows), "lse"
    assert torch.equal(got[:, 2].isnan(), bad_rows), "entropy"
    # float64 over the live ranks' logits: NaN entropy in the same rows, the same finite values.
    seen = torch.cat([torch.where(live[k][:, None], z[k], -math.inf) for k in range(ranks)], 1)
    lse, ent = lse_entropy64(seen)
    tol = stats_tolerance(ranks + 4, float(seen[seen.isfinite()].abs().max())) + 1e-5
    assert torch.equal(ent.isnan(), bad_rows)
    assert_within(got[~bad_rows, 0] + got[~bad_rows, 1], lse[~bad_rows], tol, "lse")
    assert_within(got[:, 2], ent, tol, "entropy")
    # The CPU kernel (combine_row on the host) agrees, non-finite values exactly.
    assert_within(got, torch.ops.fused_rl_ops.chosen_logprob_combine(partials).double(), tol, "against the CPU op")
    assert got[N - 1, 3].isnan()
