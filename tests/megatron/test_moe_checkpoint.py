"""An MoE model's checkpoint across (TP, EP) layouts, end to end on megatron-core 0.18 and 0.19 (CPU / gloo):
the gpt-oss-style model of test_moe saved at TP 2 (sequence parallel) / EP 1, loaded at
TP 1 / EP 2, saved there and loaded back at TP 2 / EP 1; and the same model with SequentialMLP
experts loaded into grouped-GEMM experts (TEGroupedMLP, Transformer Engine stood in) and back."""
import dataclasses
import functools

import pytest
import torch
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP  # noqa: E402
from megatron.core.utils import get_pg_size  # noqa: E402

from fused_rl_ops.checkpoint import load_sharded, save_sharded  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import model_inputs  # noqa: E402
from tests.helpers.megatron import MEGATRON_0_18  # noqa: E402
from tests.megatron.test_moe import B, S, VOCAB, moe_config  # noqa: E402

if MEGATRON_0_18:
    def _set_expert_parameter_attributes(module, parallel_mode, use_expert_pgs):
        """What megatron-core 0.18's TEGroupedLinear and Transformer Engine (<= 2.12) set: every
        weight<i> split on dim 0 (column) or 1 (row) with stride 1, a column bias<i> on dim 0, and
        the gradient group."""
        for name, param in module.named_parameters(recurse=False):
            param.allreduce = not use_expert_pgs
            if name.startswith("weight") or parallel_mode == "column":
                param.tensor_model_parallel = True
                param.partition_dim = 1 if parallel_mode == "row" and name.startswith("weight") else 0
                param.partition_stride = 1
else:
    from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes

LAYOUTS = {  # name: (parallel degrees, config overrides); no biases: the TP 2 layout cannot train them
    "tp2-ep1": (dict(tp=2, expert_tp=1), dict(sequence_parallel=True, add_bias_linear=False)),
    "tp1-ep2": (dict(tp=1, ep=2, expert_tp=1), dict(add_bias_linear=False)),
}


def groups():
    return dict(
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
        expert_tp_group=parallel_state.get_expert_tensor_parallel_group(),
    )


def model_at(layout, seed):
    degrees, overrides = LAYOUTS[layout]
    set_parallel_degrees(**degrees)
    return tiny_model("gpt", moe_config(**overrides), seed=seed, vocab_size=VOCAB, clamped_swiglu_mlp=True)


def logits(model):
    """Full-vocab logits [b, s, V] of a fixed batch (gathered over TP), without gradients."""
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        local = model(tokens, *model_inputs(tokens))
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def bits(t):
    return t.contiguous().view(torch.int32)


def _reshard(rank, world_size, path):
    source = model_at("tp2-ep1", seed=1)
    expected = logits(source)
    save_sharded(source, f"{path}/a", **groups())

    other = model_at("tp1-ep2", seed=2)
    assert not torch.allclose(logits(other), expected)  # different weights before the load
    load_sharded(other, f"{path}/a", **groups())
    # Another layout sums in another order: equal to fp32 rounding, not bitwise.
    assert_close(logits(other), expected, rtol=1e-5, atol=1e-5)
    save_sharded(other, f"{path}/b", **groups())

    back = model_at("tp2-ep1", seed=3)
    load_sharded(back, f"{path}/b", **groups())
    assert torch.equal(bits(logits(back)), bits(expected))  # the same layout again: bit for bit
    for (name, saved), (_, loaded) in zip(source.state_dict().items(), back.state_dict().items()):
        if isinstance(saved, torch.Tensor) and saved.is_floating_point():
            assert torch.equal(bits(saved.float()), bits(loaded.float())), name


def test_moe_checkpoint_reshards_between_tp_and_ep_layouts(tmp_path, checkpoint_dependencies):
    run_distributed(_reshard, 2, str(tmp_path))


