"""fused_rl_ops.megatron on megatron-core 0.19.2, on CPU / gloo with the test-only shims.

Every path by which a model reaches its output layer gets a check that the processor ran there,
on the hidden states the output layer would have seen, and that its logprobs equal Megatron's own
-vocab_parallel_cross_entropy: GPTModel forward, GPTModel schedule plan (forward and backward),
a pipeline's last stage under get_forward_backward_func, HybridModel, and models inside Megatron's
DDP / Float16Module. Each spawned run groups several checks: the megatron import and model builds
dominate the time."""
import contextlib
import functools
import math
import types

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed
from fused_rl_ops.testing.kernel_calls import KernelCalls, scored

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the GPU machine has none)")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.mlp import MLP  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules  # noqa: E402

import fused_rl_ops  # noqa: E402
from fused_rl_ops.megatron import (  # noqa: E402
    ClampedSwiGLUMLP,
    attach,
    detach,
    rl_output_processor,
    with_clamped_swiglu_mlp,
)
from fused_rl_ops.reference.megatron import NaiveRLOutputProcessor  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import full_vocab_logits, set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import forward_backward, make_rollout, model_inputs, ppo_loss, score  # noqa: E402

B, S = 2, 8  # b != s, so a [b, s] / [s, b] mix-up cannot pass
VOCAB = 256  # the model's (padded) vocabulary
REAL_VOCAB = 200  # the tokenizer's, for the padded-vocab checks


def make_batch(vocab=VOCAB, seed=0):
    """Tokens, position ids and a causal mask, identical on every rank."""
    tokens = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))
    return (tokens, *model_inputs(tokens))


