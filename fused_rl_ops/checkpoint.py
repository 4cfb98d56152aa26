"""Tensor-parallel sharding metadata read one trustworthy way, and checkpoints that reshard bit for bit.

Megatron parameters say how they are split across tensor-parallel (TP) ranks in several dialects.
This module reads all of them into one :class:`ShardSpec`, refuses to guess when they disagree,
and uses that spec to save and load checkpoints with ``torch.distributed.checkpoint`` (DCP) so
that a checkpoint written at one TP degree loads at any other.

API
---
``read_sharding(tensor, name=None) -> ShardSpec``
    Resolves a tensor's sharding from every dialect it carries:

    - ``dtensor``: DTensor placements on a 1-D mesh: ``Replicate()``, ``Shard(d)`` (stride 1),
      ``_StridedShard(d, split_factor=s)`` (stride s).
    - ``mcore-0.19``: ``_tensor_parallel_mode`` = ``"column"`` (dim 0), ``"row"`` (dim 1) or
      ``"replicated"``.
    - ``mcore-0.16``: ``_tp_duplicated=True`` or ``_mcore_tp=False`` mean replicated;
      otherwise ``_tp_partition_dim >= 0`` or ``_mcore_tp=True`` mean sharded (on
      ``_tp_partition_dim`` when given; else another dialect must name the dim, as megatron-core
      0.16 then reads ``partition_dim``).
    - ``legacy``: ``tensor_model_parallel``, ``partition_dim`` (-1: none), ``partition_stride``.
      ``tensor_model_parallel=False`` means replicated; ``True`` or a ``partition_dim >= 0``
      means sharded.

    Only attributes are read, so meta tensors and copies carrying only some legacy attributes
    (gated-delta-net meta copies have ``tensor_model_parallel`` and ``partition_dim``) work.
    When no dialect states a stride it is 1 (Megatron's default ``partition_stride``). A tensor
    with no annotation at all is replicated (Megatron's default; :func:`save_sharded` verifies
    it). Dialects that disagree on replicated vs sharded, the dim or the stride raise
    :class:`ShardingMetadataError` naming the tensor and both claims.

``ShardSpec(dim, stride=1, dialects=())``
    ``dim`` is None for a replicated tensor; ``sharded`` is ``dim is not None``. Stride s means
    the logical global tensor is s equal blocks along ``dim`` and each rank holds its 1/tp piece
    of every block, concatenated: Megatron's GLU fc1 (stride 2) holds ``[W_r ; V_r]`` of the
    logical ``[W ; V]``. ``dialects`` names the dialects the spec was read from.

``save_sharded(module_or_state_dict, path, *, tp_group=None)``
    Writes a DCP checkpoint in which every entry is its logical global tensor (a stride-2 weight
    as ``[W ; V]``, not the rank shards one after another), so plain ``dcp.load`` of a full
    tensor reads the real weight. Pass a module (its parameters, persistent buffers and extra
    state are saved) or a state dict whose tensors still carry their attributes
    (``module.state_dict(keep_vars=True)``; plain ``state_dict()`` drops them) or are DTensors
    on a 1-D mesh of the TP ranks. Non-tensor values (extra state) are pickled as DCP does and
    written once. A checkpoint already at ``path`` is overwritten. Before writing, the ranks of
    ``tp_group`` check that they hold the same entries with the same specs, shapes and dtypes,
    and that every tensor claiming to be replicated has the same bytes on all of them (a
    checksum per tensor, gathered once): a sharded tensor mislabelled as replicated raises
    :class:`ShardingMetadataError` instead of being saved from one rank.

``load_sharded(module, path, *, tp_group=None, staged=False)``
    Loads a checkpoint from :func:`save_sharded` into ``module`` at the module's own TP degree
    (the size of ``tp_group``), which may differ from the one it was saved at. Before any tensor
    data is read it checks, and raises a ``ValueError`` naming the parameter for: entries missing
    from or extra to the checkpoint, a sharded dimension that the degree (times the stride) does
    not divide, global shapes or dtypes differing from the module's; and ``FileNotFoundError`` /
    ``ValueError`` for a missing checkpoint or a missing or truncated data file. Any of these
    leaves the module unchanged. Then DCP reads straight into the module's tensors (each stride
    block of a shard into its slice), as plain DCP loads into DTensors: parameters keep their
    storage, so views into Megatron's contiguous DDP buffers stay views, and the load needs no
    memory or copy beyond plain DCP's. An I/O error in the middle of that read raises
    ``RuntimeError`` saying the module may be partially loaded. ``staged=True`` reads into
    temporaries instead and copies them into the module only once everything has been read, so
    that such an error leaves the module unchanged (``RuntimeError`` saying so); the price is one
    more copy of this rank's state, in time and memory. Extra state is set only after a
    successful read. Vocab-padded embeddings load only when padded to the same size at both
    degrees (Megatron's default padding multiple grows with TP). Entries are matched by name:
    loading ignores no entry and accepts no missing one.

``to_dtensor(tensor, mesh) -> DTensor`` / ``from_dtensor(dtensor) -> Tensor``
    Convert between a local shard annotated in any dialect and a DTensor on a 1-D mesh with the
    matching placement (``_StridedShard`` for stride > 1), for writers that speak only DTensor.
    ``from_dtensor`` returns the local shard (sharing storage) with the legacy attributes set.

Both checkpoint functions are collective: every rank of the default process group calls them
(DCP coordinates over it); ``tp_group`` (default: the whole world) only defines the TP layout, so
data-parallel replicas write identical chunks that DCP de-duplicates. Without an initialised
process group they run in one process at TP degree 1. An error found on one rank before DCP
starts is raised on every rank, so that none is left waiting in a collective. They need a DCP
with ``CheckpointableTensor`` (torch 2.14 has it) and raise ``RuntimeError`` on an older one.
"""
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

