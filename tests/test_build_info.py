"""`python -m fused_rl_ops`: the build facts setup.py recorded, and the kernels each op has."""
import subprocess
import sys

import torch

import fused_rl_ops
from fused_rl_ops import _build_info
from fused_rl_ops.__main__ import kernel_table

PUBLIC_OPS = {"clamped_swiglu", "chosen_logprob_stats", "chosen_logprob_combine", "value_head"}


def test_build_info_matches_this_build():
    assert _build_info.TORCH == torch.__version__
    assert (_build_info.CUDA is not None) == fused_rl_ops.has_cuda_kernels()
    assert (_build_info.CUDA_ARCHS is not None) == fused_rl_ops.has_cuda_kernels()


def test_kernel_table_lists_every_op_with_its_kernels():
    table = {name: (cpu, cuda) for name, cpu, cuda in kernel_table()}
    assert PUBLIC_OPS <= set(table)
    assert all(cpu for cpu, _ in table.values())
    assert all(cuda == fused_rl_ops.has_cuda_kernels() for _, cuda in table.values())


def test_main_prints_versions_and_kernels():
    out = subprocess.run([sys.executable, "-m", "fused_rl_ops"], capture_output=True, text=True, check=True).stdout
    assert f"fused_rl_ops {_build_info.VERSION}" in out
    assert f"built against torch {torch.__version__}" in out
    assert _build_info.CPU_ISA in out
    cuda = "yes" if fused_rl_ops.has_cuda_kernels() else "no"
    assert any(line.split() == ["clamped_swiglu", "yes", cuda] for line in out.splitlines())
