"""Clamped SwiGLU (gpt-oss and Megatron variants), forward and backward in one pass each."""
from typing import Optional

import torch

from ._library import check_device, check_float_dtype, ops
from ._options import (ANY_BOOL, FINITE, POSITIVE, POSITIVE_FINITE, check_options, op_arguments, option,
                       options_dataclass)

GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


@options_dataclass
class ClampedSwigluOptions:
    """The options of the clamped_swiglu ops, after their tensors x (and, for the weighted form's
    backward, scale), in the ops' order (declared for C++ as FRL_CLAMPED_SWIGLU_OPTIONS).
    Constructing it checks them (the only check of these arguments).

    limit: the clamp L; None or +inf: no clamp.
    alpha: the gate's sigmoid slope.
    linear_offset: added to the clamped linear half.
    interleaved: x holds (g, u) pairs instead of the halves [g | u].
    """
    limit: Optional[float] = option(POSITIVE)
    alpha: float = option(POSITIVE_FINITE)
    linear_offset: float = option(FINITE)
    interleaved: bool = option(ANY_BOOL)

    def __post_init__(self):
        check_options("clamped_swiglu", self)


def _check_args(x: torch.Tensor, scale: Optional[torch.Tensor] = None):
    """The op's tensors, as the C++ op checks them."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"clamped_swiglu: x must be a tensor, got {type(x).__name__}")
    check_float_dtype("clamped_swiglu", "x", x, allow_float64=x.device.type in ("cpu", "meta"))
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"clamped_swiglu: x's last dimension must be even (gate and linear halves), "
                         f"got shape {tuple(x.shape)}")
    if scale is not None:
        _check_scale(x, scale)
    check_device("clamped_swiglu", x=x, scale=scale)


def _check_scale(x: torch.Tensor, scale: torch.Tensor):
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"clamped_swiglu: scale must be a tensor or None, got {type(scale).__name__}")
    lead = tuple(x.shape[:-1])
    if tuple(scale.shape) not in (lead, lead + (1,)):
        raise ValueError(f"clamped_swiglu: scale must have shape x.shape[:-1] or x.shape[:-1] + (1,), "
                         f"got {tuple(scale.shape)} for x of shape {tuple(x.shape)}")
    if scale.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"clamped_swiglu: scale must be float32 or x's dtype, got {scale.dtype} (x: {x.dtype})")


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
    options = ClampedSwigluOptions(limit, alpha, linear_offset, interleaved)
    _check_args(x, scale)
    return ops.clamped_swiglu(x, *op_arguments(options), scale)


# The fake kernels check the arguments as the ops do.
@torch.library.register_fake("fused_rl_ops::clamped_swiglu")
def _(x, limit, alpha, linear_offset, interleaved, scale=None):
    ClampedSwigluOptions(limit, alpha, linear_offset, interleaved)
    _check_args(x, scale)
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.register_fake("fused_rl_ops::clamped_swiglu_backward")
def _(grad_out, x, *options):
    ClampedSwigluOptions(*options)
    _check_args(x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("fused_rl_ops::clamped_swiglu_scaled_backward")
def _(grad_out, x, scale, *options):
    ClampedSwigluOptions(*options)
    _check_args(x, scale)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(scale)


def _setup_context(ctx, inputs, output):
    x, *options, scale = inputs
    ctx.save_for_backward(x, scale)
    ctx.options = options


def _backward(ctx, grad_out):
    x, scale = ctx.saved_tensors
    no_grads = (None,) * len(ctx.options)
    if scale is None:
        grad_x = ops.clamped_swiglu_backward(grad_out.contiguous(), x, *ctx.options)
        return grad_x, *no_grads, None
    grad_x, grad_scale = ops.clamped_swiglu_scaled_backward(grad_out.contiguous(), x, scale, *ctx.options)
    return grad_x, *no_grads, grad_scale


torch.library.register_autograd("fused_rl_ops::clamped_swiglu", _backward, setup_context=_setup_context)
