"""Megatron-core integration (tested with megatron-core 0.18 and 0.19; importing this imports megatron-core):
the RL output processor (with on-policy distillation: the teacher's processor), its registration on
every Megatron code path, the clamped SwiGLU MLP (dense and MoE experts), and the check that a
configured clamp is never dropped."""
from .attach import attach, detach
from .distillation import TEACHER_OUTPUTS, TeacherOutputProcessor, teacher_output_processor
from .mlp import (
    ClampedSwiGLUMLP,
    ClampedSwiGLUNotAppliedError,
    ClampedSwiGLUSequentialMLP,
    ClampedSwiGLUTEGroupedMLP,
    check_clamp_not_dropped,
    with_clamped_swiglu_mlp,
)
from .processor import RLOutputProcessor, rl_output_processor

__all__ = [
    "TEACHER_OUTPUTS",
    "ClampedSwiGLUMLP",
    "ClampedSwiGLUNotAppliedError",
    "ClampedSwiGLUSequentialMLP",
    "ClampedSwiGLUTEGroupedMLP",
    "RLOutputProcessor",
    "TeacherOutputProcessor",
    "attach",
    "check_clamp_not_dropped",
    "detach",
    "rl_output_processor",
    "teacher_output_processor",
    "with_clamped_swiglu_mlp",
]
