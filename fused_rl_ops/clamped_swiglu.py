"""Clamped SwiGLU (gpt-oss and Megatron variants), forward and backward in one pass each."""
import math
from typing import Optional

import torch

from ._library import check_device, check_float_dtype, ops

GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def _check_args(x: torch.Tensor, limit: Optional[float], scale: Optional[torch.Tensor] = None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"clamped_swiglu: x must be a tensor, got {type(x).__name__}")
    check_float_dtype("clamped_swiglu", "x", x, allow_float64=x.device.type in ("cpu", "meta"))
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"clamped_swiglu: x's last dimension must be even (gate and linear halves), got shape {tuple(x.shape)}")
    if limit is not None and not (limit > 0):
        raise ValueError(f"clamped_swiglu: limit must be > 0 or None, got {limit}")
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"clamped_swiglu: scale must be a tensor or None, got {type(scale).__name__}")
    lead = tuple(x.shape[:-1])
    if tuple(scale.shape) not in (lead, lead + (1,)):
        raise ValueError(
            f"clamped_swiglu: scale must have shape x.shape[:-1] {lead} or x.shape[:-1] + (1,), got {tuple(scale.shape)}"
        )
    if scale.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"clamped_swiglu: scale must be float32 or x's dtype ({x.dtype}), got {scale.dtype}")


def clamped_swiglu(
    x: torch.Tensor,
    limit: Optional[float] = GPT_OSS_LIMIT,
    *,
    alpha: float = GPT_OSS_ALPHA,
    linear_offset: float = 1.0,
    interleaved: bool = False,
    scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y = min(g, L) * sigmoid(alpha * min(g, L)) * (clamp(u, -L, L) + linear_offset), times scale.

    x is [..., 2F]; gate g and linear u are its halves [g | u] (Megatron's fc1 layout) or, with
    interleaved=True, g = x[..., 0::2] and u = x[..., 1::2] (gpt-oss / Hugging Face). Returns
    [..., F] in x's dtype, computed in fp32 (fp64 for float64 on CPU). limit=None: no clamp.
    Defaults are gpt-oss's; alpha=1.0, linear_offset=0.0 is Megatron's clamped SiLU.
    Backward saves only x and recomputes. NaN propagates forward as through torch.clamp. Gradients
    are masked only strictly beyond the limit: inputs exactly on -L or L keep their gradient (torch
    2.14's clamp gradient drops it) and NaN inputs get NaN gradients, never a silent zero.

    scale (the weighted form: an MoE expert's routing weights): one value per row of x, shape
    x.shape[:-1] or x.shape[:-1] + (1,), float32 or x's dtype. The result is the activation times
    scale, computed in fp32 and rounded once to x's dtype. Differentiable in scale too: its
    gradient is a sum over each row in a fixed order (deterministic).
    """
    _check_args(x, limit, scale)
    check_device("clamped_swiglu", x=x, scale=scale)
    if limit is not None and math.isinf(limit):
        limit = None
    return ops.clamped_swiglu(x, limit, float(alpha), float(linear_offset), bool(interleaved), scale)


@torch.library.register_fake("fused_rl_ops::clamped_swiglu")
def _(x, limit, alpha, linear_offset, interleaved, scale=None):
    _check_args(x, limit, scale)
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.register_fake("fused_rl_ops::clamped_swiglu_backward")
def _(grad_out, x, limit, alpha, linear_offset, interleaved):
    _check_args(x, limit)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("fused_rl_ops::clamped_swiglu_scaled_backward")
def _(grad_out, x, scale, limit, alpha, linear_offset, interleaved):
    _check_args(x, limit, scale)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(scale)


def _setup_context(ctx, inputs, output):
    x, limit, alpha, linear_offset, interleaved, scale = inputs
    ctx.save_for_backward(x, scale)
    ctx.args = (limit, alpha, linear_offset, interleaved)


def _backward(ctx, grad_out):
    x, scale = ctx.saved_tensors
    if scale is None:
        grad_x = ops.clamped_swiglu_backward(grad_out.contiguous(), x, *ctx.args)
        return grad_x, None, None, None, None, None
    grad_x, grad_scale = ops.clamped_swiglu_scaled_backward(grad_out.contiguous(), x, scale, *ctx.args)
    return grad_x, None, None, None, None, grad_scale


torch.library.register_autograd("fused_rl_ops::clamped_swiglu", _backward, setup_context=_setup_context)
