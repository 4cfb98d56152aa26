"""A checkpoint's `.metadata`, read so that nothing in it is used unchecked.

read_metadata verifies the file's seal (integrity.py), unpickles it with an unpickler that builds
only the classes DCP's metadata is made of (the seal is a checksum, which anyone can compute, so
bytes that match it are no more trusted: a class outside the list is refused before anything calls
it), then checks the metadata against itself: every tensor's chunks tile its global shape exactly (inside it, no holes,
no overlaps), every chunk and object has exactly one stored item and every item belongs to one, and
the items of each data file lie back to back from its first byte, as DCP writes them.
check_data_files then checks the files on disk against it. Damage is a ValueError naming the file.
"""
import bisect
import io
import os
import pathlib
import pickle
import pickletools

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

from ._torch_private import MEM_FORMAT_ENCODING, StorageInfo, get_layout
from .integrity import METADATA, SEAL_LENGTH, SEAL_PREFIX, seal_of

__all__ = ["check_data_files", "read_metadata"]

_HEX_DIGITS = frozenset(b"0123456789abcdef")

# Everything a genuine .metadata names (the same on torch 2.11 and 2.14), under the name pickle
# stores it by: DCP's metadata dataclasses, torch.Size, dtypes, the layout (rebuilt by name), the
# memory-format encoding, and the checkpoint's path.
_METADATA_CLASSES = (Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata, BytesStorageMetadata,
                     ChunkStorageMetadata, TensorProperties, MEM_FORMAT_ENCODING, StorageInfo, torch.Size, get_layout,
                     pathlib.PosixPath)
_METADATA_GLOBALS = {
    **{(c.__module__, c.__qualname__): c for c in _METADATA_CLASSES},
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # its name where Python < 3.13 saved it
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}


class _NotMetadata(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: any other global (a function a crafted pickle would
    call, a class of another package) is refused by name, unimported and uncalled."""

    def find_class(self, module: str, name: str):
        try:
            return _METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise _NotMetadata(f"{module}.{name}") from None


def read_metadata(path: str) -> Metadata:
    """The metadata of the checkpoint at path, once its seal and structure are found intact."""
    file = os.path.join(path, METADATA)
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"no complete checkpoint at {path!r}: its .metadata file does not exist (a first save there that did "
            "not finish leaves none)")
    with open(file, "rb") as f:
        pickled = _unsealed(f.read(), file, path)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(pickled)).load()
    except _NotMetadata as exc:
        raise ValueError(
            f"checkpoint metadata {file} is refused: it names {exc}, which is none of the classes DCP's metadata is "
            "made of: unpickling it could run code, so the load stopped there, before anything in it was called") from None
    except Exception as exc:  # cannot happen to bytes that match their seal, unless they were sealed damaged
        raise _damaged(file, f"unreadable: {exc!r}") from exc
    _check_structure(metadata, file)
    return metadata


def _damaged(file: str, reason: str) -> ValueError:
    return ValueError(f"checkpoint metadata {file} is damaged: {reason}")


def _unsealed(data: bytes, file: str, path: str) -> bytes:
    """data without its seal, once the seal is found to match it."""
    pickled, seal = data[:-SEAL_LENGTH], data[-SEAL_LENGTH:]
    if len(data) > SEAL_LENGTH and seal.startswith(SEAL_PREFIX) and set(seal[len(SEAL_PREFIX):]) <= _HEX_DIGITS:
        if seal != seal_of(pickled):
            raise _damaged(file, "its bytes do not match the checksum sealed with them")
        return pickled
    if _is_one_whole_pickle(data):  # and no seal: plain DCP's, or an older save_sharded's
        raise ValueError(
            f"checkpoint {path!r} has no checksum for its metadata {file}: it was not written by save_sharded, or "
            "by one from before .metadata had a checksum, so it cannot be verified and is not loaded "
            "(torch.distributed.checkpoint.load still reads it)")
    raise _damaged(file, "unreadable: it does not end in its checksum seal (truncated?)")


def _is_one_whole_pickle(data: bytes) -> bool:
    """Whether data is one pickle to its last byte, told from its opcodes (nothing is unpickled)."""
    try:
        return max(position for _, _, position in pickletools.genops(data)) == len(data) - 1
    except Exception:  # genops raises what the damaged opcode's argument parser raises
        return False


def _is_shape(value, ndim=None) -> bool:
    return (isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)
            and (ndim is None or len(value) == ndim))


def _tiling_problem(entry: TensorStorageMetadata):
    """Why entry's chunks do not tile its global shape exactly, or None when they do."""
    shape, chunks = getattr(entry, "size", None), getattr(entry, "chunks", None)
    if not _is_shape(shape):
        return f"its global shape {shape!r} is not a shape"
    if not isinstance(getattr(getattr(entry, "properties", None), "dtype", None), torch.dtype):
        return "it has no dtype"
    if not isinstance(chunks, list):
        return "it has no list of chunks"
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (_is_shape(offsets, len(shape)) and _is_shape(sizes, len(shape))):
            return f"a chunk's offsets {offsets!r} and sizes {sizes!r} do not fit a {len(shape)}-D tensor"
        if any(o + s > extent for o, s, extent in zip(offsets, sizes, shape)):
            return f"its chunk at offsets {tuple(offsets)} of sizes {tuple(sizes)} lies outside it ({tuple(shape)})"
    # Count how many chunks cover each cell of the grid that all chunk edges cut the tensor into.
    cuts = [sorted({0, extent} | {c.offsets[d] for c in chunks} | {c.offsets[d] + c.sizes[d] for c in chunks})
            for d, extent in enumerate(shape)]
    covered = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int64)
    for chunk in chunks:
        cells = tuple(slice(bisect.bisect_left(cut, o), bisect.bisect_left(cut, o + s))
                      for cut, o, s in zip(cuts, chunk.offsets, chunk.sizes))
        covered[cells] += 1
    if bool((covered != 1).any()):
        holes, overlaps = bool((covered == 0).any()), bool((covered > 1).any())
        said = " and ".join(w for w, found in (("leave holes", holes), ("overlap", overlaps)) if found)
        return f"its chunks {[(tuple(c.offsets), tuple(c.sizes)) for c in chunks]} {said} in its shape {tuple(shape)}"
    return None


