"""Fused kernels for RL post-training on Megatron-core."""
from ._library import has_cuda_kernels
from .swiglu import clamped_swiglu

__all__ = ["clamped_swiglu", "has_cuda_kernels"]
