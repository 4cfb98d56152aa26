"""The kernels-on-CPU harness: g++ compiles each op's launchers and kernels (csrc/<op>/kernel.cu and
kernel.cuh, the sources nvcc compiles) with the host execution model
tests/kernels_on_cpu/cuda_on_host.h (what it models and what not: its header comment). A driver per
op (tests/kernels_on_cpu/<op>_driver.cpp) reads a case written here, calls one of the op's launchers
for a stand-in device and writes the buffers back; one process per build serves the session's cases
(ServingDriver). Every case runs in three builds, plain,
ThreadSanitizer and AddressSanitizer + UBSan; any sanitizer report, harness error or wrong number
fails it, and the three builds must agree bit for bit. The cases are in tests/kernels_on_cpu/test_<op>.py
(against float64 references) and tests/kernels_on_cpu/test_harness.py (the model's own checks and the
planted defects it must catch).

Run them alone with `python -m pytest -m kernels_on_cpu tests`. The drivers are built once per
session into build/kernels_on_cpu/<hash of the sources>/ (reused while the sources are unchanged)."""
import concurrent.futures
import dataclasses
import hashlib
import math
import os
import re
import select
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from fused_rl_ops._cuda_home import find_cuda_home
from fused_rl_ops.logit_options import LogitMap
from tests.helpers import op_table

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
HARNESS = ROOT / "tests" / "kernels_on_cpu"
CUDA_HOME = find_cuda_home()
CUDA_INCLUDE = Path(CUDA_HOME or "", "include")
CXX = os.environ.get("CXX", "g++")
# The ops whose kernels the harness runs, and each one's driver (the op table's).
OP_DRIVERS = {op.name: op.kernels_on_cpu_driver for op in op_table.OPS if op.kernels_on_cpu_driver}
DRIVERS = (*OP_DRIVERS, "harness_selftest")
# Every build's flags. -rdynamic: cuda_on_host names the kernels launched from their symbols. -g1:
# line tables only, what the sanitizers' reports print (file:line); full -g, for a debugger, cost a
# third more of the compile time.
COMMON_FLAGS = ["-std=c++17", "-O1", "-g1", "-pthread", "-rdynamic", "-Wall", "-Wno-unknown-pragmas"]
# asan_ubsan at -O0: UBSan's checks made g++ take 33 s over a kernel.cu at -O1, 19 s at -O0 (the
# cases' few rows run as fast either way), and the same fp32 arithmetic (SSE, no contraction).
BUILDS = {
    "plain": [],
    "tsan": ["-fsanitize=thread"],
    "asan_ubsan": ["-O0", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
}
SANITIZER_ENV = {
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66",
    # redzone: at least 1 KiB of poisoned bytes on each side of every allocation (ASan's default
    # grows from 16 bytes with the size: 128 at a few KiB), so that a write that misses its buffer by
    # a few hundred bytes is reported as the overflow it is, never as a SEGV on unmapped memory or a
    # silent write into the next allocation.
    "ASAN_OPTIONS": "halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:redzone=1024",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
# Dtype of a buffer: (name in case.txt, the launcher's DType value).
DTYPES = {torch.float32: ("f32", 0), torch.bfloat16: ("bf16", 1), torch.float16: ("f16", 2),
          torch.int64: ("i64", None), torch.float64: ("f64", None)}
FP32_EPS = 2.0**-23
# Relative spacing of a dtype's values (one ulp, at worst): kernels compute in fp32 and round once.
ULP = {torch.float32: FP32_EPS, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
HALF_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = [
    pytest.mark.kernels_on_cpu,
    pytest.mark.stack_independent,
    pytest.mark.skipif(CUDA_HOME is None or shutil.which(CXX) is None,
                       reason="needs the CUDA toolkit's headers and g++"),
]


# ---------------------------------------------------------------------------------------------
# Building and running the drivers


# A static shared-memory declaration, `__shared__ T name[dims];`, and what the host model compiles
# instead: kConcurrentBlocks copies and a reference to the copy of the block's slot
# (cuda_on_host.h), on the declaration's line(s).
SHARED_DECLARATION = re.compile(r"__shared__\s+(?P<type>[\w:<>,\s]+?)\s+(?P<name>\w+)\s*(?P<dims>(?:\[[^\]]*\]\s*)+);")


def per_slot_shared(text):
    """text with each static __shared__ declaration given one copy per concurrent block."""
    def rewrite(m):
        dims = re.sub(r"\s+", " ", m["dims"]).strip()
        return (f"static {m['type']} {m['name']}_per_slot[cuda_on_host::kConcurrentBlocks]{dims}; "
                f"auto& {m['name']} = {m['name']}_per_slot[cuda_on_host::block_slot];" + "\n" * m[0].count("\n"))
    return SHARED_DECLARATION.sub(rewrite, text)


def host_sources(csrc, out_dir):
    """Copies of csrc and of the harness's sources under out_dir, as the host model compiles them
    (per_slot_shared); returns their (csrc, harness) directories."""
    copies = []
    for source, name in ((csrc, "csrc"), (HARNESS, "harness")):
        shutil.rmtree(out_dir / name, ignore_errors=True)
        shutil.copytree(source, out_dir / name)
        for path in (out_dir / name).rglob("*"):
            if path.suffix in (".h", ".cuh", ".cu", ".cpp"):
                path.write_text(per_slot_shared(path.read_text()))
        copies.append(out_dir / name)
    return copies


def build_drivers(csrc, out_dir, drivers=DRIVERS, variants=tuple(BUILDS)):
    """Compiles each driver (tests/kernels_on_cpu/NAME.cpp; for an op, its driver with the op's
    csrc/<op>/kernel.cu) against the sources in csrc (host_sources' copies, in out_dir/src), in each
    build variant, into out_dir/<variant>/NAME, in parallel."""
    csrc, harness = host_sources(csrc, out_dir / "src")
    jobs = []
    for variant in variants:
        flags = BUILDS[variant]
        (out_dir / variant).mkdir(parents=True, exist_ok=True)
        for d in drivers:
            name = OP_DRIVERS.get(d, d)
            launchers = ["-x", "c++", str(csrc / d / "kernel.cu")] if d in OP_DRIVERS else []
            cmd = [CXX, *COMMON_FLAGS, *flags,
                   f"-I{CUDA_INCLUDE}", f"-I{csrc}", f"-I{harness}", "-include", "cuda_on_host.h",
                   str(harness / f"{name}.cpp"), *launchers, "-o", str(out_dir / variant / name)]
            jobs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    # Read every compiler's output before its exit status: one that fills its pipe would block.
    outputs = [job.communicate()[0] for job in jobs]
    errors = [output for job, output in zip(jobs, outputs) if job.returncode != 0]
    assert not errors, "driver build failed:\n" + "\n".join(errors)
    return out_dir


def sources_hash():
    h = hashlib.sha256(" ".join([CXX, str(CUDA_INCLUDE), repr(COMMON_FLAGS), repr(BUILDS)]).encode())
    h.update(subprocess.run([CXX, "--version"], capture_output=True).stdout)
    sources = [*CSRC.rglob("*.h"), *CSRC.rglob("*.cuh"), *CSRC.rglob("*.cu"), *HARNESS.glob("*.h"),
               *HARNESS.glob("*.cpp")]  # not the test files: editing a case rebuilds nothing
    for path in sorted(sources):
        h.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def drivers():
    out_dir = ROOT / "build" / "kernels_on_cpu" / sources_hash()
    if not (out_dir / "complete").exists():
        shutil.rmtree(out_dir.parent, ignore_errors=True)  # builds of older sources
        build_drivers(CSRC, out_dir)
        (out_dir / "complete").touch()
    yield out_dir
    stop_serving()


class ServingDriver:
    """A driver process serving cases one after another (tests/kernels_on_cpu/driver.h), started
    again after a case that ended it. One process keeps its threads from case to case: creating the
    512 threads of a launch took ThreadSanitizer over a second."""

    def __init__(self, path):
        self.path, self.process, self.last_stderr = path, None, None

    def run(self, case_dir, out_dir, timeout=600):
        """Runs one case; returns its CompletedProcess: the exit status (0 when the case passed), the
        launches it made as stdout, its standard error."""
        if self.process is None or self.process.poll() is not None:
            # What the process writes before its first case goes into that case's stderr.txt.
            with open(out_dir / "stderr.txt", "a") as startup_stderr:
                self.process = subprocess.Popen([str(self.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=startup_stderr, text=True, env={**os.environ, **SANITIZER_ENV})
        self.last_stderr = out_dir / "stderr.txt"
        self.process.stdin.write(f"{case_dir}\t{out_dir}\n")
        self.process.stdin.flush()
        if select.select([self.process.stdout], [], [], timeout)[0]:
            reply = self.process.stdout.readline()
        else:
            reply = f"timed out after {timeout} s"
        if reply not in ("done\n", ""):  # timed out, or printed something else (a kernel's printf): ended
            self.process.kill()
        code = 0 if reply == "done\n" else self.process.wait()
        launches = out_dir / "launches.txt"
        return subprocess.CompletedProcess(self.path, code, launches.read_text() if launches.exists() else "",
                                           self.last_stderr.read_text() + ("" if code == 0 else reply))

    def stop(self):
        """Ends a process still serving; fails if its exit was not clean."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.stdin.close()
        code = self.process.wait(timeout=120)
        stderr = self.last_stderr.read_text()
        assert code == 0 and not stderr, f"{self.path} ended with exit {code}:\n{stderr[:4000]}"


SERVING = {}  # executable path -> ServingDriver, for the session


def serving(path):
    return SERVING.setdefault(path, ServingDriver(path))


def stop_serving():
    drivers = list(SERVING.values())
    SERVING.clear()
    for driver in drivers:
        driver.stop()


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
    processes = {v: serving(drivers / v / OP_DRIVERS[op]) for v in variants}

    def run(variant):
        out_dir = tmp_dir / variant
        out_dir.mkdir()
        return processes[variant].run(case_dir, out_dir)

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


def assert_rounded_once(actual, expected, dtype, what, fp32_error=0.0):
    """Computed in fp32 and rounded once to dtype: within one ulp of dtype (relative spacing at
    worst) of the float64 value, plus fp32's own error before the rounding (a few eps relative,
    and fp32_error absolute) and fp16's subnormal spacing 2^-24."""
    tol = (ULP[dtype] + 8 * FP32_EPS) * expected.abs() + fp32_error + (2.0**-24 if dtype == torch.float16 else 0.0)
    assert_within(actual, expected, tol, what)


def sum_tolerance(terms):
    """Any order of summing n fp32 terms (each an fp32 product, itself within eps/2): error at most
    (n + 1) eps/2 of the sum of |terms|. terms: [..., n] float64."""
    return (terms.shape[-1] + 1) * FP32_EPS / 2 * terms.abs().sum(-1)


# ---------------------------------------------------------------------------------------------
# chosen_logprob: float64 references and runs of its row kernels, shared by its case files

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


def running_stats(earlier, has_earlier):
    """[N, 4] fp32 stats of an earlier chunk's logits (float64 [N, k]) where has_earlier, empty
    elsewhere; the chosen logit 0.5 (not in the chunk)."""
    m0, s0, t0 = row_stats64(earlier)
    stats = torch.stack([m0, s0, t0, torch.full_like(m0, 0.5)], 1).float()
    stats[~has_earlier] = torch.tensor([-math.inf, 0.0, 0.0, 0.0])
    return stats


def logit_map_scalars(temperature, softcap=None, prefix="") -> dict:
    """A case's logit map, as the driver reads it (read_logit_map): a scalar prefix + name per option
    of LogitMap (FRL_LOGIT_MAP), an optional one left out when None."""
    options = dataclasses.asdict(LogitMap(temperature, softcap))
    return {prefix + name: value for name, value in options.items() if value is not None}


def threshold_buffer(threshold):
    """The optional threshold buffer of a row kernel's case (the sampler's filter)."""
    return {} if threshold is None else {"threshold": Buf(threshold.float())}


STATS_WIDTH = 4  # stats_rows' columns per access on its vector path (kStatsWidth)


def run_stats_rows(drivers, tmp_path, logits, tokens, stats, col0, temperature, passes, softcap=None, threshold=None,
                   offset=0):
    """The stats_rows kernel (vocab_parallel_stats_rows_kernel) merging logits [N, C] into stats (softcap None: none; threshold:
    the logits below it dropped; offset: the logits' elements past a 16-byte boundary); checks the
    path the launcher took (vector where C and the logits allow); returns the stats it wrote, in
    float64."""
    N, C = logits.shape
    out, [launch] = run_case(drivers, "chosen_logprob", "stats_rows",
                             {"logits": Buf(logits, offset), "tokens": Buf(tokens), "stats": Buf(stats),
                              **threshold_buffer(threshold)},
                             {"N": N, "C": C, "col0": col0, **logit_map_scalars(temperature, softcap)},
                             passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=launch.block[0] // 32)  # a warp per row
    vector = C % STATS_WIDTH == 0 and offset % STATS_WIDTH == 0
    assert launch.width == (STATS_WIDTH if vector else 1), f"stats_rows took width {launch.width}"
    return out["stats"].double()


def combined_stats64(z):
    """(row max, log-sum relative to it, entropy) of each row of z, in float64, as combine_row
    writes them."""
    m = z.max(1).values
    lse, ent = lse_entropy64(z)
    return m, lse - m, ent


def run_grad_rows(drivers, tmp_path, logits, tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge, col0,
                  temperature, passes, softcap=None, grads=None, grads_col=0, offsets=(0, 0), threshold=None):
    """chosen_logprob_grad_rows_kernel on logits [N, C] with the per-row values (rounded to fp32; softcap None:
    none; threshold: the logits below it pass no gradient): in place by default, returning the
    gradients it wrote over the logits; or into columns [grads_col, grads_col + C) of grads ([N,
    stride] in the gradient dtype), returning all of grads.
    offsets: the logits' and grads' elements past a 16-byte boundary. Returns (gradients, launch)."""
    N, C = logits.shape
    buffers = {"logits": Buf(logits, offsets[0]), "tokens": Buf(tokens), "row_max": Buf(row_max.float()),
               "log_sum": Buf(log_sum.float()), "log_sum_minus_entropy": Buf(log_sum_minus_entropy.float()),
               "gl": Buf(gl), "ge": Buf(ge), **threshold_buffer(threshold)}
    scalars = {"N": N, "C": C, "col0": col0, **logit_map_scalars(temperature, softcap), "in_place": int(grads is None)}
    if grads is not None:
        buffers["grads"] = Buf(grads, offsets[1])
        scalars.update(dtype=dtype_scalar(grads.dtype), grads_stride=grads.shape[1], grads_col=grads_col)
    out, [launch] = run_case(drivers, "chosen_logprob", "grad_rows", buffers, scalars, passes=passes,
                             block_order_seed=N, tmp_dir=tmp_path)
    assert_passes(launch, N, passes)
    return out["logits" if grads is None else "grads"], launch


def grad_rows_reference(logits, tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge, col0, inv_temp):
    """float64 gradients d(gl logprob + ge entropy)/d(logits) from the fp32 per-row values the
    kernel gets, and their tolerance."""
    d, scale = logit_grads64((logits * inv_temp).double(), tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge,
                             col0)
    return d * inv_temp, 8 * FP32_EPS * scale * inv_temp + 1e-30


def logit_grads64(z, tokens, row_max, log_sum, log_sum_minus_entropy, gl, ge, col0, z_error=0.0):
    """float64 d(gl logprob + ge entropy)/dz of float64 logits z from the fp32 per-row values the
    kernel gets, and the scale of its fp32 error (in eps; z_error: the absolute error of the
    kernel's own z). A logit of probability 0 (-inf) gets none (the limit of p (z - sum p z) as
    p -> 0; float64 would say 0 * inf = NaN); NaN anywhere stays NaN."""
    N, C = z.shape
    zr = z - row_max.float().double()[:, None]  # z - m
    l, mu = log_sum.float().double()[:, None], log_sum_minus_entropy.float().double()[:, None]
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
