"""`python -m fused_rl_ops`: the build facts setup.py recorded, and the kernels each op has; the
import refusing an extension built for another torch (fused_rl_ops._library)."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import fused_rl_ops
from fused_rl_ops import _build_info
from fused_rl_ops.__main__ import kernel_table
from fused_rl_ops._library import build_mismatch, cpu_isa

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
    assert f"CPU row kernels: built for {', '.join(_build_info.ROW_KERNEL_ISAS)}, running {cpu_isa()}" in out
    cuda = "yes" if fused_rl_ops.has_cuda_kernels() else "no"
    assert any(line.split() == ["clamped_swiglu", "yes", cuda] for line in out.splitlines())


def test_build_mismatch_is_the_release_and_the_cuda_major_version():
    assert build_mismatch("2.15.0+cu130", "13.0", "2.15.0+cu130", "13.0") is None
    assert build_mismatch("2.15.0+cpu", None, "2.15.0+cu130", "13.0") is None  # the local tag aside
    assert build_mismatch("2.15.0+cu130", "13.0", "2.15.0+cu130", "13.2") is None
    assert "torch 2.15.0+cu130 and torch 2.11.0+cu130 is running" in build_mismatch(
        "2.15.0+cu130", None, "2.11.0+cu130", "13.0")
    assert "torch 2.15.0 and torch 2.15.0.dev20260101 is running" in build_mismatch(
        "2.15.0", None, "2.15.0.dev20260101", None)
    assert "built for CUDA 13.0 and the running torch 2.15.0+cu128 has CUDA 12.8" in build_mismatch(
        "2.15.0+cu130", "13.0", "2.15.0+cu128", "12.8")
    assert "has no CUDA" in build_mismatch("2.15.0+cu130", "13.0", "2.15.0+cpu", None)


def import_in_a_copy(tmp_path, edit):
    """`import fused_rl_ops` from a copy of this package (its extension included) changed by
    edit(package_dir), in a fresh interpreter: (the ImportError's message or None, whether the
    extension was loaded)."""
    package = tmp_path / "fused_rl_ops"
    shutil.copytree(Path(fused_rl_ops.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    edit(package)
    code = ("import json, sys\ntry:\n    import fused_rl_ops\n    error = None\nexcept ImportError as e:\n"
            "    error = str(e)\nprint(json.dumps([error, 'fused_rl_ops._C' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_an_extension_built_for_another_torch_is_refused_before_it_loads(tmp_path):
    """The copy's build facts name another torch release: the import fails naming both versions and
    the fix, and the extension (whose C++ symbols would not resolve) is never loaded."""
    other = "2.11.0+cu130" if not torch.__version__.startswith("2.11.") else "2.15.0+cu130"

    def built_for_other_torch(package):
        info = package / "_build_info.py"
        info.write_text(re.sub(r"(?m)^TORCH = .*$", f"TORCH = {other!r}", info.read_text()))

    error, loaded = import_in_a_copy(tmp_path, built_for_other_torch)
    assert f"it was built against torch {other} and torch {torch.__version__} is running" in error
    assert "pip install --no-build-isolation" in error and "python setup.py build_ext --inplace" in error
    assert not loaded


def test_a_package_never_built_says_so(tmp_path):
    def unbuilt(package):
        for built in [package / "_build_info.py", *package.glob("_C*.so")]:
            built.unlink()

    error, loaded = import_in_a_copy(tmp_path, unbuilt)
    assert error.startswith("fused_rl_ops is not built here") and "--no-build-isolation" in error
    assert not loaded
