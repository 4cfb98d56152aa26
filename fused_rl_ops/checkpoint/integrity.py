"""What makes a save_sharded checkpoint trustworthy on disk: checksums, completeness, file checks.

- Every item DCP stores (a tensor chunk or a pickled object) gets the XXH3-64 hash of its bytes in
  the data file, kept in `.metadata` as an extra `xxh3_64` field of DCP's per-item storage info
  (plain DCP readers ignore it). The reader verifies every item it reads before committing it.
- A save commits atomically: its data files get names no file in the directory has
  (`__<rank>_<save>_<n>.distcp`), and once every rank has written them the coordinator writes
  `.metadata.tmp`, syncs it and renames it over `.metadata` in one step (then syncs the directory),
  so until then the checkpoint that was there loads as it was, and after it the new one. It then
  removes the data files the new `.metadata` does not name (an older save's, a failed save's).
- `.metadata` ends in a seal: the XXH3-64 hash of the pickle before it (metadata.py checks it).
"""
import dataclasses
import io
import os
import pickle
import secrets

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from ._torch_private import StoragePrefix, StorageWriterTransforms, narrow_tensor_by_index, stored_data_offset
from .planners import LoadPlanner

try:
    import xxhash
except ImportError:  # the ops work without it; save_sharded / load_sharded call require_xxhash()
    xxhash = None

__all__ = ["METADATA", "SEAL_LENGTH", "SEAL_PREFIX", "ChecksummedReader", "ChecksummedWriter", "read_objects",
           "require_xxhash", "seal_of"]

METADATA = ".metadata"
# `.metadata` is DCP's pickle followed by this prefix and the pickle's XXH3-64 in 16 hex digits.
# pickle.load stops at the pickle's end, so plain DCP readers read such a file as before.
SEAL_PREFIX = b"fused_rl_ops xxh3_64 "
SEAL_LENGTH = len(SEAL_PREFIX) + 16
# Bytes read and hashed at a time, each piece hashed right after it is read, while it is in the
# core's cache.
_PIECE = 1 << 19
# A read at least this large (a tensor's data) is hashed from the buffer it filled; the bytes that
# smaller reads (torch.load parsing the item's header) skip are read again when they are needed.
_HASH_IN_PLACE_MIN = 1 << 16


def require_xxhash():
    if xxhash is None:
        raise RuntimeError("save_sharded/load_sharded need the xxhash package (pip install xxhash; it is the "
                           "fused_rl_ops[checkpoint] extra)")


def seal_of(pickled: bytes) -> bytes:
    """The seal that follows the pickled metadata in `.metadata`."""
    return SEAL_PREFIX + f"{xxhash.xxh3_64_intdigest(pickled):016x}".encode()


def _is_data_file(name: str) -> bool:
    """Whether a file name is DCP's (or a save_sharded) data file's: `__<...>.distcp`."""
    return name.startswith("__") and name.endswith(".distcp")


class _CommittingFileSystem(FileSystem):
    """DCP's local file system with the steps of a commit; every file operation of a save goes
    through it: mkdir, create_stream (the data files and `.metadata.tmp`), replace, sync_directory,
    rm_file."""

    def replace(self, path, new_path):
        """Renames path to new_path, replacing new_path in one step (POSIX rename)."""
        os.replace(path, new_path)

    def sync_directory(self, path):
        """Makes the directory's entries (a rename into it) durable."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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


class _HashingTransforms(StorageWriterTransforms):
    """DCP's per-item stream hook (no transform extensions), hashing what passes through."""

    def __init__(self, checksums: dict):
        super().__init__(())
        self._checksums = checksums

    def transform_save_stream(self, write_item, raw_stream):
        stream, descriptors = super().transform_save_stream(write_item, raw_stream)
        return _HashingStream(stream, write_item.index, self._checksums), descriptors


class ChecksummedWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter, adding each item's hash to its storage info, and committing a save
    atomically with a sealed `.metadata` (module docstring). XXH3 rather than crc32c: on large
    buffers it hashes faster than the crc32c package's hardware CRC."""

    def __init__(self, path: str):
        super().__init__(path, overwrite=True)
        self.fs = _CommittingFileSystem()
        self._checksums = {}
        self.transforms = _HashingTransforms(self._checksums)

    def prepare_local_plan(self, plan):
        # DCP's own warns on finding a checkpoint to overwrite: here that is what a save is for, and
        # the checkpoint stays whole until finish() replaces it.
        self.fs.mkdir(self.path)
        return plan

    def prepare_global_plan(self, plans):
        """Each rank's data files named `__<rank>_<save>_`..., <save> a token no file in the directory
        holds, so that no file of the checkpoint being replaced is written over."""
        existing = os.listdir(self.path)
        save = secrets.token_hex(4)
        while any(save in name for name in existing):
            save = secrets.token_hex(4)
        return [dataclasses.replace(plan, storage_data=StoragePrefix(f"__{rank}_{save}_"))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan, planner):
        # torch.save stores each item as a zip archive and by default computes a CRC32 of every
        # record for it, which torch.load never checks; the item's XXH3 covers the same bytes and is
        # checked, so the CRC32 pass (about a third of a CPU save) is skipped.
        crc32 = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            future = super().write_data(plan, planner)  # FileSystemWriter writes before returning
        finally:
            torch.serialization.set_crc32_options(crc32)
        for result in future.value():
            result.storage_data.xxh3_64 = self._checksums.pop(result.index)
        return future

    def finish(self, metadata: Metadata, results: list):
        """Commits the save, on the coordinator once every rank has written its data: the sealed
        metadata written to `.metadata.tmp` and synced, renamed over `.metadata` (the commit) and the
        rename synced; then the data files the new metadata does not name are removed."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for per_rank in results for result in per_rank}
        metadata.storage_meta = self.storage_meta()
        pickled = pickle.dumps(metadata)
        staged = self.fs.concat_path(self.path, f"{METADATA}.tmp")
        with self.fs.create_stream(staged, "wb") as file:
            file.write(pickled + seal_of(pickled))
            file.flush()
            os.fsync(file.fileno())
        self.fs.replace(staged, self.fs.concat_path(self.path, METADATA))
        self.fs.sync_directory(self.path)
        named = {info.relative_path for info in metadata.storage_data.values()}
        for name in sorted(os.listdir(self.path)):
            if _is_data_file(name) and name not in named:
                self.fs.rm_file(self.fs.concat_path(self.path, name))


class _VerifyingView(io.RawIOBase):
    """One stored item of a data file, read with pread through the reader's own descriptor and
    handed to torch.load as a seekable stream, hashing in file order the bytes it hands out;
    verify() hashes what is left from the file and compares."""

    def __init__(self, fd: int, sinfo, where: str):
        super().__init__()
        self._fd, self._sinfo, self.where = fd, sinfo, where
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

    def read_at(self, position: int, buffer):
        """Fills buffer with the item's bytes from position on; an item that ends first is an error."""
        self.seek(position)
        if self.readinto(buffer) != len(buffer):
            raise ValueError(f"{self.where}: the item ends before its tensor's {len(buffer)} bytes")

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
                raise ValueError(f"{self.where}: the data file ends early")
            self._hash.update(data)
            self._hashed += len(data)

    def verify(self):
        if not self.checked:
            self._hash_from_file(self._sinfo.length)
            self.checked = True
            if self._hash.intdigest() != self._sinfo.xxh3_64:
                raise ValueError(f"{self.where} do not match the checksum saved with them: the file is "
                                 "damaged or from another save")


