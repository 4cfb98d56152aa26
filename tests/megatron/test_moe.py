"""MoE experts with clamped_swiglu on megatron-core 0.18 and 0.19, on CPU / gloo with the test-only shims.

End to end: a tiny GPTModel with a dense and an MoE layer in gpt-oss's configuration (top-2 router
over 4 SequentialMLP experts, quick-GELU gate, clamp 7, linear offset 1), built through
with_clamped_swiglu_mlp and attached to rl_output_processor with a ValueHead, runs a PPO step at
TP 2 with sequence parallel and at EP 2; its logprobs, entropy, values, loss and every parameter
gradient match the same weights on megatron-core's own unfused clamped path (Megatron's MLP, the
naive processor). Then check_clamp_not_dropped on real Megatron modules. One spawned run holds
all the distributed checks: the megatron import and model builds dominate the time."""
import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.moe.experts import (  # noqa: E402
    GroupedMLPSubmodules,
    InferenceGroupedMLP,
    SequentialMLP,
    TEGroupedMLP,
)

import fused_rl_ops  # noqa: E402
from fused_rl_ops.megatron import (  # noqa: E402
    ClampedSwiGLUMLP,
    ClampedSwiGLUNotAppliedError,
    ClampedSwiGLUSequentialMLP,
    ClampedSwiGLUTEGroupedMLP,
    attach,
    check_clamp_not_dropped,
    rl_output_processor,
    with_clamped_swiglu_mlp,
)
from fused_rl_ops.reference.megatron import NaiveRLOutputProcessor  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import forward_backward, make_rollout, model_inputs  # noqa: E402

B, S = 2, 8
VOCAB = 256
LIMIT = 7.0
# fc1 weights are scaled by this after init (std 0.1 -> 1.0, so fc1 outputs have std ~5.7): about
# one in five values then lies beyond the limit of 7 and the clamp is really exercised. Random
# values never sit exactly on +-7, where torch.clamp's gradient (0) and ours (kept) differ.
FC1_GAIN = 10.0
# Fused and naive agree to fp32 rounding: the op evaluates the same formula in fp32 with another
# sigmoid / product order (a few ulp per element), and the routing weight is applied inside it;
# those differences grow through two layers, attention, top-2 routing and the 256-way softmax.
# Measured worst differences, relative to each tensor's largest entry: 3e-7 for the outputs and the
# loss, 1.6e-6 for the gradients (the router's bias); the tolerances leave a margin of 6x or more.
OUTPUT_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
GRAD_RTOL, GRAD_ATOL_FRACTION = 1e-4, 1e-5  # atol: this fraction of the tensor's largest entry


def moe_config(**overrides):
    """gpt-oss's MoE configuration on the tiny model: layer 1 dense, layer 2 MoE."""
    settings = dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_layer_freq=[0, 1],
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",  # alltoall creates a torch.cuda.Stream when built
        gated_linear_unit=True,
        activation_func=quick_gelu,
        activation_func_clamp_value=LIMIT,
        glu_linear_offset=1.0,
        init_method_std=0.1,
    )
    settings.update(overrides)
    return tiny_config(**settings)


def assert_close_by_name(actual, expected):
    assert actual.keys() == expected.keys() and expected
    for name, tensor in expected.items():
        assert_close(actual[name], tensor, rtol=GRAD_RTOL, atol=GRAD_ATOL_FRACTION * tensor.abs().max().item() + 1e-12,
                     msg=lambda message: f"{name}: {message}")


def build_policy_pair(config):
    """The same weights twice: fused (with_clamped_swiglu_mlp, rl_output_processor, ValueHead) and
    naive (megatron-core's MLP and SequentialMLP, the naive processor, a plain value weight), attached."""
    fused = tiny_model("gpt", config, clamped_swiglu_mlp=True, vocab_size=VOCAB)
    with torch.no_grad():
        for name, param in fused.named_parameters():
            if name.endswith("linear_fc1.weight"):
                param.mul_(FC1_GAIN)
    naive = tiny_model("gpt", config, vocab_size=VOCAB)
    naive.load_state_dict(fused.state_dict())
    value_head = fused_rl_ops.ValueHead(config.hidden_size)
    with torch.no_grad():
        value_head.weight.copy_(torch.randn(value_head.weight.shape, generator=torch.Generator().manual_seed(7)))
    naive_value = torch.nn.Parameter(value_head.weight.detach().clone())
    attach(fused, rl_output_processor(value_head=value_head))
    attach(naive, NaiveRLOutputProcessor(value_head=naive_value))
    return (fused, value_head.weight), (naive, naive_value)


