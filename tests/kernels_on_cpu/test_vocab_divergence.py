"""vocab_divergence's CUDA row kernels on the CPU (tests/helpers/kernels_on_cpu.py), against float64:
vocab_divergence_{stats_rows,mixture_rows,grad_rows,combine}_kernel (vocab_divergence/kernel.cuh)."""
import math

import pytest
import torch

from tests.helpers.kernels_on_cpu import (FP32_EPS, Buf, assert_passes, assert_within, drivers, dtype_scalar,  # noqa: F401
                                    logit_map_scalars, pytestmark, run_case)

# (temperature, student softcap, teacher softcap); None: no cap.
MAPS = [(1.0, None, None), (0.7, 4.0, 2.5)]


def mapped64(x, temperature, softcap):
    """The logit map of fp32 raw logits x, in float64."""
    x = x.double()
    return (softcap * torch.tanh(x / softcap) if softcap else x) / temperature


def map_scalars(temperature, softcap, teacher_softcap, beta=0.5):
    """Both models' maps (the teacher's with the student's temperature) and beta, as the driver reads them."""
    return {**logit_map_scalars(temperature, softcap), **logit_map_scalars(temperature, teacher_softcap, "teacher_"),
            "beta": beta}


def sides64(zs, zt):
    """Both models' Sides (max, sum, cross) of float64 logits [N, C] (vocab_divergence/math.h); a
    token of no mass (-inf) adds nothing."""
    def side(z, other):
        m = z.max(1).values
        e = (z - m[:, None]).exp()
        return m, e.sum(1), torch.where(e == 0, 0.0, e * (z - other)).sum(1)
    return side(zs, zt), side(zt, zs)


def tolerance(columns, zmax):
    """fp32 error of sums over `columns` logits of magnitude up to zmax (a few roundings each, the
    sum's chain), with slack."""
    return 4 * (columns + 8) * (1 + zmax) * FP32_EPS


def model_logits(N, C, seed):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(N, C, generator=g) * 3
    return student, student + torch.randn(N, C, generator=g)  # the teacher near the student


def merged_rows64(zs, zt):
    """[N, 6] merged rows (combined_column) of float64 logits, as combine_row writes them."""
    (ms, ss, cs), (mt, st, ct) = sides64(zs, zt)
    ls, lt = ss.log(), st.log()
    return torch.stack([ms, ls, mt, lt, ct / st - (mt - ms) - (lt - ls), cs / ss - (ms - mt) - (ls - lt)], 1)


PACK = 4  # columns per access on the row kernels' vector path (kPackWidth)


def assert_width(launch, C, offset=0):
    """The row kernel's columns per access: a pack where C and the logits' alignment allow, else 1."""
    expected = PACK if C % PACK == 0 and offset % PACK == 0 else 1
    assert launch.template_args[-1] == str(expected), f"{launch.kernel} took width {launch.template_args[-1]}"