class ChecksummedReader(dcp.FileSystemReader):
    """DCP's FileSystemReader with a read loop of its own, hashing each item as it reads it rather
    than in a second pass over the bytes. torch.load on the meta device parses an item's header and
    says where its tensor's bytes lie; those are read in pieces, each hashed while in cache,
    straight into the target when the target is the whole chunk, contiguous on the CPU (one copy
    fewer than DCP's reader), else into a buffer copied from. DCP reads a stored item whole even
    when only part of it is wanted (a load at another TP degree), so every item read is verified,
    before it is committed (objects before they are handed on); a mismatch, also one that makes
    torch.load fail first, names the entry and the data file. A direct read has put a damaged
    tensor's bytes into its target by then: load_sharded(staged=True) reads into temporaries.

    It loads by the metadata its caller has read and checked (metadata.read_metadata), never reading
    .metadata itself: DCP's reader unpickles it with the full unpickler, and a concurrent save could
    have replaced it in between."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._entry_at = {(info.relative_path, info.offset): index.fqn for index, info in metadata.storage_data.items()}

    def _describe(self, sinfo) -> str:
        return (f"{self._entry_at[(sinfo.relative_path, sinfo.offset)]}: its bytes {sinfo.offset}.."
                f"{sinfo.offset + sinfo.length} in data file {sinfo.relative_path} of checkpoint {str(self.path)!r}")

    def read_data(self, plan, planner):
        per_file = {}
        for request in plan.items:
            sinfo = self.storage_data[request.storage_index]
            if sinfo.transform_descriptors:
                raise ValueError(f"{self._describe(sinfo)} were written with transforms {sinfo.transform_descriptors}, "
                                 "which save_sharded never uses")
            per_file.setdefault(sinfo.relative_path, []).append((sinfo, request))
        for relative_path, requests in per_file.items():
            fd = os.open(self.fs.concat_path(self.path, relative_path), os.O_RDONLY)
            try:
                for sinfo, request in sorted(requests, key=lambda pair: pair[0].offset):
                    item = _VerifyingView(fd, sinfo, self._describe(sinfo))
                    try:
                        self._read_item(item, request, planner)
                    except Exception:
                        if not item.checked:
                            item.verify()  # damaged bytes can make torch.load fail first: say so
                        raise
            finally:
                os.close(fd)
        future = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _read_item(item, request, planner):
        if request.type == LoadItemType.BYTE_IO:
            data = io.BytesIO(item.read())
            item.verify()
            planner.load_bytes(request, data)
            return
        # The item is a torch.save archive: torch.load on the meta device parses its header alone
        # and says where the tensor's bytes lie in it.
        stored = torch.load(item, map_location="meta", weights_only=True)
        storage = stored.untyped_storage()
        data_at = stored_data_offset(storage)
        if data_at is None:
            raise RuntimeError("this torch's torch.load does not say where a tensor's bytes lie (torch 2.11 to "
                               "2.14 do)")
        wanted = narrow_tensor_by_index(stored, request.storage_offsets, request.lengths)
        target = planner.resolve_tensor(request).detach()
        if target.shape != wanted.shape:
            raise ValueError(f"{item.where}: the stored chunk has shape {tuple(wanted.shape)} where the target "
                             f"has {tuple(target.shape)}")
        direct = (target.device.type == "cpu" and target.dtype == stored.dtype and target.is_contiguous()
                  and wanted.shape == stored.shape and stored.is_contiguous() and stored.storage_offset() == 0
                  and storage.nbytes() == target.numel() * target.element_size())
        buffer = target if direct else torch.empty(storage.nbytes(), dtype=torch.uint8)
        item.read_at(data_at, buffer.reshape(-1).view(torch.uint8).numpy())
        item.verify()
        if not direct:
            whole = torch.empty(0, dtype=stored.dtype).set_(buffer.untyped_storage(), stored.storage_offset(),
                                                            stored.shape, stored.stride())
            target.copy_(narrow_tensor_by_index(whole, request.storage_offsets, request.lengths))
        planner.commit_tensor(request, target)


def read_objects(path: str, metadata: Metadata, names) -> dict:
    """name -> the object stored under it in the checkpoint at path (metadata: its checked
    metadata), read and verified by this rank alone: DCP's steps of a load on one rank, without the
    collectives of dcp.load (which would wait for the other ranks, or with no_dist=True warn that
    torch.distributed is off)."""
    objects = dict.fromkeys(names)
    planner = LoadPlanner({})  # DCP's own, reading objects as data only
    reader = ChecksummedReader(path, metadata)
    planner.set_up_planner(objects, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    (plan,) = reader.prepare_global_plan(planner.create_global_plan([plan]))
    reader.read_data(planner.finish_plan(plan), planner).wait()
    return objects
