"""save_sharded / load_sharded of expert tensors: round trips across (TP, EP, expert TP) layouts, both layouts.

Each check spawns 4 processes on gloo (fused_rl_ops.testing.distributed).
"""
import re
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fused_rl_ops.checkpoint import ShardingMetadataError, load_sharded, save_sharded
from fused_rl_ops.checkpoint.integrity import ChecksummedWriter
from tests.helpers.checkpoint import (add_parameter, assert_all_differ, assert_all_same, legacy, random_bits,
                                             reference_shard, same_bits, submodule, tensors_of, tp_group_of_size)
from fused_rl_ops.testing.distributed import run_distributed

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")

EXPERT_PREFIX = "decoder.layers.1.mlp.experts.local_experts"
# Shaped like megatron-core 0.19.2's MoE layer with SequentialMLP experts: the name after
# "local_experts.<i>.", logical shape of one expert, dtype, sharding attributes, (dim, stride).
EXPERT_LAYOUT = [
    ("linear_fc1.weight", (16, 6), torch.bfloat16, legacy(0, 2), (0, 2)),  # GLU [W ; V]
    ("linear_fc1.bias", (16,), torch.bfloat16, legacy(0, 2), (0, 2)),
    ("linear_fc2.weight", (6, 8), torch.float32, legacy(1), (1, 1)),
    ("linear_fc2.bias", (6,), torch.float32, {}, None),  # replicated over expert TP
]
DENSE_LAYOUT = [
    ("decoder.layers.0.mlp.linear_fc1.weight", (16, 6), torch.float32, legacy(0, 2), (0, 2)),
    ("decoder.layers.0.mlp.linear_fc2.weight", (6, 8), torch.float32, legacy(1), (1, 1)),
    ("decoder.layers.1.mlp.router.weight", (4, 6), torch.float32, {}, None),
    ("decoder.final_layernorm.weight", (6,), torch.float32, {}, None),
]


def moe_logical_state(num_experts, seed):
    state = {name: random_bits(shape, dtype, seed * 1000 + i) for i, (name, shape, dtype, _, _) in enumerate(DENSE_LAYOUT)}
    for e in range(num_experts):
        for i, (name, shape, dtype, _, _) in enumerate(EXPERT_LAYOUT):
            state[f"{EXPERT_PREFIX}.{e}.{name}"] = random_bits(shape, dtype, seed * 1000 + 100 * (e + 1) + i)
    return state


def _shard(full, split, size, rank):
    return reference_shard(full, *split, size, rank) if split else full


GROUPED_PREFIX = "decoder.layers.1.mlp.experts"
# Transformer Engine's GroupedLinear holds local expert i as `weight<i>` / `bias<i>`; megatron-core
# 0.19.2's TEGroupedMLP (_set_expert_parameter_attributes) marks them with stride 1 whatever the
# layout: fc1 (column) weights and biases on dim 0, fc2 (row) weights on dim 1, fc2 biases
# replicated. A GLU fc1 still holds [W_r ; V_r] per rank, as SequentialMLP's experts do.
GROUPED_ATTRIBUTES = {
    "linear_fc1.weight": legacy(0),
    "linear_fc1.bias": legacy(0),
    "linear_fc2.weight": legacy(1),
    "linear_fc2.bias": {"tensor_model_parallel": False, "sequence_parallel": False},
}


class GroupedLinearStandIn(torch.nn.Module):
    """Transformer Engine's GroupedLinear as a state dict sees it (TE is not installed here): the
    weight<i> / bias<i> parameters MoEToy adds, and an extra state (its FP8 scaling state: an empty
    uint8 tensor without FP8)."""

    def __init__(self, extra_state):
        super().__init__()
        self.extra_state = extra_state

    def get_extra_state(self):
        return self.extra_state

    def set_extra_state(self, state):
        self.extra_state = state


def grouped_name(name, i):
    """linear_fc1.weight, local expert i -> TE GroupedLinear's name for it under the experts module."""
    linear, kind = name.split(".")
    return f"{GROUPED_PREFIX}.{linear}.{kind}{i}"