__all__ = [
    "ShardSpec",
    "ShardingMetadataError",
    "from_dtensor",
    "load_sharded",
    "read_sharding",
    "save_sharded",
    "to_dtensor",
]


class ShardingMetadataError(ValueError):
    """A tensor's sharding metadata contradicts itself, another dialect, another rank or its data."""


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor is split across tensor-parallel ranks (see the module docstring)."""

    dim: Optional[int]
    stride: int = 1
    dialects: tuple = ()

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    def __str__(self):
        return f"sharded on dim {self.dim} with stride {self.stride}" if self.sharded else "replicated"


# --- reading the dialects -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Claim:
    """What one dialect on a tensor says; dim and stride are None where the dialect does not say."""

    dialect: str
    attributes: str  # the dialect's own spelling, for error messages
    sharded: bool
    dim: Optional[int] = None
    stride: Optional[int] = None

    def __str__(self):
        said = "sharded" if self.sharded else "replicated"
        if self.dim is not None:
            said += f" on dim {self.dim}"
        if self.stride is not None:
            said += f" with stride {self.stride}"
        return f"{self.dialect} ({self.attributes}) says {said}"


def _present_attributes(tensor, names) -> dict:
    return {n: getattr(tensor, n) for n in names if hasattr(tensor, n)}


def _spelled(attributes: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in attributes.items())


def _dtensor_claim(tensor, name: str) -> Optional[_Claim]:
    if not isinstance(tensor, DTensor):
        return None
    placements = tensor.placements
    if len(placements) != 1:
        raise ShardingMetadataError(
            f"{name}: DTensor placements {placements} span a {len(placements)}-D mesh; only a 1-D "
            "tensor-parallel mesh is supported")
    placement = placements[0]
    attributes = f"placement {placement!r}"
    if isinstance(placement, _StridedShard):
        return _Claim("dtensor", attributes, True, placement.dim, int(placement.split_factor))
    if isinstance(placement, Shard):
        return _Claim("dtensor", attributes, True, placement.dim, 1)
    if isinstance(placement, Replicate):
        return _Claim("dtensor", attributes, False)
    raise ShardingMetadataError(f"{name}: DTensor {attributes} holds pending partial sums, not a value to checkpoint")


def _mcore_019_claim(tensor, name: str) -> Optional[_Claim]:
    mode = getattr(tensor, "_tensor_parallel_mode", None)
    if mode is None:
        return None
    attributes = f"_tensor_parallel_mode={mode!r}"
    if mode == "column":
        return _Claim("mcore-0.19", attributes, True, 0)
    if mode == "row":
        return _Claim("mcore-0.19", attributes, True, 1)
    if mode == "replicated":
        return _Claim("mcore-0.19", attributes, False)
    raise ShardingMetadataError(f"{name}: unknown {attributes} (expected 'column', 'row' or 'replicated')")


def _flags_claim(dialect, found: dict, name, says_replicated, says_sharded, dim, stride) -> Optional[_Claim]:
    """The rule the mcore-0.16 and legacy dialects share; a dim < 0 means "no partition dim"."""
    dim = dim if dim is not None and dim >= 0 else None
    spelled = _spelled(found)
    if says_replicated:
        if dim is not None:
            raise ShardingMetadataError(f"{name}: {dialect} attributes contradict themselves: {spelled}")
        return _Claim(dialect, spelled, False)
    if says_sharded or dim is not None:
        return _Claim(dialect, spelled, True, dim, stride)
    return None  # e.g. only partition_dim=-1: says neither replicated nor sharded


def _mcore_016_claim(tensor, name: str) -> Optional[_Claim]:
    found = _present_attributes(tensor, ("_mcore_tp", "_tp_duplicated", "_tp_partition_dim"))
    if not found:
        return None
    says_replicated = bool(found.get("_tp_duplicated")) or found.get("_mcore_tp") is False
    return _flags_claim("mcore-0.16", found, name, says_replicated, bool(found.get("_mcore_tp")),
                        found.get("_tp_partition_dim"), None)


def _legacy_claim(tensor, name: str) -> Optional[_Claim]:
    found = _present_attributes(tensor, ("tensor_model_parallel", "partition_dim", "partition_stride"))
    if not found:
        return None
    says_replicated = "tensor_model_parallel" in found and not found["tensor_model_parallel"]
    return _flags_claim("legacy", found, name, says_replicated, bool(found.get("tensor_model_parallel")),
                        found.get("partition_dim"), found.get("partition_stride"))


_DIALECT_READERS = (_dtensor_claim, _mcore_019_claim, _mcore_016_claim, _legacy_claim)


def read_sharding(tensor: torch.Tensor, name: Optional[str] = None) -> ShardSpec:
    """The one sharding description of tensor from all the dialects it carries (module docstring).

    name is used in error messages (default: the tensor's shape)."""
    name = name or f"tensor of shape {tuple(tensor.shape)}"
    claims = [c for c in (read(tensor, name) for read in _DIALECT_READERS) if c is not None]
    for field in ("sharded", "dim", "stride"):
        stating = [c for c in claims if getattr(c, field) is not None]
        for other in stating[1:]:
            if getattr(other, field) != getattr(stating[0], field):
                raise ShardingMetadataError(f"{name}: sharding dialects disagree: {stating[0]}, but {other}")
    dialects = tuple(c.dialect for c in claims)
    if not claims or not claims[0].sharded:
        return ShardSpec(None, 1, dialects)
    dim = next((c.dim for c in claims if c.dim is not None), None)
    stride = next((c.stride for c in claims if c.stride is not None), 1)
    if dim is None:
        raise ShardingMetadataError(f"{name}: {claims[0]}, but no dialect names the partition dim")
    if not 0 <= dim < tensor.dim():
        raise ShardingMetadataError(f"{name}: partition dim {dim} does not exist in a {tensor.dim()}-D tensor")
    if stride < 1:
        raise ShardingMetadataError(f"{name}: partition stride {stride} must be >= 1")
    return ShardSpec(dim, stride, dialects)


# --- DTensor conversion ---------------------------------------------------------------------------

def _global_shape(local_shape, spec: ShardSpec, tp_size: int) -> tuple:
    shape = list(local_shape)
    if spec.sharded:
        shape[spec.dim] *= tp_size
    return tuple(shape)


def _check_stride_divides(name: str, local: torch.Tensor, spec: ShardSpec):
    if spec.sharded and local.shape[spec.dim] % spec.stride:
        raise ShardingMetadataError(
            f"{name}: local size {local.shape[spec.dim]} on dim {spec.dim} is not a multiple of its "
            f"stride {spec.stride}")


def to_dtensor(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """The DTensor on a 1-D mesh whose local shard is tensor, placed as tensor's sharding says."""
    if mesh.ndim != 1:
        raise ValueError(f"to_dtensor: mesh must be 1-D (the tensor-parallel ranks), got {mesh.ndim}-D")
    spec = read_sharding(tensor)
    _check_stride_divides("to_dtensor", tensor, spec)
    if not spec.sharded:
        placement = Replicate()
    elif spec.stride == 1:
        placement = Shard(spec.dim)
    else:
        placement = _StridedShard(spec.dim, split_factor=spec.stride)
    shape = _global_shape(tensor.shape, spec, mesh.size())
    contiguous_strides = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(tensor, mesh, [placement], run_check=False, shape=shape, stride=contiguous_strides)


def from_dtensor(dtensor: DTensor) -> torch.Tensor:
    """dtensor's local shard (sharing storage) with the legacy Megatron attributes of its placement."""
    spec = read_sharding(dtensor)
    local = dtensor.to_local().detach()  # a new tensor object, so the attributes stay off dtensor's own
    local.tensor_model_parallel = spec.sharded
    local.partition_dim = spec.dim if spec.sharded else -1
    local.partition_stride = spec.stride
    return local


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
        _check_stride_divides(name, local, spec)
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
    global_shape = _global_shape(tensor.shape, spec, tp_size)
    global_block = global_shape[dim] // stride

    def along_dim(value, base):
        coords = list(base)
        coords[dim] = value
        return tuple(coords)

    zeros = (0,) * tensor.dim()
    tensor.global_shape = global_shape
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
        expected = _global_shape(local.shape, spec, tp_size)
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
