"""Naive PyTorch implementations of every op: the path the benchmarks compare against, and (run in
float64) the independent reference the tests check the kernels with."""
from typing import Optional

import torch


def clamped_swiglu(x: torch.Tensor, limit: Optional[float] = 7.0, *, alpha: float = 1.702,
                   linear_offset: float = 1.0, interleaved: bool = False) -> torch.Tensor:
    """Eager chunk, clamp, sigmoid and multiply, in x's dtype."""
    if interleaved:
        g, u = x[..., 0::2], x[..., 1::2]
    else:
        g, u = x.chunk(2, dim=-1)
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + linear_offset)
