"""fused_rl_ops.megatron on megatron-core 0.19.2, on CPU / gloo with the test-only shims.

Every path a model reaches its output layer by gets a check that the processor ran there, on the
hidden states the output layer would have seen, and that its logprobs equal Megatron's own
-vocab_parallel_cross_entropy. Each spawned run groups several checks (model builds and the
megatron import dominate the time)."""
import contextlib
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist_utils import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

B, S = 2, 8  # b != s, so a [b, s] / [s, b] mix-up cannot pass
VOCAB = 256  # the model's (padded) vocabulary
REAL_VOCAB = 200  # the tokenizer's, for the padded-vocab checks


def make_batch(vocab=VOCAB, seed=0):
    """Tokens, position ids and a causal mask, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=generator)
    position_ids = torch.arange(S).expand(B, S)
    attention_mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).expand(B, 1, S, S)
    return tokens, position_ids, attention_mask


def same_on_all_ranks(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class RecordingProcessor:
    """Wraps a processor and keeps the hidden states of every call."""

    def __init__(self, processor):
        self.processor = processor
        self.hidden_states = []

    def __call__(self, **kwargs):
        self.hidden_states.append(kwargs["hidden_states"].detach().clone())
        return self.processor(**kwargs)


@contextlib.contextmanager
def output_layer_inputs(model):
    """Collects the hidden states the model feeds its output layer."""
    inputs = []
    handle = model.output_layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
    try:
        yield inputs
    finally:
        handle.remove()


def take_grads(model):
    """The model's parameter gradients by name; clears them."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grads[name] = param.grad.clone()
            param.grad = None
    return grads


def assert_grads_close(actual, expected):
    assert actual.keys() == expected.keys() and expected
    for name, grad in expected.items():
        assert_close(actual[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item() + 1e-9, msg=name)


def float64_reference(hidden_states, weight_shard, tokens, temperature=1.0, vocab_size=None):
    """Logprobs and entropy [b, s] in float64 from [s, b, h] hidden states and the full (TP-gathered) weight."""
    shards = [torch.empty_like(weight_shard) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, weight_shard.detach().contiguous())
    weight = torch.cat(shards)[:vocab_size].double()
    log_probs = torch.log_softmax(hidden_states.double() @ weight.t() / temperature, dim=-1)
    chosen = log_probs.gather(-1, tokens.t().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen.t(), entropy.t()


# --------------------------------------------------------------------------------- in-process checks


def test_processor_refuses_bad_calls():
    from fused_rl_ops.megatron import rl_output_processor

    hidden, weight = torch.randn(S, B, 16), torch.randn(32, 16)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens = torch.randint(0, 32, (B, S))
    processor = rl_output_processor()
    with pytest.raises(ValueError, match="got neither"):
        processor(hidden_states=hidden, output_layer=output_layer)
    with pytest.raises(ValueError, match="got both"):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens, context={"tokens": tokens})
    with pytest.raises(ValueError, match="do not match"):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens.t().contiguous())
    mup = types.SimpleNamespace(use_mup=True, mup_output_mult=0.5)
    with pytest.raises(ValueError, match="MuP"):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens, config=mup)
    with pytest.raises(ValueError, match="temperature"):
        rl_output_processor(temperature=0.0)


def test_with_clamped_swiglu_mlp_refuses_a_spec_without_mlp():
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from fused_rl_ops.megatron import with_clamped_swiglu_mlp

    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(mlp=IdentityOp))
    with pytest.raises(ValueError, match="no dense megatron MLP"):
        with_clamped_swiglu_mlp(spec)


# ----------------------------------------------------------------- GPTModel: forward and schedule plan


