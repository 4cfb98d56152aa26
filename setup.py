"""Builds fused_rl_ops._C: CPU kernels always, CUDA kernels when a CUDA toolkit and a CUDA build of
torch are present (no GPU is needed to build). Environment knobs:
  CUDA_HOME                  the toolkit (default: found by fused_rl_ops/_cuda_home.py)
  TORCH_CUDA_ARCH_LIST       architectures (default: 8.0;9.0 and 10.0 where nvcc has it, PTX for the newest)
  FUSED_RL_OPS_CPU_ONLY=1    skip the CUDA kernels
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
sources = ["csrc/module.cpp", "csrc/common/cpu_isa.cpp"] + sorted(glob.glob("csrc/*/cpu.cpp"))
# ATen's vec headers use #pragma unroll. No implicit FMA contraction, on the CPU (-ffp-contract=off)
# or the GPU (--fmad=false): chosen_logprob's backward recomputes the forward's shifted logits
# z / T - max and needs them bit for bit (a contracted z * (1/T) - max is the product's rounding
# error, not 0, and at |z / T| ~ 1e7 that is exp(+-0.5) in a probability of 1), and every kernel
# then rounds as its formula is written, the same on both devices.
# -g0: Python's own CFLAGS (which torch's build passes on) ask for full debug information, which
# takes 40% of the compile time and 90% of the extension's size; the symbols stay.
cxx_flags = ["-O3", "-g0", "-Wall", "-Wno-unknown-pragmas", "-ffp-contract=off"]
link_flags = []
if platform.system() == "Linux":
    # at::parallel_for is inline and runs serially unless the extension itself is compiled with
    # OpenMP; libgomp is then the one torch already loaded (same soname).
    cxx_flags.append("-fopenmp")
    link_flags.append("-fopenmp")
# The CPU row kernels (csrc/<op>/cpu_rows.cpp) are compiled once per ISA, as ATen compiles its own
# CPU kernels (its flags, and -DCPU_CAPABILITY naming the namespace their code lies in), and picked at
# run time (csrc/common/cpu_isa.h); the rest, torch glue with no SIMD of its own, is built for the
# baseline ISA, so that the extension loads on any CPU of its architecture.
ROW_KERNEL_SOURCES = sorted(glob.glob("csrc/*/cpu_rows.cpp"))
ROW_KERNEL_ISAS = {"DEFAULT": []}
if platform.machine() in ("x86_64", "AMD64"):
    ROW_KERNEL_ISAS["AVX2"] = ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"]
    ROW_KERNEL_ISAS["AVX512"] = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                                 "-DCPU_CAPABILITY_AVX512"]
    cxx_flags.append("-DFRL_CPU_ISAS_X86")
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
        "row_kernel_isas": list(ROW_KERNEL_ISAS),
    }
    text = ('"""Facts of the build, written by setup.py."""\n'
            + "".join(f"{key.upper()} = {value!r}\n" for key, value in info.items()))
    path = root / "fused_rl_ops" / "_build_info.py"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def weak_symbols_outside(obj, isa):
    """The weak (COMDAT) symbols an ISA's object defines outside that ISA's namespaces: the linker
    keeps one copy of each among all objects, so such a function compiled for AVX-512 could be the
    one the rest of the extension calls on a CPU without it. (DW.ref.*: data, a pointer to the C++
    runtime's exception personality routine.)"""
    listing = subprocess.run(["nm", "--defined-only", "-C", obj], capture_output=True, text=True, check=True).stdout
    names = [line.split(" ", 2)[2] for line in listing.splitlines() if line.split(" ")[1:2] in (["W"], ["V"], ["u"])]
    return [name for name in names if f"::{isa}::" not in name and not name.startswith("DW.ref.")]


class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension, with the row kernels compiled once per ISA (ROW_KERNEL_ISAS), each into
    a folder of its own (setuptools has no flags per source file), and linked into the extension."""

    def build_extension(self, ext):
        flags = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) else ext.extra_compile_args
        objects = []
        for isa, isa_flags in ROW_KERNEL_ISAS.items():
            isa_flags = flags + isa_flags + [f"-DCPU_CAPABILITY={isa}", "-DFRL_CPU_ROWS_ISA"]
            isa_objects = self.compiler.compile(
                ROW_KERNEL_SOURCES, output_dir=os.path.join(self.build_temp, f"cpu_rows_{isa}"),
                include_dirs=ext.include_dirs, extra_postargs={"cxx": isa_flags})
            for obj in isa_objects:
                if platform.system() == "Linux" and (stray := weak_symbols_outside(obj, isa)):
                    raise RuntimeError(f"{obj} defines shared symbols outside namespace {isa}: {stray[:5]} "
                                       "(mark the shared functions FRL_HD, which inlines them there)")
            objects += isa_objects
        ext.extra_objects = objects
        ext.depends = list(ext.depends) + objects  # a recompiled row kernel relinks the extension
        super().build_extension(ext)


write_build_info()
setup(
    packages=find_packages(include=["fused_rl_ops", "fused_rl_ops.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
)