def fc1_inputs_beyond_limit(model):
    """Fraction of the experts' fc1 outputs (gate above L, linear outside [-L, L]) in the next forward."""
    counts = []

    def count(module, args, output):
        gate, linear = output[0].chunk(2, dim=-1)
        counts.append(((gate > LIMIT).sum() + (linear.abs() > LIMIT).sum()).item() / output[0].numel())

    hooks = [m.linear_fc1.register_forward_hook(count) for m in model.modules() if isinstance(m, ClampedSwiGLUMLP)]
    return counts, hooks


def _check_moe_ppo_step(layout):
    config = moe_config(**layout)
    (fused, fused_value), (naive, naive_value) = build_policy_pair(config)
    experts = [m for m in fused.modules() if isinstance(m, SequentialMLP)]
    assert len(experts) == 1 and isinstance(experts[0], ClampedSwiGLUSequentialMLP)
    assert all(type(e) is ClampedSwiGLUMLP for e in experts[0].local_experts)
    assert not any(isinstance(m, ClampedSwiGLUMLP) for m in naive.modules())

    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(8))
    rollout = make_rollout(tokens, torch.full((B, S), -math.log(VOCAB)), seed=9)
    counts, hooks = fc1_inputs_beyond_limit(fused)
    fused_outputs, fused_loss = forward_backward(fused, rollout)
    for hook in hooks:
        hook.remove()
    assert min(counts) > 0.05  # every MLP and expert that saw tokens really clamps
    naive_outputs, naive_loss = forward_backward(naive, rollout)

    assert list(fused_outputs) == ["logprobs", "entropy", "values"]
    for name in fused_outputs:
        assert_close(fused_outputs[name], naive_outputs[name], **OUTPUT_TOLERANCE, msg=lambda m: f"{name}: {m}")
    assert_close(fused_loss, naive_loss, **OUTPUT_TOLERANCE)
    fused_grads = {n: p.grad for n, p in fused.named_parameters()}
    naive_grads = {n: p.grad for n, p in naive.named_parameters()}
    # Every parameter gets a gradient (each local expert and the router included).
    assert None not in fused_grads.values() and None not in naive_grads.values()
    assert any(".local_experts." in n for n in fused_grads) and any(".router." in n for n in fused_grads)
    assert_close_by_name(fused_grads, naive_grads)
    assert_close(fused_value.grad, naive_value.grad, rtol=GRAD_RTOL, atol=1e-6)