def same_on_all_ranks(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class RecordingProcessor:
    """Wraps a processor and keeps the hidden states of every call; shows attach its value head."""

    def __init__(self, processor):
        self.processor = processor
        self.value_head = getattr(processor, "value_head", None)
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


def grads_by_name(model):
    return {name: param.grad for name, param in model.named_parameters() if param.grad is not None}


def take_grads(model):
    """The model's parameter gradients by name; clears them."""
    grads = {name: grad.clone() for name, grad in grads_by_name(model).items()}
    model.zero_grad()
    return grads


def assert_close_by_name(actual, expected):
    """Dicts of named tensors (gradients, parameters) agree to fp32 rounding, relative to each tensor's scale."""
    assert actual.keys() == expected.keys() and expected
    for name, tensor in expected.items():
        assert_close(actual[name], tensor, rtol=1e-4, atol=1e-5 * tensor.abs().max().item() + 1e-9,
                     msg=lambda message: f"{name}: {message}")


def megatron_own(model, batch, coeff):
    """Megatron's own logprobs (-its cross entropy, from labels), the hidden states its output layer
    received, and the gradients of sum(coeff * logprobs)."""
    tokens, position_ids, attention_mask = batch
    with output_layer_inputs(model) as inputs:
        logprobs = -model(tokens, position_ids, attention_mask, labels=tokens)
    (coeff * logprobs).sum().backward()
    [hidden_states] = inputs
    return logprobs.detach(), hidden_states, take_grads(model)


def full_vocab_weight(weight_shard):
    """The output weight of all TP ranks (the default group's), concatenated along the vocab."""
    if not dist.is_initialized():
        return weight_shard.detach()
    shards = [torch.empty_like(weight_shard) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, weight_shard.detach().contiguous())
    return torch.cat(shards)


def float64_reference(hidden_states, weight, tokens, temperature=1.0, vocab_size=None):
    """Logprobs and entropy [b, s] in float64 from [s, b, h] hidden states and the full weight."""
    logits = hidden_states.double() @ weight[:vocab_size].double().t() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, tokens.t().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen.t(), entropy.t()


# --------------------------------------------------------------------------------- in-process checks


def test_processor_on_one_rank_matches_float64():
    """No TP group: padded vocab, temperature, loss_mask and a value-head weight, against float64."""
    hidden, weight, value_weight = torch.randn(S, B, 16), torch.randn(VOCAB, 16), torch.randn(16)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens = torch.randint(0, REAL_VOCAB, (B, S))
    loss_mask = (torch.rand(B, S) > 0.3).float()
    processor = rl_output_processor(temperature=0.8, value_head=value_weight, vocab_size=REAL_VOCAB)
    outputs = processor(hidden_states=hidden, output_layer=output_layer, labels=tokens, loss_mask=loss_mask)
    logprobs, entropy = float64_reference(hidden, weight, tokens, 0.8, REAL_VOCAB)
    assert list(outputs) == list(processor.output_names) == ["logprobs", "entropy", "values"]
    assert_close(outputs["logprobs"], (logprobs * loss_mask).float())
    kept = loss_mask == 1
    assert_close(outputs["entropy"][kept], entropy.float()[kept])
    assert_close(outputs["values"], (hidden.double() @ value_weight.double()).t().float())


@pytest.mark.parametrize("host_checks", [True, False])
def test_processor_skips_masked_positions(host_checks):
    """loss_mask 0 is an ignored label: logprob and entropy 0, no gradient, and no row the ops
    compute (they get every position and leave these out, with the host checks or without)."""
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(S, B, 16, generator=g), torch.randn(VOCAB, 16, generator=g)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=g)
    tokens[1, -1] = -100
    loss_mask = (torch.rand(B, S, generator=g) > 0.5).float()
    coeffs = torch.randn(2, B, S, generator=g)
    scored_tokens = tokens.masked_fill(loss_mask == 0, -100)
    h = hidden.clone().requires_grad_(True)
    with KernelCalls() as calls:
        outputs = rl_output_processor(vocab_size=REAL_VOCAB, host_checks=host_checks)(
            hidden_states=h, output_layer=output_layer, labels=tokens, loss_mask=loss_mask)
        (coeffs[0] * outputs["logprobs"] + coeffs[1] * outputs["entropy"]).sum().backward()
    # In the processor's [s, b] order: every position (the masked ones ignored), of which the ops
    # compute the scored ones, host checks or not.
    for op in ("chosen_logprob_stats", "chosen_logprob_backward"):
        [got], [computed] = calls.tokens(op), calls.computed_tokens(op)
        assert torch.equal(got, scored_tokens.t().reshape(-1)) and torch.equal(computed, scored(scored_tokens.t())), op
    kept = scored_tokens != -100
    logprobs, entropy = float64_reference(hidden, weight, tokens.clamp(min=0), 1.0, REAL_VOCAB)
    assert_close(outputs["logprobs"], torch.where(kept, logprobs, 0.0).float())
    assert_close(outputs["entropy"], torch.where(kept, entropy, 0.0).float())
    assert h.grad.transpose(0, 1)[~kept].eq(0).all() and h.grad.transpose(0, 1)[kept].ne(0).any(-1).all()


