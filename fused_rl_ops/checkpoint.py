"""Checkpoints that reshard bit for bit: save_sharded / load_sharded through torch.distributed.checkpoint.

    save_sharded(module_or_state_dict, path, *, tp_group=None, ep_group=None, expert_tp_group=None)
    load_sharded(module, path, *, tp_group=None, ep_group=None, expert_tp_group=None, staged=False)

Every entry is stored as its logical global tensor (a stride-2 GLU fc1 as `[W ; V]`, from
fused_rl_ops.sharding's ShardSpec), so a checkpoint saved at one tensor-parallel degree loads at any
degree that divides the sharded dimension, and plain `dcp.load` of a full tensor reads the real weight.

Groups: `tp_group` is the tensor-parallel group of dense tensors (None: the default group).
Expert tensors (megatron-core SequentialMLP's `...local_experts.<i>....` and Transformer Engine
GroupedLinear's `...experts.linear_fc1.weight<i>`, TEGroupedMLP's) are stored under their global
expert index `ep_rank * num_local_experts + i` in one spelling for both layouts, so either loads into
the other (fused_rl_ops.checkpoint_experts), with
`ep_group` the expert-parallel group (None: no expert parallelism) and `expert_tp_group` the group
their tensor-parallel sharding runs over (None: `tp_group`). So an MoE checkpoint saved at one (TP,
EP) layout loads at any other whose degrees divide the sharded dims and the expert count.

Saving first checks, in one collective, that the ranks of each TP group hold the same dense entries
(and the ranks of each expert TP group the same expert entries) with the same specs, shapes and
dtypes, that tensors claiming to be replicated there have the same bytes, and that the ranks of each
EP group hold as many local experts. Loading first checks the checkpoint against the module (names,
global shapes, dtypes, TP divisibility, expert counts, data files present with their exact lengths
and checksums recorded); any such error leaves the module untouched and is raised on every rank.
Then the reader reads straight into the module's tensors (parameters keep their storage: views into
Megatron's DDP buffers stay views), verifying each stored item's hash (XXH3) as it reads it
(fused_rl_ops.checkpoint_integrity); `staged=True` reads into temporaries first, so that a checksum
mismatch or an I/O error mid-read also leaves the module unchanged. A save that dies part-way leaves
no `.metadata`, so nothing loads from it (an older checkpoint it was overwriting is gone too).

Both functions are collective over the default group (DCP coordinates over it). They need DCP's
CheckpointableTensor (torch >= 2.14) and the xxhash package.
"""
import pickle
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

# Re-exported so `import fused_rl_ops.checkpoint as ck` keeps offering the sharding names.
from .sharding import ShardingMetadataError, ShardSpec, from_dtensor, read_sharding, to_dtensor
from .sharding import check_stride_divides, global_shape
from .checkpoint_experts import (ExpertLayout, check_expert_counts, check_grouped_glu_not_interleaved, expert_prefix,
                                 is_extra_state)
from .checkpoint_integrity import ChecksummedReader, ChecksummedWriter, check_data_files, read_metadata, require_xxhash

__all__ = [
    "ShardSpec",
    "ShardingMetadataError",
    "from_dtensor",
    "load_sharded",
    "read_sharding",
    "save_sharded",
    "to_dtensor",
]


# --- saving and loading ---------------------------------------------------------------------------

def _require_dependencies():
    """An older DCP, without CheckpointableTensor, would take each rank's shard for the whole
    tensor and keep one rank's: the silent failure this module exists to prevent."""
    if not hasattr(dcp, "CheckpointableTensor"):
        raise RuntimeError(
            "save_sharded/load_sharded need torch.distributed.checkpoint.CheckpointableTensor "
            f"(torch 2.14 has it); this is torch {torch.__version__}")
    require_xxhash()


class _Group(NamedTuple):
    """A process group as the checks need it: size, this rank's rank in it, its global ranks."""

    size: int
    rank: int
    ranks: tuple

    @classmethod
    def of(cls, group) -> "_Group":
        if not dist.is_initialized():
            return cls(1, 0, (0,))
        return cls(dist.get_world_size(group), dist.get_rank(group), tuple(dist.get_process_group_ranks(group)))


