"""Builds fused_rl_ops._C: CPU kernels always, CUDA kernels when a CUDA toolkit and a CUDA build of
torch are present (no GPU is needed to build). Environment knobs:
  CUDA_HOME                  the toolkit (default: found by fused_rl_ops/_cuda_home.py)
  TORCH_CUDA_ARCH_LIST       architectures (default: 8.0;9.0 and 10.0 where nvcc has it, PTX for the newest)
  FUSED_RL_OPS_CPU_ONLY=1    skip the CUDA kernels
  FUSED_RL_OPS_NO_AVX2=1     x86-64 CPU kernels without AVX2/FMA (for CPUs that lack them)
  MAX_JOBS                   parallel compile jobs (ninja)
"""
import glob
import importlib.util
import os
import platform
import subprocess
import sys

from setuptools import find_packages, setup


def find_cuda_home():
    """fused_rl_ops/_cuda_home.py's answer, loaded from its file (the package is not built yet)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_rl_ops", "_cuda_home.py")
    spec = importlib.util.spec_from_file_location("cuda_home", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.find_cuda_home()


def default_arch_list(cuda_home):
    archs = subprocess.run(
        [os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True, text=True
    ).stdout.split()
    wanted = ["8.0", "9.0"] + (["10.0"] if "compute_100" in archs else [])
    return ";".join(wanted) + "+PTX"


CUDA_HOME = None if os.environ.get("FUSED_RL_OPS_CPU_ONLY") == "1" else find_cuda_home()
if CUDA_HOME:
    # torch.utils.cpp_extension reads CUDA_HOME when imported.
    os.environ["CUDA_HOME"] = CUDA_HOME

try:
    import torch  # noqa: E402
except ImportError:
    # pip's default isolated build hides the installed torch; compiling against another one (the
    # newest, were it a build requirement) would give an extension that cannot load.
    sys.exit("fused_rl_ops: torch is not importable in this build environment (pip's build isolation hides an "
             "installed one). The extension must be compiled against the torch it will run with: install torch "
             "(>=2.11,<2.16) first, then build without isolation:\n"
             "    pip install setuptools wheel ninja\n"
             "    pip install --no-build-isolation <the same path, git URL or fused_rl_ops[extras]>")
from torch.utils import cpp_extension  # noqa: E402

WITH_CUDA = CUDA_HOME is not None and torch.version.cuda is not None
if CUDA_HOME and not WITH_CUDA:
    print("fused_rl_ops: torch has no CUDA support; building the CPU kernels only", file=sys.stderr)
elif not CUDA_HOME:
    print("fused_rl_ops: no CUDA toolkit found; building the CPU kernels only", file=sys.stderr)

# Every op's folder csrc/<op>/ holds cpu.cpp, cuda.cpp and kernel.cu; they include "<op>/..." and
# "common/..." from csrc.
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
sources = ["csrc/module.cpp"] + sorted(glob.glob("csrc/*/cpu.cpp"))
# ATen's vec headers use #pragma unroll. No implicit FMA contraction, on the CPU (-ffp-contract=off)
# or the GPU (--fmad=false): chosen_logprob's backward recomputes the forward's shifted logits
# z / T - max and needs them bit for bit (a contracted z * (1/T) - max is the product's rounding
# error, not 0, and at |z / T| ~ 1e7 that is exp(+-0.5) in a probability of 1), and every kernel
# then rounds as its formula is written, the same on both devices.
cxx_flags = ["-O3", "-Wall", "-Wno-unknown-pragmas", "-ffp-contract=off"]
link_flags = []
if platform.system() == "Linux":
    # at::parallel_for is inline and runs serially unless the extension itself is compiled with
    # OpenMP; libgomp is then the one torch already loaded (same soname).
    cxx_flags.append("-fopenmp")
    link_flags.append("-fopenmp")
if platform.machine() in ("x86_64", "AMD64") and os.environ.get("FUSED_RL_OPS_NO_AVX2") != "1":
    # The CPU kernels use at::vec; without these its Vectorized falls back to scalar loops.
    cxx_flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
if WITH_CUDA:
    sources += sorted(glob.glob("csrc/*/cuda.cpp")) + sorted(glob.glob("csrc/*/kernel.cu"))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", default_arch_list(CUDA_HOME))
    print(f"fused_rl_ops: building CUDA kernels for {os.environ['TORCH_CUDA_ARCH_LIST']} with {CUDA_HOME}",
          file=sys.stderr)
    extension = cpp_extension.CUDAExtension(
        "fused_rl_ops._C",
        sources,
        include_dirs=[CSRC],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr", "--fmad=false"]},
        extra_link_args=link_flags,
    )
else:
    extension = cpp_extension.CppExtension("fused_rl_ops._C", sources, include_dirs=[CSRC],
                                           extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)


def write_build_info():
    """Writes fused_rl_ops/_build_info.py (git-ignored) with the facts of this build, which
    `python -m fused_rl_ops` prints; rewritten only when they change, so re-runs touch nothing."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).parent
    info = {
        "version": tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"],
        "torch": torch.__version__,
        "cuda": torch.version.cuda if WITH_CUDA else None,
        "cuda_archs": os.environ["TORCH_CUDA_ARCH_LIST"] if WITH_CUDA else None,
        "cpu_isa": "AVX2+FMA" if "-mavx2" in cxx_flags else f"{platform.machine()} baseline (no AVX2)",
    }
    text = ('"""Facts of the build, written by setup.py."""\n'
            + "".join(f"{key.upper()} = {value!r}\n" for key, value in info.items()))
    path = root / "fused_rl_ops" / "_build_info.py"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


write_build_info()
setup(
    packages=find_packages(include=["fused_rl_ops", "fused_rl_ops.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
