"""What makes a save_sharded checkpoint trustworthy on disk: checksums, completeness, file checks.

- Checksums: every item DCP stores (a tensor chunk or a pickled object) gets the 64-bit XXH3 hash
  of its bytes as they lie in the data file (the torch.save archive, headers included), computed
  while DCP writes them and kept in the checkpoint's `.metadata` beside the item's file, offset and
  length (an extra `xxh3_64` field on DCP's per-item storage info, which plain DCP readers ignore).
  DCP reads a stored item whole even when only part of it overlaps the target (a load at another
  TP degree), so the reader verifies every item it reads. A separate pass over the file's bytes
  would cost as much again as reading them (about 15% of a page-cache load); instead the reader
  hashes the tensor data as torch.load reads it into memory, while it is still in the cache, and
  reads only the item's few header bytes a second time. The check completes before DCP copies the
  item into its target (the planner's resolve_tensor / load_bytes), and when torch.load fails on
  damaged bytes first, the mismatch is what is reported; either way the error names the entry and
  the data file. XXH3 rather than crc32c: on large buffers it hashed faster than the crc32c
  package's hardware CRC on the CPUs we measured (benchmarks/bench_checkpoint.py reports the
  hashing's share of a load).
- Completeness: DCP makes a checkpoint visible by renaming `.metadata.tmp` to `.metadata` after
  every rank has written and fsync'd its data. Overwriting a checkpoint would leave the old
  `.metadata` beside new partial data if the save died, so the writer removes the old one before
  any rank writes: a save that does not finish leaves no `.metadata`, which the loader refuses.
- File checks before anything is read: every data file the metadata points into exists and has
  exactly the length its items add up to (DCP writes a data file as its items back to back), and
  every item carries a checksum.
"""
import io
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


# A read at least this large is hashed from the buffer it filled (torch.load's read of a tensor's
# data), in pieces read and hashed in turn, so that each is hashed while it is in the core's cache;
# the bytes smaller reads skip are read again from the file when they are needed.
_HASH_IN_PLACE_MIN = 1 << 16
_PIECE = 1 << 19


class _VerifyingView(io.RawIOBase):
    """One stored item of a data file, read with pread through the reader's own descriptor and
    handed to torch.load as a seekable stream, hashing in file order the bytes it hands out;
    verify() hashes what is left from the file and compares."""

    def __init__(self, fd: int, sinfo, describe):
        super().__init__()
        self._fd, self._sinfo, self._describe = fd, sinfo, describe
        self._position = 0
        self._hash = xxhash.xxh3_64()
        self._hashed = 0  # bytes [0, _hashed) of the item are in _hash
        self.checked = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._sinfo.length}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer) -> int:
        buffer = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(buffer) and self._position < self._sinfo.length:
            size = min(len(buffer) - filled, _PIECE, self._sinfo.length - self._position)
            piece = buffer[filled:filled + size]
            n = os.preadv(self._fd, [piece], self._sinfo.offset + self._position)
            if not n:
                break
            self._absorb(self._position, piece[:n])
            self._position += n
            filled += n
        return filled

    def read(self, size=-1) -> bytes:
        left = max(0, self._sinfo.length - self._position)
        data = bytearray(left if size is None or size < 0 else min(size, left))
        return bytes(data[:self.readinto(data)])

    def _absorb(self, start: int, data):
        end = start + len(data)
        if start <= self._hashed < end:  # continues the hashed prefix
            self._hash.update(data[self._hashed - start:])
            self._hashed = end
        elif start > self._hashed and len(data) >= _HASH_IN_PLACE_MIN:
            self._hash_from_file(start)
            self._hash.update(data)
            self._hashed = end

    def _hash_from_file(self, end: int):
        while self._hashed < end:
            data = os.pread(self._fd, min(_PIECE, end - self._hashed), self._sinfo.offset + self._hashed)
            if not data:
                raise ValueError(f"{self._describe()} ends early: the data file is truncated")
            self._hash.update(data)
            self._hashed += len(data)

    def verify(self):
        if not self.checked:
            self._hash_from_file(self._sinfo.length)
            self.checked = True
            if self._hash.intdigest() != self._sinfo.xxh3_64:
                raise ValueError(f"{self._describe()} do not match the checksum saved with them: the file is "
                                 "damaged or from another save")


class _VerifyFirst:
    """The load planner, with the item being read verified before DCP hands it to the planner."""

    def __init__(self, planner, reader):
        self._planner, self._reader = planner, reader

    def resolve_tensor(self, read_item):
        self._reader.verify_current()
        return self._planner.resolve_tensor(read_item)

    def load_bytes(self, read_item, value):
        self._reader.verify_current()
        return self._planner.load_bytes(read_item, value)

    def __getattr__(self, name):
        return getattr(self._planner, name)


class ChecksummedReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, verifying each stored item's hash before DCP puts it into its target
    (module docstring)."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._entry_at = {(info.relative_path, info.offset): index.fqn for index, info in metadata.storage_data.items()}
        self._current = None

    def _describe(self, sinfo) -> str:
        return (f"{self._entry_at[(sinfo.relative_path, sinfo.offset)]}: its bytes {sinfo.offset}.."
                f"{sinfo.offset + sinfo.length} in data file {sinfo.relative_path} of checkpoint {str(self.path)!r}")

    def _slice_file(self, file, sinfo):
        self.verify_current()  # every item is checked, also one no target asked for after reading it
        # A descriptor of the reader's own: DCP's file object is closed by the time a failed read is
        # checked.
        fd = self._fds.get(sinfo.relative_path)
        if fd is None:
            fd = self._fds[sinfo.relative_path] = os.open(self.fs.concat_path(self.path, sinfo.relative_path),
                                                          os.O_RDONLY)
        self._current = _VerifyingView(fd, sinfo, lambda: self._describe(sinfo))
        return self._current

    def verify_current(self):
        if self._current is not None:
            self._current.verify()

    def read_data(self, plan, planner):
        self._fds = {}
        try:
            future = super().read_data(plan, _VerifyFirst(planner, self))
            self.verify_current()
            return future
        except Exception:
            if self._current is not None and not self._current.checked:
                self._current.verify()  # damaged bytes can make torch.load fail first: say so
            raise
        finally:
            self._current = None
            for fd in self._fds.values():
                os.close(fd)


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