def _check_clamp_is_never_dropped():
    # Fused bias_swiglu (bias_activation_fusion with a SiLU gate) ignores the clamp: refused with the
    # module names and the field, by the check and by attach; with_clamped_swiglu_mlp's model clamps.
    silu_fusion = dict(activation_func=F.silu, glu_linear_offset=0.0, bias_activation_fusion=True)
    silu_fused = moe_config(**silu_fusion)
    model = tiny_model("gpt", silu_fused, vocab_size=VOCAB)
    for refuse in (check_clamp_not_dropped, lambda m: attach(m, rl_output_processor())):
        with pytest.raises(ClampedSwiGLUNotAppliedError) as error:
            refuse(model)
        message = str(error.value)
        assert "decoder.layers.0.mlp (MLP)" in message and "bias_activation_fusion=False" in message
        for index in range(2):  # this rank's experts
            assert f"decoder.layers.1.mlp.experts.local_experts.{index} (MLP)" in message
    assert check_clamp_not_dropped(tiny_model("gpt", silu_fused, vocab_size=VOCAB, clamped_swiglu_mlp=True))

    # Shared experts stay megatron-core's MLP: a with_clamped_swiglu_mlp model checks them as it builds them.
    shared = moe_config(**silu_fusion, add_bias_linear=False, moe_shared_expert_intermediate_size=32)
    with pytest.raises(ClampedSwiGLUNotAppliedError, match=r"\(SharedExpertMLP\): .*bias_activation_fusion=False"):
        tiny_model("gpt", shared, vocab_size=VOCAB, clamped_swiglu_mlp=True)

    # The fused quick-GELU expert kernel (weighted_bias_quick_geglu_impl) clamps, but before it adds the
    # fc1 bias; without biases it is right. Megatron refuses its unweighted dense form itself.
    with pytest.raises(ClampedSwiGLUNotAppliedError, match=r"local_experts.0 \(MLP\): .*before adding fc1's bias"):
        check_clamp_not_dropped(tiny_model("gpt", moe_config(bias_activation_fusion=True), vocab_size=VOCAB))
    check_clamp_not_dropped(
        tiny_model("gpt", moe_config(bias_activation_fusion=True, add_bias_linear=False), vocab_size=VOCAB)
    )

    # Transformer Engine's activation module (use_te_activation_func) and a non-gated MLP.
    for overrides, field in (
        (dict(activation_func=F.silu, glu_linear_offset=0.0, use_te_activation_func=True), "use_te_activation_func"),
        (dict(activation_func=F.gelu, glu_linear_offset=0.0, gated_linear_unit=False), "gated_linear_unit"),
    ):
        with pytest.raises(ClampedSwiGLUNotAppliedError, match=field):
            check_clamp_not_dropped(tiny_model("gpt", moe_config(**overrides), vocab_size=VOCAB))

    # Grouped-GEMM experts (Transformer Engine's grouped linears stood in by GroupedLinearStandIn):
    # megatron-core's bias_swiglu drops the clamp, its unfused path keeps it.
    for config, dropped in ((silu_fused, True), (moe_config(), False)):
        grouped = grouped_experts(TEGroupedMLP, config)
        if dropped:
            with pytest.raises(ClampedSwiGLUNotAppliedError, match=r"<model> \(TEGroupedMLP\).*bias_activation_fusion"):
                check_clamp_not_dropped(grouped)
        else:
            check_clamp_not_dropped(grouped)


class GroupedLinearStandIn(torch.nn.Module):
    """Stands in for Transformer Engine's GroupedLinear (not installed here): one bias-free weight per
    local expert, applied to that expert's rows."""

    def __init__(self, num_gemms, input_size, output_size, *, config, **unused):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(num_gemms, output_size, input_size) * 2 / math.sqrt(input_size))

    def forward(self, x, tokens_per_expert):
        rows = x.split(list(tokens_per_expert))
        return torch.cat([r @ w.T for r, w in zip(rows, self.weight)]), None


def grouped_experts(cls, config, seed=0):
    torch.manual_seed(seed)
    submodules = GroupedMLPSubmodules(linear_fc1=GroupedLinearStandIn, linear_fc2=GroupedLinearStandIn)
    return cls(2, config, submodules, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _check_clamped_swiglu_grouped_experts():
    # DeepSeek-V4-style SiLU-gated clamped experts on TEGroupedMLP: clamped_swiglu through the
    # use_te_activation_func hook equals megatron-core's unfused clamped path, with routing weights.
    silu = dict(activation_func=F.silu, glu_linear_offset=0.0, add_bias_linear=False)
    megatron = grouped_experts(TEGroupedMLP, moe_config(**silu))
    ours = grouped_experts(ClampedSwiGLUTEGroupedMLP, moe_config(**silu, use_te_activation_func=True), seed=1)
    ours.load_state_dict(megatron.state_dict())
    tokens_per_expert = torch.tensor([5, 3])
    hidden = torch.randn(8, 32) * 4  # fc1 outputs of std ~8: many beyond the limit
    probs = torch.rand(8)
    grads = []
    for experts in (megatron, ours):
        h, p = hidden.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        output, _ = experts(h, tokens_per_expert, p)
        output.backward(torch.ones_like(output))
        grads.append((output, h.grad, p.grad, experts.linear_fc1.weight.grad, experts.linear_fc2.weight.grad))
    fc1_out = megatron.linear_fc1(hidden, [5, 3])[0]
    assert (fc1_out.abs() > LIMIT).float().mean() > 0.05  # the clamp is exercised
    for theirs, mine in zip(*grads):
        assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())
    # Configs the hook cannot serve are refused with what to use instead.
    for overrides, field in ((dict(), "moe_grouped_gemm=False"), (silu, "use_te_activation_func=True")):
        with pytest.raises(ClampedSwiGLUNotAppliedError, match=field):
            grouped_experts(ClampedSwiGLUTEGroupedMLP, moe_config(**overrides))


