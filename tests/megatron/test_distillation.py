"""Distillation through the Megatron processor (issue 37 point 3) on a tiny GPTModel at TP 2, with
and without sequence parallel: k tokens per position from output_processor_context and the model's
own top_logprobs, with the entropy, with masked positions and an ignored entry: every output and
every parameter's gradient against the naive processor on a copy of the model
(fused_rl_ops.reference.megatron: materialised logits through Megatron's output layer,
vocab_parallel_cross_entropy and TP gather); and a teacher run with autograd recording
(issue 46 point 3): warned of once, its outputs detached, the divergence unchanged."""
import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from fused_rl_ops.megatron import attach, rl_output_processor, teacher_output_processor  # noqa: E402
from fused_rl_ops.reference.megatron import NaiveRLOutputProcessor  # noqa: E402
from fused_rl_ops.testing.distributed import run_distributed  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import allreduce_sequence_parallel_grads, model_inputs  # noqa: E402

B, S, K, TOP, REAL_VOCAB, TEMPERATURE = 2, 8, 3, 5, 200, 0.8


def outputs_and_grads(model, tokens, many, loss_mask, coeff):
    outputs = model(tokens, *model_inputs(tokens), loss_mask=loss_mask, output_processor_context={"tokens": many})
    ((coeff[0] * outputs["logprobs"]).sum() + (coeff[1] * outputs["entropy"]).sum()
     + (coeff[2] * outputs["top_logprobs"]).sum()).backward()
    allreduce_sequence_parallel_grads(model)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return {name: t.detach() for name, t in outputs.items()}, grads


def _checks(rank, world_size):
    set_parallel_degrees(tp=2)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=g)
    many = torch.randint(0, REAL_VOCAB, (B, S, K), generator=g)
    many[0, 1, 2] = -100  # an ignored entry
    loss_mask = (torch.rand(B, S, generator=g) > 0.3).float()
    coeff = (torch.randn(B, S, K, generator=g), torch.randn(B, S, generator=g), torch.randn(B, S, TOP, generator=g))
    options = dict(top_logprobs=TOP, temperature=TEMPERATURE, vocab_size=REAL_VOCAB)
    for sequence_parallel in (False, True):
        config = tiny_config(sequence_parallel=sequence_parallel, init_method_std=0.3)
        fused, naive = tiny_model("gpt", config), tiny_model("gpt", config)
        naive.load_state_dict(fused.state_dict())
        attach(fused, rl_output_processor(**options))
        attach(naive, NaiveRLOutputProcessor(**options))
        (ours, our_grads), (want, want_grads) = [outputs_and_grads(m, tokens, many, loss_mask, coeff)
                                                 for m in (fused, naive)]
        assert list(ours) == list(want) == ["logprobs", "entropy", "top_ids", "top_logprobs"]
        kept = loss_mask.bool()
        scored = kept[..., None] & (many != -100)
        assert ours["logprobs"].shape == (B, S, K) and ours["top_ids"].shape == (B, S, TOP)
        for name in ours:
            assert_close(ours[name], want[name], rtol=0 if name == "top_ids" else None,
                         atol=0 if name == "top_ids" else None, msg=lambda m: f"sp={sequence_parallel} {name}: {m}")
        assert ours["logprobs"][~scored].eq(0).all() and ours["logprobs"][scored].lt(0).all()
        assert ours["top_ids"][~kept].eq(-100).all() and ours["top_logprobs"][~kept].eq(0).all()
        assert our_grads.keys() == want_grads.keys() and "output_layer.weight" in our_grads
        for name, grad in want_grads.items():
            assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item() + 1e-9,
                         msg=lambda m: f"sp={sequence_parallel} {name}: {m}")
    _teacher_recording_autograd(tokens, loss_mask)


def _teacher_recording_autograd(tokens, loss_mask):
    """A teacher whose weights require grad, run outside torch.no_grad(): its processor warns once
    (not again at the next call), returns its outputs without a graph, and the student's divergence
    and gradients are bitwise those with the teacher run under no_grad (TP 2, sequence parallel)."""
    config = tiny_config(sequence_parallel=True, init_method_std=0.3)
    student = tiny_model("gpt", config, seed=0)
    teacher = tiny_model("gpt", tiny_config(sequence_parallel=True, hidden_size=48, init_method_std=0.3), seed=1)
    inputs = (tokens, *model_inputs(tokens))
    teacher_processor = teacher_output_processor()

    def divergence_and_grads(teacher_outputs):
        outputs = student(*inputs, labels=tokens, loss_mask=loss_mask,
                          output_processor=rl_output_processor(divergence="reverse_kl", vocab_size=REAL_VOCAB),
                          output_processor_context={"teacher": teacher_outputs})
        outputs["divergence"].sum().backward()
        grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
        student.zero_grad()
        return outputs["divergence"].detach(), grads

    with torch.no_grad():
        quiet_outputs = teacher(*inputs, output_processor=teacher_processor)
    expected = divergence_and_grads(quiet_outputs)
    with pytest.warns(UserWarning, match=r"teacher's forward ran with autograd recording .*torch\.no_grad\(\), or "
                                         r"call teacher\.requires_grad_\(False\)") as caught:
        recorded = [teacher(*inputs, output_processor=teacher_processor) for _ in range(2)]
    assert len([w for w in caught if "autograd recording" in str(w.message)]) == 1
    assert not any(t.requires_grad for t in recorded[0].values() if isinstance(t, torch.Tensor))
    divergence, grads = divergence_and_grads(recorded[1])
    assert torch.equal(divergence, expected[0]) and divergence[loss_mask.bool()].gt(0).all()
    assert grads.keys() == expected[1].keys() and all(torch.equal(grads[n], g) for n, g in expected[1].items())
    assert all(p.grad is None for p in teacher.parameters())


def test_processor_many_tokens_and_top_logprobs_match_materialised_logits():
    run_distributed(_checks, 2)