def _check_structure(metadata, file: str):
    entries, stored = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not (isinstance(metadata, Metadata) and isinstance(entries, dict) and isinstance(stored, dict)):
        raise _damaged(file, "it holds no DCP metadata with entries and stored items")
    expected = set()
    for name, entry in entries.items():
        if not isinstance(name, str):
            raise _damaged(file, f"an entry is named {name!r}")
        if isinstance(entry, BytesStorageMetadata):
            expected.add(MetadataIndex(name))
            continue
        problem = _tiling_problem(entry) if isinstance(entry, TensorStorageMetadata) else "neither a tensor nor bytes"
        if problem:
            raise _damaged(file, f"{name}: {problem}")
        expected.update(MetadataIndex(name, chunk.offsets) for chunk in entry.chunks)
    if not all(isinstance(index, MetadataIndex) for index in stored):
        raise _damaged(file, "a stored item has no index of an entry")
    if stored.keys() != expected:
        unstored = sorted(str(i) for i in expected - stored.keys())
        unclaimed = sorted(str(i) for i in stored.keys() - expected)
        raise _damaged(file, f"its stored items do not match its entries: nothing stored for {unstored}, stored "
                             f"items of no entry {unclaimed}")
    _check_storage_ranges(stored, file)


def _check_storage_ranges(stored: dict, file: str):
    """Each item is a byte range of a data file, and the items of each file lie back to back from its
    first byte (DCP writes them so), so none overlaps another or lies past the others."""
    ranges = {}
    for index, info in stored.items():
        data_file, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
        checksum = getattr(info, "xxh3_64", None)
        plain_name = isinstance(data_file, str) and data_file == os.path.basename(data_file) and data_file not in (
            "", ".", "..")
        if not (plain_name and type(offset) is int and type(length) is int and offset >= 0 and length >= 0
                and (checksum is None or type(checksum) is int)):
            raise _damaged(file, f"{index.fqn}: its storage (data file {data_file!r}, offset {offset!r}, length "
                                 f"{length!r}, checksum {checksum!r}) is not a byte range of a file beside it")
        ranges.setdefault(data_file, []).append((offset, offset + length, index.fqn))
    for data_file, items in sorted(ranges.items()):
        end = 0
        for start, stop, name in sorted(items):
            if start != end:
                where = "overlap the item before" if start < end else f"leave bytes {end}..{start} to no item"
                raise _damaged(file, f"{name}: its bytes {start}..{stop} in data file {data_file} {where}")
            end = stop


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