def _check_gpt_forward_and_schedule_plan():
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan

    from fused_rl_ops.megatron import attach, detach, rl_output_processor
    from megatron_shims import tiny_config, tiny_gpt_model

    model = tiny_gpt_model(tiny_config())
    tokens, position_ids, attention_mask = make_batch()
    coeff = same_on_all_ranks(B, S, seed=1)

    # Megatron's own: its loss, its output layer's input, and the gradients of sum(coeff * logprob).
    with output_layer_inputs(model) as inputs:
        megatron_logprobs = -model(tokens, position_ids, attention_mask, labels=tokens)
    (coeff * megatron_logprobs).sum().backward()
    megatron_grads = take_grads(model)
    [hidden_states] = inputs
    _, expected_entropy = float64_reference(hidden_states, model.output_layer.weight, tokens)

    recorder = RecordingProcessor(rl_output_processor())
    attach(model, recorder)

    # forward path
    outputs = model(tokens, position_ids, attention_mask, labels=tokens)
    assert list(outputs) == ["logprobs", "entropy"]
    assert all(t.dtype == torch.float32 and t.shape == (B, S) for t in outputs.values())
    assert_close(recorder.hidden_states.pop(), hidden_states, rtol=0, atol=0)
    assert_close(outputs["logprobs"], megatron_logprobs.detach())
    assert_close(outputs["entropy"], expected_entropy.float())
    (coeff * outputs["logprobs"]).sum().backward()
    assert_grads_close(take_grads(model), megatron_grads)

    # schedule-plan path, forward then backward: the plan's output is the tuple of the dict's values
    plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=tokens)
    plan_logprobs, plan_entropy = TransformerModelChunkSchedulePlan.run(plan, None)
    assert_close(recorder.hidden_states.pop(), hidden_states)  # the final layernorm the plan skips is applied
    assert_close(plan_logprobs, megatron_logprobs.detach())
    assert_close(plan_entropy, expected_entropy.float())
    TransformerModelChunkSchedulePlan.run(None, plan, b_grad=(coeff, torch.zeros_like(plan_entropy)))
    assert_grads_close(take_grads(model), megatron_grads)
    assert not recorder.hidden_states

    with pytest.raises(ValueError, match="detach"):
        model(tokens, position_ids, attention_mask, labels=tokens, output_processor=recorder)
    detach(model)
    assert model(tokens, position_ids, attention_mask).shape == (B, S, VOCAB // 2)  # logits again
    assert "build_schedule_plan" not in vars(model)


def _check_gpt_tied_padded_vocab_masked_tempered():
    """Native keyword without attach; tied embeddings, padded vocab, loss_mask, temperature, context tokens."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from fused_rl_ops.megatron import rl_output_processor
    from megatron_shims import tiny_config, tiny_gpt_model

    model = tiny_gpt_model(tiny_config(), tied_embeddings=True)
    tokens, position_ids, attention_mask = make_batch(vocab=REAL_VOCAB)
    loss_mask = (same_on_all_ranks(B, S, seed=2) > -0.5).float()
    temperature = 0.7

    # Megatron's own logprobs over its logits with the padded rows removed.
    with output_layer_inputs(model) as inputs:
        logits = model(tokens, position_ids, attention_mask).transpose(0, 1)  # [s, b, V/tp]
    vocab_start = dist.get_rank() * logits.shape[-1]
    padded = torch.arange(vocab_start, vocab_start + logits.shape[-1]) >= REAL_VOCAB
    megatron_logprobs = -vocab_parallel_cross_entropy(
        logits.masked_fill(padded, float("-inf")).contiguous() / temperature, tokens.t().contiguous()
    ).t()
    megatron_logprobs = megatron_logprobs * loss_mask
    megatron_logprobs.sum().backward()
    megatron_grads = take_grads(model)
    [hidden_states] = inputs
    _, expected_entropy = float64_reference(
        hidden_states, model.shared_embedding_or_output_weight(), tokens, temperature, REAL_VOCAB
    )

    processor = rl_output_processor(temperature=temperature, vocab_size=REAL_VOCAB)
    call = dict(loss_mask=loss_mask, output_processor_context={"tokens": tokens})
    outputs = model(tokens, position_ids, attention_mask, output_processor=processor, **call)
    assert_close(outputs["logprobs"], megatron_logprobs.detach())
    assert (outputs["logprobs"][loss_mask == 0] == 0).all()
    assert_close(outputs["entropy"][loss_mask == 1], expected_entropy.float()[loss_mask == 1])
    outputs["logprobs"].sum().backward()
    assert_grads_close(take_grads(model), megatron_grads)  # the tied weight gets both of its gradients

    # Without vocab_size the padded rows enter the softmax: the numbers differ.
    unpadded = rl_output_processor(temperature=temperature)
    with torch.no_grad():
        padded_outputs = model(tokens, position_ids, attention_mask, output_processor=unpadded, **call)
    assert not torch.allclose(padded_outputs["logprobs"], outputs["logprobs"])


def _gpt_model_paths(rank, world_size):
    from megatron_shims import init_model_parallel

    init_model_parallel(tp=2)
    _check_gpt_forward_and_schedule_plan()
    _check_gpt_tied_padded_vocab_masked_tempered()


def test_gpt_model_paths():
    run_distributed(_gpt_model_paths, 2)
