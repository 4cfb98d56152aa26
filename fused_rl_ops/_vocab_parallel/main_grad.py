"""Megatron's main_grad: the fp32 gradient-accumulation buffer the backward adds the weight gradient
into, as megatron-core's linear layers (LinearWithGradAccumulationAndAsyncCommunication) do."""
from typing import Optional

import torch


def check_main_grad(op: str, main_grad, weight: torch.Tensor) -> None:
    if main_grad is None:
        return
    if (not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape
            or main_grad.device != weight.device or main_grad.dtype not in (torch.float32, weight.dtype)):
        got = (f"{tuple(main_grad.shape)} {main_grad.dtype} on {main_grad.device}"
               if isinstance(main_grad, torch.Tensor) else type(main_grad).__name__)
        raise ValueError(f"{op}: main_grad must be a float32 (or weight-dtype) tensor of weight's shape "
                         f"{tuple(weight.shape)} on {weight.device}, got {got}")


def weight_placeholder(weight: torch.Tensor, main_grad: Optional[torch.Tensor]) -> Optional[str]:
    """What the backward returns as the weight's gradient when it adds that gradient into main_grad:
    under Megatron's DDP (the weight carries grad_added_to_main_grad) a placeholder of the weight's
    shape, "zeros" when weight.zero_out_wgrad else "empty", which DDP's hook then drops without
    adding; otherwise None (no gradient). Sets grad_added_to_main_grad here, when the call is
    recorded for a backward, rather than in the backward, which dynamo traces without attribute side
    effects; DDP's hook reads the flag only after the backward."""
    if main_grad is None or not hasattr(weight, "grad_added_to_main_grad"):
        return None
    if torch.is_grad_enabled() and weight.requires_grad:
        weight.grad_added_to_main_grad = True
    return "zeros" if getattr(weight, "zero_out_wgrad", False) else "empty"


def placeholder_gradient(weight: torch.Tensor, placeholder: Optional[str]) -> Optional[torch.Tensor]:
    """The weight's gradient for a weight_placeholder answer."""
    if placeholder == "zeros":
        return torch.zeros_like(weight)
    if placeholder == "empty":
        return torch.empty_like(weight)
    return None
