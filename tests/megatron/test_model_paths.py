"""fused_rl_ops.megatron on megatron-core 0.18 and 0.19, on CPU / gloo with the test-only shims: every path
by which a model reaches its output layer gets a check that the processor ran there, on the hidden
states the output layer would have seen, and that its logprobs equal Megatron's own
-vocab_parallel_cross_entropy: GPTModel forward, GPTModel schedule plan (forward and backward),
HybridModel, and models inside Megatron's DDP / Float16Module, with gradient_accumulation_fusion;
and ClampedSwiGLUMLP in place of Megatron's MLP (the spec swap, and its numbers). Each spawned run
groups several checks: the megatron import and model builds dominate the time."""
import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the GPU machine has none)")
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.mlp import MLP  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules  # noqa: E402

from fused_rl_ops.megatron import (  # noqa: E402
    ClampedSwiGLUMLP,
    attach,
    detach,
    rl_output_processor,
    with_clamped_swiglu_mlp,
)
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from tests.helpers.megatron import (  # noqa: E402
    REAL_VOCAB,
    VOCAB,
    B,
    RecordingProcessor,
    S,
    assert_close_by_name,
    float64_reference,
    full_vocab_weight,
    make_batch,
    megatron_own,
    output_layer_inputs,
    same_on_all_ranks,
    take_grads,
)


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


def _model_and_megatron_own(kind, seed):
    """A tiny model of kind, the batch and its tokens, coefficients (seed) and what megatron_own
    gives for them: Megatron's own logprobs, the hidden states and the gradients."""
    model, batch = tiny_model(kind), make_batch()
    coeff = same_on_all_ranks(B, S, seed=seed)
    return model, batch, batch[0], coeff, megatron_own(model, batch, coeff)


def _check_gpt_forward_and_schedule_plan():
    model, batch, tokens, coeff, (megatron_logprobs, hidden_states, megatron_grads) = _model_and_megatron_own("gpt", 1)
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
    model, batch, tokens, coeff, (megatron_logprobs, hidden_states, megatron_grads) = _model_and_megatron_own(
        "hybrid", 3)
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
