"""A checkpoint's .metadata is as trustworthy as its data: sealed with a checksum, checked for structure.

Damage anywhere (a flipped bit in .metadata or a data file, a field of the metadata changed and
sealed again, truncation, a missing seal) must be an error naming it with the module unchanged, or,
where nothing damaged is read, a bit-exact load; never a load of anything else. Single process: a
Toy at TP 1 (its stride-2 tensors are stored as two chunks each).
"""
import copy
import os
import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from fused_rl_ops.checkpoint import load_sharded, save_sharded
from fused_rl_ops.checkpoint.integrity import SEAL_LENGTH, seal_of
from tests.helpers.checkpoint import LAYOUT, Toy, flip_bits, logical_state, same_bits, stored_items, tensors_of

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")

SAVED, LOADED_BEFORE = logical_state(seed=1), logical_state(seed=2)


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ckpt")
    save_sharded(Toy(SAVED, 1, 0, step=7), path)
    return path


def _load(path, staged, target=None):
    """Loads path into a fresh Toy (or target); returns None for a bit-exact load of the saved values,
    else the exception, after checking that the module is unchanged where it should be."""
    target = target or Toy(LOADED_BEFORE, 1, 0, step=0)
    before = {name: t.clone() for name, t in tensors_of(target).items()}
    try:
        load_sharded(target, path, staged=staged)
    except Exception as exc:  # the callers say which errors they accept
        unchanged = all(same_bits(t, before[name]) for name, t in tensors_of(target).items())
        assert target.step == 0, exc
        assert unchanged or (not staged and "may be partially loaded" in str(exc)), exc
        return exc
    expected = tensors_of(Toy(SAVED, 1, 0, step=7))
    wrong = [name for name, t in tensors_of(target).items() if not same_bits(t, expected[name])]
    assert not wrong and target.step == 7, f"loaded without an error, but {wrong} (step {target.step}) differ"
    return None


def _metadata(path):
    with open(f"{path}/.metadata", "rb") as f:
        return pickle.load(f)


def _write_sealed(path, metadata):
    """Writes metadata as save_sharded does, sealed with its own checksum: damage the seal cannot see."""
    pickled = pickle.dumps(metadata)
    with open(f"{path}/.metadata", "wb") as f:
        f.write(pickled + seal_of(pickled))


def _damaged(path):
    return rf"checkpoint metadata {re.escape(path)}/\.metadata is damaged: "


def test_a_flipped_bit_anywhere_in_the_metadata_is_an_error_naming_it(saved):
    """Every byte of .metadata, one bit each (the bit moving with the position), on both load paths."""
    with open(f"{saved}/.metadata", "rb") as f:
        size = len(f.read())
    for position in range(size):
        mask = 1 << (position % 8)
        flip_bits(f"{saved}/.metadata", position, mask)
        error = _load(saved, staged=bool(position % 2))
        assert isinstance(error, ValueError) and re.search(_damaged(saved), str(error)), (position, error)
        flip_bits(f"{saved}/.metadata", position, mask)
    assert _load(saved, staged=True) is None


