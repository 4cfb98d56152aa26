"""What each rank holds under each stored name, and the collectives that check the ranks agree.

Groups left None come from megatron-core's parallel_state when a program initialised it; without it
a world of more than one rank needs tp_group (the whole world taken as one TP group would store
data-parallel replicas as shards of a tensor twice the size).

Before a save, the ranks of each TP group must hold the same dense entries (those of each expert TP
group the same expert entries) with the same specs, shapes and dtypes, tensors said to be replicated
must have the same bytes there, the ranks of each EP group must hold as many local experts, and
ranks that store the same piece of an entry (data-parallel replicas; pipeline stages holding one
name) must hold the same bytes: the checkpoint keeps one copy (a second collective exchanges the
checksums of such shards). A load then checks the checkpoint against every rank's entries, so every
rank raises together.
"""
import contextlib
import math
import pickle
import sys
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .experts import ExpertLayout, expert_prefix, is_extra_state
from .sharding import ShardingMetadataError, ShardSpec, check_stride_divides, read_sharding
from .stages import StageLayout

__all__ = ["Entry", "Group", "Layout", "Piece", "check_ranks_agree", "layout_of", "local_entries", "raised_together"]


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


class Piece(NamedTuple):
    """The part of an entry one rank holds where the ranks split it further than tensor parallelism
    does (megatron-core's DistributedOptimizer: each data-parallel rank steps a range of the
    flattened TP shard): elements [start, stop) of the TP shard, of shape `shape`. An object or a
    0-d tensor that only some ranks hold (a range's step) is Piece(0, 1, ())."""

    start: int
    stop: int
    shape: tuple


class Entry(NamedTuple):
    """One stored entry on this rank: its name in the module, its local tensor (or object), the
    tensor's ShardSpec (None for objects), the TP group it is split over, whether it carries
    nothing (an empty expert extra state: left out of saves, loaded only where a checkpoint has it),
    and the Piece of it this rank holds (None: all of its TP shard; local is then the piece's
    elements, flat)."""

    module_name: str
    local: object
    spec: Optional[ShardSpec]
    tp: Group
    optional: bool = False
    piece: Optional[Piece] = None

    @property
    def shape(self) -> tuple:
        """The shape of the TP shard."""
        return tuple(self.local.shape) if self.piece is None else self.piece.shape


class Layout(NamedTuple):
    tp: Group  # dense tensors
    expert_tp: Group  # expert tensors
    ep: Group
    experts: ExpertLayout
    stage: StageLayout = StageLayout(1)


def _initialised_parallel_state():
    """megatron-core's parallel_state if a program imported and initialised it, else None (never
    imported here: the package works without megatron-core)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state


def _default_groups(state: dict, tp_group, ep_group, expert_tp_group, pp_group) -> tuple:
    """The groups given, those left None taken from megatron-core's parallel state (module docstring)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tp_group, ep_group, expert_tp_group, pp_group
    parallel_state = _initialised_parallel_state()
    if parallel_state is not None:
        given = (tp_group, ep_group, expert_tp_group, pp_group)
        defaults = (parallel_state.get_tensor_model_parallel_group, parallel_state.get_expert_model_parallel_group,
                    parallel_state.get_expert_tensor_parallel_group, parallel_state.get_pipeline_model_parallel_group)
        return tuple(default() if group is None else group for group, default in zip(given, defaults))
    if tp_group is None:
        experts = any(expert_prefix(name) is not None for name in state)
        raise ValueError(
            f"no tp_group given in a world of {dist.get_world_size()} ranks, and megatron-core's parallel_state "
            "is not initialised to supply one: pass tp_group (the ranks that each hold one tensor-parallel shard; "
            "a group of this rank alone when the ranks are data-parallel replicas), pp_group at pipeline "
            "parallelism" + (", and ep_group / expert_tp_group for the experts" if experts else ""))
    return tp_group, ep_group, expert_tp_group, pp_group


def layout_of(state: dict, groups: tuple, module=None) -> Layout:
    """This rank's layout. groups: (tp, ep, expert_tp, pp), None where not given; module: the module
    whose state this is (its layers' global numbers come from it), None for a plain state dict."""
    tp_group, ep_group, expert_tp_group, pp_group = _default_groups(state, *groups)
    tp = Group.of(dist.group.WORLD if tp_group is None else tp_group)
    expert_tp = tp if expert_tp_group is None else Group.of(expert_tp_group)
    # Without expert (pipeline) parallelism every rank holds every expert (layer): a group of its own.
    own_rank = dist.get_rank() if dist.is_initialized() else 0
    ep = Group(1, 0, (own_rank,)) if ep_group is None else Group.of(ep_group)
    pp_size = 1 if pp_group is None else Group.of(pp_group).size
    stage = StageLayout.of(module, pp_size)
    in_global_layers = {stage.stored_name(name): value for name, value in state.items()}
    return Layout(tp, expert_tp, ep, ExpertLayout.of(in_global_layers, ep.size, ep.rank), stage)


