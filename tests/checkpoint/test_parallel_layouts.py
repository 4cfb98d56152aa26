"""save_sharded / load_sharded beside data and pipeline parallelism: replicas stored once (never as
shards), the groups taken from megatron-core's parallel_state or refused, and a 4-layer GPTModel's
pipeline stages stored under global layer numbers, loaded at PP 1 and back at PP 2 (with TP 2 and DP
beside). Each multi-process check runs inside one spawned run per world size."""
import os
import pickle
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from fused_rl_ops.checkpoint import load_sharded, save_sharded
from tests.helpers.checkpoint import (LAYOUT, Toy, add_parameter, assert_all_differ, assert_all_same,
                                             global_layer_name, logical_state, partition_of, perturb, random_bits,
                                             reference_shard, reference_unshard, same_bits, stored_items,
                                             tp_group_of_size)
from fused_rl_ops.testing.distributed import run_distributed

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")


def _stored_shapes(path):
    """stored name -> global shape of every tensor in a checkpoint, from DCP's own .metadata."""
    with open(f"{path}/.metadata", "rb") as f:
        metadata = pickle.load(f)
    return {name: tuple(md.size) for name, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}


def _each_piece_stored_once(path, tp):
    """Each tensor of the toy saved at TP degree tp is stored as stride x tp chunks (1 when
    replicated), and the data files hold nothing but the stored items: no replica wrote its copy too."""
    items = stored_items(path)
    chunks = Counter(name for *_, name in items)
    assert {name: chunks[name] for name, *_ in LAYOUT} == {
        name: split[1] * tp if split else 1 for name, _, _, _, split in LAYOUT}
    data_files = [f for f in os.listdir(path) if f.endswith(".distcp")]
    assert sum(os.path.getsize(f"{path}/{f}") for f in data_files) == sum(end - start for _, start, end, _ in items)


def _load_and_compare(target, expected, path, **groups):
    assert_all_differ(target, expected)
    load_sharded(target, path, **groups)
    assert_all_same(target, expected)
    assert target.step == expected.step


# --- TP 1 x DP 2: replicas, and the refusals (2 processes) -----------------------------------------

def _replicas(rank, world_size, root):
    singles = tp_group_of_size(1)  # TP 1: each rank is a data-parallel replica of the whole model
    original = logical_state(seed=1)
    save_sharded(Toy(original, 1, 0, step=7), f"{root}/replicas", tp_group=singles)
    assert _stored_shapes(f"{root}/replicas") == {name: tuple(t.shape) for name, t in original.items()}
    _each_piece_stored_once(f"{root}/replicas", tp=1)
    # every replica reads its copy
    _load_and_compare(Toy(logical_state(seed=2), 1, 0, step=0), Toy(original, 1, 0, step=7), f"{root}/replicas",
                      tp_group=singles)

    # Without a group and without megatron-core's parallel_state, a world of 2 ranks is refused:
    # taking it as one TP group would store the replicas as two halves of a tensor twice the size.
    target = Toy(logical_state(seed=2), 1, 0, step=0)
    for call in (lambda: save_sharded(Toy(original, 1, 0, step=7), f"{root}/no_group"),
                 lambda: load_sharded(target, f"{root}/replicas")):
        with pytest.raises(ValueError, match="no tp_group given in a world of 2 ranks.*pass tp_group.*pp_group"):
            call()
    assert not os.path.exists(f"{root}/no_group/.metadata")
    assert_all_differ(target, Toy(original, 1, 0, step=7))
    experts = torch.nn.Module()
    add_parameter(experts, "mlp.experts.local_experts.0.linear_fc1.weight", torch.zeros(4, 2), {})
    with pytest.raises(ValueError, match="no tp_group given.*ep_group / expert_tp_group for the experts"):
        save_sharded(experts, f"{root}/no_group")

    # Replicas that differ would be stored from one rank only: refused, naming the entry and ranks,
    # for a sharded tensor (its TP shard 0) and for a replicated one.
    for name, match in (("column.weight", "its tensor-parallel shard 0"), ("norm.weight", "it ")):
        differing = Toy(original, 1, 0, step=7)
        with torch.no_grad():
            getattr(differing, name.split(".")[0]).weight.view(torch.int32)[0] ^= rank
        with pytest.raises(ValueError, match=f"{name}: ranks 0 and 1 both hold {match}.*different bytes"):
            save_sharded(differing, f"{root}/differing", tp_group=singles)
        assert not os.path.exists(f"{root}/differing/.metadata")

    _stages_with_experts(rank, root, singles)