def test_processor_passes_batch_invariant():
    """batch_invariant=True reaches chosen_logprob: the processor's logprobs and entropy are bitwise
    those of chosen_logprob(batch_invariant=True), which differ from the default tiling's here (600
    tokens, more than one row block; a vocabulary over one fixed chunk)."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(200, 3, 16, generator=g), torch.randn(2500, 16, generator=g)
    tokens = torch.randint(0, 2500, (3, 200), generator=g)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    outputs = rl_output_processor(batch_invariant=True)(hidden_states=hidden, output_layer=output_layer,
                                                        labels=tokens)

    def direct(batch_invariant):
        return fused_rl_ops.chosen_logprob(hidden, weight, tokens.t(), return_entropy=True,
                                           batch_invariant=batch_invariant)

    (logprobs, entropy), (default_logprobs, _) = direct(True), direct(False)
    assert not torch.equal(logprobs, default_logprobs)
    assert torch.equal(outputs["logprobs"], logprobs.t()) and torch.equal(outputs["entropy"], entropy.t())


def test_processor_host_checks_off_skips_both_checks_and_marks_bad_tokens_nan(monkeypatch):
    """host_checks=False reaches chosen_logprob as check_tokens=False and check_group=False: an
    out-of-range label no longer raises but gets a NaN logprob, and every other output is bitwise
    that of the checked processor with that label ignored (batch-invariant: the checked one skips
    that row, the unchecked one computes every row)."""
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(S, B, 16, generator=g), torch.randn(32, 16, generator=g)
    tokens = torch.randint(0, 32, (B, S), generator=g)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens[1, 2] = 40
    with pytest.raises(ValueError, match="token ids must lie in"):
        rl_output_processor()(hidden_states=hidden, output_layer=output_layer, labels=tokens)
    calls = []
    real_chosen_logprob = fused_rl_ops.chosen_logprob

    def recording_chosen_logprob(*args, **kwargs):
        calls.append((kwargs["check_tokens"], kwargs["check_group"]))
        return real_chosen_logprob(*args, **kwargs)

    monkeypatch.setattr(fused_rl_ops, "chosen_logprob", recording_chosen_logprob)
    unchecked = rl_output_processor(host_checks=False, batch_invariant=True)(
        hidden_states=hidden, output_layer=output_layer, labels=tokens)
    checked = rl_output_processor(batch_invariant=True)(hidden_states=hidden, output_layer=output_layer,
                                                        labels=tokens.masked_fill(tokens == 40, -100))
    assert calls == [(False, False), (True, True)]
    bad = tokens == 40
    assert unchecked["logprobs"][bad].isnan().all() and checked["entropy"][bad].eq(0).all()
    assert torch.equal(unchecked["logprobs"][~bad], checked["logprobs"][~bad])
    assert torch.equal(unchecked["entropy"][~bad], checked["entropy"][~bad])


def test_processor_refuses_bad_calls():
    hidden, weight = torch.randn(S, B, 16), torch.randn(32, 16)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens = torch.randint(0, 32, (B, S))
    processor = rl_output_processor()
    with pytest.raises(ValueError, match="got neither"):
        processor(hidden_states=hidden, output_layer=output_layer)
    with pytest.raises(ValueError, match="got both"):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens, context={"tokens": tokens})
    with pytest.raises(ValueError, match=r"labels must be \[b, s\] = \[2, 8\]"):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens.t().contiguous())
    mup = types.SimpleNamespace(use_mup=True, mup_output_mult=0.5)
    with pytest.raises(ValueError, match="MuP"):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens, config=mup)
    with pytest.raises(ValueError, match="value head must map"):
        rl_output_processor(value_head=torch.nn.Linear(16, 1))(hidden_states=hidden, output_layer=output_layer, labels=tokens)
    with pytest.raises(ValueError, match="temperature"):
        rl_output_processor(temperature=0.0)


def test_with_clamped_swiglu_mlp_swaps_both_spec_forms_and_refuses_a_spec_without_mlp():
    layer = get_gpt_layer_local_spec()  # its mlp: partial(MLP.as_mlp_submodule, submodules=...)
    mlp_submodules = layer.submodules.mlp.keywords["submodules"]
    old_form = ModuleSpec(  # what TransformerLayer rewraps itself
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(mlp=ModuleSpec(module=MLP, submodules=mlp_submodules)),
    )
    block = TransformerBlockSubmodules(layer_specs=[layer, old_form])
    swapped = with_clamped_swiglu_mlp(block)
    for spec in swapped.layer_specs:
        assert spec.submodules.mlp.func == ClampedSwiGLUMLP.as_mlp_submodule
        assert spec.submodules.mlp.keywords["submodules"] is mlp_submodules
    assert layer.submodules.mlp.func == MLP.as_mlp_submodule  # the input is left as it was
    again = with_clamped_swiglu_mlp(swapped)  # a converted spec is taken as it is
    assert [spec.submodules.mlp for spec in again.layer_specs] == [spec.submodules.mlp for spec in swapped.layer_specs]

    no_mlp = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(mlp=IdentityOp))
    with pytest.raises(ValueError, match="no dense megatron MLP"):
        with_clamped_swiglu_mlp(no_mlp)


# ----------------------------------------------------------------- GPTModel: forward and schedule plan


def _check_gpt_forward_and_schedule_plan():
    model = tiny_model("gpt")
    batch = make_batch()
    tokens = batch[0]
    coeff = same_on_all_ranks(B, S, seed=1)
    megatron_logprobs, hidden_states, megatron_grads = megatron_own(model, batch, coeff)
    _, expected_entropy = float64_reference(hidden_states, full_vocab_weight(model.output_layer.weight), tokens)

    recorder = RecordingProcessor(rl_output_processor())
    attach(model, recorder)

    # forward path
    outputs = model(*batch, labels=tokens)
    assert list(outputs) == ["logprobs", "entropy"]
    assert all(t.dtype == torch.float32 and t.shape == (B, S) for t in outputs.values())
    assert_close(recorder.hidden_states.pop(), hidden_states, rtol=0, atol=0)
    assert_close(outputs["logprobs"], megatron_logprobs)
    assert_close(outputs["entropy"], expected_entropy.float())
    (coeff * outputs["logprobs"]).sum().backward()
    assert_close_by_name(take_grads(model), megatron_grads)

    # schedule-plan path, forward then backward: the plan's output is the tuple of the dict's values
    plan = model.build_schedule_plan(*batch, labels=tokens)
    plan_logprobs, plan_entropy = TransformerModelChunkSchedulePlan.run(plan, None)
    assert_close(recorder.hidden_states.pop(), hidden_states)  # with the final layernorm the plan skips
    assert_close(plan_logprobs, megatron_logprobs)
    assert_close(plan_entropy, expected_entropy.float())
    TransformerModelChunkSchedulePlan.run(None, plan, b_grad=(coeff, torch.zeros_like(plan_entropy)))
    assert_close_by_name(take_grads(model), megatron_grads)
    assert not recorder.hidden_states

    with pytest.raises(ValueError, match="detach"):
        model(*batch, labels=tokens, output_processor=recorder)
    detach(model)
    assert model(*batch).shape == (B, S, VOCAB // 2)  # logits again
    assert "build_schedule_plan" not in vars(model)


def _check_gpt_tied_padded_vocab_masked_tempered():
    """The native keyword without attach; tied embeddings, padded vocab, loss_mask, temperature,
    tokens from the context."""
    model = tiny_model("gpt", tied_embeddings=True)
    batch = make_batch(vocab=REAL_VOCAB)
    tokens = batch[0]
    loss_mask = (same_on_all_ranks(B, S, seed=2) > -0.5).float()
    temperature = 0.7

    # Megatron's own cross entropy over its logits with the padded rows removed.
    with output_layer_inputs(model) as inputs:
        logits = model(*batch).transpose(0, 1)  # [s, b, V/tp]
    vocab_start = dist.get_rank() * logits.shape[-1]
    padded = torch.arange(vocab_start, vocab_start + logits.shape[-1]) >= REAL_VOCAB
    megatron_logprobs = -vocab_parallel_cross_entropy(
        logits.masked_fill(padded, float("-inf")).contiguous() / temperature, tokens.t().contiguous()
    ).t()
    megatron_logprobs = megatron_logprobs * loss_mask
    megatron_logprobs.sum().backward()
    megatron_grads = take_grads(model)
    [hidden_states] = inputs
    embedding = full_vocab_weight(model.shared_embedding_or_output_weight())
    _, expected_entropy = float64_reference(hidden_states, embedding, tokens, temperature, REAL_VOCAB)

    processor = rl_output_processor(temperature=temperature, vocab_size=REAL_VOCAB)
    call = dict(loss_mask=loss_mask, output_processor_context={"tokens": tokens})
    outputs = model(*batch, output_processor=processor, **call)
    assert_close(outputs["logprobs"], megatron_logprobs.detach())
    assert (outputs["logprobs"][loss_mask == 0] == 0).all()
    kept = loss_mask == 1
    assert_close(outputs["entropy"][kept], expected_entropy.float()[kept])
    outputs["logprobs"].sum().backward()
    assert_close_by_name(take_grads(model), megatron_grads)  # the tied weight gets both of its gradients

    # Without vocab_size the padded rows enter the softmax: the numbers differ.
    with torch.no_grad():
        unpadded = model(*batch, output_processor=rl_output_processor(temperature=temperature), **call)
    assert not torch.allclose(unpadded["logprobs"], outputs["logprobs"])


def _gpt_model_paths(rank, world_size):
    set_parallel_degrees(tp=2)
    _check_gpt_forward_and_schedule_plan()
    _check_gpt_tied_padded_vocab_masked_tempered()


def test_gpt_model_paths():
    run_distributed(_gpt_model_paths, 2)


# ------------------------------------------------- HybridModel, wrapped models, clamped SwiGLU MLP


def _check_hybrid_model():
    """No native hook: the output layer is swapped per forward; labels are refused."""
    model = tiny_model("hybrid")
    batch = make_batch()
    tokens = batch[0]
    coeff = same_on_all_ranks(B, S, seed=3)
    megatron_logprobs, hidden_states, megatron_grads = megatron_own(model, batch, coeff)
    state_dict_keys = list(model.state_dict())

    recorder = RecordingProcessor(rl_output_processor())
    attach(model, recorder)
    context = {"tokens": tokens}
    outputs = model(*batch, output_processor_context=context)
    assert list(outputs) == ["logprobs", "entropy"]
    assert_close(recorder.hidden_states.pop(), hidden_states, rtol=0, atol=0)
    assert_close(outputs["logprobs"], megatron_logprobs)
    (coeff * outputs["logprobs"]).sum().backward()
    assert_close_by_name(take_grads(model), megatron_grads)
    assert isinstance(model.output_layer, ColumnParallelLinear) and list(model.state_dict()) == state_dict_keys

    loss_mask = (coeff > 0).float()
    masked = model(*batch, output_processor_context=context, loss_mask=loss_mask)
    assert_close(masked["logprobs"], outputs["logprobs"].detach() * loss_mask)

    with pytest.raises(ValueError, match="do not pass labels"):
        model(*batch, labels=tokens)
    with pytest.raises(ValueError, match="do not pass labels"):
        model(*batch, None, tokens)  # labels by position
    assert isinstance(model.output_layer, ColumnParallelLinear)
    detach(model)
    assert model(*batch).shape == (B, S, VOCAB // 2)


def _check_wrapped_models():
    """attach finds the language model inside Megatron's DDP and Float16Module wrappers."""
    batch = make_batch()
    tokens = batch[0]
    coeff = same_on_all_ranks(B, S, seed=4)

    config = tiny_config()
    ddp_model = DistributedDataParallel(config, DistributedDataParallelConfig(), tiny_model("gpt", config))
    megatron_logprobs = -ddp_model(*batch, labels=tokens)
    (coeff * megatron_logprobs).sum().backward()
    megatron_grads = {name: p.main_grad.clone() for name, p in ddp_model.named_parameters()}
    ddp_model.zero_grad_buffer()
    attach(ddp_model, rl_output_processor())
    outputs = ddp_model(*batch, labels=tokens)
    assert_close(outputs["logprobs"], megatron_logprobs.detach())
    (coeff * outputs["logprobs"]).sum().backward()
    assert_close_by_name({name: p.main_grad for name, p in ddp_model.named_parameters()}, megatron_grads)
    detach(ddp_model)

    bf16_config = tiny_config(bf16=True)
    bf16_model = Float16Module(bf16_config, tiny_model("hybrid", bf16_config))
    megatron_logprobs = -bf16_model(*batch, labels=tokens)
    attach(bf16_model, rl_output_processor())
    outputs = bf16_model(*batch, output_processor_context={"tokens": tokens})
    assert outputs["logprobs"].dtype == torch.float32
    # Megatron's cross entropy reads bf16 logits; the op accumulates bf16 inputs in fp32.
    assert_close(outputs["logprobs"], megatron_logprobs, rtol=0, atol=2e-2)