class _Entry(NamedTuple):
    """One stored entry on this rank: its name in the module, its local tensor (or object), the
    tensor's ShardSpec (None for objects), the TP group it is split over, and whether it carries
    nothing (an empty expert extra state: left out of saves, loaded only where a checkpoint has it)."""

    module_name: str
    local: object
    spec: Optional[ShardSpec]
    tp: _Group
    optional: bool = False


class _Layout(NamedTuple):
    tp: _Group  # dense tensors
    expert_tp: _Group  # expert tensors
    ep: _Group
    experts: ExpertLayout


def _layout(state: dict, tp_group, ep_group, expert_tp_group) -> _Layout:
    tp = _Group.of(dist.group.WORLD if tp_group is None else tp_group)
    expert_tp = tp if expert_tp_group is None else _Group.of(expert_tp_group)
    # Without expert parallelism every rank holds every expert: an EP group of its own.
    own_rank = dist.get_rank() if dist.is_initialized() else 0
    ep = _Group(1, 0, (own_rank,)) if ep_group is None else _Group.of(ep_group)
    return _Layout(tp, expert_tp, ep, ExpertLayout.of(state, ep.size, ep.rank))


def _local_entries(state: dict, layout: _Layout) -> dict:
    """stored name -> _Entry (expert tensors under their global expert index)."""
    entries = {}
    for name, value in state.items():
        stored = layout.experts.stored_name(name)
        tp = layout.tp if expert_prefix(name) is None else layout.expert_tp
        optional = layout.experts.carries_nothing(name, value)
        if not isinstance(value, torch.Tensor):
            entries[stored] = _Entry(name, value, None, tp, optional)
            continue
        spec = layout.experts.sharding(name, read_sharding(value, name))
        local = value
        if isinstance(value, DTensor):
            if value.device_mesh.size() != tp.size:
                raise ShardingMetadataError(
                    f"{name}: DTensor mesh has {value.device_mesh.size()} ranks but its tensor-parallel "
                    f"group has {tp.size}")
            local = value.to_local()
        if local.is_meta:
            raise ValueError(f"{name}: is a meta tensor; it has no data to save or load into")
        check_stride_divides(name, local, spec)
        entries[stored] = _Entry(name, local, spec, tp, optional)
    return entries


_CHECKSUM_CHUNK_BYTES = 1 << 22  # bounds the int64 temporaries to a few tens of MB


def _replica_checksum(tensor: torch.Tensor) -> tuple:
    """Plain and position-weighted sums of the tensor's bytes: equal bytes give equal sums, and
    bytes that differ (another rank's shard) practically never do."""
    data = tensor.detach().reshape(-1).view(torch.uint8)
    total = weighted = 0
    for start in range(0, data.numel(), _CHECKSUM_CHUNK_BYTES):
        chunk = data[start:start + _CHECKSUM_CHUNK_BYTES].to(torch.int64)
        positions = torch.arange(start + 1, start + 1 + chunk.numel(), device=chunk.device, dtype=torch.int64)
        total += int(chunk.sum())
        weighted += int((chunk * positions).sum())
    return total, weighted


class _Held(NamedTuple):
    """What one rank holds under one name, in a form the other ranks can compare."""

    layout: object  # "object", "replicated" or (dim, stride)
    shape: Optional[tuple] = None
    dtype: Optional[str] = None
    checksum: Optional[tuple] = None  # of replicated tensors and of objects (pickled), when saving


def _held(entries: dict, with_checksums: bool) -> dict:
    held = {}
    for name, entry in entries.items():
        local, spec = entry.local, entry.spec
        if spec is None:
            checksum = None
            if with_checksums:
                checksum = _replica_checksum(torch.frombuffer(bytearray(pickle.dumps(local)), dtype=torch.uint8))
            held[name] = _Held("object", checksum=checksum)
        elif spec.sharded:
            held[name] = _Held((spec.dim, spec.stride), tuple(local.shape), str(local.dtype))
        else:
            checksum = _replica_checksum(local) if with_checksums else None
            held[name] = _Held("replicated", tuple(local.shape), str(local.dtype), checksum)
    return held