class MoEToy(torch.nn.Module):
    """One rank of a model with a dense MLP and an MoE layer: dense shards over the TP group, experts
    ep_rank * n .. + n - 1 of the logical state as local experts 0..n-1, sharded over the expert TP
    group, held as megatron-core's SequentialMLP holds them or, with grouped=True, as TEGroupedMLP's
    Transformer Engine GroupedLinear modules do (names and sharding attributes as GROUPED_ATTRIBUTES
    says, or as `attributes` overrides per name); `allreduce` set on expert parameters as megatron-core
    sets it (False when they use the expert process groups: EP > 1 or expert TP != TP)."""

    def __init__(self, logical, layout, num_local, grouped=False, attributes=None, extra_state=None):
        super().__init__()
        tp_group, ep_group, expert_tp_group = layout
        tp, ep = _size_and_rank(tp_group), _size_and_rank(ep_group)
        etp = tp if expert_tp_group is None else _size_and_rank(expert_tp_group)  # expert TP defaults to TP
        for name, _, _, attrs, split in DENSE_LAYOUT:
            add_parameter(self, name, _shard(logical[name], split, *tp).clone(), attrs)
        uses_expert_groups = ep[0] > 1 or etp[0] != tp[0]
        if grouped:
            for linear in ("linear_fc1", "linear_fc2"):
                submodule(self, GROUPED_PREFIX).add_module(linear, GroupedLinearStandIn(
                    torch.empty(0, dtype=torch.uint8) if extra_state is None else extra_state))
        for i in range(num_local):
            for name, _, _, attrs, split in EXPERT_LAYOUT:
                full = logical[f"{EXPERT_PREFIX}.{ep[1] * num_local + i}.{name}"]
                if grouped:
                    module_name, attrs = grouped_name(name, i), GROUPED_ATTRIBUTES[name]
                else:
                    module_name = f"{EXPERT_PREFIX}.{i}.{name}"
                attrs = {**attrs, **(attributes or {}).get(name, {})}
                add_parameter(self, module_name, _shard(full, split, *etp).clone(),
                              {**attrs, "allreduce": not uses_expert_groups})


def _size_and_rank(group):
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def _moe_layouts():
    """(TP group, EP group, expert TP group) of each layout on 4 ranks; every rank creates every group."""
    singles, pairs, everyone = tp_group_of_size(1), tp_group_of_size(2), tp_group_of_size(4)
    strided = None
    for ranks in ([0, 2], [1, 3]):
        group = dist.new_group(ranks)
        strided = group if dist.get_rank() in ranks else strided
    return {
        "TP1/EP1": (singles, None, None),
        "TP2/EP1": (pairs, None, None),  # expert TP = TP 2; data-parallel replicas {0, 2}, {1, 3}
        "TP1/EP2": (singles, pairs, None),
        "TP1/EP4": (singles, everyone, None),
        "TP2/EP2": (pairs, strided, None),  # TP ranks {0, 1} hold the same experts (expert TP 2)
        "TP2/EP2/ETP1": (pairs, pairs, singles),  # TP ranks {0, 1} hold different experts
    }


def _moe_kwargs(layout):
    return dict(zip(("tp_group", "ep_group", "expert_tp_group"), layout))


def _assert_untouched_by_failing_load(module, path, layout, match):
    before = {name: t.clone() for name, t in tensors_of(module).items()}
    for staged in (False, True):
        with pytest.raises(ValueError, match=match):
            load_sharded(module, path, staged=staged, **_moe_kwargs(layout))
        assert all(same_bits(t, before[name]) for name, t in tensors_of(module).items())


