"""Loads the compiled kernels and says what they were built with."""
import torch

from . import _C  # noqa: F401  (importing registers the fused_rl_ops::* operators)

ops = torch.ops.fused_rl_ops


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("fused_rl_ops::clamped_swiglu", "CUDA")


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
