"""Megatron's tensor-parallel sharding dialects read one way; lives in fused_rl_ops.checkpoint.sharding."""
from .checkpoint.sharding import ShardingMetadataError, ShardSpec, from_dtensor, read_sharding, to_dtensor

__all__ = ["ShardSpec", "ShardingMetadataError", "from_dtensor", "read_sharding", "to_dtensor"]
