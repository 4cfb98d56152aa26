"""Checkpoints that reshard bit for bit: save_sharded / load_sharded through torch.distributed.checkpoint.

Every entry is stored as its logical global tensor (a stride-2 GLU fc1 as `[W ; V]`, from
fused_rl_ops.sharding's ShardSpec), so a checkpoint saved at one tensor-parallel degree loads at any
degree that divides the sharded dimension, and plain `dcp.load` of a full tensor reads the real weight.

Saving first checks, in one collective, that the ranks of each TP group hold the same entries with
the same specs, shapes and dtypes, and that tensors claiming to be replicated have the same bytes.
Loading first checks the checkpoint against the module (names, global shapes, dtypes, TP
divisibility, data files present and long enough); any such error leaves the module untouched and
is raised on every rank. Then DCP reads straight into the module's tensors (parameters keep their
storage: views into Megatron's DDP buffers stay views); `staged=True` reads into temporaries first,
so that an I/O error mid-read also leaves the module unchanged.

Both functions are collective over the default group (DCP coordinates over it); `tp_group` only
defines the TP layout. They need DCP's CheckpointableTensor (torch >= 2.14).
"""
import os
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

def _require_checkpointable_tensor():
    """An older DCP, without CheckpointableTensor, would take each rank's shard for the whole
    tensor and keep one rank's: the silent failure this module exists to prevent."""
    if not hasattr(dcp, "CheckpointableTensor"):
        raise RuntimeError(
            "save_sharded/load_sharded need torch.distributed.checkpoint.CheckpointableTensor "
            f"(torch 2.14 has it); this is torch {torch.__version__}")


def _tp_size_and_rank(tp_group) -> tuple:
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _local_entries(state: dict, tp_size: int) -> dict:
    """name -> (local tensor, ShardSpec) for tensors, (value, None) for other objects."""
    entries = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            entries[name] = (value, None)
            continue
        spec = read_sharding(value, name)
        local = value
        if isinstance(value, DTensor):
            if value.device_mesh.size() != tp_size:
                raise ShardingMetadataError(
                    f"{name}: DTensor mesh has {value.device_mesh.size()} ranks but the tensor-parallel "
                    f"group has {tp_size}")
            local = value.to_local()
        if local.is_meta:
            raise ValueError(f"{name}: is a meta tensor; it has no data to save or load into")
        check_stride_divides(name, local, spec)
        entries[name] = (local, spec)
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
    checksum: Optional[tuple] = None  # of replicated tensors, when saving


def _held(entries: dict, with_checksums: bool) -> dict:
    held = {}
    for name, (local, spec) in entries.items():
        if spec is None:
            held[name] = _Held("object")
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


def _check_tp_ranks_agree(held_by_rank: list, ranks: tuple):
    """Raises unless the given ranks (one tensor-parallel group) hold the same entries, layouts,
    shapes, dtypes and (where computed) the same bytes in their replicated tensors."""
    first = ranks[0]
    reference = held_by_rank[first]
    for rank in ranks[1:]:
        other = held_by_rank[rank]
        if reference.keys() != other.keys():
            raise ValueError(
                f"tensor-parallel ranks {first} and {rank} hold different entries: only on {first}: "
                f"{sorted(reference.keys() - other.keys())}, only on {rank}: {sorted(other.keys() - reference.keys())}")
        for name, mine in reference.items():
            theirs = other[name]
            if mine._replace(checksum=None) != theirs._replace(checksum=None):
                raise ShardingMetadataError(
                    f"{name}: tensor-parallel ranks disagree on (layout, local shape, dtype): "
                    f"rank {first} has {mine[:3]}, rank {rank} has {theirs[:3]}")
            if mine.checksum != theirs.checksum:
                raise ShardingMetadataError(
                    f"{name}: claims to be replicated but its bytes differ between tensor-parallel ranks {first} "
                    f"and {rank}; a sharded tensor labelled replicated would be saved from one rank only")


def _entries_agreed_by_tp_ranks(state: dict, tp_group, tp_size: int, with_checksums: bool, check=None) -> dict:
    """name -> (local tensor, ShardSpec), or (object, None) for non-tensors, once every rank has
    read its specs, passed check(entries) (which returns an error or None) and agrees with the
    other ranks of its tensor-parallel group. One collective exchanges all of it, and every rank
    checks every group, so all raise together and none is left waiting in a later collective."""
    entries, held, error = None, None, None
    try:
        entries = _local_entries(state, tp_size)
        held = _held(entries, with_checksums)
        error = check(entries) if check else None
    except ValueError as exc:
        error = exc
    group = tp_group if tp_group is not None else dist.group.WORLD
    tp_ranks = tuple(dist.get_process_group_ranks(group)) if dist.is_initialized() else (0,)
    gathered = _gather_from_all_ranks((error, held, tp_ranks))
    held_by_rank = [h for _, h, _ in gathered]
    if all(h is not None for h in held_by_rank):
        for ranks in sorted({r for _, _, r in gathered}):
            _check_tp_ranks_agree(held_by_rank, ranks)
    _raise_first_error(error, [e for e, _, _ in gathered])
    return entries


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


