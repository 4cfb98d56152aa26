"""Every CUDA kernel of the package, executed on the CPU: g++ compiles each op's launchers and
kernels (csrc/<op>/kernel.cu and kernel.cuh, the sources nvcc compiles) with the host execution
model tests/kernels_on_cpu/cuda_on_host.h (what it models and what not: its header comment). A
driver per op (tests/kernels_on_cpu/<op>_driver.cpp) reads a case written here, calls one of the
op's launchers for a stand-in device and writes the buffers back. Every case runs in three
builds, plain, ThreadSanitizer and AddressSanitizer + UBSan; any sanitizer report, harness error
or wrong number fails it, and the three builds must agree bit for bit. Results are checked
against float64 references.

Run alone with `python -m pytest -m kernels_on_cpu tests`. The drivers are built once per session
into build/kernels_on_cpu/<hash of the sources>/ (reused while the sources are unchanged)."""
import concurrent.futures
import hashlib
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from fused_rl_ops import reference
from fused_rl_ops._cuda_home import find_cuda_home

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
HARNESS = ROOT / "tests" / "kernels_on_cpu"
CUDA_HOME = find_cuda_home()
CUDA_INCLUDE = Path(CUDA_HOME or "", "include")
CXX = os.environ.get("CXX", "g++")
OPS = ("chosen_logprob", "clamped_swiglu", "value_head")
DRIVERS = (*OPS, "harness_selftest")
BUILDS = {
    "plain": [],
    "tsan": ["-fsanitize=thread"],
    "asan_ubsan": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
}
SANITIZER_ENV = {
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66",
    "ASAN_OPTIONS": "halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
# Dtype of a buffer: (name in case.txt, the launcher's DType value).
DTYPES = {torch.float32: ("f32", 0), torch.bfloat16: ("bf16", 1), torch.float16: ("f16", 2),
          torch.int64: ("i64", None)}
FP32_EPS = 2.0**-23
# Relative spacing of a dtype's values (one ulp, at worst): kernels compute in fp32 and round once.
ULP = {torch.float32: FP32_EPS, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
HALF_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = [
    pytest.mark.kernels_on_cpu,
    pytest.mark.skipif(CUDA_HOME is None or shutil.which(CXX) is None,
                       reason="needs the CUDA toolkit's headers and g++"),
]


# ---------------------------------------------------------------------------------------------
# Building and running the drivers


def build_drivers(csrc, out_dir, drivers=DRIVERS, variants=tuple(BUILDS)):
    """Compiles each driver (tests/kernels_on_cpu/NAME.cpp; for an op, <op>_driver.cpp with the op's
    csrc/<op>/kernel.cu) against the sources in csrc, in each build variant, into
    out_dir/<variant>/NAME, in parallel."""
    jobs = []
    for variant in variants:
        flags = BUILDS[variant]
        (out_dir / variant).mkdir(parents=True, exist_ok=True)
        for d in drivers:
            name = f"{d}_driver" if d in OPS else d
            launchers = ["-x", "c++", str(csrc / d / "kernel.cu")] if d in OPS else []
            # -rdynamic: cuda_on_host names the kernels launched from their symbols.
            cmd = [CXX, "-std=c++17", "-O1", "-g", "-pthread", "-rdynamic", "-Wall", "-Wno-unknown-pragmas", *flags,
                   f"-I{CUDA_INCLUDE}", f"-I{csrc}", f"-I{HARNESS}", "-include", "cuda_on_host.h",
                   str(HARNESS / f"{name}.cpp"), *launchers, "-o", str(out_dir / variant / name)]
            jobs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    errors = [job.communicate()[0] for job in jobs if job.wait() != 0]
    assert not errors, "driver build failed:\n" + "\n".join(errors)
    return out_dir


def sources_hash():
    h = hashlib.sha256(" ".join([CXX, str(CUDA_INCLUDE), repr(BUILDS)]).encode())
    h.update(subprocess.run([CXX, "--version"], capture_output=True).stdout)
    for path in sorted([*CSRC.rglob("*.h"), *CSRC.rglob("*.cuh"), *CSRC.rglob("*.cu"), *HARNESS.iterdir()]):
        h.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def drivers():
    out_dir = ROOT / "build" / "kernels_on_cpu" / sources_hash()
    if not (out_dir / "complete").exists():
        shutil.rmtree(out_dir.parent, ignore_errors=True)  # builds of older sources
        build_drivers(CSRC, out_dir)
        (out_dir / "complete").touch()
    return out_dir


class Buf:
    """A buffer of a case: its tensor (initial contents) and how many elements past a 16-byte
    boundary the driver places it (1: a pointer the vector path must refuse)."""

    def __init__(self, tensor, offset=0):
        self.tensor, self.offset = tensor.contiguous(), offset


def write_case(case_dir, kernel, device, buffers, scalars, block_order_seed):
    case_dir.mkdir(parents=True)
    lines = [f"kernel {kernel}", "device {} {}".format(*device), f"block_order_seed {block_order_seed}"]
    for name, value in scalars.items():
        lines.append(f"{'float' if isinstance(value, float) else 'int'} {name} {value!r}")
    for name, b in buffers.items():
        lines.append(f"buffer {name} {DTYPES[b.tensor.dtype][0]} {b.tensor.numel()} {b.offset}")
        (case_dir / f"{name}.bin").write_bytes(b.tensor.view(torch.uint8).numpy().tobytes())
    (case_dir / "case.txt").write_text("\n".join(lines) + "\n")


class Launch(NamedTuple):
    """One kernel launch a launcher made, as the driver reports it."""
    kernel: str
    template_args: tuple  # e.g. ("float", "4", "false")
    grid: tuple
    block: tuple

    @property
    def width(self):
        """Elements per thread: the kernel's second template argument (1 for a kernel without)."""
        return int(self.template_args[1]) if len(self.template_args) > 1 else 1


def run_case(drivers, op, kernel, buffers, scalars, *, passes="one", block_order_seed=0, tmp_dir):
    """Calls one launcher in every build found under drivers, on the stand-in device DEVICES[passes];
    returns (outputs of the first build, the launches it made). Fails on any error, sanitizer
    report, or disagreement between the builds."""
    variants = [v for v in BUILDS if (drivers / v).is_dir()]
    case_dir = tmp_dir / "case"
    write_case(case_dir, kernel, DEVICES[passes], buffers, scalars, block_order_seed)
    env = {**os.environ, **SANITIZER_ENV}

    def run(variant):
        out_dir = tmp_dir / variant
        out_dir.mkdir()
        return subprocess.run([str(drivers / variant / f"{op}_driver"), str(case_dir), str(out_dir)],
                              capture_output=True, text=True, env=env, timeout=600)

    with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
        results = dict(zip(variants, pool.map(run, variants)))
    for variant, r in results.items():
        assert r.returncode == 0 and not r.stderr, f"{op} {kernel} [{variant}] exit {r.returncode}:\n{r.stderr[:4000]}"
    outputs = {}
    for name, b in buffers.items():
        raw = {v: (tmp_dir / v / f"{name}.out").read_bytes() for v in variants}
        assert len(set(raw.values())) == 1, f"{name}: the builds disagree"
        outputs[name] = torch.frombuffer(bytearray(raw[variants[0]]), dtype=b.tensor.dtype).reshape(b.tensor.shape)
    launches = [Launch(name, tuple(args.split(",")) if args else (), tuple(map(int, grid.split())),
                       tuple(map(int, block.split())))
                for name, args, grid, block in re.findall(r"^launch (\w+)(?:<(.*)>)? (\d+ \d+ \d+) (\d+ \d+ \d+)$",
                                                          results[variants[0]].stdout, re.M)]
    return outputs, launches


# The stand-in devices (SMs, resident threads per SM) the launchers size their grids for:
# "several" grid-stride passes on a device that holds one block, "one" pass on a device large
# enough for a block per row tile.
DEVICES = {"several": (1, 1), "one": (1 << 16, 2048)}


def assert_passes(launch, rows, passes, rows_per_block=None):
    """The grid-stride passes launch makes over `rows` rows (rows_per_block per block, by default
    its block's y extent): more than one, or exactly one, as `passes` says."""
    per_pass = launch.grid[0] * (rows_per_block or launch.block[1])
    made = -(-rows // per_pass)
    assert made > 1 if passes == "several" else made == 1, \
        f"{launch.kernel}: {made} grid-stride passes over {rows} rows ({per_pass} a pass), expected {passes}"


def dtype_scalar(dtype):
    return DTYPES[dtype][1]


def assert_within(actual, expected, tol, what):
    """|actual - expected| <= tol elementwise (tol a tensor or number) where expected is finite;
    elsewhere actual equals it exactly (NaN where it is NaN, the same infinity)."""
    actual, expected = actual.double(), expected.double()
    err = (actual - expected).abs()
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    bad = ~(same | (expected.isfinite() & (err <= tol)))
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off, first at "
                           f"{bad.nonzero()[0].tolist()}: {actual[bad][0].item()} vs {expected[bad][0].item()}")


# ---------------------------------------------------------------------------------------------
# chosen_logprob: chosen_logprob_{stats_rows,grad_rows,combine}_kernel (chosen_logprob/kernel.cuh)

def row_stats64(z):
    """(max, sum, ent) of logits z [N, C] (already divided by the temperature), as chosen_logprob/math.h
    keeps them, in float64; rows with no columns are (-inf, 0, 0)."""
    if z.shape[1] == 0:
        empty = torch.zeros(z.shape[0], dtype=torch.float64)
        return empty - math.inf, empty, empty
    m = z.max(1).values
    e = (z - m[:, None]).exp()
    return m, e.sum(1), (e * (z - m[:, None])).sum(1)


def lse_entropy64(z):
    """log-sum-exp and entropy of each row of z (entries may be -inf: no logit), in float64."""
    logp = torch.log_softmax(z, 1)
    p = logp.exp()
    return torch.logsumexp(z, 1), -(p * torch.where(p > 0, logp, 0.0)).sum(1)


def stats_tolerance(terms, zmax):
    """Bound on the fp32 error of lse and entropy from the kernels' sums s and t: each of the
    `terms` fp32 additions along a row's longest chain adds at most eps relative to the sum; each
    exp(z - m) carries the rounding of z - m (at most 2 zmax eps) and its own (an ulp); lse adds
    |m| eps, and entropy's t / s scales all of it by |z - m| <= 2 zmax. Then a factor 2 of slack."""
    return 2 * (terms + 2 * zmax + 2) * (1 + 2 * zmax) * FP32_EPS


@pytest.mark.parametrize("N,C,passes", [
    (21, 45, "several"),  # 3 tiles of 8 rows on 1 block; C: a lane tail
    (21, 45, "one"),      # 3 blocks, the last with 3 idle warps
    (8, 96, "one"),       # one full block; C a multiple of the warp
    (13, 7, "several"),   # fewer columns than lanes (a short last chunk)
])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chosen_logprob_stats_rows(drivers, tmp_path, N, C, passes, temperature):
    col0 = 100  # the chunk holds global ids [100, 100 + C)
    inv_temp = float(torch.tensor(1 / temperature, dtype=torch.float32))
    logits = torch.randn(N, C) * 3
    # Tokens at the chunk's first and last column, just outside it on both sides, an ignore_index
    # and random ids inside.
    tokens = torch.randint(col0, col0 + C, (N,))
    tokens[:5] = torch.tensor([col0, col0 + C - 1, col0 - 1, col0 + C, -100])
    # Running stats from an earlier chunk (rows 0..N/2) or none yet (the rest): the merge.
    earlier = torch.randn(N, 30, dtype=torch.float64) * 3
    has_earlier = torch.arange(N) < N // 2
    stats = running_stats(earlier, has_earlier)
    got = run_stats_rows(drivers, tmp_path, logits, tokens, stats, col0, temperature, passes)

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


def running_stats(earlier, has_earlier):
    """[N, 4] fp32 stats of an earlier chunk's logits (float64 [N, k]) where has_earlier, empty
    elsewhere; the chosen logit 0.5 (not in the chunk)."""
    m0, s0, t0 = row_stats64(earlier)
    stats = torch.stack([m0, s0, t0, torch.full_like(m0, 0.5)], 1).float()
    stats[~has_earlier] = torch.tensor([-math.inf, 0.0, 0.0, 0.0])
    return stats


def run_stats_rows(drivers, tmp_path, logits, tokens, stats, col0, temperature, passes, softcap=0.0):
    """chosen_logprob_stats_rows_kernel merging logits [N, C] into stats (softcap 0: none); returns the stats it
    wrote, in float64."""
    N, C = logits.shape
    out, [launch] = run_case(drivers, "chosen_logprob", "stats_rows",
                             {"logits": Buf(logits), "tokens": Buf(tokens), "stats": Buf(stats)},
                             {"N": N, "C": C, "col0": col0, "temperature": temperature, "softcap": softcap},
                             passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=launch.block[0] // 32)  # a warp per row
    return out["stats"].double()


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
    # and ranks), and mean = log_sum - entropy, as chosen_logprob's backward passes them.
    row_max, log_sum, ent = combined_stats64(torch.cat([z, torch.randn(N, 50, dtype=torch.float64)], 1))
    mean = log_sum - ent
    gl, ge = torch.randn(N), torch.randn(N)
    out = run_grad_rows(drivers, tmp_path, logits, tokens, row_max, log_sum, mean, gl, ge, col0, temperature, passes)
    expected, tol = grad_rows_reference(logits, tokens, row_max, log_sum, mean, gl, ge, col0, inv_temp)
    assert_within(out, expected, tol, "logit gradients")


def combined_stats64(z):
    """(row max, log-sum relative to it, entropy) of each row of z, in float64, as combine_row
    writes them."""
    m = z.max(1).values
    lse, ent = lse_entropy64(z)
    return m, lse - m, ent


def run_grad_rows(drivers, tmp_path, logits, tokens, row_max, log_sum, mean, gl, ge, col0, temperature, passes,
                  softcap=0.0):
    """chosen_logprob_grad_rows_kernel on logits [N, C] with the per-row values (rounded to fp32; softcap 0:
    none); returns the gradients it wrote in place."""
    N, C = logits.shape
    out, [launch] = run_case(drivers, "chosen_logprob", "grad_rows",
                             {"logits": Buf(logits), "tokens": Buf(tokens), "row_max": Buf(row_max.float()),
                              "lse": Buf(log_sum.float()), "mean": Buf(mean.float()), "gl": Buf(gl), "ge": Buf(ge)},
                             {"N": N, "C": C, "col0": col0, "temperature": temperature, "softcap": softcap},
                             passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes)
    return out["logits"]


def grad_rows_reference(logits, tokens, row_max, log_sum, mean, gl, ge, col0, inv_temp):
    """float64 gradients d(gl logprob + ge entropy)/d(logits) from the fp32 per-row values the
    kernel gets, and their tolerance."""
    d, scale = logit_grads64((logits * inv_temp).double(), tokens, row_max, log_sum, mean, gl, ge, col0)
    return d * inv_temp, 8 * FP32_EPS * scale * inv_temp + 1e-30


def logit_grads64(z, tokens, row_max, log_sum, mean, gl, ge, col0, z_error=0.0):
    """float64 d(gl logprob + ge entropy)/dz of float64 logits z from the fp32 per-row values the
    kernel gets, and the scale of its fp32 error (in eps; z_error: the absolute error of the
    kernel's own z). A logit of probability 0 (-inf) gets none (the limit of p (z - mean) as
    p -> 0; float64 would say 0 * inf = NaN); NaN anywhere stays NaN."""
    N, C = z.shape
    zr = z - row_max.float().double()[:, None]  # z - m
    l, mu = log_sum.float().double()[:, None], mean.float().double()[:, None]
    g, e = gl.double()[:, None], ge.double()[:, None]
    p = (zr - l).exp()
    d = torch.where(p == 0, 0.0, -p * (g + e * (zr - mu)))
    inside = ((tokens >= col0) & (tokens < col0 + C)).nonzero()[:, 0]
    d[inside, tokens[inside] - col0] += g[inside, 0]
    # A handful of fp32 roundings per element (z - m among them: |z - m| eps absolute), exp's
    # relative error growing with |z - m - lse|, and the chosen column's addition of gl.
    zr_f = torch.where(zr.isfinite(), zr, 0.0)
    factor = torch.where(p == 0, 0.0, (1 + (zr_f - l).abs() + zr_f.abs() + z_error) * p
                         * (g.abs() + e.abs() * ((zr_f - mu).abs() + 1)))
    return d, factor + g.abs()


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


def nonfinite_logits(N, C):
    """logits [N, C] and the column chosen in each row: rows 0-3 hold a NaN there, rows 4-7 a
    -inf, rows 8-11 are -inf throughout, the rest finite."""
    logits = torch.randn(N, C) * 3
    cols = torch.randint(0, C, (N,))
    rows = torch.arange(N)
    logits[rows[:4], cols[:4]] = math.nan
    logits[rows[4:8], cols[4:8]] = -math.inf
    logits[8:12] = -math.inf
    return logits, cols


@pytest.mark.parametrize("C,passes", [(45, "several"), (45, "one"), (7, "several")])
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
    mean = log_sum - ent
    assert row_max[:4].isnan().all() and row_max[4:].isfinite().all()
    gl, ge = torch.randn(N), torch.randn(N)
    got = run_grad_rows(drivers, tmp_path, logits.clone(), tokens, row_max, log_sum, mean, gl, ge, col0, 1.3,
                        passes)
    expected, tol = grad_rows_reference(logits, tokens, row_max, log_sum, mean, gl, ge, col0, inv_temp)
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


# ---------------------------------------------------------------------------------------------
# clamped_swiglu: clamped_swiglu_{forward,backward,scaled_backward}_kernel (clamped_swiglu/kernel.cuh)

SWIGLU = dict(alpha=1.702, limit=7.0, offset=1.0)


def clamped_swiglu_input(rows, F, dtype):
    """x [rows, 2F] with values on and beyond +-limit among random ones (finite)."""
    x = torch.randn(rows, 2 * F, dtype=torch.float64) * 5
    edges = torch.tensor([7.0, -7.0, 8.5, -8.5, 0.0], dtype=torch.float64)
    x.view(-1)[: len(edges)] = edges
    x.view(-1)[-len(edges):] = edges
    return x.to(dtype)


def clamped_swiglu_reference(x, dy, interleaved):
    x64 = x.double().requires_grad_(True)
    y = reference.clamped_swiglu(x64, SWIGLU["limit"], alpha=SWIGLU["alpha"], linear_offset=SWIGLU["offset"],
                                 interleaved=interleaved)
    y.backward(dy.double())
    return y.detach(), x64.grad


def assert_rounded_once(actual, expected, dtype, what, fp32_error=0.0):
    """Computed in fp32 and rounded once to dtype: within one ulp of dtype (relative spacing at
    worst) of the float64 value, plus fp32's own error before the rounding (a few eps relative,
    and fp32_error absolute) and fp16's subnormal spacing 2^-24."""
    tol = (ULP[dtype] + 8 * FP32_EPS) * expected.abs() + fp32_error + (2.0**-24 if dtype == torch.float16 else 0.0)
    assert_within(actual, expected, tol, what)


# (rows, F, grid-stride passes, pointer offset in elements, vector or scalar path). Blocks are
# [rows, F / N] tiles of 256 threads: with F = 64, 8 to 32 rows per tile.
SWIGLU_CASES = [
    (40, 64, "several", 0, "vector"),
    (40, 64, "one", 0, "vector"),
    (5, 37, "several", 0, "scalar"),  # an F no vector width divides: row tails
    (5, 64, "one", 1, "scalar"),      # an aligned F but a misaligned pointer
    (2, 2080, "several", 0, "vector"),  # more packs per row than threads: column passes too
]


@pytest.mark.parametrize("rows,F,passes,offset,path", SWIGLU_CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_clamped_swiglu_forward_and_backward(drivers, tmp_path, rows, F, passes, offset, path, interleaved, dtype):
    x = clamped_swiglu_input(rows, F, dtype)
    dy = torch.randn(rows, F).to(dtype)
    y_ref, dx_ref = clamped_swiglu_reference(x, dy, interleaved)
    scalars = dict(rows=rows, F=F, dtype=dtype_scalar(dtype), interleaved=int(interleaved), has_scale=0, **SWIGLU)
    expected_width = (8 if interleaved else 16) // x.element_size() if path == "vector" else 1

    out, [launch] = run_case(drivers, "clamped_swiglu", "forward",
                             {"x": Buf(x, offset), "y": Buf(torch.full((rows, F), math.nan).to(dtype), offset)},
                             scalars, passes=passes, block_order_seed=rows, tmp_dir=tmp_path / "fwd")
    assert launch.width == expected_width
    assert_passes(launch, rows, passes)
    # u' + offset cancels for u' near -offset: an absolute fp32 error of eps |u'| |g' s| <= 50 eps.
    assert_rounded_once(out["y"], y_ref, dtype, "y", fp32_error=8 * FP32_EPS * 50)

    out, [launch] = run_case(drivers, "clamped_swiglu", "backward",
                             {"x": Buf(x, offset), "y": Buf(dy, offset),
                              "x_grad": Buf(torch.full((rows, 2 * F), math.nan).to(dtype), offset)},
                             scalars, passes=passes, tmp_dir=tmp_path / "bwd")
    assert launch.width == expected_width
    assert_passes(launch, rows, passes)
    # d/dg = dy (u' + offset) (s + alpha g' s (1 - s)) cancels between terms of up to ~100 in size
    # for |g|, |u| <= 7 (the clamp), |dy| <= 4: an absolute fp32 error of a few eps times 100.
    assert_rounded_once(out["x_grad"], dx_ref, dtype, "dx", fp32_error=8 * FP32_EPS * 100)


@pytest.mark.parametrize("rows,F,passes,offset,path", SWIGLU_CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_clamped_swiglu_weighted_forward_and_backward(drivers, tmp_path, rows, F, passes, offset, path, interleaved,
                                                      dtype):
    """The weighted form y = scale * swiglu(x): clamped_swiglu_forward_kernel with a scale buffer and
    clamped_swiglu_scaled_backward_kernel (dx and dscale). row_sum takes its shuffle-only branch where a
    row has at most a warp of threads (F = 64 on the vector path: 8 to 32 threads a row) and its
    shared-memory branch otherwise (64 or 256 threads a row)."""
    x = clamped_swiglu_input(rows, F, dtype)
    dy = torch.randn(rows, F).to(dtype)
    scale = torch.rand(rows) * 2  # routing weights; one of them 0
    scale[rows // 2] = 0.0
    x64, s64 = x.double().requires_grad_(True), scale.double().requires_grad_(True)
    y_ref = reference.clamped_swiglu(x64, SWIGLU["limit"], alpha=SWIGLU["alpha"], linear_offset=SWIGLU["offset"],
                                     interleaved=interleaved, scale=s64)
    y_ref.backward(dy.double())
    y_ref = y_ref.detach()
    scalars = dict(rows=rows, F=F, dtype=dtype_scalar(dtype), interleaved=int(interleaved), has_scale=1, **SWIGLU)
    expected_width = (8 if interleaved else 16) // x.element_size() if path == "vector" else 1
    row_fits_a_warp = F == 64 and path == "vector"

    out, [launch] = run_case(drivers, "clamped_swiglu", "forward",
                             {"x": Buf(x, offset), "scale": Buf(scale),
                              "y": Buf(torch.full((rows, F), math.nan).to(dtype), offset)},
                             scalars, passes=passes, block_order_seed=rows, tmp_dir=tmp_path / "fwd")
    assert launch.width == expected_width
    assert_passes(launch, rows, passes)
    # As the unweighted forward (its fp32 error times the scale), plus the product's rounding
    # (within the 8 eps relative).
    s = scale.double()[:, None]
    assert_rounded_once(out["y"], y_ref, dtype, "y", fp32_error=8 * FP32_EPS * 50 * s)

    out, [launch] = run_case(drivers, "clamped_swiglu", "scaled_backward",
                             {"x": Buf(x, offset), "y": Buf(dy, offset), "scale": Buf(scale),
                              "x_grad": Buf(torch.full((rows, 2 * F), math.nan).to(dtype), offset),
                              "dscale": Buf(torch.full((rows,), math.nan))},
                             scalars, passes=passes, block_order_seed=rows + 1, tmp_dir=tmp_path / "bwd")
    assert launch.width == expected_width
    assert (launch.block[0] <= 32) == row_fits_a_warp, launch
    assert_passes(launch, rows, passes)
    # dx: the unweighted backward's bound with dy * scale (one more rounding, within the 8 eps).
    assert_rounded_once(out["x_grad"], x64.grad, dtype, "dx", fp32_error=8 * FP32_EPS * 100 * s)
    # dscale = sum over the row of dy * swiglu(x): each term's fp32 error (8 eps relative and the
    # forward's 8 eps * 50 absolute, times |dy|), then the sum's, in any order.
    swiglu64 = reference.clamped_swiglu(x.double(), SWIGLU["limit"], alpha=SWIGLU["alpha"],
                                        linear_offset=SWIGLU["offset"], interleaved=interleaved)
    terms = dy.double() * swiglu64
    term_error = (8 * FP32_EPS * (terms.abs() + 50 * dy.double().abs())).sum(1)
    assert_within(out["dscale"], s64.grad, sum_tolerance(terms) + term_error, "dscale")


# ---------------------------------------------------------------------------------------------
# value_head: value_head_forward_kernel, value_head_backward_hidden_kernel,
# value_head_partials_kernel and value_head_sum_partials_kernel (value_head/kernel.cuh)


def sum_tolerance(terms):
    """Any order of summing n fp32 terms (each an fp32 product, itself within eps/2): error at most
    (n + 1) eps/2 of the sum of |terms|. terms: [..., n] float64."""
    return (terms.shape[-1] + 1) * FP32_EPS / 2 * terms.abs().sum(-1)


# (rows, H, grid-stride passes, pointer offset in elements, vector path?). The forward's blocks
# take 8 rows, backward_hidden's [rows, H / N] tiles of 256 threads up to 32.
VALUE_HEAD_CASES = [
    (70, 40, "several", 0, True),
    (70, 40, "one", 0, True),
    (13, 37, "several", 0, False),  # H no width divides: the scalar path
    (13, 40, "one", 1, False),      # a misaligned pointer: the scalar path
    (9, 640, "several", 0, True),   # enough packs for the 4-loads-in-flight loop and its tail
]


@pytest.mark.parametrize("rows,H,passes,offset,vector", VALUE_HEAD_CASES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_value_head_forward_and_backward_hidden(drivers, tmp_path, rows, H, passes, offset, vector, dtype):
    hidden = torch.randn(rows, H).to(dtype)
    weight = torch.randn(H)
    bias = torch.randn(1)
    width = 16 // hidden.element_size() if vector else 1
    scalars = dict(rows=rows, H=H, dtype=dtype_scalar(dtype), has_bias=int(rows % 2))

    out, [launch] = run_case(drivers, "value_head", "forward",
                             {"hidden": Buf(hidden, offset), "weight": Buf(weight, offset), "bias": Buf(bias),
                              "out": Buf(torch.full((rows,), math.nan))},
                             scalars, passes=passes, block_order_seed=7, tmp_dir=tmp_path / "fwd")
    assert launch.width == width
    assert_passes(launch, rows, passes)
    terms = hidden.double() * weight.double()
    expected = terms.sum(1) + (bias.double() if rows % 2 else 0.0)
    assert_within(out["out"], expected, sum_tolerance(terms) + FP32_EPS * expected.abs(), "forward")

    grad_out = torch.randn(rows)
    out, [launch] = run_case(drivers, "value_head", "backward_hidden",
                             {"grad_out": Buf(grad_out), "weight": Buf(weight, offset),
                              "grad_hidden": Buf(torch.full((rows, H), math.nan).to(dtype), offset)},
                             scalars, passes=passes, tmp_dir=tmp_path / "bwd")
    assert launch.width == width
    assert_passes(launch, rows, passes)
    assert_rounded_once(out["grad_hidden"], grad_out.double()[:, None] * weight.double(), dtype, "grad_hidden")


@pytest.mark.parametrize("rows,H,offset", [
    (63, 40, 0),     # one partial row block
    (64, 40, 0),     # exactly one
    (65, 37, 0),     # one and a row; the scalar path
    (130, 300, 1),   # column tiles over blockIdx.y; a misaligned pointer
    (1093, 8, 0),    # 18 row blocks: stage 2 sums more partial rows than its 16 slices
])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_value_head_backward_params(drivers, tmp_path, rows, H, offset, dtype):
    hidden = torch.randn(rows, H).to(dtype)
    grad_out = torch.randn(rows)
    blocks = (rows + 63) // 64
    out, launches = run_case(drivers, "value_head", "backward_params",
                             {"grad_out": Buf(grad_out), "hidden": Buf(hidden, offset),
                              "weight_partials": Buf(torch.full((blocks, H), math.nan), offset),
                              "bias_partials": Buf(torch.full((blocks,), math.nan)),
                              "grad_weight": Buf(torch.full((H,), math.nan)),
                              "grad_bias": Buf(torch.full((1,), math.nan))},
                             dict(rows=rows, H=H, dtype=dtype_scalar(dtype)), block_order_seed=3, tmp_dir=tmp_path)
    vector = H % (16 // hidden.element_size()) == 0 and offset == 0
    assert launches[0].width == (16 // hidden.element_size() if vector else 1)
    g = grad_out.double()
    terms = g[:, None] * hidden.double()                           # [rows, H]
    padded = torch.cat([terms, terms.new_zeros(blocks * 64 - rows, H)]).view(blocks, 64, H).transpose(1, 2)
    assert_within(out["weight_partials"], padded.sum(-1), sum_tolerance(padded), "stage 1 weight partials")
    g_blocks = torch.cat([g, g.new_zeros(blocks * 64 - rows)]).view(blocks, 64)
    assert_within(out["bias_partials"], g_blocks.sum(-1), sum_tolerance(g_blocks), "stage 1 bias partials")
    assert_within(out["grad_weight"], terms.sum(0), sum_tolerance(terms.T), "grad_weight")
    assert_within(out["grad_bias"], g.sum()[None], sum_tolerance(g[None]), "grad_bias")


# ---------------------------------------------------------------------------------------------
# The model itself: its checks of synchronisation, and the launch shapes of common/cuda_utils.cuh


@pytest.mark.parametrize("scenario,error", [
    ("good_exchanges", None),
    ("bad_launch_configs_are_errors", None),
    ("device_sizes", None),
    ("bad_barrier_after_return", "threads wait at __syncthreads()"),
    ("bad_barriers_at_two_places", "threads wait at different __syncthreads()"),
    ("bad_shuffle_absent_lanes", "names lanes absent from this warp"),
    ("bad_shuffle_returned_lanes", "returned while its warp waits"),
    ("bad_deadlock", "deadlock: timed out"),
])
def test_harness_selftest(drivers, scenario, error):
    env = {**os.environ, **SANITIZER_ENV, "CUDA_ON_HOST_TIMEOUT_S": "2"}
    for variant in BUILDS:
        r = subprocess.run([str(drivers / variant / "harness_selftest"), scenario], capture_output=True, text=True,
                           env=env, timeout=120)
        if error is None:
            assert r.returncode == 0 and r.stdout == "ok\n" and not r.stderr, f"[{variant}] {r.stderr[:4000]}"
        else:
            assert r.returncode == 70 and error in r.stderr and "Sanitizer" not in r.stderr, \
                f"[{variant}] {r.stderr[:4000]}"


# ---------------------------------------------------------------------------------------------
# Proof that the harness catches bugs: known defects planted in a copy of the sources, one at a
# time, each reported by a case above. Each entry: (file, line, defective line, the op whose driver
# runs the case, case, the report expected, the one build that gives it); only that build is
# compiled and run, which keeps the rebuilds inside CI's time budget.

DEFECTS = {
    # value_head stage 1 without the barrier between writing and reading the group sums.
    "syncthreads_deleted": (
        "value_head/kernel.cuh", "  __syncthreads();\n  if (threadIdx.y != 0 || c >= H) return;",
        "  if (threadIdx.y != 0 || c >= H) return;", "value_head",
        lambda d, tmp: test_value_head_backward_params(d, tmp, 130, 40, 0, torch.float32),
        "ThreadSanitizer: data race", "tsan"),
    # The same barrier placed after threads return: reached by part of the block.
    "barrier_after_return": (
        "value_head/kernel.cuh", "  __syncthreads();\n  if (threadIdx.y != 0 || c >= H) return;",
        "  if (threadIdx.y != 0 || c >= H) return;\n  __syncthreads();", "value_head",
        lambda d, tmp: test_value_head_backward_params(d, tmp, 130, 40, 0, torch.float32),
        "cuda_on_host error", "plain"),
    # chosen_logprob's max loop reads one column past the row.
    "loop_bound_le": (
        "chosen_logprob/kernel.cuh", "for (int64_t k = lane; k < C; k += kWarp) m =",
        "for (int64_t k = lane; k <= C; k += kWarp) m =", "chosen_logprob",
        lambda d, tmp: test_chosen_logprob_stats_rows(d, tmp, 21, 45, "several", 1.0),
        "AddressSanitizer: heap-buffer-overflow", "asan_ubsan"),
    # warp_sum's butterfly starting at offset 8: each half-warp sums only itself (a row of more
    # than 16 packs).
    "shuffle_offset_halved": (
        "common/cuda_utils.cuh", "for (int offset = kWarp / 2; offset > 0; offset /= 2)",
        "for (int offset = kWarp / 4; offset > 0; offset /= 2)", "value_head",
        lambda d, tmp: test_value_head_forward_and_backward_hidden(d, tmp, 9, 640, "several", 0, True, torch.float32),
        "forward: ", "plain"),
    # row_sum without the barrier that keeps a row's next totals from overwriting ones still read
    # (rows of 256 threads, two rows in turn on one block).
    "row_sum_first_barrier_deleted": (
        "clamped_swiglu/kernel.cuh", "  __syncthreads();  // the previous call's totals are read\n", "",
        "clamped_swiglu",
        lambda d, tmp: test_clamped_swiglu_weighted_forward_and_backward(d, tmp, 2, 2080, "several", 0, "vector",
                                                                         False, torch.float32),
        "ThreadSanitizer: data race", "tsan"),
    # row_sum's warp_sum over the whole warp when a row has fewer threads (8 here): rows mix.
    "row_sum_width_ignored": (
        "clamped_swiglu/kernel.cuh", "const int width = blockDim.x < kWarp ? blockDim.x : kWarp;",
        "const int width = kWarp;", "clamped_swiglu",
        lambda d, tmp: test_clamped_swiglu_weighted_forward_and_backward(d, tmp, 40, 64, "one", 0, "vector", False,
                                                                         torch.bfloat16),
        "dscale: ", "plain"),
    # The launchers' grid arithmetic, each ceil-division turned into a floor division. Grid-stride
    # kernels still cover every row with too few blocks, so the launch shape itself is checked: on
    # the large stand-in device a block per row tile, one pass (21 rows: 2 blocks of 8 rows).
    "stats_rows_grid_floor": (
        "chosen_logprob/kernel.cu", "grid_for((N + kStatsRowsPerBlock - 1) / kStatsRowsPerBlock,",
        "grid_for(N / kStatsRowsPerBlock,", "chosen_logprob",
        lambda d, tmp: test_chosen_logprob_stats_rows(d, tmp, 21, 45, "one", 1.0),
        "chosen_logprob_stats_rows_kernel: 2 grid-stride passes", "plain"),
    # 300 rows: 1 block of 256.
    "combine_grid_floor": (
        "chosen_logprob/kernel.cu", "grid_for((N + kCombineThreads - 1) / kCombineThreads,",
        "grid_for(N / kCombineThreads,", "chosen_logprob",
        lambda d, tmp: test_chosen_logprob_combine(d, tmp, 3, 300, "one"),
        "chosen_logprob_combine_kernel: 2 grid-stride passes", "plain"),
    # row_launch (grad_rows, clamped_swiglu, value_head backward_hidden): 70 rows in tiles of 16.
    "row_launch_grid_floor": (
        "common/cuda_utils.cuh", "grid_for((rows + ty - 1) / ty,", "grid_for(rows / ty,", "value_head",
        lambda d, tmp: test_value_head_forward_and_backward_hidden(d, tmp, 70, 40, "one", 0, True, torch.float32),
        "value_head_backward_hidden_kernel: 2 grid-stride passes", "plain"),
    # 70 rows: 8 blocks of 8.
    "value_head_forward_grid_floor": (
        "value_head/kernel.cu", "grid_for((rows + kForwardWarps - 1) / kForwardWarps,",
        "grid_for(rows / kForwardWarps,", "value_head",
        lambda d, tmp: test_value_head_forward_and_backward_hidden(d, tmp, 70, 40, "one", 0, True, torch.float32),
        "value_head_forward_kernel: 2 grid-stride passes", "plain"),
    # Stage 1's column tiles: 300 columns (the scalar path) in 9 tiles of 32, the last 12 lost.
    "partials_columns_floor": (
        "value_head/kernel.cu", "(H / N + kWarp - 1) / kWarp", "H / N / kWarp", "value_head",
        lambda d, tmp: test_value_head_backward_params(d, tmp, 130, 300, 1, torch.float32),
        "stage 1 weight partials", "plain"),
    # Stage 2's column tiles: the bias's one column gets a grid of 0 blocks, a launch error.
    "sum_partials_columns_floor": (
        "value_head/kernel.cu", "(cols + kWarp - 1) / kWarp", "cols / kWarp", "value_head",
        lambda d, tmp: test_value_head_backward_params(d, tmp, 130, 40, 0, torch.float32),
        "launch returned error", "plain"),
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_planted_defect_is_caught(tmp_path, defect):
    path, good, bad, op, case, report, variant = DEFECTS[defect]
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    text = (csrc / path).read_text()
    assert text.count(good) == 1, f"{path} no longer holds the line this defect changes"
    (csrc / path).write_text(text.replace(good, bad))
    drivers = build_drivers(csrc, tmp_path / "build", drivers=(op,), variants=(variant,))
    (tmp_path / "run").mkdir()
    with pytest.raises(AssertionError, match=re.escape(report)):
        case(drivers, tmp_path / "run")