def local_entries(state: dict, layout: Layout) -> dict:
    """stored name -> Entry (layers under their global number, expert tensors under their global expert index)."""
    entries = {}
    for name, value in state.items():
        in_global_layer = layout.stage.stored_name(name)
        stored = layout.experts.stored_name(in_global_layer)
        tp = layout.tp if expert_prefix(name) is None else layout.expert_tp
        optional = layout.experts.carries_nothing(name, value)
        if not isinstance(value, torch.Tensor):
            entries[stored] = Entry(name, value, None, tp, optional)
            continue
        spec = layout.experts.sharding(in_global_layer, read_sharding(value, name))
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
    shape: Optional[tuple] = None  # of the TP shard
    dtype: Optional[str] = None
    checksum: Optional[tuple] = None  # of replicated tensors and objects (pickled) when saving; of shards
    # only where another rank holds the same one (_with_shard_checksums)
    piece: Optional[tuple] = None  # (start, stop) of a Piece


def _held(entries: dict, with_checksums: bool) -> dict:
    held = {}
    for name, entry in entries.items():
        local, spec = entry.local, entry.spec
        piece = None if entry.piece is None else entry.piece[:2]
        if spec is None:
            checksum = None
            if with_checksums:
                checksum = _replica_checksum(torch.frombuffer(bytearray(pickle.dumps(local)), dtype=torch.uint8))
            held[name] = _Held("object", checksum=checksum, piece=piece)
        elif spec.sharded:
            held[name] = _Held((spec.dim, spec.stride), entry.shape, str(local.dtype), piece=piece)
        else:
            checksum = _replica_checksum(local) if with_checksums else None
            held[name] = _Held("replicated", entry.shape, str(local.dtype), checksum, piece)
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


def _holders(gathered: list) -> dict:
    """(stored name, TP rank of a shard or None for a whole tensor or object, (start, stop) of a
    Piece or None) -> the ranks holding that piece, in rank order."""
    holders = {}
    for rank, (held, layout) in enumerate(gathered):
        for name, mine in held.items():
            tp = layout.tp if expert_prefix(name) is None else layout.expert_tp
            key = (name, tp.rank if isinstance(mine.layout, tuple) else None, mine.piece)
            holders.setdefault(key, []).append((rank, tp.size))
    return holders


def _check_replicas_agree(gathered: list, why_bytes_differ: Optional[str] = None):
    """Ranks that hold the same piece of an entry hold the same layout, shape, dtype and (where
    computed) bytes; why_bytes_differ: a known cause of differing bytes, which the error then names."""
    for (name, tp_rank, piece), holders in _holders(gathered).items():
        (first_rank, _), *others = holders
        first = gathered[first_rank][0][name]
        for rank, _ in others:
            mine = gathered[rank][0][name]
            if mine != first:
                what = "it" if tp_rank is None else f"its tensor-parallel shard {tp_rank}"
                if piece is not None:
                    what = f"elements {piece[0]}..{piece[1]} of {what}"
                differ = "bytes" if first._replace(checksum=None) == mine._replace(checksum=None) else (
                    f"(layout, local shape, dtype): {first[:3]} and {mine[:3]}")
                cause = f": {why_bytes_differ}" if differ == "bytes" and why_bytes_differ else ""
                raise ValueError(
                    f"{name}: ranks {first_rank} and {rank} both hold {what} (as data-parallel replicas, or "
                    f"pipeline stages holding one name) but with different {differ}; a checkpoint keeps one copy"
                    f"{cause}")


