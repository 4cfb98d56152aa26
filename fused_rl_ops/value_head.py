"""Fused value head: one fp32 value per token from the final hidden states, v = hidden . w + b."""
from typing import Optional

import torch
from torch import nn

from ._library import acc_dtype, check_device, check_float_dtype, ops

_OP = "value_head"


def _check_args(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """The op's arguments, as the C++ op checks them (the op has no options)."""
    for name, t in (("hidden", hidden), ("weight", weight)) + ((("bias", bias),) if bias is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a tensor, got {type(t).__name__}")
    check_float_dtype(_OP, "hidden", hidden, allow_float64=hidden.device.type in ("cpu", "meta"))
    if hidden.dim() == 0 or hidden.shape[-1] == 0:
        raise ValueError(f"{_OP}: hidden must be [..., H] with H >= 1, got shape {tuple(hidden.shape)}")
    H = hidden.shape[-1]
    if tuple(weight.shape) not in ((H,), (1, H)):
        raise ValueError(f"{_OP}: weight must be [H] or [1, H] (H = hidden's last dimension), "
                         f"got shape {tuple(weight.shape)} for H = {H}")
    params = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
    for name, t in params.items():
        if t.dtype not in (torch.float32, hidden.dtype):
            raise TypeError(f"{_OP}: {name} must be float32 or hidden's dtype, got {t.dtype} (hidden: {hidden.dtype})")
    if bias is not None and (bias.dim() > 1 or bias.numel() != 1):
        raise ValueError(f"{_OP}: bias must be a scalar tensor or [1], got shape {tuple(bias.shape)}")
    check_device(_OP, hidden=hidden, weight=weight, bias=bias)


def value_head(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Values v[...] = sum_j hidden[..., j] * weight[j] + bias, accumulated and returned in fp32.

    hidden is [..., H] in float32, bfloat16 or float16 (any strides); weight is [H] or [1, H]
    (nn.Linear(H, 1)'s layout) in float32 or hidden's dtype; bias is None, a scalar or [1], in
    float32 or hidden's dtype. Returns float32 [...] (float64 for float64 inputs on the CPU).
    Differentiable in all three: hidden's gradient comes in hidden's dtype, weight's and bias's in
    their own, all accumulated in fp32; weight and bias gradients are bitwise reproducible.
    """
    _check_args(hidden, weight, bias)
    return ops.value_head(hidden, weight, bias)


class ValueHead(nn.Module):
    """A critic's value head: an nn.Linear(hidden_size, 1) run by the fused kernel.

    Initialisation follows OpenRLHF's critic: weight ~ Normal(0, 1 / (hidden_size + 1)), no bias by
    default (a bias, when asked for, starts at zero). The weight is stored as [1, hidden_size], so
    state dicts load to and from nn.Linear(hidden_size, 1). Keep the head in float32 (the default)
    under a bf16 backbone: the kernel reads bf16 hidden states with an fp32 weight directly.
    """

    def __init__(self, hidden_size: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(1, dtype=dtype, device=device)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.weight.normal_(mean=0.0, std=1.0 / (self.hidden_size + 1))
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden_size] -> fp32 values [...]."""
        return value_head(hidden, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, bias={self.bias is not None}, dtype={self.weight.dtype}"


@torch.library.register_fake("fused_rl_ops::value_head")
def _(hidden, weight, bias):
    _check_args(hidden, weight, bias)
    return hidden.new_empty(hidden.shape[:-1], dtype=acc_dtype(hidden.dtype))


@torch.library.register_fake("fused_rl_ops::value_head_backward_hidden")
def _(grad_out, weight, dtype):
    return grad_out.new_empty(*grad_out.shape, weight.shape[-1], dtype=dtype)


@torch.library.register_fake("fused_rl_ops::value_head_backward_params")
def _(grad_out, hidden):
    acc = acc_dtype(hidden.dtype)
    return grad_out.new_empty(hidden.shape[-1], dtype=acc), grad_out.new_empty((), dtype=acc)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias = inputs
    ctx.save_for_backward(hidden, weight)
    ctx.bias_meta = None if bias is None else (bias.dtype, bias.shape)


def _backward(ctx, grad_out):
    hidden, weight = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_hidden = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_hidden = ops.value_head_backward_hidden(grad_out, weight, hidden.dtype)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        grad_w, grad_b = ops.value_head_backward_params(grad_out, hidden)
        grad_weight = grad_w.to(weight.dtype).view(weight.shape)
        if ctx.bias_meta is not None:
            bias_dtype, bias_shape = ctx.bias_meta
            grad_bias = grad_b.to(bias_dtype).view(bias_shape)
    return grad_hidden, grad_weight, grad_bias


torch.library.register_autograd("fused_rl_ops::value_head", _backward, setup_context=_setup_context)
