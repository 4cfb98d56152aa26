"""Tensor-parallel sharding metadata, read one trustworthy way.

Megatron parameters say how they are split across tensor-parallel ranks in several dialects:
DTensor placements (`Shard`, `Replicate`, `_StridedShard`); megatron-core 0.19's
`_tensor_parallel_mode`; 0.16's `_mcore_tp` / `_tp_duplicated` / `_tp_partition_dim`; the legacy
`tensor_model_parallel` / `partition_dim` / `partition_stride`. `read_sharding` reads every dialect
a tensor carries into one ShardSpec and raises ShardingMetadataError when two disagree (on
replicated vs sharded, the dim or the stride), never guessing. Only attributes are read, so meta
tensors and partial copies work. No annotation means replicated (Megatron's default); no stated
stride means 1.

Stride s (ShardSpec.stride) means the logical global tensor is s equal blocks along `dim` and each
rank holds its 1/tp piece of every block, concatenated: Megatron's GLU fc1 (stride 2) holds
`[W_r ; V_r]` of the logical `[W ; V]`.
"""
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from ._torch_private import StridedShard

__all__ = ["ShardSpec", "ShardingMetadataError", "from_dtensor", "read_sharding", "to_dtensor"]


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
    if isinstance(placement, StridedShard):
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

def global_shape(local_shape, spec: ShardSpec, tp_size: int) -> tuple:
    shape = list(local_shape)
    if spec.sharded:
        shape[spec.dim] *= tp_size
    return tuple(shape)


def check_stride_divides(name: str, local: torch.Tensor, spec: ShardSpec):
    if spec.sharded and local.shape[spec.dim] % spec.stride:
        raise ShardingMetadataError(
            f"{name}: local size {local.shape[spec.dim]} on dim {spec.dim} is not a multiple of its "
            f"stride {spec.stride}")


def to_dtensor(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """The DTensor on a 1-D mesh whose local shard is tensor, placed as tensor's sharding says."""
    if mesh.ndim != 1:
        raise ValueError(f"to_dtensor: mesh must be 1-D (the tensor-parallel ranks), got {mesh.ndim}-D")
    spec = read_sharding(tensor)
    check_stride_divides("to_dtensor", tensor, spec)
    if not spec.sharded:
        placement = Replicate()
    elif spec.stride == 1:
        placement = Shard(spec.dim)
    else:
        placement = StridedShard(spec.dim, split_factor=spec.stride)
    shape = global_shape(tensor.shape, spec, mesh.size())
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
