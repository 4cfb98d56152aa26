"""fused_rl_ops.checkpoint: sharding dialects, and DCP round trips across tensor-parallel degrees.

Multi-process checks run in real processes on gloo (fused_rl_ops.testing.distributed); each spawned run groups
several checks because starting processes dominates the time. Data is random bit patterns (NaN
payloads, -0.0, infinities included) compared through integer views, and every shard comes from
the test's own reference split (Megatron's rule: chunks of N / (stride * tp), rank r takes chunks
r, r + tp, ...), not from the code under test.
"""
import itertools
import os
import pickle
import re
import shutil
import types
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fused_rl_ops import checkpoint_integrity
from fused_rl_ops.testing.distributed import run_distributed
from fused_rl_ops.checkpoint import (
    ShardingMetadataError,
    ShardSpec,
    from_dtensor,
    load_sharded,
    read_sharding,
    save_sharded,
    to_dtensor,
)

# save_sharded/load_sharded need DCP's CheckpointableTensor (torch 2.14; the GPU machine's torch 2.11
# lacks it) and the xxhash package (CI installs it), and the tiny-GPTModel check needs megatron-core:
# elsewhere those tests do not apply.
needs_checkpointable_dcp = pytest.mark.skipif(
    not hasattr(dcp, "CheckpointableTensor") or checkpoint_integrity.xxhash is None,
    reason="this torch's DCP has no CheckpointableTensor, or the xxhash package is missing")

# --- reference helpers ----------------------------------------------------------------------------

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_bits(shape, dtype, seed):
    """A tensor of dtype whose bytes are random: every bit pattern, NaN payloads and -0.0 included."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**15, 2**15, (*shape, dtype.itemsize // 2), dtype=torch.int16, generator=generator)
    return words.view(dtype).reshape(shape)


def bits(t):
    return t.detach().contiguous().view(_INT_OF_SIZE[t.element_size()])


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def reference_shard(full, dim, stride, tp, rank):
    pieces = torch.split(full, full.shape[dim] // (stride * tp), dim)
    return torch.cat(pieces[rank::tp], dim)


def reference_unshard(shards, dim, stride):
    """The logical tensor from all ranks' shards: block b of every rank, in rank order, for each b."""
    blocks = [s.chunk(stride, dim) for s in shards]
    return torch.cat([blocks[r][b] for b in range(stride) for r in range(len(shards))], dim)


def legacy(dim, stride=1):
    return {"tensor_model_parallel": True, "partition_dim": dim, "partition_stride": stride}


def submodule(module, path):
    """module's submodule at path ("a.b"), created (as plain Modules) where missing."""
    for part in path.split("."):
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    return module


def add_parameter(module, name, tensor, attributes):
    """Registers tensor as parameter name ("a.b.weight") of module, creating the submodules on the way."""
    path, _, leaf = name.rpartition(".")
    module = submodule(module, path) if path else module
    param = torch.nn.Parameter(tensor, requires_grad=False)
    for key, value in attributes.items():
        setattr(param, key, value)
    module.register_parameter(leaf, param)


# --- a toy module covering every kind of tensor ---------------------------------------------------

# name, logical shape, dtype, sharding attributes, (dim, stride) for the reference split or None
LAYOUT = [
    ("column.weight", (16, 6), torch.float32, legacy(0), (0, 1)),
    ("column.bias", (16,), torch.float32, legacy(0), (0, 1)),
    ("fc1.weight", (32, 6), torch.bfloat16, legacy(0, 2), (0, 2)),  # GLU [W ; V]
    ("fc1.bias", (32,), torch.bfloat16, legacy(0, 2), (0, 2)),
    ("row.weight", (6, 16), torch.float32, {"_tensor_parallel_mode": "row"}, (1, 1)),
    ("row.bias", (6,), torch.float32, {"_tensor_parallel_mode": "replicated"}, None),
    ("strided_row.weight", (6, 16), torch.float16, legacy(1, 2), (1, 2)),
    ("norm.weight", (6,), torch.float32, {}, None),
    # vocab 13 padded to 16 rows; the padded rows hold data too (megatron-core 0.16 dialect)
    ("embedding.weight", (16, 6), torch.bfloat16, {"_mcore_tp": True, "_tp_partition_dim": 0}, (0, 1)),
    # gated-delta-net style: only tensor_model_parallel and partition_dim
    ("gdn.conv.weight", (8, 1, 4), torch.float32, {"tensor_model_parallel": True, "partition_dim": 0}, (0, 1)),
]


