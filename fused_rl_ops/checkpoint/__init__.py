"""Checkpoints that reshard bit for bit across tensor-, expert- and pipeline-parallel layouts.

- save_load: save_sharded / load_sharded through torch.distributed.checkpoint
- sharding: read_sharding, ShardSpec and DTensor conversion of Megatron's sharding dialects
- experts: expert tensors under their global expert index
- stages: layers under their global layer number across pipeline stages
- integrity: checksums of every stored item and of .metadata, saves that commit atomically
- metadata: .metadata read only once its checksum and structure are found intact
- optimizer: a torch.optim or megatron-core optimizer's state (fp32 main copies included), stored
  and resharded with its parameters
- chunks: where a rank's shard, or its range of one, lies in the global tensor (DCP's chunks)
- planners: DCP's planners, writing and reading each rank's chunks where chunks.py places them
- ranks: the collective check that the ranks agree before a save or load
- param_gather: megatron-core DDP's pending parameter all-gather, named when replicas differ
"""
from .save_load import IncompatibleKeys, load_sharded, save_sharded
from .sharding import ShardingMetadataError, ShardSpec, from_dtensor, read_sharding, to_dtensor

__all__ = [
    "IncompatibleKeys",
    "ShardSpec",
    "ShardingMetadataError",
    "from_dtensor",
    "load_sharded",
    "read_sharding",
    "save_sharded",
    "to_dtensor",
]