class TEGroupedLinearStandIn(torch.nn.Module):
    """Transformer Engine's GroupedLinear as megatron-core's TEColumnParallelGroupedLinear /
    TERowParallelGroupedLinear build it (TE is not installed here): `weight<i>` [out, in] (and
    `bias<i>`) per local expert, split over the expert TP group, marked by megatron-core's own
    _set_expert_parameter_attributes, an empty extra state (no FP8); expert i's rows meet weight<i>."""

    def __init__(self, num_gemms, input_size, output_size, *, parallel_mode, config, init_method, bias,
                 skip_bias_add, is_expert, pg_collection, **unused):
        super().__init__()
        tp = get_pg_size(pg_collection.expt_tp)
        if parallel_mode == "column":
            output_size //= tp
        else:
            input_size //= tp
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(init_method(torch.empty(output_size, input_size))))
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(output_size)))
        self.num_gemms, self.use_bias, self.return_bias = num_gemms, bias, bias and skip_bias_add
        uses_expert_groups = config.expert_model_parallel_size > 1 or tp != config.tensor_model_parallel_size
        _set_expert_parameter_attributes(self, parallel_mode, uses_expert_groups)

    def forward(self, x, tokens_per_expert):
        rows = x.split(list(tokens_per_expert))
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None
        out = torch.cat([r @ w.T + (b if biases and not self.return_bias else 0) for r, w, b in
                         zip(rows, weights, biases or weights)])
        return out, (biases if self.return_bias else None)

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass


def with_grouped_experts(spec):
    """The decoder block spec with the MoE layer's SequentialMLP experts replaced by TEGroupedMLP."""
    grouped = functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=functools.partial(TEGroupedLinearStandIn, parallel_mode="column"),
        linear_fc2=functools.partial(TEGroupedLinearStandIn, parallel_mode="row")))
    moe_spec = spec.layer_specs[1]
    moe = moe_spec.submodules.mlp
    moe = functools.partial(moe.func, *moe.args, **{
        **moe.keywords, "submodules": dataclasses.replace(moe.keywords["submodules"], experts=grouped)})
    layers = list(spec.layer_specs)
    layers[1] = dataclasses.replace(moe_spec, submodules=dataclasses.replace(moe_spec.submodules, mlp=moe))
    return dataclasses.replace(spec, layer_specs=layers)


def _sequential_and_grouped(rank, world_size, path):
    # SequentialMLP experts at TP 1 / EP 2 -> TEGroupedMLP at TP 2 / expert TP 2 (sequence parallel),
    # where each rank holds half of every expert: [W_r ; V_r] of fc1, which megatron-core marks stride 1.
    set_parallel_degrees(tp=1, ep=2, expert_tp=1)
    sequential = tiny_model("gpt", moe_config(add_bias_linear=False), seed=1, vocab_size=VOCAB)
    expected = logits(sequential)
    source = {name: t.clone() for name, t in sequential.state_dict().items() if isinstance(t, torch.Tensor)}
    save_sharded(sequential, f"{path}/sequential", **groups())

    set_parallel_degrees(tp=2, expert_tp=2)
    config = moe_config(add_bias_linear=False, sequence_parallel=True)
    grouped = tiny_model("gpt", config, seed=2, vocab_size=VOCAB, edit_spec=with_grouped_experts)
    experts = grouped.decoder.layers[1].mlp.experts
    assert isinstance(experts, TEGroupedMLP) and hasattr(experts.linear_fc1, "weight3")
    assert not torch.allclose(logits(grouped), expected)
    load_sharded(grouped, f"{path}/sequential", **groups())
    # TEGroupedMLP's eager path computes what SequentialMLP's does, to fp32 rounding (another layout).
    assert_close(logits(grouped), expected, rtol=1e-5, atol=1e-5)
    save_sharded(grouped, f"{path}/grouped", **groups())

    set_parallel_degrees(tp=1, ep=2, expert_tp=1)
    back = tiny_model("gpt", moe_config(add_bias_linear=False), seed=3, vocab_size=VOCAB)
    load_sharded(back, f"{path}/grouped", **groups())
    loaded = back.state_dict()
    for name, saved in source.items():
        if saved.is_floating_point():
            assert torch.equal(bits(saved), bits(loaded[name])), name


def test_sequential_experts_load_into_grouped_gemm_experts_and_back(tmp_path, checkpoint_dependencies):
    """gpt-oss-style experts: a SequentialMLP checkpoint saved at EP 2 loads into megatron-core's
    TEGroupedMLP (Transformer Engine's GroupedLinear stood in, with its parameter names and
    megatron-core's own sharding attributes) at expert TP 2, which then computes the same logits,
    and its checkpoint loads back into SequentialMLP experts at EP 2 bit for bit."""
    run_distributed(_sequential_and_grouped, 2, str(tmp_path))
