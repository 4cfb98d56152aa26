"""fused_rl_ops.checkpoint.sharding: the sharding dialects, DTensor conversion and the checks before saving.

The two-rank checks run in real processes on gloo (fused_rl_ops.testing.distributed), grouped in one
spawned run because starting processes dominates the time.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fused_rl_ops.checkpoint import (
    ShardingMetadataError,
    ShardSpec,
    from_dtensor,
    read_sharding,
    save_sharded,
    to_dtensor,
)
from tests.helpers.checkpoint import (Toy, SerialisedState, add_parameter, annotated, legacy, logical_state,
                                             random_bits, same_bits)
from fused_rl_ops.testing.distributed import run_distributed


# (attributes of one dialect alone, the expected (dim, stride), the dialect's name)
ALONE = [
    (legacy(0), (0, 1), "legacy"),
    (legacy(1), (1, 1), "legacy"),
    (legacy(0, 2), (0, 2), "legacy"),
    ({"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}, (None, 1), "legacy"),
    ({"_tensor_parallel_mode": "column"}, (0, 1), "mcore-0.19"),
    ({"_tensor_parallel_mode": "row"}, (1, 1), "mcore-0.19"),
    ({"_tensor_parallel_mode": "replicated"}, (None, 1), "mcore-0.19"),
    ({"_mcore_tp": True, "_tp_partition_dim": 0}, (0, 1), "mcore-0.16"),
    ({"_mcore_tp": True, "_tp_partition_dim": 1}, (1, 1), "mcore-0.16"),
    ({"_mcore_tp": True, "_tp_duplicated": True}, (None, 1), "mcore-0.16"),
]


@pytest.mark.parametrize("attributes, layout, dialect", ALONE)
def test_each_dialect_alone(attributes, layout, dialect):
    spec = read_sharding(annotated((8, 4), attributes))
    assert (spec.dim, spec.stride, spec.dialects) == (*layout, (dialect,))
    assert spec.sharded == (layout[0] is not None)


# one layout spelled in each attribute dialect (DTensor: in the two-rank checks)
SPELLINGS = {
    "column": [legacy(0), {"_tensor_parallel_mode": "column"}, {"_mcore_tp": True, "_tp_partition_dim": 0}],
    "row": [legacy(1), {"_tensor_parallel_mode": "row"}, {"_mcore_tp": True, "_tp_partition_dim": 1}],
    "replicated": [{"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1},
                   {"_tensor_parallel_mode": "replicated"}, {"_mcore_tp": True, "_tp_duplicated": True}],
}


@pytest.mark.parametrize("layout", SPELLINGS)
def test_each_dialect_alone_resolves_the_same(layout):
    specs = [read_sharding(annotated((8, 4), attributes)) for attributes in SPELLINGS[layout]]
    assert len({(spec.dim, spec.stride) for spec in specs}) == 1
    assert [spec.dialects for spec in specs] == [("legacy",), ("mcore-0.19",), ("mcore-0.16",)]


def test_unannotated_tensor_is_replicated():
    assert read_sharding(torch.empty(3)) == ShardSpec(None, 1, ())


def test_gated_delta_net_meta_copy():
    """A meta copy carrying only tensor_model_parallel and partition_dim (megatron-core 0.19's
    fallback case) resolves like the annotated parameter."""
    param = torch.nn.Parameter(torch.randn(8, 1, 4))
    for key, value in legacy(0).items():
        setattr(param, key, value)
    param._tensor_parallel_mode = "column"
    copy = torch.empty_like(param, device="meta")
    copy.tensor_model_parallel, copy.partition_dim = True, 0
    assert read_sharding(copy) == ShardSpec(0, 1, ("legacy",))
    assert (read_sharding(param).dim, read_sharding(param).stride) == (0, 1)


@pytest.mark.parametrize("attributes, layout", [
    ({**legacy(0), "_tensor_parallel_mode": "column", "_mcore_tp": True, "_tp_partition_dim": 0}, (0, 1)),
    ({**legacy(1), "_tensor_parallel_mode": "row"}, (1, 1)),
    ({**legacy(0, 2), "_tensor_parallel_mode": "column"}, (0, 2)),  # stride from the only dialect stating one
    ({**legacy(0), "_mcore_tp": True}, (0, 1)),  # 0.16 without a dim takes legacy partition_dim, as mcore 0.16 does
    ({"tensor_model_parallel": False, "partition_dim": -1, "_tensor_parallel_mode": "replicated",
      "_mcore_tp": True, "_tp_duplicated": True}, (None, 1)),
])
def test_agreeing_dialects_resolve(attributes, layout):
    spec = read_sharding(annotated((8, 4), attributes), "w")
    assert (spec.dim, spec.stride) == layout
    assert len(spec.dialects) >= 2


@pytest.mark.parametrize("attributes, spellings", [
    ({**legacy(0), "_tensor_parallel_mode": "row"}, ["_tensor_parallel_mode='row'", "partition_dim=0"]),
    ({**legacy(0), "_tensor_parallel_mode": "replicated"}, ["'replicated'", "tensor_model_parallel=True"]),
    ({**legacy(1), "_mcore_tp": True, "_tp_duplicated": True}, ["_tp_duplicated=True", "partition_dim=1"]),
    ({"_tensor_parallel_mode": "column", "_mcore_tp": True, "_tp_partition_dim": 1},
     ["'column'", "_tp_partition_dim=1"]),
    ({**legacy(0, 2), "_mcore_tp": True, "_tp_partition_dim": 1}, ["_tp_partition_dim=1", "partition_stride=2"]),
])
def test_disagreeing_dialects_raise(attributes, spellings):
    with pytest.raises(ShardingMetadataError) as caught:
        read_sharding(annotated((8, 4), attributes), "decoder.layers.0.mlp.linear_fc1.weight")
    message = str(caught.value)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in message
    for spelling in spellings:
        assert spelling in message


@pytest.mark.parametrize("attributes, fragment", [
    ({"tensor_model_parallel": False, "partition_dim": 0}, "contradict"),
    ({"_mcore_tp": True}, "no dialect names the partition dim"),
    ({"tensor_model_parallel": True, "partition_dim": -1}, "no dialect names the partition dim"),
    (legacy(2), "does not exist"),
    ({"_tensor_parallel_mode": "sideways"}, "unknown"),
    (legacy(0, 0), "stride 0"),
])
def test_incomplete_or_contradictory_metadata_raises(attributes, fragment):
    with pytest.raises(ShardingMetadataError, match=fragment):
        read_sharding(annotated((8, 4), attributes), "w")


# --- two-rank checks: DTensor conversion and the checks before saving --------------------------

def _dtensor_and_save_checks(rank, world_size, root):
    from torch.distributed.tensor import Shard, init_device_mesh
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world_size,))
    original = logical_state(seed=1)
    toy = Toy(original, world_size, rank, step=7)
    params = dict(toy.named_parameters())
    placements = {"column.weight": Shard(0), "row.weight": Shard(1), "fc1.weight": _StridedShard(0, split_factor=2),
                  "strided_row.weight": _StridedShard(1, split_factor=2)}
    dtensors = {}
    for name, placement in placements.items():
        dtensor = to_dtensor(params[name], mesh)
        assert dtensor.placements == (placement,), name
        # torch 2.11's redistribute cannot turn a lone _StridedShard into Replicate ("unable to be
        # interpreted into a corresponding shard_order"); 2.14's can. The round trip below holds on both.
        if not (isinstance(placement, _StridedShard) and torch.__version__ < "2.14"):
            assert same_bits(dtensor.full_tensor(), original[name]), name
        local = from_dtensor(dtensor)
        assert same_bits(local, params[name])
        legacy_spec = read_sharding(params[name])
        assert read_sharding(local) == ShardSpec(legacy_spec.dim, legacy_spec.stride, ("legacy",))
        assert read_sharding(dtensor).dialects == ("dtensor",)
        dtensors[name] = dtensor

    # A writer speaking only DTensor saves the same logical tensors.
    save_sharded(dtensors, f"{root}/dtensors", tp_group=dist.group.WORLD)
    full = {name: torch.empty_like(original[name]) for name in dtensors}
    dcp.load(full, checkpoint_id=f"{root}/dtensors")
    assert all(same_bits(full[name], original[name]) for name in dtensors)

    # A plain Shard placement on a tensor whose legacy attributes say stride 2: never a guess.
    contradicting = to_dtensor(params["column.weight"], mesh)
    for key, value in legacy(0, 2).items():
        setattr(contradicting, key, value)
    with pytest.raises(ShardingMetadataError, match="stride"):
        read_sharding(contradicting, "fc1.weight")

    # A sharded tensor labelled replicated (in any dialect, or not at all) is caught at save.
    for i, label in enumerate(({"_tensor_parallel_mode": "replicated"}, {"tensor_model_parallel": False}, {})):
        module = torch.nn.Module()
        add_parameter(module, "norm.weight", params["norm.weight"].clone(), {})
        add_parameter(module, "proj.weight", random_bits((4, 4), torch.float32, seed=rank), label)  # rank-dependent
        with pytest.raises(ShardingMetadataError, match="proj.weight: claims to be replicated"):
            save_sharded(module, f"{root}/mislabelled{i}", tp_group=dist.group.WORLD)
        assert not os.path.exists(f"{root}/mislabelled{i}/.metadata")

    # Extra states, objects or tensors, that differ between the ranks are refused, not saved from one.
    for module in (Toy(original, world_size, rank, step=rank), SerialisedState({"amax": list(range(rank + 1))})):
        with pytest.raises(ValueError, match="_extra_state: tensor-parallel ranks 0 and 1 hold different extra states"):
            save_sharded(module, f"{root}/extra_state", tp_group=dist.group.WORLD)
        assert not os.path.exists(f"{root}/extra_state/.metadata")

    # Bitwise: 0.0 on one rank and -0.0 on the other compare equal but are not the same bytes.
    signed_zero = torch.zeros(4) if rank == 0 else -torch.zeros(4)
    with pytest.raises(ShardingMetadataError, match="bias: claims to be replicated"):
        save_sharded({"bias": signed_zero}, f"{root}/signed_zero", tp_group=dist.group.WORLD)

    # Ranks disagreeing on a tensor's layout are caught too.
    square = annotated((4, 4), legacy(rank), device="cpu")
    with pytest.raises(ShardingMetadataError, match="w: tensor-parallel ranks disagree"):
        save_sharded({"w": square}, f"{root}/disagree", tp_group=dist.group.WORLD)

    # An error on one rank only reaches every rank (no rank is left waiting in a collective).
    mode = "row" if rank == 1 else "column"
    conflicted = annotated((4, 4), {**legacy(0), "_tensor_parallel_mode": mode}, device="cpu")
    with pytest.raises(ShardingMetadataError, match="rank 1 failed" if rank == 0 else "dialects disagree"):
        save_sharded({"w": conflicted}, f"{root}/one_rank", tp_group=dist.group.WORLD)


def test_dtensor_conversion_and_save_checks(tmp_path, checkpoint_dependencies):
    """Legacy shards convert to DTensors and back; ranks that disagree, mislabelled replicas and
    differing extra states are refused before anything is saved. One spawned run of 2 processes."""
    run_distributed(_dtensor_and_save_checks, 2, str(tmp_path))