def _check_gradient_accumulation_fusion():
    """Megatron's DDP with gradient_accumulation_fusion on the output layer: the processor adds the
    output weight's gradient into main_grad (Megatron's own layers would need the CUDA-only
    fused_weight_gradient_mlp_cuda, so only the output layer is switched to the fusion, which the
    processor replaces). Over two micro-batches every main_grad is bitwise what the unfused path
    gives (gradient returned, added by DDP's hook). (overlap_grad_reduce starts its reduction on a
    CUDA stream: not on the CPU.)"""
    batches = [make_batch(vocab=REAL_VOCAB, seed=seed) for seed in (0, 1)]
    coeffs = [same_on_all_ranks(B, S, seed=seed) for seed in (4, 5)]
    main_grads = {}
    for fusion in (False, True):
        config = tiny_config()
        ddp_model = DistributedDataParallel(config, DistributedDataParallelConfig(), tiny_model("gpt", config))
        output_layer = ddp_model.module.output_layer
        output_layer.gradient_accumulation_fusion = fusion
        attach(ddp_model, rl_output_processor(vocab_size=REAL_VOCAB))
        for batch, coeff in zip(batches, coeffs):
            outputs = ddp_model(*batch, labels=batch[0])
            (coeff * outputs["logprobs"]).sum().backward()
            # The placeholder gradient went to DDP's hook, which dropped it without adding.
            assert output_layer.weight.grad_added_to_main_grad == fusion and output_layer.weight.grad is None
        main_grads[fusion] = {name: p.main_grad.clone() for name, p in ddp_model.named_parameters()}
    assert main_grads[True]["module.output_layer.weight"].abs().sum() > 0
    for name, main_grad in main_grads[False].items():
        assert torch.equal(main_grads[True][name], main_grad), name