def logical_state(seed):
    state = {name: random_bits(shape, dtype, seed * 1000 + i) for i, (name, shape, dtype, _, _) in enumerate(LAYOUT)}
    state["norm.running"] = random_bits((6,), torch.float64, seed * 1000 + 999)
    return state


class Toy(torch.nn.Module):
    """Parameters are this TP rank's shards of the logical tensors, annotated as in LAYOUT; a
    replicated buffer and an extra state ride along."""

    def __init__(self, logical, tp, tp_rank, step):
        super().__init__()
        for name, _, _, attributes, split in LAYOUT:
            local = reference_shard(logical[name], *split, tp, tp_rank) if split else logical[name]
            add_parameter(self, name, local.clone(), attributes)
        self.norm.register_buffer("running", logical["norm.running"].clone())
        self.step = step

    def get_extra_state(self):
        return {"step": self.step}

    def set_extra_state(self, state):
        self.step = state["step"]


def tensors_of(module):
    """module's tensors, without extra states (GroupedLinearStandIn's is a tensor)."""
    return {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def assert_all_differ(module, expected):
    wanted = tensors_of(expected)
    for name, t in tensors_of(module).items():
        assert not same_bits(t, wanted[name]), f"{name} already equals the expected value"


def assert_all_same(module, expected):
    wanted = tensors_of(expected)
    for name, t in tensors_of(module).items():
        assert same_bits(t, wanted[name]), f"{name} differs"


def storage_of(module):
    """Where each tensor's data lives: loading must write into it, not swap it."""
    return {name: (t.untyped_storage().data_ptr(), t.storage_offset()) for name, t in tensors_of(module).items()}


def views_into_one_buffer(module):
    """Makes every parameter a view into one flat byte buffer (Megatron DDP style; attributes stay on
    the Parameter objects), followed by random padding. Returns the buffer and the padding."""
    params = list(module.parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    padding = random_bits((64,), torch.int16, seed=3).view(torch.uint8)
    flat = torch.empty(sum(sizes) + padding.numel(), dtype=torch.uint8)
    offset = 0
    for param, size in zip(params, sizes):
        view = flat[offset:offset + size].view(param.dtype).view(param.shape)
        view.copy_(param.data)
        param.data = view
        offset += size
    flat[offset:].copy_(padding)
    return flat, padding


def tp_group_of_size(tp):
    """This rank's group among consecutive groups of tp ranks (every rank creates every group)."""
    mine = None
    for start in range(0, dist.get_world_size(), tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= dist.get_rank() < start + tp:
            mine = group
    return mine


# --- single process: the dialects -----------------------------------------------------------------

def annotated(shape, attributes, device="meta"):
    t = torch.empty(shape, device=device)
    for key, value in attributes.items():
        setattr(t, key, value)
    return t


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


def test_refuses_a_dcp_without_checkpointable_tensor(monkeypatch, tmp_path):
    """Without the protocol DCP would save every rank's shard as the whole tensor."""
    monkeypatch.delattr(dcp, "CheckpointableTensor")
    with pytest.raises(RuntimeError, match="CheckpointableTensor"):
        save_sharded({"w": annotated((4, 4), legacy(0), device="cpu")}, str(tmp_path))
    with pytest.raises(RuntimeError, match="CheckpointableTensor"):
        load_sharded(torch.nn.Linear(2, 2), str(tmp_path))


# --- round trips across TP degrees (4 processes, with the GPTModel check) ------------------------

def _round_trips(rank, world_size, root):
    groups = {tp: tp_group_of_size(tp) for tp in (1, 2, 4)}
    original = logical_state(seed=1)
    for tp, group in groups.items():
        save_sharded(Toy(original, tp, dist.get_rank(group), step=7), f"{root}/tp{tp}", tp_group=group)

    for save_tp in groups:
        for load_tp, group in groups.items():
            if load_tp == save_tp:
                continue
            for staged in (False, True):
                target = Toy(logical_state(seed=2), load_tp, dist.get_rank(group), step=0)
                expected = Toy(original, load_tp, dist.get_rank(group), step=7)
                storage = storage_of(target)
                assert_all_differ(target, expected)
                load_sharded(target, f"{root}/tp{save_tp}", tp_group=group, staged=staged)
                assert_all_same(target, expected)
                assert storage_of(target) == storage, (save_tp, load_tp, staged)
                assert target.step == 7, (save_tp, load_tp, staged)

    # Parameters as views into one flat buffer, as Megatron's DDP keeps them: the default load
    # writes through the views (stride-2 blocks included) and leaves the rest of the buffer alone.
    group = groups[2]
    target = Toy(logical_state(seed=2), 2, dist.get_rank(group), step=0)
    flat, padding = views_into_one_buffer(target)
    load_sharded(target, f"{root}/tp4", tp_group=group)
    expected = Toy(original, 2, dist.get_rank(group), step=7)
    assert_all_same(target, expected)
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in target.parameters())
    assert torch.equal(flat[-padding.numel():], padding)

    # A disagreement inside one TP group (ranks 2 and 3) is raised on the other group's ranks too,
    # instead of leaving them waiting in DCP for ranks that never come.
    square = annotated((4, 4), legacy(1 if dist.get_rank() == 3 else 0), device="cpu")
    with pytest.raises(ShardingMetadataError, match=r"w: tensor-parallel ranks disagree .* rank 2 has .* rank 3 has"):
        save_sharded({"w": square}, f"{root}/one_group_disagrees", tp_group=groups[2])

    # The checkpoint holds logical tensors: plain DCP reads [W ; V], not the rank shards in a row.
    for tp in groups:
        full = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype, _, _ in LAYOUT}
        dcp.load(full, checkpoint_id=f"{root}/tp{tp}")
        for name, t in full.items():
            assert same_bits(t, original[name]), (tp, name)


# --- two-rank checks: DTensor conversion, checks before saving, failed loads -----------------------

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
        assert same_bits(dtensor.full_tensor(), original[name]), name
        local = from_dtensor(dtensor)
        assert same_bits(local, params[name])
        legacy_spec = read_sharding(params[name])
        assert read_sharding(local) == ShardSpec(legacy_spec.dim, legacy_spec.stride, ("legacy",))
        assert read_sharding(dtensor).dialects == ("dtensor",)
        dtensors[name] = dtensor

    # A writer speaking only DTensor saves the same logical tensors.
    save_sharded(dtensors, f"{root}/dtensors")
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
            save_sharded(module, f"{root}/mislabelled{i}")
        assert not os.path.exists(f"{root}/mislabelled{i}/.metadata")

    # Extra states, objects or tensors, that differ between the ranks are refused, not saved from one.
    for module in (Toy(original, world_size, rank, step=rank), SerialisedState({"amax": list(range(rank + 1))})):
        with pytest.raises(ValueError, match="_extra_state: tensor-parallel ranks 0 and 1 hold different extra states"):
            save_sharded(module, f"{root}/extra_state")
        assert not os.path.exists(f"{root}/extra_state/.metadata")

    # Bitwise: 0.0 on one rank and -0.0 on the other compare equal but are not the same bytes.
    signed_zero = torch.zeros(4) if rank == 0 else -torch.zeros(4)
    with pytest.raises(ShardingMetadataError, match="bias: claims to be replicated"):
        save_sharded({"bias": signed_zero}, f"{root}/signed_zero")

    # Ranks disagreeing on a tensor's layout are caught too.
    square = annotated((4, 4), legacy(rank), device="cpu")
    with pytest.raises(ShardingMetadataError, match="w: tensor-parallel ranks disagree"):
        save_sharded({"w": square}, f"{root}/disagree")

    # An error on one rank only reaches every rank (no rank is left waiting in a collective).
    mode = "row" if rank == 1 else "column"
    conflicted = annotated((4, 4), {**legacy(0), "_tensor_parallel_mode": mode}, device="cpu")
    with pytest.raises(ShardingMetadataError, match="rank 1 failed" if rank == 0 else "dialects disagree"):
        save_sharded({"w": conflicted}, f"{root}/one_rank")


def _snapshot(module):
    return {name: t.clone() for name, t in tensors_of(module).items()}, module.step


def _assert_load_fails_untouched(path, exception, match, target=None, paths=(False, True)):
    """Loading fails with match and leaves target unchanged, on each of the given paths (staged or not)."""
    target = target or Toy(logical_state(seed=2), 2, dist.get_rank(), step=0)
    tensors, step = _snapshot(target)
    for staged in paths:
        with pytest.raises(exception, match=match):
            load_sharded(target, path, staged=staged)
        assert all(same_bits(t, tensors[name]) for name, t in tensors_of(target).items()), staged
        assert target.step == step


def _on_rank_0(action):
    dist.barrier()
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _truncate_to_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _load_failures(rank, world_size, root):
    original = logical_state(seed=1)
    for name in ("good", "truncated", "no_data", "bad_metadata"):
        save_sharded(Toy(original, 2, rank, step=7), f"{root}/{name}")

    _assert_load_fails_untouched(f"{root}/absent", FileNotFoundError, "no complete checkpoint at")
    _on_rank_0(lambda: _truncate_to_half(f"{root}/truncated/__1_0.distcp"))
    _assert_load_fails_untouched(f"{root}/truncated", ValueError, "truncated: data file __1_0.distcp")
    _on_rank_0(lambda: os.remove(f"{root}/no_data/__0_0.distcp"))
    _assert_load_fails_untouched(f"{root}/no_data", FileNotFoundError, "__0_0.distcp does not exist")
    _on_rank_0(lambda: _truncate_to_half(f"{root}/bad_metadata/.metadata"))
    _assert_load_fails_untouched(f"{root}/bad_metadata", ValueError, "unreadable")

    # Wrong shape or dtype in the last entry: the entries before it must not have been loaded.
    wrong_shape = Toy(logical_state(seed=2), 2, rank, step=0)
    add_parameter(wrong_shape, "gdn.conv.weight", torch.zeros(4, 1, 5), legacy(0))
    _assert_load_fails_untouched(f"{root}/good", ValueError,
                                 r"gdn.conv.weight: the checkpoint holds global shape \(8, 1, 4\)", wrong_shape)
    wrong_dtype = Toy(logical_state(seed=2), 2, rank, step=0)
    wrong_dtype.gdn.conv.weight.data = wrong_dtype.gdn.conv.weight.data.double()
    _assert_load_fails_untouched(f"{root}/good", ValueError, "gdn.conv.weight: the checkpoint holds torch.float32",
                                 wrong_dtype)
    extra_param = Toy(logical_state(seed=2), 2, rank, step=0)
    add_parameter(extra_param, "norm.bias", torch.zeros(6), {})
    _assert_load_fails_untouched(f"{root}/good", ValueError, r"missing \['norm.bias'\]", extra_param)

    # A degree that does not divide the sharded dim (6 rows at stride 2 over 2 ranks): refused from
    # the metadata alone, so it is still the error when the data files are gone.
    singleton = tp_group_of_size(1)
    glu = annotated((6, 4), legacy(0, 2), device="cpu").copy_(random_bits((6, 4), torch.float32, seed=5))
    save_sharded({"fc1.weight": glu}, f"{root}/six_rows", tp_group=singleton)
    data_files = [f"{root}/six_rows/{f}" for f in os.listdir(f"{root}/six_rows") if f.endswith(".distcp")]
    _on_rank_0(lambda: [os.remove(f) for f in data_files])
    two_ranks = torch.nn.Module()
    add_parameter(two_ranks, "fc1.weight", torch.zeros(4, 4), legacy(0, 2))
    for staged in (False, True):
        with pytest.raises(ValueError, match="fc1.weight: cannot be split across tensor-parallel degree 2: dim 0 has 6"):
            load_sharded(two_ranks, f"{root}/six_rows", staged=staged)
        assert torch.equal(two_ranks.fc1.weight, torch.zeros(4, 4))

    # A read failing inside DCP on one rank, after its data arrived. Staged, nothing reaches any
    # module. Direct, the data is already in the module: the error must say so.
    reader = checkpoint_integrity.ChecksummedReader
    real_read = reader.read_data

    def read_then_fail(self, plan, planner):
        real_read(self, plan, planner).wait()
        raise OSError("disk went away")

    if rank == 1:
        reader.read_data = read_then_fail
    _assert_load_fails_untouched(f"{root}/good", RuntimeError, "left unchanged", paths=(True,))
    target = Toy(logical_state(seed=2), 2, rank, step=0)
    with pytest.raises(RuntimeError, match="may be partially loaded.*staged=True"):
        load_sharded(target, f"{root}/good")
    reader.read_data = real_read
    expected = Toy(original, 2, rank, step=7)
    assert_all_same(target, expected)
    assert target.step == 0  # extra state is set only after a successful read

    # The same checkpoint still loads.
    target = Toy(logical_state(seed=2), 2, rank, step=0)
    load_sharded(target, f"{root}/good")
    assert_all_same(target, Toy(original, 2, rank, step=7))

    _damaged_data(rank, root, original)


def _stored_items(path):
    """(data file, first byte, end, entry name) of every item in a checkpoint, read from DCP's own
    .metadata (DCP's per-item storage info)."""
    with open(f"{path}/.metadata", "rb") as f:
        metadata = pickle.load(f)
    return sorted((info.relative_path, info.offset, info.offset + info.length, index.fqn)
                  for index, info in metadata.storage_data.items())


def _flip_bits(path, position, mask):
    """XORs the byte at position of the file at path with mask."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ mask]))


def _damaged_data(rank, root, original):
    """Checksums: a flipped byte in any data file, a data file from another save of the same model,
    a data file longer than its entries, a checkpoint without checksums, and another model's
    checkpoint. Every error names the entry or file; the staged path leaves the module unchanged."""
    save_sharded(Toy(logical_state(seed=3), 2, rank, step=9), f"{root}/other_save")
    items = _stored_items(f"{root}/good")
    # one flipped byte in the largest item of each data file: in its middle (tensor bytes, mostly)
    # and in its first byte (the archive's header, which makes DCP's read fail before the hash check)
    for file, where in itertools.product(sorted({item[0] for item in items}), ("middle", "first")):
        start, end, name = max((item[1:] for item in items if item[0] == file), key=lambda item: item[1] - item[0])
        damaged = f"{root}/flipped_{where}_{file}"
        position = (start + end) // 2 if where == "middle" else start

        def flip(damaged=damaged, file=file, position=position):
            shutil.copytree(f"{root}/good", damaged)
            _flip_bits(f"{damaged}/{file}", position, 0x10)

        _on_rank_0(flip)
        expected = rf"{re.escape(name)}: its bytes {start}..{end} in data file {file} .* do not match the checksum"
        _assert_load_fails_untouched(damaged, RuntimeError, f"left unchanged.*{expected}", paths=(True,))
        with pytest.raises(RuntimeError, match=f"may be partially loaded.*{expected}"):
            load_sharded(Toy(logical_state(seed=2), 2, rank, step=0), damaged)

    # The data of another save beside this save's .metadata: same sizes, other bytes.
    def mix():
        shutil.copytree(f"{root}/good", f"{root}/mixed")
        shutil.copy(f"{root}/other_save/__1_0.distcp", f"{root}/mixed/__1_0.distcp")

    _on_rank_0(mix)
    _assert_load_fails_untouched(f"{root}/mixed", RuntimeError,
                                 r"left unchanged.*: its bytes \d+\.\.\d+ in data file __1_0.distcp", paths=(True,))

    # Checked before anything is read, so both paths leave the module unchanged.
    def grow():
        shutil.copytree(f"{root}/good", f"{root}/longer")
        with open(f"{root}/longer/__0_0.distcp", "ab") as f:
            f.write(b"\0")

    _on_rank_0(grow)
    _assert_load_fails_untouched(f"{root}/longer", ValueError, "inconsistent: data file __0_0.distcp has")
    dcp.save(Toy(original, 1, 0, step=7).state_dict(), checkpoint_id=f"{root}/plain_dcp",  # the logical tensors
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    _assert_load_fails_untouched(f"{root}/plain_dcp", ValueError, "no checksum for .* not written by save_sharded")
    another_model = torch.nn.Linear(6, 6)
    weight = another_model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"does not match the module: missing \['bias', 'weight'\], unexpected \[.*"):
        load_sharded(another_model, f"{root}/good")
    assert same_bits(another_model.weight, weight)


def _two_rank_checks(rank, world_size, root):
    _dtensor_and_save_checks(rank, world_size, f"{root}/save")
    _load_failures(rank, world_size, f"{root}/load")


@needs_checkpointable_dcp
def test_dtensor_conversion_save_checks_and_failed_loads(tmp_path):
    """One spawned run for both groups of two-rank checks: starting processes is most of the time.
    Failed loads must leave the module unchanged on both load paths, except a read failing in the
    middle of a direct (unstaged) load, which must say the module may be partially loaded."""
    run_distributed(_two_rank_checks, 2, str(tmp_path))


# --- a real tiny megatron-core GPTModel (4 processes, spawned with the round trips) --------------

def _partition(param):
    """(dim, stride) from Megatron's own legacy attributes, or None when replicated."""
    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim, getattr(param, "partition_stride", 1)
    return None


def _perturb(model, tp_rank, seed):
    """Random values everywhere (Megatron initialises norms and biases to constants): the same on
    every TP rank for replicated tensors, rank-dependent for shards."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            rank_part = tp_rank if _partition(param) else 0
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * seed + rank_part)
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))


def _gathered_logical(model, group):
    """The logical tensors of a TP-sharded model, assembled by the test's reference rule."""
    logical = {}
    for name, param in model.named_parameters():
        split = _partition(param)
        if split is None:
            logical[name] = param.detach().clone()
            continue
        shards = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, param.detach().contiguous(), group=group)
        logical[name] = reference_unshard(shards, *split)
    return logical


