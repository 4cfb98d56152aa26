"""Naive PyTorch implementations of every op: the path the benchmarks compare against, and (run in
float64) the independent reference the tests check the kernels with."""
from typing import Optional

import torch


def clamped_swiglu(x: torch.Tensor, limit: Optional[float] = 7.0, *, alpha: float = 1.702,
                   linear_offset: float = 1.0, interleaved: bool = False) -> torch.Tensor:
    """Eager chunk, clamp, sigmoid and multiply, in x's dtype.

    The clamp is spelled with torch.where so that its gradient follows the op's contract: kept on
    the boundary (|u| = L, g = L) and NaN for NaN inputs. torch.clamp's own gradient (torch 2.14)
    is zero on the boundary and for NaN."""
    if interleaved:
        g, u = x[..., 0::2], x[..., 1::2]
    else:
        g, u = x.chunk(2, dim=-1)
    if limit is not None:
        g = torch.where(g > limit, limit, g)
        u = torch.where(u > limit, limit, torch.where(u < -limit, -limit, u))
    return g * torch.sigmoid(alpha * g) * (u + linear_offset)
