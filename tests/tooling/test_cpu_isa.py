"""The CPU row kernels' instruction set (csrc/common/cpu_isa.h): built for DEFAULT (scalar), AVX2 and
AVX512 on x86-64 and chosen at run time as ATen's CPU capability. Each ISA this CPU runs, forced with
ATEN_CPU_CAPABILITY in a fresh process, passes every op's float64 reference tests (the ISAs may
differ from each other in the last bits: their vector widths sum a row's lanes in different orders,
docs/determinism.md); an ISA the CPU lacks is refused with a warning and the widest one it has runs
instead."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_rl_ops

from fused_rl_ops import _build_info
from fused_rl_ops._library import cpu_isa

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine() in ("x86_64", "AMD64")
# ATEN_CPU_CAPABILITY's value -> the ISA's name, and the CPU features it needs (ATen's own check).
ISAS = {"default": ("DEFAULT", set()), "avx2": ("AVX2", {"avx2", "fma"}),
        "avx512": ("AVX512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"})}
REFERENCE_TESTS = [
    "tests/ops/test_vocab_divergence.py::test_matches_float64_reference",
    "tests/ops/test_vocab_divergence.py::test_float64",
    "tests/ops/test_chosen_logprob.py::test_matches_float64_reference",
    "tests/ops/test_chosen_logprob_sampler_filter.py::test_matches_float64_reference",
    "tests/ops/test_top_logprobs.py::test_top_logprobs_match_float64",
    "tests/ops/test_clamped_swiglu.py::test_matches_float64_reference",
    "tests/ops/test_clamped_swiglu.py::test_reduced_precision",
    "tests/ops/test_clamped_swiglu.py::test_scaled_matches_float64_reference",
    "tests/ops/test_clamped_swiglu.py::test_gradcheck_float64",
    "tests/ops/test_value_head.py::test_matches_float64_reference",
    "tests/ops/test_value_head.py::test_reduced_precision_hidden",
    "tests/ops/test_value_head.py::test_non_finite_values_and_gradients_as_float64_linear",
]


def cpu_flags() -> set:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def runnable(capability: str) -> bool:
    return capability == "default" or (X86 and ISAS[capability][1] <= cpu_flags())


def forced(capability: str, *args) -> subprocess.CompletedProcess:
    """args run by this Python with ATEN_CPU_CAPABILITY=capability, the repository first on its path."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, FUSED_RL_OPS_TEST_DEVICES="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_the_build_has_every_isa_of_its_machine():
    assert _build_info.ROW_KERNEL_ISAS == (["DEFAULT", "AVX2", "AVX512"] if X86 else ["DEFAULT"])


def test_the_row_kernels_run_atens_capability():
    aten = torch.backends.cpu.get_cpu_capability()
    assert cpu_isa() == (aten if X86 and aten in ("AVX2", "AVX512") else "DEFAULT")


@pytest.mark.skipif(not X86, reason="x86-64 builds only have more than the scalar row kernels")
@pytest.mark.parametrize("capability", ISAS)
def test_a_forced_isa_runs_where_the_cpu_has_it_else_is_refused_with_a_warning(capability):
    result = forced(capability, "-c", "from fused_rl_ops._library import cpu_isa; print(cpu_isa())")
    assert result.returncode == 0, result.stderr
    ran = result.stdout.split()[-1]
    if runnable(capability):
        assert ran == ISAS[capability][0]
        assert "cannot run" not in result.stderr
    else:
        widest = next(name for cap, (name, _) in reversed(ISAS.items()) if runnable(cap))
        assert ran == widest
        assert f"ATen's CPU capability is {ISAS[capability][0]}" in result.stderr
        assert f"which this CPU cannot run; the row kernels run {widest}" in result.stderr


@pytest.mark.parametrize("capability", [c for c in ISAS if runnable(c)])
def test_every_isa_the_cpu_runs_matches_the_float64_references(capability):
    script = ("import sys, pytest\nfrom fused_rl_ops._library import cpu_isa\n"
              f"assert cpu_isa() == {ISAS[capability][0]!r}, cpu_isa()\n"
              f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *{REFERENCE_TESTS!r}]))")
    result = forced(capability, "-c", script)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


@pytest.mark.skipif(not X86, reason="the ISA namespaces exist on x86-64 builds only")
def test_only_the_isa_namespaces_hold_vector_instructions():
    """The extension loads on any x86-64 CPU: the code outside the AVX2 and AVX512 namespaces (the
    torch glue, the scalar row kernels) has no VEX-encoded instruction (AVX and later) at all."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", fused_rl_ops._C.__file__],
                             capture_output=True, text=True, check=True).stdout
    # A name objdump cannot demangle keeps its namespaces as <length><name>: 4AVX2, 6AVX512.
    isa_namespaces = ("::AVX2::", "::AVX512::", "4AVX2", "6AVX512")
    function, outside = None, {}
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line.split("<", 1)[1][:-2]
        elif function and "\t" in line and not any(name in function for name in isa_namespaces):
            mnemonic = line.split("\t")[1].split(" ")[0]
            if mnemonic.startswith("v") or "%ymm" in line or "%zmm" in line:
                outside.setdefault(function, mnemonic)
    counted = sum(1 for line in listing.splitlines() if line.endswith(">:"))
    assert counted > 1000 and not outside, list(outside.items())[:10]