def _check_clamped_swiglu_mlp():
    """ClampedSwiGLUMLP equals Megatron's unfused clamped GLU, forward and backward, in GPT and hybrid specs."""
    batch = make_batch()
    coeff = same_on_all_ranks(B, S, seed=5)
    limit = 0.5
    # (model kind, gate, linear offset): Megatron's clamped SiLU, and gpt-oss's quick-GELU gate
    for kind, gate, offset in (("gpt", torch.nn.functional.silu, 0.0), ("hybrid", quick_gelu, 1.0)):
        config = tiny_config(
            init_method_std=0.1, gated_linear_unit=True, activation_func=gate,
            activation_func_clamp_value=limit, glu_linear_offset=offset,
        )
        megatron_model = tiny_model(kind, config)
        model = tiny_model(kind, config, clamped_swiglu_mlp=True)
        model.load_state_dict(megatron_model.state_dict())
        mlps = [m for m in model.modules() if isinstance(m, ClampedSwiGLUMLP)]
        assert len(mlps) == len([m for m in megatron_model.modules() if type(m).__name__ == "MLP"]) > 0

        fc1_outputs = []
        mlps[0].linear_fc1.register_forward_hook(lambda module, args, output: fc1_outputs.append(output[0]))
        (megatron_logprobs, _, megatron_grads), (logprobs, _, grads) = [
            megatron_own(m, batch, coeff) for m in (megatron_model, model)
        ]
        assert (fc1_outputs[0].abs() > limit).float().mean() > 0.1  # the clamp is exercised
        assert_close(logprobs, megatron_logprobs)
        assert_close_by_name(grads, megatron_grads)

    with pytest.raises(ValueError, match="gated_linear_unit"):
        tiny_model("gpt", clamped_swiglu_mlp=True)