def _moe(rank, world_size):
    # TP 2 with sequence parallel (MoE training at TP > 1 requires it); experts at expert-TP 1, and
    # no biases: megatron-core 0.19.2's own MLP.forward adds an expert's fc2 bias in place onto the
    # output of an expert-TP-1 reduce-scatter, which is a view of its input, and autograd refuses
    # that (on any device).
    set_parallel_degrees(tp=2, expert_tp=1)
    _check_moe_ppo_step(dict(sequence_parallel=True, add_bias_linear=False))
    # EP 2 (two experts per rank), with biases as gpt-oss has them.
    set_parallel_degrees(tp=1, ep=2, expert_tp=1)
    _check_moe_ppo_step(dict(add_bias_linear=True))
    _check_clamp_is_never_dropped()
    _check_clamped_swiglu_grouped_experts()


def test_moe_ppo_step_matches_megatron_and_the_clamp_is_never_dropped():
    run_distributed(_moe, 2)


# ------------------------------------------------------------------ specs (no process group needed)


def test_with_clamped_swiglu_mlp_replaces_sequential_experts_and_dense_mlps():
    dense, moe = get_gpt_layer_local_spec(), get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    swapped_dense, swapped_moe = with_clamped_swiglu_mlp([dense, moe])
    assert swapped_dense.submodules.mlp.func == ClampedSwiGLUMLP.as_mlp_submodule
    experts = swapped_moe.submodules.mlp.keywords["submodules"].experts
    assert experts.func is ClampedSwiGLUSequentialMLP
    assert experts.keywords == moe.submodules.mlp.keywords["submodules"].experts.keywords
    assert with_clamped_swiglu_mlp(swapped_moe).submodules.mlp.keywords["submodules"].experts is experts
    # The input spec is left as it was.
    assert moe.submodules.mlp.keywords["submodules"].experts.func is SequentialMLP


def moe_layer_with_experts(experts):
    layer = get_gpt_layer_local_spec(num_experts=4)
    moe = layer.submodules.mlp
    moe_submodules = dataclasses.replace(moe.keywords["submodules"], experts=experts)
    layer.submodules.mlp = functools.partial(moe.func, submodules=moe_submodules)
    return layer


def test_with_clamped_swiglu_mlp_swaps_grouped_experts_and_refuses_inference_ones():
    submodules = GroupedMLPSubmodules(linear_fc1=None, linear_fc2=None)
    swapped = with_clamped_swiglu_mlp(moe_layer_with_experts(functools.partial(TEGroupedMLP, submodules=submodules)))
    experts = swapped.submodules.mlp.keywords["submodules"].experts
    assert experts.func is ClampedSwiGLUTEGroupedMLP and experts.keywords == {"submodules": submodules}
    assert with_clamped_swiglu_mlp(swapped).submodules.mlp.keywords["submodules"].experts is experts
    inference = moe_layer_with_experts(functools.partial(InferenceGroupedMLP, submodules=submodules))
    with pytest.raises(ClampedSwiGLUNotAppliedError, match="InferenceGroupedMLP, whose inference kernels .*moe_grouped_gemm"):
        with_clamped_swiglu_mlp(inference)
    unknown = moe_layer_with_experts(functools.partial(type("MyGroupedMLP", (TEGroupedMLP,), {}), submodules=submodules))
    with pytest.raises(ClampedSwiGLUNotAppliedError, match="MyGroupedMLP, a TEGroupedMLP subclass .* does not know"):
        with_clamped_swiglu_mlp(unknown)