def _dcp_state(entries: dict, tp_size: int, tp_rank: int, make_buffer) -> dict:
    """The state dict handed to DCP: make_buffer(local) for each tensor (marked with its chunks if
    sharded), other objects as they are."""
    state = {}
    for name, (local, spec) in entries.items():
        if spec is None:
            state[name] = local
        elif spec.sharded:
            state[name] = _as_checkpoint_chunks(make_buffer(local), spec, tp_size, tp_rank)
        else:
            state[name] = make_buffer(local)
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


def save_sharded(module_or_state_dict: Union[torch.nn.Module, dict], path: str, *, tp_group=None) -> None:
    """Saves each entry as its logical global tensor with DCP (see the module docstring)."""
    _require_checkpointable_tensor()
    tp_size, tp_rank = _tp_size_and_rank(tp_group)
    entries = _entries_agreed_by_tp_ranks(_state_of(module_or_state_dict), tp_group, tp_size, with_checksums=True)
    state = _dcp_state(entries, tp_size, tp_rank, _alias)
    planner = _SavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True), planner=planner)


def _read_metadata(path: str) -> Metadata:
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"no checkpoint at {path!r}: its .metadata file does not exist")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # unpickling a damaged file can raise almost anything
        raise ValueError(f"checkpoint {path!r}: .metadata is unreadable (truncated?): {exc!r}") from exc


def _check_against_checkpoint(entries: dict, metadata: Metadata, tp_size: int, path: str):
    stored = metadata.state_dict_metadata
    missing, unexpected = sorted(entries.keys() - stored.keys()), sorted(stored.keys() - entries.keys())
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match the module: missing {missing}, unexpected {unexpected}")
    for name, (local, spec) in entries.items():
        md = stored[name]
        if (spec is None) != isinstance(md, BytesStorageMetadata):
            kinds = ("an object", "a tensor") if spec is None else ("a tensor", "an object")
            raise ValueError(f"{name}: the module holds {kinds[0]}, the checkpoint {kinds[1]}")
        if spec is None:
            continue
        saved_shape = tuple(md.size)
        if spec.sharded and len(saved_shape) == local.dim() and saved_shape[spec.dim] % (spec.stride * tp_size):
            raise ValueError(
                f"{name}: cannot be split across tensor-parallel degree {tp_size}: dim {spec.dim} has "
                f"{saved_shape[spec.dim]} entries in the checkpoint, not a multiple of {tp_size} ranks x "
                f"stride {spec.stride}")
        expected = global_shape(local.shape, spec, tp_size)
        if saved_shape != expected:
            raise ValueError(
                f"{name}: the checkpoint holds global shape {saved_shape}, the module expects {expected} "
                f"(local {tuple(local.shape)} at tensor-parallel degree {tp_size})")
        if md.properties.dtype != local.dtype:
            raise ValueError(f"{name}: the checkpoint holds {md.properties.dtype}, the module {local.dtype}")


def _check_data_files(metadata: Metadata, path: str):
    """Every data file the checkpoint's entries point into exists and is long enough."""
    needed = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for file, size in sorted(needed.items()):
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"checkpoint {path!r} is incomplete: data file {file} does not exist")
        if os.path.getsize(full) < size:
            raise ValueError(
                f"checkpoint {path!r} is truncated: data file {file} has {os.path.getsize(full)} bytes, "
                f"its entries need {size}")


def _reason_not_to_load(entries: dict, path: str, tp_size: int) -> Optional[Exception]:
    """None when the checkpoint at path can be loaded into entries, else the error saying why not."""
    try:
        metadata = _read_metadata(path)
        _check_against_checkpoint(entries, metadata, tp_size, path)
        _check_data_files(metadata, path)
        return None
    except (ValueError, OSError) as exc:
        return exc


def load_sharded(module: torch.nn.Module, path: str, *, tp_group=None, staged: bool = False) -> None:
    """Loads a save_sharded checkpoint into module at its TP degree, in place or staged (module docstring)."""
    _require_checkpointable_tensor()
    tp_size, tp_rank = _tp_size_and_rank(tp_group)
    entries = _entries_agreed_by_tp_ranks(module.state_dict(keep_vars=True), tp_group, tp_size, with_checksums=False,
                                          check=lambda mine: _reason_not_to_load(mine, path, tp_size))

    loaded = _dcp_state(entries, tp_size, tp_rank, torch.empty_like if staged else _alias)
    # No flattening: DCP would otherwise put loaded objects (extra state) into a copy of `loaded`.
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(path), planner=planner)
    except dcp.CheckpointException as exc:
        if staged:
            raise RuntimeError(f"reading checkpoint {path!r} failed; the module was left unchanged") from exc
        raise RuntimeError(
            f"reading checkpoint {path!r} failed part-way; the module may be partially loaded (pass "
            "staged=True to read into temporaries first and leave it unchanged on such a failure)") from exc

    with torch.no_grad():
        for name, (local, spec) in entries.items():
            if spec is None:
                owner = name[: -len(_EXTRA_STATE_KEY_SUFFIX)].rstrip(".")
                module.get_submodule(owner).set_extra_state(loaded[name])
            elif staged:
                local.copy_(loaded[name])
