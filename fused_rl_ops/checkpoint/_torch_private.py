"""Every private torch name the checkpoint package uses, in one place: a torch upgrade that moves or
renames one breaks this import, not a checkpoint later."""
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX
from torch.serialization import _get_layout

__all__ = ["EXTRA_STATE_KEY_SUFFIX", "MEM_FORMAT_ENCODING", "StorageInfo", "StoragePrefix", "StorageWriterTransforms",
           "StridedShard", "get_layout", "narrow_tensor_by_index", "stored_data_offset"]

EXTRA_STATE_KEY_SUFFIX = _EXTRA_STATE_KEY_SUFFIX
MEM_FORMAT_ENCODING = _MEM_FORMAT_ENCODING  # how TensorProperties pickles a memory format
StorageInfo = _StorageInfo  # FileSystemWriter's per-item storage info in .metadata
get_layout = _get_layout  # what a pickled torch.layout is rebuilt with
StoragePrefix = _StoragePrefix
StorageWriterTransforms = _StorageWriterTransforms
StridedShard = _StridedShard


def stored_data_offset(storage):
    """Where the bytes of a storage that torch.load made on the meta device lie in the archive it
    read (torch 2.11 to 2.14 record it), or None."""
    return getattr(storage, "_checkpoint_offset", None)