def _tiny_gpt(rank, world_size, root):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from fused_rl_ops.testing.megatron_cpu import build_tiny_gpt, full_vocab_logits, set_parallel_degrees

    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))

    set_parallel_degrees(2)
    original = build_tiny_gpt(seed=1)
    _perturb(original, ps.get_tensor_model_parallel_rank(), seed=1)
    with torch.no_grad():
        logits_tp2 = full_vocab_logits(original, tokens)
    save_sharded(original, root, tp_group=ps.get_tensor_model_parallel_group())
    logical = _gathered_logical(original, ps.get_tensor_model_parallel_group())

    set_parallel_degrees(1)
    reference = build_tiny_gpt(seed=2)  # the original weights at TP=1, copied in directly
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(logical[name])
        logits_reference = full_vocab_logits(reference, tokens)
    loaded = build_tiny_gpt(seed=2)
    _perturb(loaded, 0, seed=2)
    assert all(not same_bits(p, logical[n]) for n, p in loaded.named_parameters())
    load_sharded(loaded, root, tp_group=ps.get_tensor_model_parallel_group())
    assert all(same_bits(p, logical[n]) for n, p in loaded.named_parameters())
    with torch.no_grad():
        logits_tp1 = full_vocab_logits(loaded, tokens)
    assert same_bits(logits_tp1, logits_reference)
    torch.testing.assert_close(logits_tp1, logits_tp2, rtol=1e-5, atol=1e-5)

    set_parallel_degrees(4)
    loaded = build_tiny_gpt(seed=2)
    tp_rank = ps.get_tensor_model_parallel_rank()
    _perturb(loaded, tp_rank, seed=2)
    expected = {n: reference_shard(logical[n], *_partition(p), 4, tp_rank) if _partition(p) else logical[n]
                for n, p in loaded.named_parameters()}
    assert all(not same_bits(p, expected[n]) for n, p in loaded.named_parameters())
    load_sharded(loaded, root, tp_group=ps.get_tensor_model_parallel_group())
    assert all(same_bits(p, expected[n]) for n, p in loaded.named_parameters())
    with torch.no_grad():
        logits_tp4 = full_vocab_logits(loaded, tokens)
    torch.testing.assert_close(logits_tp4, logits_reference, rtol=1e-5, atol=1e-5)


