"""What each rank holds under each stored name, and the one collective that checks the ranks agree.

Before a save, the ranks of each TP group must hold the same dense entries (those of each expert TP
group the same expert entries) with the same specs, shapes and dtypes, tensors said to be replicated
must have the same bytes there, and the ranks of each EP group must hold as many local experts. A
load runs its own check of the checkpoint inside the same collective, so every rank raises together.
"""
import pickle
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .experts import ExpertLayout, expert_prefix, is_extra_state
from .sharding import ShardingMetadataError, ShardSpec, check_stride_divides, read_sharding

__all__ = ["Entry", "Group", "Layout", "entries_agreed"]


class Group(NamedTuple):
    """A process group as the checks need it: size, this rank's rank in it, its global ranks."""

    size: int
    rank: int
    ranks: tuple

    @classmethod
    def of(cls, group) -> "Group":
        if not dist.is_initialized():
            return cls(1, 0, (0,))
        return cls(dist.get_world_size(group), dist.get_rank(group), tuple(dist.get_process_group_ranks(group)))


class Entry(NamedTuple):
    """One stored entry on this rank: its name in the module, its local tensor (or object), the
    tensor's ShardSpec (None for objects), the TP group it is split over, and whether it carries
    nothing (an empty expert extra state: left out of saves, loaded only where a checkpoint has it)."""

    module_name: str
    local: object
    spec: Optional[ShardSpec]
    tp: Group
    optional: bool = False


class Layout(NamedTuple):
    tp: Group  # dense tensors
    expert_tp: Group  # expert tensors
    ep: Group
    experts: ExpertLayout


def _layout(state: dict, tp_group, ep_group, expert_tp_group) -> Layout:
    tp = Group.of(dist.group.WORLD if tp_group is None else tp_group)
    expert_tp = tp if expert_tp_group is None else Group.of(expert_tp_group)
    # Without expert parallelism every rank holds every expert: an EP group of its own.
    own_rank = dist.get_rank() if dist.is_initialized() else 0
    ep = Group(1, 0, (own_rank,)) if ep_group is None else Group.of(ep_group)
    return Layout(tp, expert_tp, ep, ExpertLayout.of(state, ep.size, ep.rank))


def _local_entries(state: dict, layout: Layout) -> dict:
    """stored name -> Entry (expert tensors under their global expert index)."""
    entries = {}
    for name, value in state.items():
        stored = layout.experts.stored_name(name)
        tp = layout.tp if expert_prefix(name) is None else layout.expert_tp
        optional = layout.experts.carries_nothing(name, value)
        if not isinstance(value, torch.Tensor):
            entries[stored] = Entry(name, value, None, tp, optional)
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
        entries[stored] = Entry(name, local, spec, tp, optional)
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


def entries_agreed(state: dict, groups: tuple, with_checksums: bool, check=None, extend=None) -> tuple:
    """(stored name -> Entry, what check returned) once every rank has read its specs, added the
    entries extend(entries) returns (an optimizer's state, stored with its parameters'), passed
    check(entries, layout) (which raises ValueError or OSError when this rank cannot go on) and
    agrees with the ranks of its groups (_check_layouts_agree). One collective exchanges all of it,
    and every rank checks every group, so all raise together and none is left waiting in a later
    collective."""
    entries, held, layout, checked, error = None, None, None, None, None
    try:
        layout = _layout(state, *groups)
        entries = _local_entries(state, layout)
        if extend:
            entries.update(extend(entries))
        held = _held(entries, with_checksums)
        checked = check(entries, layout) if check else None
    except (ValueError, OSError) as exc:
        error = exc
    gathered = _gather_from_all_ranks((error, held, layout))
    if all(h is not None for _, h, _ in gathered):
        _check_layouts_agree(gathered)
    _raise_first_error(error, [e for e, _, _ in gathered])
    return entries, checked
