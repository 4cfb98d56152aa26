"""On-policy distillation on Megatron-core: the teacher's processor and the student's divergence.

`teacher_output_processor()` is the teacher model's `output_processor`: its forward returns its final
hidden states and its output-weight shard (a dict: teacher_outputs), no logits (a dict, which
Megatron's paths pass on unchanged). The student's
`rl_output_processor(divergence=kind, beta=...)` takes that as
`output_processor_context={"teacher": teacher_outputs}` and returns "divergence" [b, s] fp32 beside
its other outputs (student_divergence below): fused_rl_ops.vocab_divergence over the whole
vocabulary, vocab-parallel, under the processor's logit map and vocab_size (the teacher's softcap is
its processor's), 0 and not computed where loss_mask is 0 or the label is ignored. With
sequence parallel both models' hidden states are gathered (the teacher's without a gradient).
Teacher and student share the tokenizer and the TP degree, so that each rank holds the same vocab
rows of both output layers; a teacher whose vocab partition differs is refused."""
import warnings

import torch
import torch.distributed as dist

import fused_rl_ops

from .output_layer import gather_sequence_parallel

__all__ = ["TEACHER_OUTPUTS", "TeacherOutputProcessor", "teacher_output_processor"]

# The keys of what the teacher's forward returns: hidden_states [s(/tp), b, h_t] after its final
# layernorm (split along s with sequence parallel), output_weight its local [V_local, h_t] vocab
# shard, whether sequence_parallel splits the states, its tp_size and its softcap.
TEACHER_OUTPUTS = ("hidden_states", "output_weight", "sequence_parallel", "tp_size", "softcap")


class TeacherOutputProcessor:
    """The teacher's output processor (module docstring); softcap: the teacher's final logit cap.

    The divergence gives the teacher no gradient, so its outputs are returned detached: a teacher run
    with autograd recording (its weights require grad, outside torch.no_grad()) then drops the graph
    of its forward as the forward returns, instead of holding its activations through the student's
    step. Building that graph cost the forward time and peak memory for nothing: the first such call
    warns, naming the fix."""

    def __init__(self, *, softcap=None):
        self.softcap = softcap
        self.warned_of_graph = False

    def __call__(self, *, hidden_states, output_layer, output_weight=None, **unused_keywords):
        weight = output_weight if output_weight is not None else output_layer.weight
        if (hidden_states.requires_grad or weight.requires_grad) and torch.is_grad_enabled() \
                and not self.warned_of_graph:
            self.warned_of_graph = True
            warnings.warn("teacher_output_processor: the teacher's forward ran with autograd recording (its weights "
                          "require grad): it built a graph that the divergence never uses (no gradient reaches "
                          "the teacher; its outputs are returned detached). Run the teacher under torch.no_grad(), "
                          "or call teacher.requires_grad_(False) once", UserWarning, stacklevel=2)
        return dict(zip(TEACHER_OUTPUTS, (hidden_states.detach(), weight.detach(), bool(output_layer.sequence_parallel),
                                          dist.get_world_size(output_layer.tp_group), self.softcap)))


def teacher_output_processor(*, softcap=None) -> TeacherOutputProcessor:
    """An output processor for the teacher model: its forward returns a dict of TEACHER_OUTPUTS (its
    hidden states and output-weight shard, detached) instead of logits. Run the teacher under
    torch.no_grad(); a teacher run with autograd recording warns once (TeacherOutputProcessor)."""
    return TeacherOutputProcessor(softcap=softcap)


def _teacher_of(name, context, student_weight, tp_size):
    teacher = context.get("teacher") if isinstance(context, dict) else None
    if not isinstance(teacher, dict) or set(teacher) != set(TEACHER_OUTPUTS):
        raise ValueError(f"{name}: divergence needs output_processor_context={{'teacher': outputs of a model whose "
                         f"output_processor is teacher_output_processor()}}, got {type(teacher).__name__}")
    rows = teacher["output_weight"].shape[0]
    if teacher["tp_size"] != tp_size or rows != student_weight.shape[0]:
        raise ValueError(f"{name}: the teacher's vocab partition differs from the student's: it holds "
                         f"{rows} vocab rows per rank over {teacher['tp_size']} TP ranks, the "
                         f"student {student_weight.shape[0]} over {tp_size}; teacher and student must share the "
                         f"tokenizer (padded vocabulary) and the TP degree")
    return teacher


def student_divergence(caller, hidden_states, shard, context, *, kind, beta, logit_map, mask, vocab_size,
                       batch_invariant, check_group):
    """[s, b] divergence of the student's gathered [s, b, h] hidden states over its OutputShard from
    the teacher's outputs in context, under the student's logit_map, at the positions of mask [s, b]
    (the others 0, not computed); kind, beta, vocab_size, batch_invariant and check_group as
    fused_rl_ops.vocab_divergence takes them. caller names the processor in errors."""
    teacher = _teacher_of(caller, context, shard.weight, shard.tp_size())
    teacher_hidden = teacher["hidden_states"]
    if teacher["sequence_parallel"]:
        teacher_hidden = gather_sequence_parallel(teacher_hidden.detach(), shard.tp_group)
    if teacher_hidden.shape[:2] != hidden_states.shape[:2]:
        raise ValueError(f"{caller}: the teacher's hidden states [s, b, h_t] {list(teacher_hidden.shape)} do not "
                         f"match the student's [s, b, h] {list(hidden_states.shape)}")
    return fused_rl_ops.vocab_divergence(
        hidden_states, shard.weight, teacher_hidden, teacher["output_weight"], kind=kind, beta=beta,
        logit_map=logit_map, teacher_softcap=teacher["softcap"], mask=mask, vocab_size=vocab_size,
        tp_group=shard.tp_group, reduce_hidden_grad=shard.reduce_hidden_grad, main_grad=shard.main_grad,
        batch_invariant=batch_invariant, check_group=check_group)