# --- numbered layers with experts across 2 pipeline stages, without megatron-core ------------------

def _layer_values(layer, seed):
    """A layer's tensors by its global index: a norm and two experts' weights."""
    names = ["norm.weight"] + [f"mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(2)]
    return {name: random_bits((4, 3), torch.float32, seed * 100 + layer * 10 + i) for i, name in enumerate(names)}


class _Stack(torch.nn.Module):
    """decoder.layers: the given consecutive global layers, each marked with megatron-core's 1-based,
    global layer_number; an embedding on the stage holding layer 0."""

    def __init__(self, layers, seed):
        super().__init__()
        self.first_layer = layers[0]
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList()
        for layer in layers:
            module = torch.nn.Module()
            module.layer_number = layer + 1
            for name, value in _layer_values(layer, seed).items():
                add_parameter(module, name, value, {})
            self.decoder.layers.append(module)
        if 0 in layers:
            add_parameter(self, "embedding.weight", random_bits((5, 3), torch.float32, seed), {})

    def by_global_name(self):
        """The test's own numbering: the stage's layers are consecutive from its first."""
        return {global_layer_name(name, self.first_layer): t for name, t in self.state_dict().items()}


def _assert_stack_loads(target, expected, path, **groups):
    wanted = expected.by_global_name()
    assert target.by_global_name().keys() == wanted.keys()
    assert all(not same_bits(t, wanted[name]) for name, t in target.by_global_name().items())
    load_sharded(target, path, **groups)
    assert all(same_bits(t, wanted[name]) for name, t in target.by_global_name().items())


def _stages_with_experts(rank, root, singles):
    """Stage r holds global layer r (its experts as local_experts.0, .1 of decoder.layers.0)."""
    stages = dict(tp_group=singles, pp_group=dist.group.WORLD)
    save_sharded(_Stack([rank], seed=1), f"{root}/stack_pp2", **stages)
    _assert_stack_loads(_Stack([0, 1], seed=2), _Stack([0, 1], seed=1), f"{root}/stack_pp2", tp_group=singles)
    save_sharded(_Stack([0, 1], seed=3), f"{root}/stack_pp1", tp_group=singles)
    _assert_stack_loads(_Stack([rank], seed=2), _Stack([rank], seed=3), f"{root}/stack_pp1", **stages)


def test_data_parallel_replicas_are_stored_once_and_load_at_world_one(tmp_path):
    """TP 1 x DP 2: the stored tensors have the model's shapes, each piece is stored once, and the
    checkpoint loads bit for bit in this process (world 1). No group given in a multi-rank world
    without parallel_state, and replicas that differ, are refused. Numbered layers with experts saved
    from 2 pipeline stages load at PP 1 (here and at DP 2), and back at PP 2."""
    run_distributed(_replicas, 2, str(tmp_path))
    original = logical_state(seed=1)
    _load_and_compare(Toy(logical_state(seed=2), 1, 0, step=0), Toy(original, 1, 0, step=7),
                      str(tmp_path / "replicas"))
    _assert_stack_loads(_Stack([0, 1], seed=2), _Stack([0, 1], seed=1), str(tmp_path / "stack_pp2"))


# --- TP 2 x DP 2 on 4 ranks, loaded at TP 1 and TP 4 (with the GPTModel check) ---------------------

def _tp2_dp2(rank, root):
    pairs, singles, everyone = tp_group_of_size(2), tp_group_of_size(1), tp_group_of_size(4)
    original = logical_state(seed=1)
    save_sharded(Toy(original, 2, rank % 2, step=7), f"{root}/tp2_dp2", tp_group=pairs)  # replicas {0, 2}, {1, 3}
    assert _stored_shapes(f"{root}/tp2_dp2") == {name: tuple(t.shape) for name, t in original.items()}
    _each_piece_stored_once(f"{root}/tp2_dp2", tp=2)
    _load_and_compare(Toy(logical_state(seed=2), 1, 0, step=0), Toy(original, 1, 0, step=7), f"{root}/tp2_dp2",
                      tp_group=singles)
    _load_and_compare(Toy(logical_state(seed=2), 4, rank, step=0), Toy(original, 4, rank, step=7),
                      f"{root}/tp2_dp2", tp_group=everyone)
    _load_and_compare(Toy(logical_state(seed=2), 2, rank % 2, step=0), Toy(original, 2, rank % 2, step=7),
                      f"{root}/tp2_dp2", tp_group=pairs)


# --- a 4-layer GPTModel across pipeline stages (4 processes) ---------------------------------------

NUM_LAYERS = 4


def _stage_model(tp, pp, seed, tied=False):
    """The GPTModel stage of this rank at (tp, pp) (the rest data-parallel), its values perturbed by
    global name and TP rank; (model, its first global layer), the offset by the test's own rule.
    tied: tied embeddings, the last stage's copy made equal to the first's as megatron-core does it."""
    from megatron.core import parallel_state as ps
    from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model
    import torch.nn.functional as F

    set_parallel_degrees(tp=tp, pp=pp)
    config = tiny_config(num_layers=NUM_LAYERS, pipeline_dtype=torch.float32, gated_linear_unit=True,
                         activation_func=F.silu, add_bias_linear=True)
    model = tiny_model("gpt", config, seed=seed, tied_embeddings=tied)
    offset = ps.get_pipeline_model_parallel_rank() * NUM_LAYERS // pp
    perturb(model, ps.get_tensor_model_parallel_rank(), seed, layer_offset=offset)
    if tied and pp > 1 and ps.is_rank_in_embedding_group():
        weight = model.shared_embedding_or_output_weight().data
        if not ps.is_pipeline_first_stage():
            weight.zero_()
        dist.all_reduce(weight, group=ps.get_embedding_group())
    return model, offset


def _by_global_name(model, offset):
    """{global name: (this TP rank's tensor, its partition)} of the stage, as the test numbers layers."""
    return {global_layer_name(name, offset): (p.detach().clone(), partition_of(p))
            for name, p in model.named_parameters()}


def _every_stage(model, offset):
    """{(global name, TP rank): tensor} and {global name: partition} over all ranks: what the whole
    pipeline holds."""
    from megatron.core import parallel_state as ps

    mine = (ps.get_tensor_model_parallel_rank(), _by_global_name(model, offset))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    shards = {(name, tp_rank): t for tp_rank, held in everyone for name, (t, _) in held.items()}
    partitions = {name: split for _, held in everyone for name, (_, split) in held.items()}
    return shards, partitions


def _expected_shards(model, offset, shards, partitions, saved_tp):
    """What each of the model's parameters must hold after a load from the pipeline that held
    shards at TP degree saved_tp: the logical tensor (test's reference unshard) split at this TP rank."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    expected = {}
    for name, param in model.named_parameters():
        global_name = global_layer_name(name, offset)
        split = partitions[global_name]
        if split is None:
            expected[name] = shards[(global_name, 0)]
            continue
        logical = reference_unshard([shards[(global_name, r)] for r in range(saved_tp)], *split)
        expected[name] = reference_shard(logical, *split, tp, tp_rank)
    return expected


def _assert_loads(model, expected, path):
    params = dict(model.named_parameters())
    assert all(not same_bits(p, expected[n]) for n, p in params.items()), "the target already holds the values"
    load_sharded(model, path)  # the groups from megatron-core's parallel_state
    assert params.keys() == expected.keys()
    for name, param in params.items():
        assert same_bits(param, expected[name]), name


def _pipeline(rank, root):
    import warnings

    warnings.filterwarnings("ignore")
    # TP 2 x PP 2: stage 0 holds global layers 0, 1 (and the embedding), stage 1 layers 2, 3 as
    # decoder.layers.0, .1 (and the final norm and output layer).
    stage, offset = _stage_model(tp=2, pp=2, seed=1)
    shards, partitions = _every_stage(stage, offset)
    save_sharded(stage, f"{root}/tp2_pp2")
    stored = _stored_shapes(f"{root}/tp2_pp2")
    assert {n for n in stored if "_extra_state" not in n} == set(partitions)  # every stage's parameters
    assert len(partitions) == NUM_LAYERS * 12 + 5  # 12 per layer; embeddings, final norm, output layer
    assert {int(n.split(".")[2]) for n in partitions if n.startswith("decoder.layers.")} == set(range(NUM_LAYERS))

    # PP 1 (TP 2 x DP 2): every layer at its global place, compared by global name.
    whole, _ = _stage_model(tp=2, pp=1, seed=2)
    _assert_loads(whole, _expected_shards(whole, 0, shards, partitions, saved_tp=2), f"{root}/tp2_pp2")
    save_sharded(whole, f"{root}/tp2_pp1")

    # Back to PP 2, at TP 1 x DP 2 and at TP 2: the original pipeline's values again.
    for tp in (1, 2):
        back, back_offset = _stage_model(tp=tp, pp=2, seed=3)
        _assert_loads(back, _expected_shards(back, back_offset, shards, partitions, saved_tp=2), f"{root}/tp2_pp1")

    # What cannot be placed at PP 2 is refused: a plain state dict (its layer names are local to
    # the stage), a layer without megatron-core's layer_number.
    with pytest.raises(ValueError, match="a plain state dict cannot be placed at pipeline-parallel degree 2"):
        save_sharded(back.state_dict(keep_vars=True), f"{root}/state_dict")
    del back.decoder.layers[1].layer_number
    with pytest.raises(ValueError, match=re.escape("its layer decoder.layers.1 has no layer_number")):
        save_sharded(back, f"{root}/unnumbered")
    assert not os.path.exists(f"{root}/state_dict/.metadata") and not os.path.exists(f"{root}/unnumbered/.metadata")


def _tied_pipeline(rank, root):
    """Tied embeddings at PP 2: the last stage's copy of the word embeddings is stored once, under the
    embedding's name (checked equal to the first stage's), so the checkpoint loads at PP 1 and back."""
    from megatron.core import parallel_state as ps

    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # megatron-core moves the tied copy to CUDA to sync it
    stage, offset = _stage_model(tp=1, pp=2, seed=4, tied=True)
    shards, partitions = _every_stage(stage, offset)
    save_sharded(stage, f"{root}/tied_pp2")
    assert {n for n in _stored_shapes(f"{root}/tied_pp2") if "_extra_state" not in n} == set(partitions) - {
        "output_layer.weight"}
    whole, _ = _stage_model(tp=1, pp=1, seed=5, tied=True)
    _assert_loads(whole, _expected_shards(whole, 0, shards, partitions, saved_tp=1), f"{root}/tied_pp2")
    save_sharded(whole, f"{root}/tied_pp1")
    back, back_offset = _stage_model(tp=1, pp=2, seed=6, tied=True)
    _assert_loads(back, _expected_shards(back, back_offset, shards, partitions, saved_tp=1), f"{root}/tied_pp1")

    # A last stage whose copy drifted from the first stage's is refused, not stored from one of them.
    if ps.is_pipeline_last_stage():
        with torch.no_grad():
            back.output_layer.weight.view(torch.int32)[0] ^= 1
    drifted = r"embedding.word_embeddings.weight: ranks \d and \d both hold .* different bytes"
    with pytest.raises(ValueError, match=drifted):
        save_sharded(back, f"{root}/drifted")


def _four_ranks(rank, world_size, root):
    _tp2_dp2(rank, f"{root}/toy")
    _pipeline(rank, f"{root}/gpt")
    _tied_pipeline(rank, f"{root}/gpt")


def test_tp_dp_and_pipeline_layouts_on_four_ranks(tmp_path):
    """TP 2 x DP 2 loaded at TP 1, TP 4 and TP 2; a 4-layer GPTModel saved at TP 2 x PP 2 (groups
    from megatron-core's parallel_state), loaded at PP 1 (TP 2 x DP 2) with every layer at its global
    place, saved there and loaded back at PP 2 (TP 1 x DP 2 and TP 2); the same with tied embeddings
    at TP 1. One spawned run."""
    run_distributed(_four_ranks, 4, str(tmp_path))