def _four_rank_checks(rank, world_size, root):
    _round_trips(rank, world_size, f"{root}/toy")
    _tiny_gpt(rank, world_size, f"{root}/gpt")


@needs_checkpointable_dcp
def test_round_trips_across_tp_degrees_and_tiny_gpt(tmp_path):
    """Toy modules saved at TP 1, 2 and 4 load bit for bit at the other degrees; a tiny GPTModel
    saved at TP=2 loads at TP=1 (logits to the bit) and TP=4 (parameters to the bit, logits within
    fp32 reduction-order tolerance). One spawned run: starting processes is most of the time."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    run_distributed(_four_rank_checks, 4, str(tmp_path))


# --- a save that dies part-way (2 processes, one of them killed) ---------------------------------

def _dies_while_writing(rank, world_size, root):
    save_sharded(Toy(logical_state(seed=1), 2, rank, step=7), root)  # a complete checkpoint
    dist.barrier()
    if rank == 1:  # overwriting it, rank 1 dies once its first item is in its data file
        def close_then_die(self):
            real_close(self)
            os._exit(17)

        real_close = checkpoint_integrity._HashingStream.close
        checkpoint_integrity._HashingStream.close = close_then_die
    save_sharded(Toy(logical_state(seed=3), 2, rank, step=9), root)


@needs_checkpointable_dcp
def test_a_save_killed_part_way_leaves_nothing_loadable(tmp_path):
    """A rank killed in the middle of overwriting a checkpoint: the old .metadata must not survive
    beside the new partial data, so load_sharded (here in this process, at TP 1) refuses the
    directory and leaves the module unchanged."""
    with pytest.raises(Exception, match="exit code 17"):
        run_distributed(_dies_while_writing, 2, str(tmp_path))
    assert os.path.getsize(tmp_path / "__1_0.distcp") > 0
    target = Toy(logical_state(seed=2), 1, 0, step=0)
    tensors, _ = _snapshot(target)
    for staged in (False, True):
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            load_sharded(target, str(tmp_path), staged=staged)
    assert all(same_bits(t, tensors[name]) for name, t in tensors_of(target).items())


# --- expert-parallel round trips (4 processes) ----------------------------------------------------

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
    dcp.save(holed, checkpoint_id=f"{root}/holed")
    _assert_untouched_by_failing_load(MoEToy(original, layouts["TP1/EP2"], 2), f"{root}/holed", layouts["TP1/EP2"],
                                      r"numbered \[0, 1, 3, 4, 5\], not 0..4: missing \[2\]")
    with pytest.raises(ValueError, match=r"local expert indices \[0, 1, 3, 4, 5\] are not 0..4"):
        save_sharded(holed, f"{root}/holed_save", **_moe_kwargs(layouts["TP1/EP4"]))
    uneven = MoEToy(original, layouts["TP1/EP2"], 2 if rank % 2 else 1)
    with pytest.raises(ValueError, match="expert-parallel ranks .* hold different numbers of local experts"):
        save_sharded(uneven, f"{root}/uneven", **_moe_kwargs(layouts["TP1/EP2"]))


@needs_checkpointable_dcp
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


@needs_checkpointable_dcp
def test_grouped_gemm_experts_reshard_and_interchange_with_sequential(tmp_path):
    """Experts held as Transformer Engine GroupedLinear modules hold them (TEGroupedMLP:
    `experts.linear_fc1.weight<i>`, megatron-core's stride-1 sharding attributes) saved at EP 2 load
    bit for bit at EP 1 and EP 2 and other expert TP degrees, and into SequentialMLP experts and back;
    expert counts that do not fit and sharding metadata that contradicts the layout are clear errors
    with the module untouched. One spawned run of 4 processes."""
    run_distributed(_grouped_expert_checks, 4, str(tmp_path))


def _reader_state():
    """A tensor over the reader's in-place hashing threshold, a small bf16 tensor and a pickled
    object."""
    return {"big": random_bits((300, 400), torch.float32, 1), "small": random_bits((7,), torch.bfloat16, 2),
            "obj": "note " * 40}


def _reader_targets():
    return {"big": torch.zeros(300, 400), "small": torch.zeros(7, dtype=torch.bfloat16), "obj": ""}


@needs_checkpointable_dcp
def test_verifying_reader_loads_bit_exact(tmp_path):
    """ChecksummedReader reads tensors straight into contiguous targets and through a buffer into
    strided and other-dtype ones, and hands on pickled objects, all bit-exact."""
    state, good = _reader_state(), str(tmp_path / "good")
    dcp.save(state, storage_writer=checkpoint_integrity.ChecksummedWriter(good))
    target = _reader_targets()
    dcp.load(target, storage_reader=checkpoint_integrity.ChecksummedReader(good))
    assert same_bits(target["big"], state["big"]) and same_bits(target["small"], state["small"])
    assert target["obj"] == state["obj"]
    odd = {"empty": torch.empty(0, 5), "scalar": torch.tensor(2.5, dtype=torch.float64),
           "mask": torch.tensor([True, False, True]), "ids": torch.arange(-3, 9),
           "half": random_bits((5, 3), torch.float16, 3)}
    dcp.save(odd, storage_writer=checkpoint_integrity.ChecksummedWriter(str(tmp_path / "odd")))
    into = {"empty": torch.ones(0, 5), "scalar": torch.tensor(0.0, dtype=torch.float64),
            "mask": torch.zeros(3, dtype=torch.bool), "ids": torch.zeros(12, dtype=torch.int32),
            "half": torch.zeros(3, 5, dtype=torch.float16).t()}
    dcp.load(into, storage_reader=checkpoint_integrity.ChecksummedReader(str(tmp_path / "odd")))
    assert all(torch.equal(into[name].to(t.dtype), t) for name, t in odd.items() if name != "half")
    assert same_bits(into["half"], odd["half"])


@needs_checkpointable_dcp
def test_writer_skips_the_zip_crc32_only_while_it_writes(tmp_path, monkeypatch):
    """The writer turns torch.save's CRC32 off for its own writes (its XXH3 covers those bytes) and
    gives the caller's setting back, also when writing fails."""
    seen = []
    real_write_data = dcp.FileSystemWriter.write_data

    def recording_write_data(self, plan, planner):
        seen.append(torch.serialization.get_crc32_options())
        return real_write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", recording_write_data)
    dcp.save(_reader_state(), storage_writer=checkpoint_integrity.ChecksummedWriter(str(tmp_path / "ok")))
    assert seen == [False] and torch.serialization.get_crc32_options()

    def failing_write_data(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", failing_write_data)
    with pytest.raises(dcp.api.CheckpointException) as failed:
        dcp.save(_reader_state(), storage_writer=checkpoint_integrity.ChecksummedWriter(str(tmp_path / "fail")))
    assert str(failed.value.failures[0][0]) == "disk full" and torch.serialization.get_crc32_options()


class SerialisedState(torch.nn.Module):
    """A module whose extra state is a uint8 tensor made anew by each get_extra_state() call, of a
    length that follows the state (as Transformer Engine serialises its FP8 state)."""

    def __init__(self, state):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3))
        self.state = state

    def get_extra_state(self):
        return torch.frombuffer(bytearray(pickle.dumps(self.state)), dtype=torch.uint8)

    def set_extra_state(self, tensor):
        self.state = pickle.loads(tensor.numpy().tobytes())