def test_a_flipped_bit_in_a_data_file_is_an_error_naming_the_item(saved):
    """A few hundred positions over the data file: every item's first and last byte and evenly
    spaced ones between. Every byte of an item is hashed as it is read, so each flip is an error
    naming its item; staged, the module stays unchanged; direct, the error says it may not be."""
    items = stored_items(saved)
    (data_file,) = {file for file, _, _, _ in items}
    size = os.path.getsize(f"{saved}/{data_file}")
    positions = sorted({p for _, start, end, _ in items for p in (start, end - 1)} | set(range(0, size, size // 200)))
    assert len(positions) > 200
    for i, position in enumerate(positions):
        mask = 1 << (i % 8)
        flip_bits(f"{saved}/{data_file}", position, mask)
        staged = bool(i % 2)
        error = _load(saved, staged)
        file, start, end, name = next(item for item in items if item[1] <= position < item[2])
        said = "left unchanged" if staged else "may be partially loaded"
        assert isinstance(error, RuntimeError), (position, error)
        assert re.search(rf"{said}.*{re.escape(name)}: its bytes {start}..{end} in data file {file} .* do not "
                         "match the checksum", str(error)), (position, error)
        flip_bits(f"{saved}/{data_file}", position, mask)
    assert _load(saved, staged=True) is None


def _int_fields(metadata):
    """(what, get, set) for every integer the load relies on: global shapes, chunk offsets and sizes,
    the stored items' offsets, lengths and checksums and their index's chunk offsets."""
    fields = []

    def tuple_fields(what, obj, attribute):
        for d in range(len(getattr(obj, attribute))):
            def get(obj=obj, d=d):
                return getattr(obj, attribute)[d]

            def put(value, obj=obj, d=d):
                old = getattr(obj, attribute)
                object.__setattr__(obj, attribute, torch.Size((*old[:d], value, *old[d + 1:])))
            fields.append((f"{what}.{attribute}[{d}]", get, put))

    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            tuple_fields(name, entry, "size")
            for c, chunk in enumerate(entry.chunks):
                tuple_fields(f"{name} chunk {c}", chunk, "offsets")
                tuple_fields(f"{name} chunk {c}", chunk, "sizes")
    for index, info in metadata.storage_data.items():
        if index.offset is not None:
            tuple_fields(f"{index.fqn} item", index, "offset")
        for attribute in ("offset", "length", "xxh3_64"):
            fields.append((f"{index.fqn} item {attribute}", lambda info=info, a=attribute: getattr(info, a),
                           lambda value, info=info, a=attribute: setattr(info, a, value)))
    return fields


def test_every_field_flipped_and_sealed_again_is_caught_by_the_structure_checks(saved):
    """A field changed with the seal recomputed (as a bug or a copy tool could leave it) is caught by
    what the metadata says of itself, the data files and the module: each integer the load relies on,
    one bit at a time (low, middle and high bits), is an error naming the checkpoint, as is a data
    file name with a flipped letter."""
    metadata = _metadata(saved)
    fields = _int_fields(metadata)
    assert len(fields) > 100
    for what, get, put in fields:
        original = get()
        for bit in (0, 3, 12, 40):
            put(original ^ (1 << bit))
            _write_sealed(saved, metadata)
            error = _load(saved, staged=bool(bit % 2))
            put(original)
            assert isinstance(error, (ValueError, OSError, RuntimeError)) and saved in str(error), (what, bit, error)
    # A data file name with a flipped letter points to no file.
    for info in metadata.storage_data.values():
        info.relative_path = info.relative_path.replace("distcp", "distcq")
    _write_sealed(saved, metadata)
    assert re.search(r"data file __0_\w+\.distcq does not exist", str(_load(saved, staged=True)))


def _moved_chunk(path, name, new_offset):
    """The metadata with the second chunk of name moved to new_offset rows (its item's index too, as
    one flipped bit in a shared pickled object moves both), sealed again."""
    metadata = _metadata(path)
    chunk = metadata.state_dict_metadata[name].chunks[1]
    index = next(i for i in metadata.storage_data if i.fqn == name and i.offset == chunk.offsets)
    moved = torch.Size((new_offset, *chunk.offsets[1:]))
    object.__setattr__(chunk, "offsets", moved)
    info = metadata.storage_data.pop(index)
    metadata.storage_data[MetadataIndex(name, moved, index.index)] = info
    _write_sealed(path, metadata)
    return metadata


@pytest.mark.parametrize("staged", [False, True])
def test_a_moved_chunk_offset_is_damage_not_rows_never_written(saved, staged):
    """fc1.weight (32 rows, stored as [W ; V], two chunks of 16) with its second chunk moved: past the
    tensor's rows, half of it would never be written (staged: left as uninitialised memory); inside
    them, chunks overlap and rows are missing. Both are errors before anything is read."""
    original = _metadata(saved)
    _moved_chunk(saved, "fc1.weight", 48)
    error = _load(saved, staged)
    assert re.search(_damaged(saved) + r"fc1.weight: its chunk at offsets \(48, 0\) of sizes \(16, 6\) lies outside",
                     str(error)), error
    _moved_chunk(saved, "fc1.weight", 8)
    assert re.search(_damaged(saved) + r"fc1.weight: its chunks .* leave holes and overlap", str(_load(saved, staged)))
    # The same move without sealing again: the checksum catches it before anything is unpickled.
    pickled = pickle.dumps(_moved_chunk(saved, "fc1.weight", 48))
    with open(f"{saved}/.metadata", "wb") as f:
        f.write(pickled + seal_of(pickle.dumps(original)))
    error = _load(saved, staged)
    assert re.search(_damaged(saved) + "its bytes do not match the checksum sealed with them", str(error)), error


@pytest.mark.parametrize("staged", [False, True])
def test_stored_items_that_overlap_or_leave_gaps_are_damage(saved, staged):
    """Items of a data file that do not lie back to back from its first byte, their lengths still
    adding up to the file's size: one item's range moved by a byte, or two items swapping lengths."""
    metadata = _metadata(saved)
    infos = sorted(metadata.storage_data.items(), key=lambda item: item[1].offset)
    (_, first), (second_index, second) = infos[0], infos[1]
    second.offset -= 1
    _write_sealed(saved, metadata)
    assert re.search(_damaged(saved) + rf"{re.escape(second_index.fqn)}: its bytes .* overlap the item before",
                     str(_load(saved, staged)))
    second.offset += 1
    first.length, second.length = second.length, first.length
    _write_sealed(saved, metadata)
    assert re.search(_damaged(saved) + ".*: its bytes .* (overlap the item before|leave bytes .* to no item)",
                     str(_load(saved, staged)))


@pytest.mark.parametrize("staged", [False, True])
def test_truncated_files(saved, staged):
    """A data file one byte short, and a .metadata cut anywhere (in its seal or its pickle)."""
    good = {name: open(f"{saved}/{name}", "rb").read() for name in os.listdir(saved)}
    (data_file,) = [name for name in good if name.endswith(".distcp")]
    with open(f"{saved}/{data_file}", "r+b") as f:
        f.truncate(len(good[data_file]) - 1)
    assert re.search(rf"checkpoint .* is truncated: data file {data_file} has", str(_load(saved, staged)))
    with open(f"{saved}/{data_file}", "wb") as f:
        f.write(good[data_file])
    for cut in (1, SEAL_LENGTH - 1, SEAL_LENGTH, SEAL_LENGTH + 1, len(good[".metadata"]) // 2):
        with open(f"{saved}/.metadata", "wb") as f:
            f.write(good[".metadata"][:-cut])
        error = _load(saved, staged)
        assert isinstance(error, ValueError), (cut, error)
        # Cut at the seal's first byte, what is left is a whole pickle without a seal: refused as such.
        assert re.search(_damaged(saved) + "unreadable" if cut != SEAL_LENGTH else "no checksum for its metadata",
                         str(error)), (cut, error)


@pytest.mark.parametrize("staged", [False, True])
def test_metadata_without_a_checksum_is_refused(saved, staged):
    """An older save_sharded's checkpoint, or plain DCP's: its .metadata has no seal, so it cannot be
    verified. load_sharded refuses it, naming the file, and leaves the module unchanged; plain DCP
    still reads it, as it reads a sealed one."""
    full = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype, _, _ in LAYOUT}
    dcp.load(full, checkpoint_id=saved)
    assert all(same_bits(full[name], SAVED[name]) for name in full)
    with open(f"{saved}/.metadata", "rb") as f:
        unsealed = f.read()[:-SEAL_LENGTH]
    with open(f"{saved}/.metadata", "wb") as f:
        f.write(unsealed)
    error = _load(saved, staged)
    assert re.search(rf"has no checksum for its metadata {re.escape(saved)}/\.metadata: it was not written by "
                     r"save_sharded, or by one from before .metadata had a checksum, so it cannot be verified",
                     str(error)), error
    full = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype, _, _ in LAYOUT}
    dcp.load(full, checkpoint_id=saved)
    assert all(same_bits(full[name], SAVED[name]) for name in full)


def test_metadata_that_is_no_dcp_metadata_is_damage(saved):
    """Sealed objects of the wrong kind where the metadata or its parts belong, or parts missing."""
    metadata = _metadata(saved)
    assert re.search(_damaged(saved) + "it holds no DCP metadata", str(_sealed_load(saved, {"not": "metadata"})))
    broken = copy.deepcopy(metadata)
    broken.state_dict_metadata["column.weight"] = "a string"
    assert re.search(_damaged(saved) + "column.weight: neither a tensor nor bytes", str(_sealed_load(saved, broken)))
    broken = copy.deepcopy(metadata)
    del broken.storage_data[next(i for i in broken.storage_data if i.fqn == "row.weight")].length
    assert re.search(_damaged(saved) + r"row.weight: its storage \(data file '__0_\w+.distcp', offset \d+, length None",
                     str(_sealed_load(saved, broken)))
    broken = copy.deepcopy(metadata)
    del broken.storage_data[next(i for i in broken.storage_data if i.fqn == "norm.weight")]
    assert re.search(_damaged(saved) + r"its stored items do not match its entries: nothing stored for "
                                       r"\[.*fqn='norm.weight'", str(_sealed_load(saved, broken)))


def _sealed_load(path, metadata):
    _write_sealed(path, metadata)
    return _load(path, staged=True)


class _LeavesATrace:
    """Unpickled by Python's full unpickler, calls open(path, "w"): the file is the trace of code run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


_OPEN = rf"{open.__module__}\.{open.__qualname__}"


@pytest.mark.parametrize("where", ["whole file", "planner_data", "an item's data file"])
def test_metadata_that_would_run_code_is_refused_naming_it(saved, tmp_path, where):
    """A .metadata crafted to call open when unpickled, sealed with the package's own seal_of so
    that the seal matches: as the whole file, as a field the load never looks at (its structure
    checks would pass), and as a field the structure checks would reject only after unpickling.
    The load refuses it naming the function, nothing is called, and the module is unchanged."""
    trace = tmp_path / "trace"
    metadata = _metadata(saved)
    if where == "whole file":
        metadata = _LeavesATrace(str(trace))
    elif where == "planner_data":
        metadata.planner_data = _LeavesATrace(str(trace))
    else:
        next(iter(metadata.storage_data.values())).relative_path = _LeavesATrace(str(trace))
    error = _sealed_load(saved, metadata)
    assert not trace.exists()
    assert isinstance(error, ValueError) and re.search(
        rf"checkpoint metadata {re.escape(saved)}/\.metadata is refused: it names {_OPEN}, which is none of the "
        "classes DCP's metadata is made of", str(error)), error


def test_a_stored_object_that_would_run_code_is_refused_naming_it(tmp_path):
    """Objects are read as data only, both ways the loader reads them: a module's extra state (read
    with the tensors) and an optimizer's param group (read ahead of them), each saved by
    save_sharded itself, so every checksum matches. The load refuses each naming the function,
    nothing is called, and the same checkpoint without the crafted object loads."""
    trace, path = tmp_path / "trace", str(tmp_path / "ckpt")
    save_sharded(Toy(SAVED, 1, 0, step={"count": 7, "note": _LeavesATrace(str(trace))}), path)
    for staged in (False, True):
        error = _load(path, staged)
        assert isinstance(error, RuntimeError) and re.search(
            rf"_extra_state: the object stored for it is refused: it names {_OPEN}, which "
            r"torch.load\(weights_only=True\) does not allow", str(error)), error
    assert not trace.exists()

    module = Toy(SAVED, 1, 0, step=7).requires_grad_(True)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    optimizer.param_groups[0]["note"] = _LeavesATrace(str(trace))
    save_sharded(module, path, optimizer=optimizer)
    target = Toy(LOADED_BEFORE, 1, 0, step=0).requires_grad_(True)
    with pytest.raises(ValueError, match=rf"reading the optimizer's objects from checkpoint {re.escape(repr(path))} failed: "
                                         rf".*/optimizer/param_group: the object stored for it is refused: it names "
                                         rf"{_OPEN}"):
        load_sharded(target, path, optimizer=torch.optim.SGD(target.parameters(), lr=0.1))
    assert not trace.exists() and target.step == 0
    optimizer.param_groups[0]["note"] = "plain data"
    save_sharded(module, path, optimizer=optimizer)
    assert _load(path, staged=False) is None
