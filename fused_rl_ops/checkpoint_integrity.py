"""What makes a save_sharded checkpoint trustworthy on disk: checksums, completeness, file checks.

- Checksums: every item DCP stores (a tensor chunk or a pickled object) gets the 64-bit XXH3 hash
  of its bytes as they lie in the data file (the torch.save archive, headers included), computed
  while DCP writes them and kept in the checkpoint's `.metadata` beside the item's file, offset and
  length (an extra `xxh3_64` field on DCP's per-item storage info, which plain DCP readers ignore).
  DCP reads a stored item whole even when only part of it overlaps the target (a load at another
  TP degree), so the reader verifies every item it reads, hashing the file's pages in place
  (mmap, no copy), before DCP deserialises it; a mismatch names the entry and the data file. XXH3
  rather than crc32c: on a load from the page cache the hash is most of the cost beyond plain DCP
  (benchmarks/bench_checkpoint.py reports its share), and on large buffers XXH3 hashed faster than
  the crc32c package's hardware CRC on the CPUs we measured.
- Completeness: DCP makes a checkpoint visible by renaming `.metadata.tmp` to `.metadata` after
  every rank has written and fsync'd its data. Overwriting a checkpoint would leave the old
  `.metadata` beside new partial data if the save died, so the writer removes the old one before
  any rank writes: a save that does not finish leaves no `.metadata`, which the loader refuses.
- File checks before anything is read: every data file the metadata points into exists and has
  exactly the length its items add up to (DCP writes a data file as its items back to back), and
  every item carries a checksum.
"""
import mmap
import os

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import Metadata

try:
    import xxhash
except ImportError:  # the ops work without it; save_sharded / load_sharded call require_xxhash()
    xxhash = None

__all__ = ["ChecksummedReader", "ChecksummedWriter", "check_data_files", "read_metadata", "require_xxhash"]

_METADATA = ".metadata"


def require_xxhash():
    if xxhash is None:
        raise RuntimeError("save_sharded/load_sharded need the xxhash package (pip install xxhash)")


class _HashingStream:
    """Passes an item's bytes on to DCP's stream and records their hash under the item's index
    when DCP closes it (DCP closes the per-item stream once the item is written)."""

    def __init__(self, raw, index, checksums: dict):
        self._raw, self._index, self._checksums = raw, index, checksums
        self._hash = xxhash.xxh3_64()

    def write(self, data) -> int:
        self._hash.update(data)
        return self._raw.write(data)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def flush(self):
        self._raw.flush()

    def close(self):
        self._checksums[self._index] = self._hash.intdigest()
        self._raw.close()


class _HashingTransforms(_StorageWriterTransforms):
    """DCP's per-item stream hook (no transform extensions), hashing what passes through."""

    def __init__(self, checksums: dict):
        super().__init__(())
        self._checksums = checksums

    def transform_save_stream(self, write_item, raw_stream):
        stream, descriptors = super().transform_save_stream(write_item, raw_stream)
        return _HashingStream(stream, write_item.index, self._checksums), descriptors


class ChecksummedWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter, adding each item's hash to its storage info and removing an older
    checkpoint's .metadata before any data is written (module docstring)."""

    def __init__(self, path: str):
        super().__init__(path, overwrite=True)
        self._checksums = {}
        self.transforms = _HashingTransforms(self._checksums)
        self._is_coordinator = False

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        # Runs on every rank before the collective that hands out the global plan, and no rank
        # writes data before that plan arrives: the old .metadata is gone before any new byte lands.
        plan = super().prepare_local_plan(plan)
        if self._is_coordinator:
            try:
                os.remove(os.path.join(self.path, _METADATA))
            except FileNotFoundError:
                pass
        return plan

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # FileSystemWriter writes before returning
        for result in future.value():
            result.storage_data.xxh3_64 = self._checksums.pop(result.index)
        return future


def _hash_of_file_range(file, offset: int, length: int) -> int:
    """The hash of length bytes at offset, read through a read-only mapping of the file's pages."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(file.fileno(), offset + length - start, offset=start, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as view:
            return xxhash.xxh3_64_intdigest(view[offset - start:])


class ChecksummedReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, verifying each stored item's hash before DCP deserialises it."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._entry_at = {(info.relative_path, info.offset): index.fqn for index, info in metadata.storage_data.items()}

    def _slice_file(self, file, sinfo):
        if _hash_of_file_range(file, sinfo.offset, sinfo.length) != sinfo.xxh3_64:
            raise ValueError(
                f"{self._entry_at[(sinfo.relative_path, sinfo.offset)]}: its bytes {sinfo.offset}.."
                f"{sinfo.offset + sinfo.length} in data file {sinfo.relative_path} of checkpoint {str(self.path)!r} "
                "do not match the checksum saved with them: the file is damaged or from another save")
        return super()._slice_file(file, sinfo)


def read_metadata(path: str) -> Metadata:
    if not os.path.isfile(os.path.join(path, _METADATA)):
        raise FileNotFoundError(
            f"no complete checkpoint at {path!r}: its .metadata file does not exist (a save that did not finish "
            "leaves none)")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # unpickling a damaged file can raise almost anything
        raise ValueError(f"checkpoint {path!r}: .metadata is unreadable (truncated?): {exc!r}") from exc


def check_data_files(metadata: Metadata, path: str):
    """Every data file the checkpoint's items point into exists with exactly the items' length, and
    every item has a checksum."""
    lengths = {}
    for index, info in metadata.storage_data.items():
        if getattr(info, "xxh3_64", None) is None:
            raise ValueError(
                f"checkpoint {path!r} has no checksum for {index.fqn}: it was not written by save_sharded")
        lengths[info.relative_path] = lengths.get(info.relative_path, 0) + info.length
    for file, length in sorted(lengths.items()):
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"checkpoint {path!r} is incomplete: data file {file} does not exist")
        size = os.path.getsize(full)
        if size != length:
            state = "truncated" if size < length else "inconsistent"
            raise ValueError(
                f"checkpoint {path!r} is {state}: data file {file} has {size} bytes, its entries in .metadata "
                f"add up to {length}")
