"""Distillation through the Megatron processor (issue 37 point 3) on a tiny GPTModel at TP 2, with
and without sequence parallel: k tokens per position from output_processor_context and the model's
own top_logprobs, with the entropy, with masked positions and an ignored entry: every output and
every parameter's gradient against the naive processor on a copy of the model
(fused_rl_ops.reference.megatron: materialised logits through Megatron's output layer,
vocab_parallel_cross_entropy and TP gather)."""
import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from fused_rl_ops.megatron import attach, rl_output_processor  # noqa: E402
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


def test_processor_many_tokens_and_top_logprobs_match_materialised_logits():
    run_distributed(_checks, 2)
