"""Fused kernels for RL post-training on Megatron-core."""
from ._library import has_cuda_kernels
from .chosen_logprob import DEFAULT_WORKSPACE_BYTES, chosen_logprob
from .swiglu import clamped_swiglu

__all__ = ["DEFAULT_WORKSPACE_BYTES", "chosen_logprob", "clamped_swiglu", "has_cuda_kernels"]