def _hybrid_wrapped_and_mlp(rank, world_size):
    set_parallel_degrees(tp=2)
    _check_hybrid_model()
    _check_wrapped_models()
    _check_gradient_accumulation_fusion()
    _check_clamped_swiglu_mlp()


def test_hybrid_model_wrapped_models_and_clamped_swiglu_mlp():
    run_distributed(_hybrid_wrapped_and_mlp, 2)


# ------------------------------------------------------------- end to end: a PPO step, fused vs naive


def build_policy_pair(config, **processor_options):
    """The same GPTModel twice, with a processor each, not attached:
    fused: ClampedSwiGLUMLP, rl_output_processor, fused_rl_ops.ValueHead;
    naive: Megatron's MLP, the reference processor (materialised logits), a copy of the value head.
    Returns [(model, processor)] for fused, then naive; attach makes each value head its model's."""
    fused = tiny_model("gpt", config, clamped_swiglu_mlp=True)
    naive = tiny_model("gpt", config)
    naive.load_state_dict(fused.state_dict())
    value_head = fused_rl_ops.ValueHead(config.hidden_size)
    with torch.no_grad():
        value_head.weight.copy_(same_on_all_ranks(*value_head.weight.shape, seed=7))
    naive_value_head = fused_rl_ops.ValueHead(config.hidden_size)
    naive_value_head.load_state_dict(value_head.state_dict())
    return [
        (fused, rl_output_processor(value_head=value_head, **processor_options)),
        (naive, NaiveRLOutputProcessor(value_head=naive_value_head, **processor_options)),
    ]