@needs_checkpointable_dcp
@pytest.mark.parametrize("staged", [False, True])
def test_tensor_extra_state_reaches_the_module(tmp_path, staged):
    """A tensor extra state is handed to set_extra_state, whatever its length in the module before
    (the load used to read it into the temporary get_extra_state() made, or refuse another length)."""
    saved = SerialisedState({"amax": [1.5, -2.0], "step": 7})
    save_sharded(saved, str(tmp_path / "ckpt"))
    for before in ({"amax": [0.0, 0.0], "step": 1}, {}, {"amax": list(range(50))}):
        target = SerialisedState(before)
        load_sharded(target, str(tmp_path / "ckpt"), staged=staged)
        assert target.state == saved.state


@needs_checkpointable_dcp
def test_load_reads_the_metadata_once_and_loads_by_what_it_checked(tmp_path, monkeypatch):
    """load_sharded checks the checkpoint's .metadata against the module and hands that same metadata
    to DCP, rather than letting DCP read the file again (a save replacing it in between would load
    by metadata nobody checked)."""
    original, path = logical_state(seed=1), str(tmp_path / "ckpt")
    save_sharded(Toy(original, 1, 0, step=7), path)
    reads = []
    real_read_metadata = dcp.FileSystemReader.read_metadata

    def counting_read_metadata(self, *args, **kwargs):
        reads.append(self.path)
        return real_read_metadata(self, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", counting_read_metadata)
    target = Toy(logical_state(seed=2), 1, 0, step=0)
    load_sharded(target, path)
    assert len(reads) == 1
    expected = Toy(original, 1, 0, step=7)
    assert all(same_bits(t, tensors_of(expected)[name]) for name, t in tensors_of(target).items())
    assert target.step == 7


@needs_checkpointable_dcp
@pytest.mark.parametrize("where", ["first", "header", "data_start", "middle", "data_end", "last"])
def test_verifying_reader_catches_a_flip_anywhere_in_an_item(tmp_path, where):
    """ChecksummedReader hashes a tensor's data as it reads it into the target and the other bytes of
    the item separately: a flipped byte in either part, of a tensor larger than the in-place
    threshold, of a small tensor and of a pickled object, fails the load naming the entry (a damaged
    object is never handed on)."""
    state, good = _reader_state(), str(tmp_path / "good")
    dcp.save(state, storage_writer=checkpoint_integrity.ChecksummedWriter(good))
    for file, start, end, name in _stored_items(good):
        data_bytes = state[name].numel() * state[name].element_size() if name != "obj" else 0
        position = {"first": start, "header": start + 40, "middle": (start + end) // 2, "last": end - 1}.get(where)
        if where in ("data_start", "data_end"):
            if not data_bytes:
                continue
            raw = open(f"{good}/{file}", "rb").read()[start:end]
            data_at = raw.find(state[name].contiguous().view(torch.uint8).numpy().tobytes())
            assert data_at > 0
            position = start + data_at + (0 if where == "data_start" else data_bytes - 1)
        damaged = tmp_path / f"damaged_{name}"
        shutil.copytree(good, damaged)
        _flip_bits(damaged / file, position, 0x01)
        fresh = _reader_targets()
        with pytest.raises(dcp.CheckpointException, match=rf"{name}: its bytes {start}..{end} in data file {file} "
                                                         r".* do not match the checksum"):
            dcp.load(fresh, storage_reader=checkpoint_integrity.ChecksummedReader(str(damaged)))
        assert fresh["obj"] == ""
        shutil.rmtree(damaged)
