"""Megatron-core integration (tested with megatron-core 0.18 and 0.19; importing this imports megatron-core):
the RL output processor (with on-policy distillation: the teacher's processor), its registration on
every Megatron code path, the clamped SwiGLU MLP (dense and MoE experts), the check that a
configured clamp is never dropped, and each context-parallel rank's part of a batch."""
from .attach import attach, detach
from .context_parallel import context_parallel_positions, shift_labels, split_for_context_parallel
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
    "context_parallel_positions",
    "detach",
    "rl_output_processor",
    "shift_labels",
    "split_for_context_parallel",
    "teacher_output_processor",
    "with_clamped_swiglu_mlp",
]