def ppo_config(**overrides):
    """gpt-oss-style MLP (quick-GELU gate, offset 1) with a clamp the tiny model's activations reach."""
    return tiny_config(
        init_method_std=0.1, gated_linear_unit=True, activation_func=quick_gelu,
        activation_func_clamp_value=0.5, glu_linear_offset=1.0, **overrides,
    )


def assert_same_outputs(fused_outputs, naive_outputs):
    assert list(fused_outputs) == list(naive_outputs)
    for name in fused_outputs:
        assert_close(fused_outputs[name], naive_outputs[name], msg=lambda message: f"{name}: {message}")


def assert_same_step(policies):
    """Fused and naive have the same gradient for every parameter (the value head's, on the stage
    that has it, among them); after an SGD step each over model.parameters(), the same parameters."""
    (fused, _), (naive, _) = policies
    fused_grads, naive_grads = grads_by_name(fused), grads_by_name(naive)
    assert ("value_head.weight" in fused_grads) == parallel_state.is_pipeline_last_stage()
    assert_close_by_name(fused_grads, naive_grads)
    for model, _ in policies:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert_close_by_name(dict(fused.named_parameters()), dict(naive.named_parameters()))


def next_token_logprobs(logits, tokens, temperature, vocab_size):
    """float64 [b, s] from full-vocab logits [b, s, V]: position t's logprob of token t + 1, and 0 at
    each sequence's last position (nothing follows it)."""
    log_probs = torch.log_softmax(logits[..., :vocab_size].double() / temperature, dim=-1)
    chosen = log_probs[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([chosen, chosen.new_zeros(len(tokens), 1)], dim=1)


def _check_ppo_step(sequence_parallel):
    """The PPO step of fused_rl_ops.testing.ppo (what examples/ppo_step.py runs): the old logprobs
    (score) and the step's logprobs (make_rollout's labels) are each position's logprob of the next
    token, as float64 has it; fused and naive agree on every output, gradient and updated parameter."""
    config = ppo_config(sequence_parallel=sequence_parallel)
    policies = build_policy_pair(config, vocab_size=REAL_VOCAB, temperature=0.9)
    (fused, _), _ = policies
    tokens = make_batch(REAL_VOCAB, seed=8)[0]
    with torch.no_grad():
        expected_logprobs = next_token_logprobs(full_vocab_logits(fused, tokens), tokens, 0.9, REAL_VOCAB).float()
    for model, processor in policies:
        attach(model, processor)
    with torch.no_grad():
        old_logprobs = score(fused, tokens)["logprobs"]
    assert_close(old_logprobs, expected_logprobs)
    rollout = make_rollout(tokens, old_logprobs, seed=9)
    assert torch.all(rollout["mask"][:, -1] == 0)  # the last position has no next token
    (fused_outputs, fused_loss), (naive_outputs, naive_loss) = [forward_backward(m, rollout) for m, _ in policies]
    assert list(fused_outputs) == ["logprobs", "entropy", "values"]
    assert_close(fused_outputs["logprobs"], expected_logprobs)
    assert_same_outputs(fused_outputs, naive_outputs)
    assert_close(fused_loss, naive_loss)
    assert_same_step(policies)
    with torch.no_grad():
        fused_after, naive_after = [score(m, tokens)["logprobs"] for m, _ in policies]
    assert_close(fused_after, naive_after)
    assert not torch.allclose(fused_after, fused_outputs["logprobs"])  # the step moved the policy


def _ppo_step_tensor_parallel(rank, world_size):
    set_parallel_degrees(tp=2)
    _check_ppo_step(sequence_parallel=False)
    _check_ppo_step(sequence_parallel=True)


def test_ppo_step_tensor_parallel_with_and_without_sequence_parallel():
    run_distributed(_ppo_step_tensor_parallel, 2)


def run_schedule(model, rollouts, loss_func, forward_only=False):
    """Megatron's pipeline schedule over the rollouts as microbatches; loss_func(output, rollout)."""
    def forward_step(data_iterator, model):
        rollout = next(data_iterator)
        tokens = rollout["tokens"]
        output = model(tokens, *model_inputs(tokens), labels=rollout["labels"])
        return output, functools.partial(loss_func, rollout=rollout)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(rollouts), model=[model],
        num_microbatches=len(rollouts), seq_length=S, micro_batch_size=B, forward_only=forward_only,
    )


