"""Compile gate: every CUDA source compiles for sm_90 with warnings as errors, no kernel spills
registers (read from ptxas's resource report), and every kernel is in namespace fused_rl_ops (the
filter of gpu_check.sh's racecheck and synccheck). Needs nvcc, not a GPU."""
import glob
import os
import re
import subprocess

import pytest

from fused_rl_ops._cuda_home import find_cuda_home

CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")
CU_FILES = sorted(glob.glob(os.path.join(CSRC, "*", "kernel.cu")))


def nvcc_path():
    home = find_cuda_home()
    return os.path.join(home, "bin", "nvcc") if home else None


@pytest.mark.skipif(nvcc_path() is None, reason="no CUDA toolkit on this machine")
@pytest.mark.parametrize("source", CU_FILES, ids=lambda path: os.path.basename(os.path.dirname(path)))
def test_compiles_for_sm90_without_warnings_or_spills(source, tmp_path):
    result = subprocess.run(
        [nvcc_path(), "-std=c++17", "-O3", "--fmad=false", "-arch=sm_90", "-Werror", "all-warnings", "-Xptxas", "-v",
         f"-I{CSRC}", "-c", source, "-o", str(tmp_path / "out.o")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    report = result.stderr
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    assert kernels, "ptxas reported no kernels"
    # gpu_check.sh's racecheck and synccheck check the kernels whose mangled names hold the namespace.
    outside = [k for k in kernels if "fused_rl_ops" not in k]
    assert not outside, f"kernels outside namespace fused_rl_ops (gpu_check.sh's sanitizers skip them): {outside}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) >= len(kernels)
    spilling = [k for k, (st, ld) in zip(kernels, spills) if int(st) or int(ld)]
    assert not spilling, f"kernels spill registers: {spilling}"


def test_every_kernel_source_is_gated():
    assert CU_FILES, "no CUDA sources found"