def _gather_from_all_ranks(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _raise_first_error(mine: Optional[Exception], errors: list):
    """Raises this rank's error, else the first other rank's, if any rank failed."""
    if mine is not None:
        raise mine
    for rank, other in enumerate(errors):
        if other is not None:
            raise type(other)(f"rank {rank} failed: {other}")


def _check_ranks_agree(held_by_rank: list, ranks: tuple, kind: str):
    """Raises unless the given ranks (one tensor-parallel group of that kind) hold the same
    entries, layouts, shapes, dtypes and (where computed) the same bytes in their replicated tensors."""
    first = ranks[0]
    reference = held_by_rank[first]
    for rank in ranks[1:]:
        other = held_by_rank[rank]
        if reference.keys() != other.keys():
            raise ValueError(
                f"{kind} ranks {first} and {rank} hold different entries: only on {first}: "
                f"{sorted(reference.keys() - other.keys())}, only on {rank}: {sorted(other.keys() - reference.keys())}")
        for name, mine in reference.items():
            theirs = other[name]
            if mine != theirs and is_extra_state(name):
                raise ValueError(
                    f"{name}: {kind} ranks {first} and {rank} hold different extra states (as Transformer Engine's "
                    "per-rank FP8 scaling state can be); a checkpoint holds one extra state per tensor-parallel "
                    "group, so saving would keep one rank's for all")
            if mine._replace(checksum=None) != theirs._replace(checksum=None):
                raise ShardingMetadataError(
                    f"{name}: {kind} ranks disagree on (layout, local shape, dtype): "
                    f"rank {first} has {mine[:3]}, rank {rank} has {theirs[:3]}")
            if mine.checksum != theirs.checksum:
                raise ShardingMetadataError(
                    f"{name}: claims to be replicated but its bytes differ between {kind} ranks {first} "
                    f"and {rank}; a sharded tensor labelled replicated would be saved from one rank only")


def _check_layouts_agree(gathered: list):
    """Dense entries agree within each TP group, expert entries within each expert TP group (ranks
    of one TP group at different EP ranks hold different experts), and the ranks of each EP group
    hold as many experts in each experts module."""
    held = [h for _, h, _ in gathered]
    dense = [{n: v for n, v in h.items() if expert_prefix(n) is None} for h in held]
    expert = [{n: v for n, v in h.items() if expert_prefix(n) is not None} for h in held]
    for ranks in sorted({layout.tp.ranks for _, _, layout in gathered}):
        _check_ranks_agree(dense, ranks, "tensor-parallel")
    for ranks in sorted({layout.expert_tp.ranks for _, _, layout in gathered}):
        _check_ranks_agree(expert, ranks, "expert tensor-parallel")
    for ranks in sorted({layout.ep.ranks for _, _, layout in gathered}):
        counts = [gathered[r][2].experts.local_counts for r in ranks]
        if any(c != counts[0] for c in counts):
            raise ValueError(f"expert-parallel ranks {ranks} hold different numbers of local experts: {counts}")


def _entries_agreed(state: dict, groups: tuple, with_checksums: bool, check=None) -> tuple:
    """(stored name -> _Entry, what check returned) once every rank has read its specs, passed
    check(entries, layout) (which raises ValueError or OSError when this rank cannot go on) and
    agrees with the ranks of its groups (_check_layouts_agree). One collective exchanges all of it,
    and every rank checks every group, so all raise together and none is left waiting in a later
    collective."""
    entries, held, layout, checked, error = None, None, None, None, None
    try:
        layout = _layout(state, *groups)
        entries = _local_entries(state, layout)
        held = _held(entries, with_checksums)
        checked = check(entries, layout) if check else None
    except (ValueError, OSError) as exc:
        error = exc
    gathered = _gather_from_all_ranks((error, held, layout))
    if all(h is not None for _, h, _ in gathered):
        _check_layouts_agree(gathered)
    _raise_first_error(error, [e for e, _, _ in gathered])
    return entries, checked


def _as_checkpoint_chunks(tensor: torch.Tensor, spec: ShardSpec, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Marks tensor (this rank's shard) with where its stride blocks sit in the logical global
    tensor (DCP's CheckpointableTensor fields), so DCP stores and reads the global layout."""
    dim, stride = spec.dim, spec.stride
    block = tensor.shape[dim] // stride
    shape = global_shape(tensor.shape, spec, tp_size)
    global_block = shape[dim] // stride

    def along_dim(value, base):
        coords = list(base)
        coords[dim] = value
        return tuple(coords)

    zeros = (0,) * tensor.dim()
    tensor.global_shape = shape
    tensor.global_offsets = tuple(along_dim(b * global_block + tp_rank * block, zeros) for b in range(stride))
    tensor.local_offsets = tuple(along_dim(b * block, zeros) for b in range(stride))
    tensor.local_sizes = tuple(along_dim(block, tensor.shape) for _ in range(stride))
    return tensor


def _alias(local: torch.Tensor) -> torch.Tensor:
    """local's storage under a new tensor object, so the chunk fields DCP reads stay off the
    parameter, and the parameter keeps its storage (Megatron's DDP holds it as a view of a buffer)."""
    return local.detach()


def _dcp_state(entries: dict, make_buffer) -> dict:
    """The state dict handed to DCP: make_buffer(local) for each tensor (marked with its chunks if
    sharded), other objects as they are."""
    state = {}
    for name, entry in entries.items():
        if entry.spec is None:
            state[name] = entry.local
        elif entry.spec.sharded:
            state[name] = _as_checkpoint_chunks(make_buffer(entry.local), entry.spec, entry.tp.size, entry.tp.rank)
        else:
            state[name] = make_buffer(entry.local)
    return state


def _state_of(module_or_state_dict) -> dict:
    if isinstance(module_or_state_dict, torch.nn.Module):
        return module_or_state_dict.state_dict(keep_vars=True)  # keep_vars: Parameters keep their attributes
    return dict(module_or_state_dict)


class _SavePlanner(dcp.DefaultSavePlanner):
    """DCP clones every tensor whose storage is larger than the tensor (else torch.save would write
    the whole storage), which would copy each stride block of a stride > 1 shard. A contiguous
    block is handed over instead as a tensor over exactly its bytes: an alias, not a copy."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.is_contiguous() and data.untyped_storage().nbytes() != data.nbytes:
            start = data.storage_offset() * data.element_size()
            own_bytes = data.untyped_storage()[start:start + data.nbytes]
            data = torch.empty(0, dtype=data.dtype, device=data.device).set_(own_bytes, 0, data.shape)
        return data


def save_sharded(module_or_state_dict: Union[torch.nn.Module, dict], path: str, *, tp_group=None, ep_group=None,
                 expert_tp_group=None) -> None:
    """Saves each entry as its logical global tensor with DCP (see the module docstring)."""
    _require_dependencies()
    if isinstance(module_or_state_dict, torch.nn.Module):
        check_grouped_glu_not_interleaved(module_or_state_dict)
    entries, _ = _entries_agreed(_state_of(module_or_state_dict), (tp_group, ep_group, expert_tp_group),
                                 with_checksums=True)
    entries = {name: entry for name, entry in entries.items() if not entry.optional}
    planner = _SavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.save(_dcp_state(entries, _alias), storage_writer=ChecksummedWriter(path), planner=planner)


def _check_against_checkpoint(entries: dict, layout: _Layout, metadata: Metadata, path: str):
    """Raises where the checkpoint does not fit entries; removes the optional entries it lacks."""
    stored = metadata.state_dict_metadata
    check_expert_counts(stored.keys(), layout.experts, path)
    for name in [n for n, entry in entries.items() if entry.optional and n not in stored]:
        del entries[name]
    missing = sorted(entries[n].module_name + ("" if n == entries[n].module_name else f" (stored as {n})")
                     for n in entries.keys() - stored.keys())
    unexpected = sorted(n for n in stored.keys() - entries.keys() if layout.experts.holds(n))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match the module: missing {missing}, unexpected {unexpected}")
    for name, (module_name, local, spec, tp, _) in entries.items():
        md = stored[name]
        if (spec is None) != isinstance(md, BytesStorageMetadata):
            kinds = ("an object", "a tensor") if spec is None else ("a tensor", "an object")
            raise ValueError(f"{module_name}: the module holds {kinds[0]}, the checkpoint {kinds[1]} (as {name})")
        if spec is None:
            continue
        if md.properties.dtype != local.dtype:
            raise ValueError(f"{module_name}: the checkpoint holds {md.properties.dtype}, the module {local.dtype}")
        if is_extra_state(module_name):
            continue  # a serialised state (Transformer Engine's): its length is the checkpoint's
        saved_shape = tuple(md.size)
        if spec.sharded and len(saved_shape) == local.dim() and saved_shape[spec.dim] % (spec.stride * tp.size):
            raise ValueError(
                f"{module_name}: cannot be split across tensor-parallel degree {tp.size}: dim {spec.dim} has "
                f"{saved_shape[spec.dim]} entries in the checkpoint, not a multiple of {tp.size} ranks x "
                f"stride {spec.stride}")
        expected = global_shape(local.shape, spec, tp.size)
        if saved_shape != expected:
            raise ValueError(
                f"{module_name}: the checkpoint holds global shape {saved_shape} (as {name}), the module expects "
                f"{expected} (local {tuple(local.shape)} at tensor-parallel degree {tp.size})")


def _loadable_metadata(entries: dict, layout: _Layout, path: str) -> Metadata:
    """The checkpoint's metadata, once the checkpoint at path is found loadable into entries."""
    metadata = read_metadata(path)
    _check_against_checkpoint(entries, layout, metadata, path)
    check_data_files(metadata, path)
    return metadata


def _failures(exc: dcp.CheckpointException) -> str:
    return "; ".join(f"rank {rank}: {error!r}" for rank, (error, _) in sorted(exc.failures.items()))


def load_sharded(module: torch.nn.Module, path: str, *, tp_group=None, ep_group=None, expert_tp_group=None,
                 staged: bool = False) -> None:
    """Loads a save_sharded checkpoint into module at its (TP, EP) layout, in place or staged (module docstring)."""
    _require_dependencies()
    check_grouped_glu_not_interleaved(module)
    entries, metadata = _entries_agreed(module.state_dict(keep_vars=True), (tp_group, ep_group, expert_tp_group),
                                        with_checksums=False, check=lambda *mine: _loadable_metadata(*mine, path))

    loaded = _dcp_state(entries, torch.empty_like if staged else _alias)
    for name, entry in entries.items():
        if entry.spec is not None and is_extra_state(entry.module_name):
            # get_extra_state() made a new tensor: read into one of the stored size, then hand it over.
            stored = metadata.state_dict_metadata[name]
            loaded[name] = entry.local.new_empty(stored.size)
    # No flattening: DCP would otherwise put loaded objects (extra state) into a copy of `loaded`.
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        dcp.load(loaded, storage_reader=ChecksummedReader(path, metadata), planner=planner)
    except dcp.CheckpointException as exc:
        if staged:
            raise RuntimeError(
                f"reading checkpoint {path!r} failed; the module was left unchanged: {_failures(exc)}") from exc
        raise RuntimeError(
            f"reading checkpoint {path!r} failed part-way; the module may be partially loaded (pass staged=True "
            f"to read into temporaries first and leave it unchanged on such a failure): {_failures(exc)}") from exc

    with torch.no_grad():
        for name, entry in entries.items():
            if is_extra_state(entry.module_name):
                owner = entry.module_name[: -len(_EXTRA_STATE_KEY_SUFFIX)].rstrip(".")
                module.get_submodule(owner).set_extra_state(loaded[name])
            elif staged:
                entry.local.copy_(loaded[name])