def megatron_logprobs_loss(cross_entropy, rollout):
    return cross_entropy.sum(), {"logprobs": -cross_entropy.detach()}


def ppo_loss_and_outputs(outputs, rollout):
    loss = ppo_loss(outputs, rollout)
    return loss, {"loss": loss.detach(), **{name: t.detach() for name, t in outputs.items()}}


def _pipeline_parallel(rank, world_size):
    """2 stages through get_forward_backward_func: the last stage's processor sees the output layer's
    input and matches Megatron's cross entropy; the PPO step matches the naive path on both stages."""
    set_parallel_degrees(tp=1, pp=2)
    policies = build_policy_pair(ppo_config(pipeline_dtype=torch.float32))
    (fused, fused_processor), (naive, naive_processor) = policies
    rollouts = [
        make_rollout(make_batch(seed=10 + i)[0], torch.full((B, S), -math.log(VOCAB)), seed=20 + i) for i in range(2)
    ]
    last_stage = parallel_state.is_pipeline_last_stage()

    with output_layer_inputs(fused) if last_stage else contextlib.nullcontext([]) as hidden_states:
        megatron_results = run_schedule(fused, rollouts, megatron_logprobs_loss, forward_only=True)
    recorder = RecordingProcessor(fused_processor)
    attach(fused, recorder)
    attach(naive, naive_processor)
    fused_results = run_schedule(fused, rollouts, ppo_loss_and_outputs)
    naive_results = run_schedule(naive, rollouts, ppo_loss_and_outputs)

    assert len(fused_results) == len(naive_results) == len(megatron_results) == (2 if last_stage else 0)
    assert len(recorder.hidden_states) == len(hidden_states) == (2 if last_stage else 0)
    for recorded, expected in zip(recorder.hidden_states, hidden_states):
        assert_close(recorded, expected, rtol=0, atol=0)
    for fused_outputs, naive_outputs, megatron_outputs in zip(fused_results, naive_results, megatron_results):
        # The last position's label is ignore_index: logprob 0 here, Megatron's cross entropy has no such label.
        assert_close(fused_outputs["logprobs"][:, :-1], megatron_outputs["logprobs"][:, :-1])
        assert torch.all(fused_outputs["logprobs"][:, -1] == 0)
        assert_same_outputs(fused_outputs, naive_outputs)
    assert_same_step(policies)


def test_pipeline_parallel_two_stages():
    run_distributed(_pipeline_parallel, 2)
