"""Checkpoints that reshard bit for bit across tensor- and expert-parallel layouts.

- save_load: save_sharded / load_sharded through torch.distributed.checkpoint
- sharding: read_sharding, ShardSpec and DTensor conversion of Megatron's sharding dialects
- experts: expert tensors under their global expert index
- integrity: checksums of every stored item and of .metadata, complete saves
- metadata: .metadata read only once its checksum and structure are found intact
- ranks: the collective check that the ranks agree before a save or load
"""
from .save_load import load_sharded, save_sharded
from .sharding import ShardingMetadataError, ShardSpec, from_dtensor, read_sharding, to_dtensor

__all__ = [
    "ShardSpec",
    "ShardingMetadataError",
    "from_dtensor",
    "load_sharded",
    "read_sharding",
    "save_sharded",
    "to_dtensor",
]
