"""DCP's default planners, told where each rank's tensors lie in the global tensors (chunks.py).

DCP takes a plain tensor for the whole of its global tensor: handed a TP shard, every rank would
store its shard as the whole tensor and the checkpoint would keep one rank's. So the planners are
given, besides DCP's state dict, each sharded tensor's Placement (its global shape and its chunks
as views of the rank's tensor). A save plans one write item per chunk (a chunk of the global shape,
the chunk's elements written from its view); a load plans reads from the overlaps of the stored
chunks with the rank's own (DCP's create_read_items_for_chunk_list), each read into its chunk's
view. Everything else (objects, tensors that are whole) goes through DCP's default planning, except
that a load reads each stored object with torch.load(weights_only=True), never DCP's full
unpickler: a checkpoint brings data, not code (load_object). Only
DCP's public planner API is used, so the same checkpoint is written and read on every torch the
package supports: the one DCP's own CheckpointableTensor fields (torch >= 2.14) give.
"""
import io
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (create_default_local_load_plan,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["LoadPlanner", "SavePlanner", "load_object"]


def load_object(stored: io.BytesIO, name: str):
    """The object stored under name, read by torch.load(weights_only=True): numbers, strings,
    containers, tensors and what torch.serialization.add_safe_globals allows. An item naming any
    other function or class (whose unpickling could call it) is refused, naming it."""
    try:
        return torch.load(stored, weights_only=True)
    except pickle.UnpicklingError as exc:
        stored.seek(0)
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(stored)
        reason = f"it names {', '.join(unsafe)}" if unsafe else f"torch.load(weights_only=True) fails on it: {exc}"
        raise ValueError(f"{name}: the object stored for it is refused: {reason}, which torch.load(weights_only=True) "
                         "does not allow (unpickling it could run code)") from None


def _write_items(name: str, placement) -> list:
    """A write item per chunk of a placed tensor: where the chunk lies in the global tensor."""
    return [WriteItem(index=MetadataIndex(name, torch.Size(at_global), i), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(
                          chunk=ChunkStorageMetadata(offsets=torch.Size(at_global), sizes=chunk.shape),
                          properties=TensorProperties.create_from_tensor(chunk),
                          size=torch.Size(placement.global_shape)))
            for i, (at_global, chunk) in enumerate(placement.chunks.items())]


def _plan_items(state_dict: dict, placements: dict, default, placed) -> list:
    """A plan's items in the state dict's order: placed(name, placement) for a placed tensor,
    default(name, value) (DCP's own planning) for everything else."""
    items = []
    for name, value in state_dict.items():
        placement = placements.get(name)
        items += default(name, value) if placement is None else placed(name, placement)
    return items


class SavePlanner(dcp.DefaultSavePlanner):
    """DCP's save planner, writing each placed tensor's chunks (module docstring). DCP clones every
    tensor whose storage is larger than the tensor (else torch.save would write the whole storage),
    which would copy each chunk of a shard cut into several; a contiguous chunk is handed over
    instead as a tensor over exactly its bytes: an alias, not a copy."""

    def __init__(self, placements: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._placements = placements

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(_plan_items(
            self.state_dict, self._placements,
            lambda name, value: create_default_local_save_plan({name: value}, self.is_coordinator).items, _write_items))
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        placement = self._placements.get(index.fqn)
        return super().lookup_object(index) if placement is None else placement.chunks[tuple(index.offset)]

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.is_contiguous() and data.untyped_storage().nbytes() != data.nbytes:
            start = data.storage_offset() * data.element_size()
            own_bytes = data.untyped_storage()[start:start + data.nbytes]
            data = torch.empty(0, dtype=data.dtype, device=data.device).set_(own_bytes, 0, data.shape)
        return data


class LoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner, reading into each placed tensor's chunks (module docstring). No
    flattening: DCP would otherwise put loaded objects (extra state) into a copy of the state dict."""

    def __init__(self, placements: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._placements = placements

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(_plan_items(
            self.state_dict, self._placements,
            lambda name, value: create_default_local_load_plan({name: value}, self.metadata).items, self._read_items))

    def _read_items(self, name: str, placement) -> list:
        mine = [ChunkStorageMetadata(offsets=torch.Size(at_global), sizes=chunk.shape)
                for at_global, chunk in placement.chunks.items()]
        return create_read_items_for_chunk_list(name, self.metadata.state_dict_metadata[name], mine)

    def load_bytes(self, read_item, value: io.BytesIO):
        self.state_dict[read_item.dest_index.fqn] = load_object(value, read_item.dest_index.fqn)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        placement = self._placements.get(index.fqn)
        return super().lookup_tensor(index) if placement is None else placement.chunks[tuple(index.offset)]