def _check_pieces_tile(gathered: list):
    """The Pieces the ranks hold of an entry (megatron-core's DistributedOptimizer: each data-parallel
    rank's range of a TP shard) agree on the layout, shape and dtype, and tile each TP shard
    exactly: every element held, none by two different pieces (equal pieces are replicas,
    _check_replicas_agree)."""
    pieces, described = {}, {}
    for (name, tp_rank, piece), holders in _holders(gathered).items():
        if piece is None:
            continue
        rank, tp_size = holders[0]
        held = gathered[rank][0][name]
        first = described.setdefault(name, (rank, held[:3], tp_size))
        if first[1:] != (held[:3], tp_size):
            raise ShardingMetadataError(
                f"{name}: ranks {first[0]} and {rank} hold pieces of it with different (layout, shape, dtype, "
                f"tensor-parallel degree): {first[1:]} and {(held[:3], tp_size)}")
        pieces.setdefault(name, {}).setdefault(tp_rank, []).append(piece)
    for name, by_shard in sorted(pieces.items()):
        _, (layout, shape, _), tp_size = described[name]
        shards = set(range(tp_size)) if isinstance(layout, tuple) else {None}
        if by_shard.keys() != shards:
            raise ValueError(f"{name}: no rank holds any part of its tensor-parallel shards "
                             f"{sorted(shards - by_shard.keys())}")
        size = math.prod(shape) if shape is not None else 1
        for tp_rank, ranges in by_shard.items():
            covered = 0  # elements 0..covered are held; -1 once a piece leaves a hole or overlaps
            for start, stop in sorted(ranges):
                covered = stop if start == covered else -1
            if covered != size:
                what = "it" if tp_rank is None else f"its tensor-parallel shard {tp_rank}"
                raise ValueError(f"{name}: the ranks' pieces {sorted(ranges)} of {what} do not tile its {size} "
                                 "elements exactly")


def _with_shard_checksums(gathered: list, entries: dict) -> list:
    """gathered with the checksums of the shards that more than one rank holds (data-parallel
    replicas), exchanged in a second collective where there are any: computing a checksum costs
    several times writing the tensor, so shards that one rank holds alone get none."""
    shared = [(name, [rank for rank, _ in holders]) for (name, tp_rank, _), holders in _holders(gathered).items()
              if tp_rank is not None and len(holders) > 1]
    if not shared:
        return gathered
    own_rank = dist.get_rank()
    mine = {name: _replica_checksum(entries[name].local) for name, ranks in shared if own_rank in ranks}
    checksums = _gather_from_all_ranks(mine)
    return [({name: h._replace(checksum=checksums[rank].get(name, h.checksum)) for name, h in held.items()}, layout)
            for rank, (held, layout) in enumerate(gathered)]


def _check_layouts_agree(gathered: list):
    """Dense entries agree within each TP group, expert entries within each expert TP group (ranks
    of one TP group at different EP ranks hold different experts), and the ranks of each EP group
    hold as many experts in each experts module."""
    held = [{n: v for n, v in h.items() if v.piece is None} for h, _ in gathered]  # pieces: _check_pieces_tile
    dense = [{n: v for n, v in h.items() if expert_prefix(n) is None} for h in held]
    expert = [{n: v for n, v in h.items() if expert_prefix(n) is not None} for h in held]
    for ranks in sorted({layout.tp.ranks for _, layout in gathered}):
        _check_ranks_agree(dense, ranks, "tensor-parallel")
    for ranks in sorted({layout.expert_tp.ranks for _, layout in gathered}):
        _check_ranks_agree(expert, ranks, "expert tensor-parallel")
    for ranks in sorted({layout.ep.ranks for _, layout in gathered}):
        counts = [gathered[r][1].experts.local_counts for r in ranks]
        if any(c != counts[0] for c in counts):
            raise ValueError(f"expert-parallel ranks {ranks} hold different numbers of local experts: {counts}")


@contextlib.contextmanager
def raised_together():
    """Runs the block, then exchanges the ValueError or OSError it raised on any rank (one
    collective on every rank), so every rank raises this rank's error, else the first other rank's:
    none is left waiting in a later collective."""
    error = None
    try:
        yield
    except (ValueError, OSError) as exc:
        error = exc
    _raise_first_error(error, _gather_from_all_ranks(error))


def check_ranks_agree(entries: dict, layout: Layout, with_checksums: bool,
                      why_bytes_differ: Optional[str] = None) -> set:
    """The stored names some rank holds, once every rank is found to agree with the ranks of its
    groups (_check_layouts_agree) and with those holding the same pieces (_check_replicas_agree;
    when saving, with_checksums, their bytes too, naming why_bytes_differ where they differ). Every
    rank checks every group from the same gathered data, so all raise together."""
    gathered = _gather_from_all_ranks((_held(entries, with_checksums), layout))
    _check_layouts_agree(gathered)
    _check_pieces_tile(gathered)
    _check_replicas_agree(_with_shard_checksums(gathered, entries) if with_checksums else gathered, why_bytes_differ)
    return set().union(*(held.keys() for held, _ in gathered))
