"""save_sharded / load_sharded round trips across tensor-parallel degrees, into toy modules and a tiny GPTModel.

Multi-process checks run in real processes on gloo (fused_rl_ops.testing.distributed); each spawned
run groups several checks because starting processes dominates the time.
"""
import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fused_rl_ops.checkpoint import ShardingMetadataError, load_sharded, save_sharded
from tests.helpers.checkpoint import (LAYOUT, SerialisedState, Toy, add_parameter, annotated,
                                             assert_all_differ, assert_all_same, gathered_logical, legacy,
                                             logical_state, partition_of, perturb, random_bits, reference_shard,
                                             same_bits, storage_of, tp_group_of_size)
from fused_rl_ops.testing.distributed import run_distributed

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")


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


# --- a real tiny megatron-core GPTModel (4 processes, spawned with the round trips) --------------

def _tiny_gpt(rank, world_size, root):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from fused_rl_ops.testing.megatron_cpu import build_tiny_gpt, full_vocab_logits, set_parallel_degrees

    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))

    set_parallel_degrees(2)
    original = build_tiny_gpt(seed=1)
    perturb(original, ps.get_tensor_model_parallel_rank(), seed=1)
    with torch.no_grad():
        logits_tp2 = full_vocab_logits(original, tokens)
    save_sharded(original, root, tp_group=ps.get_tensor_model_parallel_group())
    logical = gathered_logical(original, ps.get_tensor_model_parallel_group())

    set_parallel_degrees(1)
    reference = build_tiny_gpt(seed=2)  # the original weights at TP=1, copied in directly
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(logical[name])
        logits_reference = full_vocab_logits(reference, tokens)
    loaded = build_tiny_gpt(seed=2)
    perturb(loaded, 0, seed=2)
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
    perturb(loaded, tp_rank, seed=2)
    expected = {n: reference_shard(logical[n], *partition_of(p), 4, tp_rank) if partition_of(p) else logical[n]
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


def test_round_trips_across_tp_degrees_and_tiny_gpt(tmp_path):
    """Toy modules saved at TP 1, 2 and 4 load bit for bit at the other degrees; a tiny GPTModel
    saved at TP=2 loads at TP=1 (logits to the bit) and TP=4 (parameters to the bit, logits within
    fp32 reduction-order tolerance). One spawned run: starting processes is most of the time."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    run_distributed(_four_rank_checks, 4, str(tmp_path))


# --- the checkpoint DCP's own sharded tensors give ------------------------------------------------

def _blocks(shape, split, tp, rank):
    """(global offset, offset in the shard, size) of each block of rank's shard of a tensor of shape
    split (dim, stride) over tp ranks, by Megatron's rule: block b of rank r is block b * tp + r."""
    dim, stride = split
    block = shape[dim] // (stride * tp)

    def along(value, others):
        return tuple(value if d == dim else others[d] for d in range(len(shape)))

    zeros = (0,) * len(shape)
    return [(along((b * tp + rank) * block, zeros), along(b * block, zeros), along(block, shape))
            for b in range(stride)]


def _as_dcp_shards(shard, shape, split, tp, rank, means):
    """shard as DCP itself takes a tensor held in blocks: a ShardedTensor of them, or (torch >= 2.14)
    the tensor with CheckpointableTensor's fields."""
    blocks = _blocks(shape, split, tp, rank)
    if means == "CheckpointableTensor":
        marked = shard.clone()
        marked.global_shape = shape
        marked.global_offsets, marked.local_offsets, marked.local_sizes = (tuple(block[i] for block in blocks)
                                                                           for i in range(3))
        return marked
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    return init_from_local_shards(
        [Shard(shard[tuple(slice(o, o + n) for o, n in zip(in_shard, size))].contiguous(),
               ShardMetadata(list(at_global), list(size), f"rank:{dist.get_rank()}/cpu"))
         for at_global, in_shard, size in blocks], *shape)


def _blocks_of(loaded, split, means):
    """The blocks DCP read into what _as_dcp_shards made, joined back into the rank's shard."""
    if means == "CheckpointableTensor":
        return loaded
    blocks = sorted(loaded.local_shards(), key=lambda shard: shard.metadata.shard_offsets)
    return torch.cat([block.tensor for block in blocks], split[0])


def without_strides(properties):
    """TensorProperties but for the strides torch 2.15 added, which DCP's own saves fill differently
    (the local shard's for a CheckpointableTensor, None for a ShardedTensor)."""
    fields = {f.name: getattr(properties, f.name) for f in dataclasses.fields(properties)}
    fields.pop("strides", None)
    return fields


def _same_checkpoint_as_dcps_own(rank, world_size, root, means):
    from fused_rl_ops.checkpoint.integrity import ChecksummedWriter
    from fused_rl_ops.checkpoint.metadata import read_metadata

    group = tp_group_of_size(2)
    toy = Toy(logical_state(seed=1), 2, rank, step=7)
    shards = dict(toy.state_dict())
    splits = {name: split for name, _, _, _, split in LAYOUT}
    shapes = {name: shape for name, shape, _, _, _ in LAYOUT}

    def as_dcps_own(tensors):
        return {name: _as_dcp_shards(t, shapes[name], splits[name], 2, rank, means) if splits.get(name) else t
                for name, t in tensors.items()}

    save_sharded(toy, f"{root}/save_sharded", tp_group=group)
    dcp.save(as_dcps_own(shards), storage_writer=ChecksummedWriter(f"{root}/dcp"),
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))  # the extra state's dict as one object

    def chunks_of(path):
        return {name: (md.size, without_strides(md.properties), sorted((tuple(c.offsets), tuple(c.sizes))
                                                                       for c in md.chunks))
                if hasattr(md, "chunks") else md for name, md in read_metadata(path).state_dict_metadata.items()}

    assert chunks_of(f"{root}/save_sharded") == chunks_of(f"{root}/dcp")

    target = Toy(logical_state(seed=2), 2, rank, step=0)
    load_sharded(target, f"{root}/dcp", tp_group=group)
    assert_all_same(target, toy)
    assert target.step == 7

    fresh = as_dcps_own({name: torch.zeros_like(t) for name, t in shards.items() if isinstance(t, torch.Tensor)})
    dcp.load(fresh, checkpoint_id=f"{root}/save_sharded")
    for name, loaded in fresh.items():
        assert same_bits(_blocks_of(loaded, splits[name], means) if splits.get(name) else loaded, shards[name]), name