def _expert_parallel_checks(rank, world_size, root):
    layouts = _moe_layouts()
    original = moe_logical_state(4, seed=1)
    for save in ("TP2/EP1", "TP2/EP2", "TP2/EP2/ETP1", "TP1/EP2"):
        layout = layouts[save]
        save_sharded(MoEToy(original, layout, 4 // _size_and_rank(layout[1])[0]), f"{root}/{save}",
                     **_moe_kwargs(layout))
    for i, (save, load) in enumerate([("TP2/EP1", "TP1/EP2"), ("TP1/EP2", "TP1/EP4"), ("TP2/EP2", "TP2/EP1"),
                                      ("TP2/EP2/ETP1", "TP2/EP2"), ("TP2/EP2", "TP2/EP2/ETP1"),
                                      ("TP1/EP2", "TP2/EP2/ETP1"), ("TP2/EP1", "TP1/EP4")]):
        layout = layouts[load]
        num_local = 4 // _size_and_rank(layout[1])[0]
        target = MoEToy(moe_logical_state(4, seed=2), layout, num_local)
        expected = MoEToy(original, layout, num_local)
        assert_all_differ(target, expected)
        load_sharded(target, f"{root}/{save}", staged=bool(i % 2), **_moe_kwargs(layout))
        assert_all_same(target, expected)

    # Expert counts that do not fit are refused before any tensor is read.
    _assert_untouched_by_failing_load(MoEToy(original, layouts["TP1/EP2"], 1), f"{root}/TP2/EP1", layouts["TP1/EP2"],
                                      "holds 4 experts under .*local_experts., the module 2 .1 per rank x "
                                      "expert-parallel degree 2")
    _assert_untouched_by_failing_load(MoEToy(moe_logical_state(8, 2), layouts["TP1/EP4"], 2), f"{root}/TP2/EP1",
                                      layouts["TP1/EP4"], "holds 4 experts .*, the module 8")
    six = moe_logical_state(6, seed=3)
    save_sharded(MoEToy(six, layouts["TP1/EP2"], 3), f"{root}/six", **_moe_kwargs(layouts["TP1/EP2"]))
    _assert_untouched_by_failing_load(MoEToy(original, layouts["TP1/EP4"], 1), f"{root}/six", layouts["TP1/EP4"],
                                      "its 6 experts under .* cannot be split over expert-parallel degree 4")
    holed = {name: t for name, t in six.items() if ".local_experts.2." not in name}
    # save_sharded refuses the hole (below); its writer stores the entries as they are, sealed.
    dcp.save(holed, storage_writer=ChecksummedWriter(f"{root}/holed"))
    _assert_untouched_by_failing_load(MoEToy(original, layouts["TP1/EP2"], 2), f"{root}/holed", layouts["TP1/EP2"],
                                      r"numbered \[0, 1, 3, 4, 5\], not 0..4: missing \[2\]")
    with pytest.raises(ValueError, match=r"local expert indices \[0, 1, 3, 4, 5\] are not 0..4"):
        save_sharded(holed, f"{root}/holed_save", **_moe_kwargs(layouts["TP1/EP4"]))
    uneven = MoEToy(original, layouts["TP1/EP2"], 2 if rank % 2 else 1)
    with pytest.raises(ValueError, match="expert-parallel ranks .* hold different numbers of local experts"):
        save_sharded(uneven, f"{root}/uneven", **_moe_kwargs(layouts["TP1/EP2"]))


def test_expert_parallel_round_trips(tmp_path):
    """An MoE-shaped toy with 4 experts saved at (TP, EP, expert TP) = (2, 1, 2), (2, 2, 2),
    (2, 2, 1) and (1, 2, 1) loads bit for bit at another layout (TP 2 / EP 1 -> TP 1 / EP 2,
    EP 2 -> EP 4, expert TP 2 <-> 1 at TP 2, ...); expert counts that do not fit are clear errors
    with the module untouched. One spawned run of 4 processes."""
    run_distributed(_expert_parallel_checks, 4, str(tmp_path))


def _grouped_expert_checks(rank, world_size, root):
    layouts = _moe_layouts()
    original = moe_logical_state(4, seed=1)

    def toy(logical, name, grouped):
        layout = layouts[name]
        return MoEToy(logical, layout, 4 // _size_and_rank(layout[1])[0], grouped=grouped)

    def load_and_compare(save, load, grouped, staged):
        target, expected = toy(moe_logical_state(4, seed=2), load, grouped), toy(original, load, grouped)
        assert_all_differ(target, expected)
        load_sharded(target, f"{root}/{save}", staged=staged, **_moe_kwargs(layouts[load]))
        assert_all_same(target, expected)

    for save in ("TP1/EP2", "TP2/EP2", "TP2/EP2/ETP1"):
        save_sharded(toy(original, save, grouped=True), f"{root}/grouped/{save}", **_moe_kwargs(layouts[save]))
    save_sharded(toy(original, "TP2/EP2", grouped=False), f"{root}/sequential", **_moe_kwargs(layouts["TP2/EP2"]))
    # Grouped experts saved at EP 2 load at EP 1 and EP 2, across expert TP 1 <-> 2 ...
    for i, (save, load) in enumerate([("TP1/EP2", "TP1/EP1"), ("TP1/EP2", "TP1/EP2"), ("TP2/EP2", "TP2/EP1"),
                                      ("TP2/EP2/ETP1", "TP2/EP2"), ("TP2/EP2", "TP1/EP4")]):
        load_and_compare(f"grouped/{save}", load, grouped=True, staged=bool(i % 2))
    # ... and into SequentialMLP experts, and back.
    load_and_compare("grouped/TP2/EP2", "TP1/EP2", grouped=False, staged=False)
    load_and_compare("sequential", "TP2/EP2/ETP1", grouped=True, staged=True)
    # Plain DCP reads each expert's logical tensors under its global index.
    full = {f"{EXPERT_PREFIX}.{e}.{name}": torch.empty(shape, dtype=dtype)
            for e in range(4) for name, shape, dtype, _, _ in EXPERT_LAYOUT}
    dcp.load(full, checkpoint_id=f"{root}/grouped/TP2/EP2")
    assert all(same_bits(t, original[name]) for name, t in full.items())

    # Expert counts that do not fit, and sharding metadata that contradicts a grouped tensor's place
    # in the MLP, are refused before anything is read, naming the experts or the parameter.
    ep2 = layouts["TP1/EP2"]
    _assert_untouched_by_failing_load(MoEToy(original, ep2, 1, grouped=True), f"{root}/grouped/TP1/EP2", ep2,
                                      r"holds 4 experts under .*experts.local_experts., the module 2 \(as TE grouped "
                                      r"weight<i>\) \(1 per rank x expert-parallel degree 2\)")
    for name, attributes, said in [
            ("linear_fc2.weight", legacy(0), "sharded on dim 0"),  # TE's own marking without megatron-core's
            ("linear_fc2.bias", legacy(0), "sharded on dim 0"),
            ("linear_fc1.weight", {"tensor_model_parallel": False, "partition_dim": -1}, "replicated"),
            ("linear_fc1.bias", legacy(0, 4), "stride 4")]:
        wrong = MoEToy(original, ep2, 2, grouped=True, attributes={name: attributes})
        match = rf"{re.escape(grouped_name(name, 0))}: a grouped expert's {name} must be .*, its metadata says .*{said}"
        _assert_untouched_by_failing_load(wrong, f"{root}/grouped/TP1/EP2", ep2, match)
        with pytest.raises(ShardingMetadataError, match=match):
            save_sharded(wrong, f"{root}/wrong", **_moe_kwargs(ep2))
    holed = MoEToy(moe_logical_state(6, seed=3), ep2, 3, grouped=True)
    for linear in ("linear_fc1", "linear_fc2"):
        del holed.get_submodule(f"{GROUPED_PREFIX}.{linear}").weight1, holed.get_submodule(f"{GROUPED_PREFIX}.{linear}").bias1
    with pytest.raises(ValueError, match=r"experts.local_experts.: local expert indices \[0, 2\] are not 0..1"):
        save_sharded(holed, f"{root}/holed", **_moe_kwargs(ep2))
    both = MoEToy(original, ep2, 2, grouped=True)
    add_parameter(both, f"{EXPERT_PREFIX}.0.linear_fc1.weight", torch.zeros(16, 6), {})
    with pytest.raises(ValueError, match=r"experts.local_experts.: holds experts in both layouts: .*local_experts.0"
                                         r".linear_fc1.weight \(SequentialMLP\) and .*linear_fc1.weight0"):
        save_sharded(both, f"{root}/both", **_moe_kwargs(ep2))
    interleaved = MoEToy(original, ep2, 2, grouped=True)
    submodule(interleaved, GROUPED_PREFIX).config = types.SimpleNamespace(gated_linear_unit=True,
                                                                          moe_mlp_glu_interleave_size=4)
    _assert_untouched_by_failing_load(interleaved, f"{root}/grouped/TP1/EP2", ep2,
                                      r"mlp.experts: grouped experts with interleaved GLU rows .*size=4")
    with pytest.raises(ValueError, match="mlp.experts: grouped experts with interleaved GLU rows"):
        save_sharded(interleaved, f"{root}/interleaved", **_moe_kwargs(ep2))
    fp8 = MoEToy(original, ep2, 2, grouped=True, extra_state=torch.ones(40, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"experts.linear_fc1._extra_state: Transformer Engine FP8 state of grouped"):
        save_sharded(fp8, f"{root}/fp8", **_moe_kwargs(ep2))
    single = {f"{GROUPED_PREFIX}.linear_fc1.weight": torch.zeros(2, 16, 6)}  # TE's moe_single_grouped_weight
    with pytest.raises(ValueError, match=r"experts.linear_fc1.weight: one grouped tensor for all local experts"):
        save_sharded(single, f"{root}/single", **_moe_kwargs(ep2))


def test_grouped_gemm_experts_reshard_and_interchange_with_sequential(tmp_path):
    """Experts held as Transformer Engine GroupedLinear modules hold them (TEGroupedMLP:
    `experts.linear_fc1.weight<i>`, megatron-core's stride-1 sharding attributes) saved at EP 2 load
    bit for bit at EP 1 and EP 2 and other expert TP degrees, and into SequentialMLP experts and back;
    expert counts that do not fit and sharding metadata that contradicts the layout are clear errors
    with the module untouched. One spawned run of 4 processes."""
    run_distributed(_grouped_expert_checks, 4, str(tmp_path))
