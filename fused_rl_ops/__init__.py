"""Fused kernels for RL post-training on Megatron-core."""
from ._library import has_cuda_kernels
from .chosen_logprob import DEFAULT_WORKSPACE_BYTES, chosen_logprob
from .clamped_swiglu import clamped_swiglu
from .logit_options import LogitMap, LogitOptions
from .top_logprobs import top_logprobs
from .value_head import ValueHead, value_head
from .vocab_divergence import vocab_divergence

__all__ = ["DEFAULT_WORKSPACE_BYTES", "LogitMap", "LogitOptions", "ValueHead", "chosen_logprob", "clamped_swiglu",
           "has_cuda_kernels", "top_logprobs", "value_head", "vocab_divergence"]