@pytest.mark.parametrize("means", [
    "ShardedTensor",
    pytest.param("CheckpointableTensor", marks=pytest.mark.skipif(
        not hasattr(dcp, "CheckpointableTensor"),
        reason="compares with DCP's CheckpointableTensor fields, which torch < 2.14 lacks (save_sharded does not "
               "use them)")),
])
def test_checkpoint_is_the_one_dcp_writes_for_the_same_shards(tmp_path, means):
    """At TP 2, save_sharded's checkpoint holds, tensor by tensor, the global shape, properties and
    chunks that DCP itself stores for the same shards handed to it as ShardedTensors of their
    blocks, or marked with CheckpointableTensor's fields (as save_sharded did before it planned the
    chunks itself, on torch 2.14 only); DCP's checkpoint loads through load_sharded bit for bit,
    and save_sharded's through DCP's own reading of those tensors."""
    run_distributed(_same_checkpoint_as_dcps_own, 2, str(tmp_path), means)


# --- extra states -------------------------------------------------------------------------------

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


# --- strict=False, and no warnings in one process ------------------------------------------------

def test_strict_false_loads_what_matches_and_returns_the_rest(tmp_path):
    """A policy's checkpoint (with a value head) into a reference model without it, which has an
    entry of its own: the strict load names both and changes nothing; strict=False loads the shared
    entries bit for bit, leaves the module's own as it was and returns what it left out, as
    nn.Module.load_state_dict does. Saving, overwriting and loading in one process warn nothing."""
    path = str(tmp_path / "policy")
    policy = Toy(logical_state(seed=1), 1, 0, step=7)
    add_parameter(policy, "value_head.weight", random_bits((1, 6), torch.float32, seed=11), {})
    add_parameter(policy, "value_head.bias", random_bits((1,), torch.float32, seed=12), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_sharded(Toy(logical_state(seed=3), 1, 0, step=3), path)
        save_sharded(policy, path)  # over the older save
        assert load_sharded(Toy(logical_state(seed=2), 1, 0, step=0), path, strict=False) == (
            [], ["value_head.bias", "value_head.weight"])

    reference = Toy(logical_state(seed=2), 1, 0, step=0)
    add_parameter(reference, "extra.weight", random_bits((3,), torch.float32, seed=13), {})
    before = {name: t.clone() for name, t in reference.state_dict().items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError, match=r"missing \['extra.weight'\], unexpected \['value_head.bias', "
                                         r"'value_head.weight'\] \(strict=False loads what matches\)"):
        load_sharded(reference, path)
    assert all(same_bits(t, before[name]) for name, t in reference.state_dict().items() if name in before)
    result = load_sharded(reference, path, strict=False)
    assert result.missing_keys == ["extra.weight"]
    assert result.unexpected_keys == ["value_head.bias", "value_head.weight"]
    saved = policy.state_dict()
    for name, t in reference.state_dict().items():
        if isinstance(t, torch.Tensor):
            assert same_bits(t, before[name] if name == "extra.weight" else saved[name]), name
    assert reference.step == 7
