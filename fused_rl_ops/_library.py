"""Loads the compiled kernels, once it is sure they were built for the running torch, and says what
they were built with."""
from typing import Optional

import torch


def build_mismatch(built_torch: str, built_cuda: Optional[str], running_torch: str,
                   running_cuda: Optional[str]) -> Optional[str]:
    """Why an extension built against torch built_torch (with CUDA kernels for built_cuda, or None)
    cannot load under running_torch (running_cuda), or None when it can. libtorch's C++ ABI changes
    between releases (a 2.15.0 build under 2.11.0: an undefined symbol), so the release must be the
    same, its local tag (+cu130, +cpu: the same C++ code) aside; CUDA kernels need the CUDA major
    version they were linked against (their libcudart)."""
    if built_torch.split("+")[0] != running_torch.split("+")[0]:
        return f"it was built against torch {built_torch} and torch {running_torch} is running"
    if built_cuda and (running_cuda or "").split(".")[0] != built_cuda.split(".")[0]:
        return (f"its CUDA kernels were built for CUDA {built_cuda} and the running torch {running_torch} "
                f"has {'CUDA ' + running_cuda if running_cuda else 'no CUDA'}")
    return None


def _check_build():
    """Refuses to load an extension that is missing or built for another torch, saying how to build it."""
    how_to_build = ("build it against the running torch: `pip install --no-build-isolation --no-deps "
                    "--force-reinstall <where you installed it from>`, or `python setup.py build_ext --inplace` "
                    "in a checkout (docs/build.md)")
    try:
        from . import _build_info
    except ImportError:
        raise ImportError(f"fused_rl_ops is not built here (no _build_info.py): {how_to_build}") from None
    mismatch = build_mismatch(_build_info.TORCH, _build_info.CUDA, torch.__version__, torch.version.cuda)
    if mismatch:
        raise ImportError(f"fused_rl_ops cannot load its kernels: {mismatch}; {how_to_build}")


_check_build()
from . import _C  # noqa: E402, F401  (importing registers the fused_rl_ops::* operators)

ops = torch.ops.fused_rl_ops


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA kernels: every operator it registers has one."""
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused_rl_ops::")]
    return bool(names) and all(torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA") for n in names)


def cpu_isa() -> str:
    """The instruction set the CPU kernels' row kernels run: "AVX512", "AVX2" or "DEFAULT" (scalar),
    chosen once as ATen's CPU capability (so ATEN_CPU_CAPABILITY=avx2 or =default forces a lower one)."""
    return _C.cpu_isa()


def check_device(op: str, **tensors):
    """Raises a clear error when tensors sit on different devices or on one without kernels."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {listed}")
    device = next(iter(devices.values()))
    if device.type == "cuda" and not has_cuda_kernels():
        raise RuntimeError(f"{op}: fused_rl_ops was built without CUDA kernels; reinstall with a CUDA toolkit")
    if device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{op}: unsupported device {device}")


def check_float_dtype(op: str, name: str, t: torch.Tensor, allow_float64: bool):
    allowed = (torch.float32, torch.bfloat16, torch.float16) + ((torch.float64,) if allow_float64 else ())
    if t.dtype not in allowed:
        extra = " (float64 only on CPU)" if t.dtype == torch.float64 else ""
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16{extra}, got {t.dtype}")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulation and fp32-output dtype for inputs of dtype: float64 stays float64
    (CPU, for gradcheck), everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
