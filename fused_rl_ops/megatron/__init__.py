"""Megatron-core integration (tested with megatron-core 0.19.2; importing this imports megatron-core):
the RL output processor, its registration on every Megatron code path, and the clamped SwiGLU MLP."""
from .attach import attach, detach
from .mlp import ClampedSwiGLUMLP, with_clamped_swiglu_mlp
from .processor import RLOutputProcessor, rl_output_processor

__all__ = ["ClampedSwiGLUMLP", "RLOutputProcessor", "attach", "detach", "rl_output_processor", "with_clamped_swiglu_mlp"]
