"""On-policy distillation on tiny Megatron GPTModels at TP 2, with and without sequence parallel: a
teacher wider than the student (hidden 48 against 32) run with teacher_output_processor(), the
student with rl_output_processor(divergence=kind) beside the rollout sampler's top_k, scoring shifted
labels. Its "divergence" matches float64 from the two models' own logits (Megatron's output layers,
TP-gathered) over the whole vocabulary (the sampler's filter does not reach it), every student
parameter's gradient matches the gradient through those logits, and the teacher gets none. Every
output (logprobs, entropy, divergence) and gradient matches the naive processor
(fused_rl_ops.reference.megatron) on a copy of the student."""
import pytest
import torch
import torch.distributed.nn.functional as dist_fn
from torch.testing import assert_close

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from fused_rl_ops import reference  # noqa: E402
from fused_rl_ops.megatron import rl_output_processor, teacher_output_processor  # noqa: E402
from fused_rl_ops.reference.megatron import NaiveRLOutputProcessor  # noqa: E402
from fused_rl_ops.testing.distributed import run_distributed  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import allreduce_sequence_parallel_grads, model_inputs, shifted_labels  # noqa: E402
from tests.helpers.megatron import B, REAL_VOCAB, S, assert_close_by_name, take_grads  # noqa: E402
from tests.ops.test_vocab_divergence import reference_keywords  # noqa: E402


def gathered_logits(model, tokens):
    """The model's own logits [b, s, V] (its output layer), gathered over TP differentiably. Every
    rank then computes the same loss, and the gather's backward sums the ranks' gradients: a loss
    through these is to be divided by the TP degree."""
    from megatron.core import parallel_state

    local = model(tokens, *model_inputs(tokens))  # [b, s, V / tp]
    return torch.cat(dist_fn.all_gather(local.contiguous(), group=parallel_state.get_tensor_model_parallel_group()),
                     -1)


def reference_divergence(student_logits, teacher_logits, kind, mask, **kw):
    """float64 divergence [b, s] from both models' logits: reference.vocab_divergence with the logits
    as hidden states and the identity as the output weight (kw: the op's keywords)."""
    eye = torch.eye(student_logits.shape[-1], dtype=torch.float64)
    return reference.vocab_divergence(student_logits.double(), eye, teacher_logits.double(), eye, kind=kind,
                                      mask=mask, **reference_keywords(kw))


def outputs_and_grads(model, processor, tokens, loss_mask, teacher_outputs, coeff):
    """The processor's outputs on model and every parameter's gradient of a loss of all of them (a
    logprob the sampler's filter drops, -inf, takes no part)."""
    outputs = model(tokens, *model_inputs(tokens), labels=shifted_labels(tokens), loss_mask=loss_mask,
                    output_processor=processor, output_processor_context={"teacher": teacher_outputs})
    logprobs = torch.where(outputs["logprobs"].isneginf(), 0.0, outputs["logprobs"])
    (coeff * (outputs["divergence"] + 0.5 * logprobs + 0.3 * outputs["entropy"])).sum().backward()
    allreduce_sequence_parallel_grads(model)
    return {name: t.detach() for name, t in outputs.items()}, take_grads(model)


def _distillation_checks(rank, world_size):
    set_parallel_degrees(tp=2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=g)
    labels = shifted_labels(tokens)
    loss_mask = (torch.rand(B, S, generator=g) > 0.3).float()
    scored = loss_mask.bool() & (labels != -100)
    coeff = torch.randn(B, S, generator=g)
    options = dict(temperature=0.8, vocab_size=REAL_VOCAB)
    sampler = dict(options, top_k=20)  # the rollout's filter: the logprobs' and entropy's, not the divergence's
    for sequence_parallel in (False, True):
        student = tiny_model(config=tiny_config(sequence_parallel=sequence_parallel, init_method_std=0.3), seed=0)
        teacher = tiny_model(config=tiny_config(sequence_parallel=sequence_parallel, hidden_size=48,
                                                init_method_std=0.3), seed=1)
        with torch.no_grad():
            teacher_outputs = teacher(tokens, *model_inputs(tokens), output_processor=teacher_output_processor())
            teacher_logits = gathered_logits(teacher, tokens)
        for kind in ("forward_kl", "reverse_kl", "jsd"):
            outputs = student(tokens, *model_inputs(tokens), labels=labels, loss_mask=loss_mask,
                              output_processor=rl_output_processor(divergence=kind, beta=0.3, **sampler),
                              output_processor_context={"teacher": teacher_outputs})
            assert list(outputs) == ["logprobs", "entropy", "divergence"]
            (coeff * outputs["divergence"]).sum().backward()
            allreduce_sequence_parallel_grads(student)
            fused_grads = take_grads(student)

            expected = reference_divergence(gathered_logits(student, tokens), teacher_logits, kind, scored, beta=0.3,
                                            **options)
            ((coeff * expected).sum() / world_size).backward()  # gathered_logits' note
            allreduce_sequence_parallel_grads(student)
            torch.testing.assert_close(outputs["divergence"].double(), expected.detach(), atol=2e-5, rtol=2e-5)
            assert expected[scored].gt(1e-3).all() and outputs["divergence"][~scored].eq(0).all()
            assert_close_by_name(fused_grads, take_grads(student))

            naive = tiny_model(config=student.config, seed=0)
            naive.load_state_dict(student.state_dict())
            ours, want = [outputs_and_grads(model, processor(divergence=kind, beta=0.3, **sampler), tokens, loss_mask,
                                            teacher_outputs, coeff)
                          for model, processor in ((student, rl_output_processor), (naive, NaiveRLOutputProcessor))]
            assert list(ours[0]) == list(want[0]) == ["logprobs", "entropy", "divergence"]
            assert ours[0]["logprobs"].isneginf().any()  # tokens outside the sampler's top k
            for name, expected in want[0].items():
                assert_close(ours[0][name], expected, msg=lambda m: f"sp={sequence_parallel} {kind} {name}: {m}")
            assert_close_by_name(ours[1], want[1])
        assert all(p.grad is None for p in teacher.parameters())
    # A teacher of another vocab partition is refused clearly.
    other = tiny_model(config=tiny_config(), seed=2, vocab_size=384)
    with torch.no_grad():
        other_outputs = other(tokens, *model_inputs(tokens), output_processor=teacher_output_processor())
    with pytest.raises(ValueError, match="the teacher's vocab partition differs from the student's"):
        student(tokens, *model_inputs(tokens), labels=tokens,
                output_processor=rl_output_processor(divergence="forward_kl"),
                output_processor_context={"teacher": other_outputs})


def test_distillation_matches_both_models_own_logits_at_tp2():
    run_distributed(_distillation_checks, 2)