def check_stats_rows(drivers, tmp_path, student, teacher, maps, passes, offset=0):
    """stats_rows merging both models' logits [N, C] into running stats (rows 0..N/2 from an earlier
    chunk, the rest none yet), against float64; offset: the teacher's elements past a 16-byte boundary."""
    temperature, softcap, teacher_softcap = maps
    N, C = student.shape
    earlier_s, earlier_t = (t.double() for t in model_logits(N, 30, seed=1))
    has_earlier = torch.arange(N) < N // 2
    (ms, ss, cs), (mt, st, ct) = sides64(earlier_s, earlier_t)
    stats = torch.stack([ms, ss, cs, mt, st, ct], 1).float()
    stats[~has_earlier] = torch.tensor([-math.inf, 0.0, 0.0, -math.inf, 0.0, 0.0])
    out, [launch] = run_case(drivers, "vocab_divergence", "stats_rows",
                             {"logits": Buf(student), "teacher_logits": Buf(teacher, offset), "stats": Buf(stats)},
                             {"N": N, "C": C, **map_scalars(*maps)}, passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=launch.block[0] // 32)  # a warp per row
    assert_width(launch, C, offset)
    got = out["stats"].double()

    zs, zt = mapped64(student, temperature, softcap), mapped64(teacher, temperature, teacher_softcap)
    no_earlier = torch.full((N, 30), -math.inf, dtype=torch.float64)
    seen_s = torch.cat([torch.where(has_earlier[:, None], earlier_s, no_earlier), zs], 1)
    seen_t = torch.cat([torch.where(has_earlier[:, None], earlier_t, no_earlier), zt], 1)
    (ms, ss, cs), (mt, st, ct) = sides64(seen_s, seen_t)
    zmax = max(float(z[z.isfinite()].abs().max()) for z in (seen_s, seen_t))
    tol = tolerance(C + 30, max(zmax, 12.0))
    for column, expected, what in ((0, ms + ss.log(), "student lse"), (3, mt + st.log(), "teacher lse"),
                                   (2, cs / ss, "student cross / sum"), (5, ct / st, "teacher cross / sum")):
        got_value = got[:, column] + got[:, column + 1].log() if column in (0, 3) else got[:, column] / got[:, column - 1]
        assert_within(got_value, expected, tol, what)
    return got, has_earlier


@pytest.mark.parametrize("N,C,passes", [
    (21, 45, "several"),  # 3 tiles of 8 rows on 1 block; C: a lane tail (the scalar path)
    (21, 45, "one"),      # 3 blocks, the last with 3 idle warps
    (13, 7, "several"),   # fewer columns than lanes
    (8, 96, "one"),       # one full block; 24 packs of 4 (the vector path)
    (21, 100, "several"),  # 25 packs: lanes 25-31 idle
    (9, 520, "one"),      # 130 packs: 4 rounds of the warp and 2 packs
])
@pytest.mark.parametrize("maps", MAPS)
def test_vocab_divergence_stats_rows(drivers, tmp_path, N, C, passes, maps):
    student, teacher = model_logits(N, C, seed=C)
    teacher[1, C // 2] = math.nan  # a NaN row of the teacher's
    got, has_earlier = check_stats_rows(drivers, tmp_path, student, teacher, maps, passes)
    assert got[1].isnan()[3:].all() and got[~has_earlier].isfinite().any()


@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("C,offset", [(520, 0), (520, 1), (45, 0)])
def test_vocab_divergence_stats_rows_online(drivers, tmp_path, order, C, offset):
    """Rows in ascending order raise each lane's running maxima at every access (each rescales the
    sums), descending ones never after the first; the teacher's logits off the vector's alignment
    take the scalar path."""
    student = (torch.randn(11, C) * 4).sort(1, descending=order == "descending").values
    teacher = student + torch.rand(11, C)  # in the same order: its maximum rises with the student's
    check_stats_rows(drivers, tmp_path, student, teacher, MAPS[1], "several", offset)


@pytest.mark.parametrize("N,C,passes", [(21, 45, "several"), (9, 70, "one"), (9, 520, "one"), (21, 100, "several")])
@pytest.mark.parametrize("maps", MAPS)
def test_vocab_divergence_mixture_rows(drivers, tmp_path, N, C, passes, maps):
    temperature, softcap, teacher_softcap = maps
    beta = 0.3
    student, teacher = model_logits(N, C, seed=2)
    zs, zt = mapped64(student, temperature, softcap), mapped64(teacher, temperature, teacher_softcap)
    # The rows merged over a vocabulary larger than the chunk (other chunks and ranks).
    extra_s, extra_t = (t.double() for t in model_logits(N, 50, seed=3))
    rows = merged_rows64(torch.cat([zs, extra_s], 1), torch.cat([zt, extra_t], 1))
    earlier = torch.randn(N, 2)
    out, [launch] = run_case(drivers, "vocab_divergence", "mixture_rows",
                             {"logits": Buf(student), "teacher_logits": Buf(teacher), "rows": Buf(rows.float()),
                              "mixture": Buf(earlier)},
                             {"N": N, "C": C, **map_scalars(*maps, beta=beta)}, passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=launch.block[0] // 32)
    assert_width(launch, C)
    r = rows.float().double()
    log_q, log_p = zs - r[:, :1] - r[:, 1:2], zt - r[:, 2:3] - r[:, 3:4]
    log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
    expected = earlier.double() + torch.stack([(log_p.exp() * (log_p - log_m)).sum(1),
                                               (log_q.exp() * (log_q - log_m)).sum(1)], 1)
    assert_within(out["mixture"], expected, tolerance(C, 12.0), "jsd sums")


def grad_reference(kind, zs, zt, rows, term, grad, beta, slope):
    r = rows.float().double()
    log_q, log_p = zs - r[:, :1] - r[:, 1:2], zt - r[:, 2:3] - r[:, 3:4]
    q, p, t = log_q.exp(), log_p.exp(), term.double()[:, None]
    if kind == 0:
        d = q - p
    elif kind == 1:
        d = q * (log_q - log_p - t)
    else:
        log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
        d = (1 - beta) * q * (log_q - log_m - t)
    scale = (q + p) * (1 + log_q.abs() + log_p.abs() + t.abs() + 2 * zs.abs().max()) * grad.double().abs()[:, None]
    return d * grad.double()[:, None] * slope, 8 * FP32_EPS * scale * slope + 1e-30


@pytest.mark.parametrize("N,C,passes,col", [
    (20, 45, "several", 4),  # block (64, 4): 5 row tiles on one block, a column tail (the scalar path)
    (9, 300, "several", 4),  # 75 packs a row, block (128, 2) (the vector path)
    (33, 3, "one", 4),       # block (4, 64): a partial row tile
    (20, 64, "one", 6),      # packs of the logits, but the buffer's columns off their alignment
])
@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("into", [None, torch.float32, torch.bfloat16])
def test_vocab_divergence_grad_rows(drivers, tmp_path, N, C, passes, col, kind, into):
    """In place over the student's logits, or into columns [col, col + C) of a wider buffer in the
    gradient GEMMs' dtype; the student softcapped (its slope), the teacher not."""
    temperature, softcap, beta = 0.8, 5.0, 0.35
    student, teacher = model_logits(N, C, seed=4)
    zs, zt = mapped64(student, temperature, softcap), mapped64(teacher, temperature, None)
    extra_s, extra_t = (t.double() for t in model_logits(N, 50, seed=5))
    rows = merged_rows64(torch.cat([zs, extra_s], 1), torch.cat([zt, extra_t], 1))
    term, grad = torch.randn(N), torch.randn(N)
    buffers = {"logits": Buf(student), "teacher_logits": Buf(teacher), "rows": Buf(rows.float()),
               "row_term": Buf(term), "grad": Buf(grad)}
    scalars = {"N": N, "C": C, "kind": kind, "in_place": int(into is None),
               **map_scalars(temperature, softcap, None, beta)}
    if into is not None:
        buffers["grads"] = Buf(torch.zeros(N, C + 12, dtype=into))
        scalars.update(dtype=dtype_scalar(into), grads_stride=C + 12, grads_col=col)
    out, [launch] = run_case(drivers, "vocab_divergence", "grad_rows", buffers, scalars, passes=passes,
                             block_order_seed=N, tmp_dir=tmp_path)
    assert_passes(launch, N, passes)
    assert_width(launch, C, 0 if into is None else col)
    x = student.double()
    slope = (1 - torch.tanh(x / softcap) ** 2) / temperature
    expected, tol = grad_reference(kind, zs, zt, rows, term, grad, beta, slope)
    if into is None:
        assert_within(out["logits"], expected, tol, "logit gradients")
        return
    got = out["grads"]
    assert got[:, :col].eq(0).all() and got[:, col + C:].eq(0).all()
    rounding = 2.0**-8 * expected.abs() if into == torch.bfloat16 else 0.0
    assert_within(got[:, col:col + C], expected, tol + rounding, "logit gradients")


@pytest.mark.parametrize("ranks,N,passes", [(3, 300, "one"), (2, 600, "several")])
def test_vocab_divergence_combine(drivers, tmp_path, ranks, N, passes):
    """The ranks' partials of one vocabulary, some empty (a shard of padding), merged."""
    C = 20
    student, teacher = (t.double() for t in model_logits(N, ranks * C, seed=6))
    partials = []
    for k in range(ranks):
        (ms, ss, cs), (mt, st, ct) = sides64(student[:, k * C:(k + 1) * C], teacher[:, k * C:(k + 1) * C])
        partials.append(torch.stack([ms, ss, cs, mt, st, ct], 1))
    partials = torch.stack(partials).float()
    partials[ranks - 1, : N // 2] = torch.tensor([-math.inf, 0.0, 0.0, -math.inf, 0.0, 0.0])
    seen = torch.ones(N, ranks * C, dtype=torch.bool)
    seen[: N // 2, (ranks - 1) * C:] = False
    out, [launch] = run_case(drivers, "vocab_divergence", "combine",
                             {"partials": Buf(partials), "out": Buf(torch.zeros(N, 6))}, {"N": N, "ranks": ranks},
                             passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=launch.block[0])
    got = out["out"].double()
    for rows in (slice(0, N // 2), slice(N // 2, N)):
        cols = seen[rows][0]
        expected = merged_rows64(student[rows][:, cols], teacher[rows][:, cols])
        assert_within(got[rows][:, 4:], expected[:, 4:], tolerance(ranks * C, 10.0), "divergences")
        assert_within(got[rows][:, 0] + got[rows][:, 1], expected[:, 0] + expected[:, 1], tolerance(ranks * C, 10.0),
                      "student lse")
        assert_within(got[rows][:, 2] + got[rows][:, 3], expected[:, 2] + expected[:, 3], tolerance(ranks * C, 10.0),
                      "teacher lse")
