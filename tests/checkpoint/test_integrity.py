"""fused_rl_ops.checkpoint.integrity: failed loads, damaged data, a save killed part-way, the verifying reader.

Every failed load must leave the module unchanged on both load paths (staged or not), except a read
failing in the middle of a direct load, which must say the module may be partially loaded.
Multi-process checks run in real processes on gloo (fused_rl_ops.testing.distributed).
"""
import itertools
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from fused_rl_ops.checkpoint import integrity, load_sharded, save_load, save_sharded
from fused_rl_ops.checkpoint.metadata import read_metadata
from tests.helpers.checkpoint import (Toy, add_parameter, annotated, assert_all_same, data_file,
                                             die_after_file_operation, flip_bits, legacy, logical_state, random_bits,
                                             same_bits, stored_items, tensors_of, tp_group_of_size)
from fused_rl_ops.testing.distributed import run_distributed

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")


def _snapshot(module):
    return {name: t.clone() for name, t in tensors_of(module).items()}, module.step


def _assert_load_fails_untouched(path, exception, match, target=None, paths=(False, True)):
    """Loading fails with match and leaves target unchanged, on each of the given paths (staged or not)."""
    target = target or Toy(logical_state(seed=2), 2, dist.get_rank(), step=0)
    tensors, step = _snapshot(target)
    for staged in paths:
        with pytest.raises(exception, match=match):
            load_sharded(target, path, tp_group=dist.group.WORLD, staged=staged)
        assert all(same_bits(t, tensors[name]) for name, t in tensors_of(target).items()), staged
        assert target.step == step


def _on_rank_0(action):
    dist.barrier()
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _truncate_to_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _load_failures(rank, world_size, root):
    original = logical_state(seed=1)
    for name in ("good", "truncated", "no_data", "bad_metadata"):
        save_sharded(Toy(original, 2, rank, step=7), f"{root}/{name}", tp_group=dist.group.WORLD)

    _assert_load_fails_untouched(f"{root}/absent", FileNotFoundError, "no complete checkpoint at")
    rank_1_file, rank_0_file = data_file(f"{root}/truncated", 1), data_file(f"{root}/no_data", 0)
    _on_rank_0(lambda: _truncate_to_half(f"{root}/truncated/{rank_1_file}"))
    _assert_load_fails_untouched(f"{root}/truncated", ValueError, f"truncated: data file {rank_1_file}")
    _on_rank_0(lambda: os.remove(f"{root}/no_data/{rank_0_file}"))
    _assert_load_fails_untouched(f"{root}/no_data", FileNotFoundError, f"{rank_0_file} does not exist")
    _on_rank_0(lambda: _truncate_to_half(f"{root}/bad_metadata/.metadata"))
    _assert_load_fails_untouched(f"{root}/bad_metadata", ValueError, "unreadable")

    # Wrong shape or dtype in the last entry: the entries before it must not have been loaded.
    wrong_shape = Toy(logical_state(seed=2), 2, rank, step=0)
    add_parameter(wrong_shape, "gdn.conv.weight", torch.zeros(4, 1, 5), legacy(0))
    _assert_load_fails_untouched(f"{root}/good", ValueError,
                                 r"gdn.conv.weight: the checkpoint holds global shape \(8, 1, 4\)", wrong_shape)
    wrong_dtype = Toy(logical_state(seed=2), 2, rank, step=0)
    wrong_dtype.gdn.conv.weight.data = wrong_dtype.gdn.conv.weight.data.double()
    _assert_load_fails_untouched(f"{root}/good", ValueError, "gdn.conv.weight: the checkpoint holds torch.float32",
                                 wrong_dtype)
    extra_param = Toy(logical_state(seed=2), 2, rank, step=0)
    add_parameter(extra_param, "norm.bias", torch.zeros(6), {})
    _assert_load_fails_untouched(f"{root}/good", ValueError, r"missing \['norm.bias'\]", extra_param)

    # A degree that does not divide the sharded dim (6 rows at stride 2 over 2 ranks): refused from
    # the metadata alone, so it is still the error when the data files are gone.
    singleton = tp_group_of_size(1)
    glu = annotated((6, 4), legacy(0, 2), device="cpu").copy_(random_bits((6, 4), torch.float32, seed=5))
    save_sharded({"fc1.weight": glu}, f"{root}/six_rows", tp_group=singleton)
    data_files = [f"{root}/six_rows/{f}" for f in os.listdir(f"{root}/six_rows") if f.endswith(".distcp")]
    _on_rank_0(lambda: [os.remove(f) for f in data_files])
    two_ranks = torch.nn.Module()
    add_parameter(two_ranks, "fc1.weight", torch.zeros(4, 4), legacy(0, 2))
    for staged in (False, True):
        with pytest.raises(ValueError, match="fc1.weight: cannot be split across tensor-parallel degree 2: dim 0 has 6"):
            load_sharded(two_ranks, f"{root}/six_rows", tp_group=dist.group.WORLD, staged=staged)
        assert torch.equal(two_ranks.fc1.weight, torch.zeros(4, 4))

    # A read failing inside DCP on one rank, after its data arrived. Staged, nothing reaches any
    # module. Direct, the data is already in the module: the error must say so.
    reader = integrity.ChecksummedReader
    real_read = reader.read_data

    def read_then_fail(self, plan, planner):
        real_read(self, plan, planner).wait()
        raise OSError("disk went away")

    if rank == 1:
        reader.read_data = read_then_fail
    _assert_load_fails_untouched(f"{root}/good", RuntimeError, "left unchanged", paths=(True,))
    target = Toy(logical_state(seed=2), 2, rank, step=0)
    with pytest.raises(RuntimeError, match="may be partially loaded.*staged=True"):
        load_sharded(target, f"{root}/good", tp_group=dist.group.WORLD)
    reader.read_data = real_read
    expected = Toy(original, 2, rank, step=7)
    assert_all_same(target, expected)
    assert target.step == 0  # extra state is set only after a successful read

    # The same checkpoint still loads.
    target = Toy(logical_state(seed=2), 2, rank, step=0)
    load_sharded(target, f"{root}/good", tp_group=dist.group.WORLD)
    assert_all_same(target, Toy(original, 2, rank, step=7))

    _damaged_data(rank, root, original)


def _damaged_data(rank, root, original):
    """Checksums: a flipped byte in any data file, a data file from another save of the same model,
    a data file longer than its entries, a checkpoint without checksums, and another model's
    checkpoint. Every error names the entry or file; the staged path leaves the module unchanged."""
    save_sharded(Toy(logical_state(seed=3), 2, rank, step=9), f"{root}/other_save", tp_group=dist.group.WORLD)
    items = stored_items(f"{root}/good")
    # one flipped byte in the largest item of each data file: in its middle (tensor bytes, mostly)
    # and in its first byte (the archive's header, which makes DCP's read fail before the hash check)
    for file, where in itertools.product(sorted({item[0] for item in items}), ("middle", "first")):
        start, end, name = max((item[1:] for item in items if item[0] == file), key=lambda item: item[1] - item[0])
        damaged = f"{root}/flipped_{where}_{file}"
        position = (start + end) // 2 if where == "middle" else start

        def flip(damaged=damaged, file=file, position=position):
            shutil.copytree(f"{root}/good", damaged)
            flip_bits(f"{damaged}/{file}", position, 0x10)

        _on_rank_0(flip)
        expected = rf"{re.escape(name)}: its bytes {start}..{end} in data file {file} .* do not match the checksum"
        _assert_load_fails_untouched(damaged, RuntimeError, f"left unchanged.*{expected}", paths=(True,))
        with pytest.raises(RuntimeError, match=f"may be partially loaded.*{expected}"):
            load_sharded(Toy(logical_state(seed=2), 2, rank, step=0), damaged, tp_group=dist.group.WORLD)

    # The data of another save beside this save's .metadata: same sizes, other bytes.
    rank_1_file = data_file(f"{root}/good", 1)

    def mix():
        shutil.copytree(f"{root}/good", f"{root}/mixed")
        shutil.copy(f"{root}/other_save/{data_file(f'{root}/other_save', 1)}", f"{root}/mixed/{rank_1_file}")

    _on_rank_0(mix)
    _assert_load_fails_untouched(f"{root}/mixed", RuntimeError,
                                 rf"left unchanged.*: its bytes \d+\.\.\d+ in data file {rank_1_file}",
                                 paths=(True,))

    # Checked before anything is read, so both paths leave the module unchanged.
    rank_0_file = data_file(f"{root}/good", 0)

    def grow():
        shutil.copytree(f"{root}/good", f"{root}/longer")
        with open(f"{root}/longer/{rank_0_file}", "ab") as f:
            f.write(b"\0")

    _on_rank_0(grow)
    _assert_load_fails_untouched(f"{root}/longer", ValueError, f"inconsistent: data file {rank_0_file} has")
    dcp.save(Toy(original, 1, 0, step=7).state_dict(), checkpoint_id=f"{root}/plain_dcp",  # the logical tensors
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    _assert_load_fails_untouched(f"{root}/plain_dcp", ValueError, "no checksum for .* not written by save_sharded")
    another_model = torch.nn.Linear(6, 6)
    weight = another_model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"does not match the module: missing \['bias', 'weight'\], unexpected \[.*"):
        load_sharded(another_model, f"{root}/good", tp_group=dist.group.WORLD)
    assert same_bits(another_model.weight, weight)


def test_failed_loads_leave_the_module_unchanged(tmp_path):
    """Missing, truncated or damaged checkpoints and ones that do not fit the module fail naming the
    entry or file, with the module unchanged; a read failing mid-way in a direct load says the
    module may be partially loaded. One spawned run of 2 processes."""
    run_distributed(_load_failures, 2, str(tmp_path))


# --- saves killed at every step (SIGKILL), one rank and two ----------------------------------------

def _save_killed(rank, world_size, path, killed_rank, k):
    if rank == killed_rank:
        die_after_file_operation(k)
    save_sharded(Toy(logical_state(seed=3), world_size, rank, step=9), path, tp_group=dist.group.WORLD)


def _which_checkpoint(path, old, new):
    """"old" or "new": the checkpoint at path, loaded here at TP 1, bit for bit."""
    loaded = Toy(logical_state(seed=2), 1, 0, step=0)
    load_sharded(loaded, str(path))
    for name, expected in (("old", old), ("new", new)):
        wanted = tensors_of(expected)
        if loaded.step == expected.step and all(same_bits(t, wanted[n]) for n, t in tensors_of(loaded).items()):
            return name
    raise AssertionError(f"{path} holds neither the old nor the new checkpoint")


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_checkpoint(tmp_path, world_size):
    """A save over a checkpoint (saved from one rank) whose rank is SIGKILLed right after each of its
    file operations in turn, every rank in turn, until one runs to the end: after every kill the
    directory loads (here, at TP 1), bit for bit, as the old checkpoint until the commit and as the
    new one from then on; a finished save leaves only its own files, and loads after the directory
    is moved."""
    old, new = Toy(logical_state(seed=1), 1, 0, step=7), Toy(logical_state(seed=3), 1, 0, step=9)
    save_sharded(old, str(tmp_path / "old"))
    for killed_rank in range(world_size):
        seen = []
        for k in itertools.count(1):
            path = tmp_path / f"rank{killed_rank}_after{k}"
            shutil.copytree(tmp_path / "old", path)  # a checkpoint loads wherever it is copied
            try:
                run_distributed(_save_killed, world_size, str(path), killed_rank, k)
            except mp.ProcessExitedException as exc:
                assert "SIGKILL" in str(exc)
                seen.append(_which_checkpoint(path, old, new))
                continue
            seen.append(_which_checkpoint(path, old, new))
            break
        # The old checkpoint until the commit, the new one after it, and a kill at every step of both.
        assert seen == sorted(seen, key=["old", "new"].index) and seen[-1] == "new" and "old" in seen, seen
        if killed_rank == 0:  # the coordinator commits: the last kills come after it
            assert seen[-2] == "new", seen
    assert sorted(os.listdir(path)) == sorted({".metadata", *(file for file, *_ in stored_items(path))})
    os.rename(path, tmp_path / "moved")
    assert _which_checkpoint(tmp_path / "moved", old, new) == "new"


def _save_toy(rank, world_size, path, seed):
    save_sharded(Toy(logical_state(seed=seed), world_size, rank, step=seed), path, tp_group=dist.group.WORLD)


def test_a_save_over_a_larger_checkpoint_leaves_only_its_own_files(tmp_path):
    """A save at 2 ranks over a checkpoint saved at 4: the directory then holds the new .metadata and
    the 2 data files it names, and loads as the new checkpoint."""
    path = str(tmp_path / "ckpt")
    run_distributed(_save_toy, 4, path, 1)
    assert len([f for f in os.listdir(path) if f.endswith(".distcp")]) == 4
    run_distributed(_save_toy, 2, path, 3)
    files = {file for file, *_ in stored_items(path)}
    assert len(files) == 2 and sorted(os.listdir(path)) == sorted({".metadata", *files})
    old, new = Toy(logical_state(seed=1), 1, 0, step=1), Toy(logical_state(seed=3), 1, 0, step=3)
    assert _which_checkpoint(path, old, new) == "new"


# --- the verifying reader and writer, alone -------------------------------------------------------

def _reader_state():
    """A tensor over the reader's in-place hashing threshold, a small bf16 tensor and a pickled
    object."""
    return {"big": random_bits((300, 400), torch.float32, 1), "small": random_bits((7,), torch.bfloat16, 2),
            "obj": "note " * 40}


def _reader_targets():
    return {"big": torch.zeros(300, 400), "small": torch.zeros(7, dtype=torch.bfloat16), "obj": ""}


def test_verifying_reader_loads_bit_exact(tmp_path):
    """ChecksummedReader reads tensors straight into contiguous targets and through a buffer into
    strided and other-dtype ones, and hands on pickled objects, all bit-exact."""
    state, good = _reader_state(), str(tmp_path / "good")
    dcp.save(state, storage_writer=integrity.ChecksummedWriter(good))
    target = _reader_targets()
    dcp.load(target, storage_reader=integrity.ChecksummedReader(good, read_metadata(good)))
    assert same_bits(target["big"], state["big"]) and same_bits(target["small"], state["small"])
    assert target["obj"] == state["obj"]
    odd = {"empty": torch.empty(0, 5), "scalar": torch.tensor(2.5, dtype=torch.float64),
           "mask": torch.tensor([True, False, True]), "ids": torch.arange(-3, 9),
           "half": random_bits((5, 3), torch.float16, 3)}
    dcp.save(odd, storage_writer=integrity.ChecksummedWriter(str(tmp_path / "odd")))
    into = {"empty": torch.ones(0, 5), "scalar": torch.tensor(0.0, dtype=torch.float64),
            "mask": torch.zeros(3, dtype=torch.bool), "ids": torch.zeros(12, dtype=torch.int32),
            "half": torch.zeros(3, 5, dtype=torch.float16).t()}
    odd_path = str(tmp_path / "odd")
    dcp.load(into, storage_reader=integrity.ChecksummedReader(odd_path, read_metadata(odd_path)))
    assert all(torch.equal(into[name].to(t.dtype), t) for name, t in odd.items() if name != "half")
    assert same_bits(into["half"], odd["half"])


def test_writer_skips_the_zip_crc32_only_while_it_writes(tmp_path, monkeypatch):
    """The writer turns torch.save's CRC32 off for its own writes (its XXH3 covers those bytes) and
    gives the caller's setting back, also when writing fails."""
    seen = []
    real_write_data = dcp.FileSystemWriter.write_data

    def recording_write_data(self, plan, planner):
        seen.append(torch.serialization.get_crc32_options())
        return real_write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", recording_write_data)
    dcp.save(_reader_state(), storage_writer=integrity.ChecksummedWriter(str(tmp_path / "ok")))
    assert seen == [False] and torch.serialization.get_crc32_options()

    def failing_write_data(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", failing_write_data)
    with pytest.raises(dcp.api.CheckpointException) as failed:
        dcp.save(_reader_state(), storage_writer=integrity.ChecksummedWriter(str(tmp_path / "fail")))
    assert str(failed.value.failures[0][0]) == "disk full" and torch.serialization.get_crc32_options()


def test_load_reads_the_metadata_once_and_loads_by_what_it_checked(tmp_path, monkeypatch):
    """load_sharded reads and checks the checkpoint's .metadata once and hands that same metadata to
    DCP, rather than letting DCP read the file again (a save replacing it in between would load by
    metadata nobody checked)."""
    original, path = logical_state(seed=1), str(tmp_path / "ckpt")
    save_sharded(Toy(original, 1, 0, step=7), path)
    reads = []
    real_read_metadata, real_dcp_read_metadata = save_load.read_metadata, dcp.FileSystemReader.read_metadata

    def checking_read_metadata(path):
        reads.append("checked")
        return real_read_metadata(path)

    def dcp_read_metadata(self, *args, **kwargs):
        reads.append("dcp")
        return real_dcp_read_metadata(self, *args, **kwargs)

    monkeypatch.setattr(save_load, "read_metadata", checking_read_metadata)
    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", dcp_read_metadata)
    target = Toy(logical_state(seed=2), 1, 0, step=0)
    load_sharded(target, path)
    assert reads == ["checked"]
    expected = Toy(original, 1, 0, step=7)
    assert all(same_bits(t, tensors_of(expected)[name]) for name, t in tensors_of(target).items())
    assert target.step == 7


@pytest.mark.parametrize("where", ["first", "header", "data_start", "middle", "data_end", "last"])
def test_verifying_reader_catches_a_flip_anywhere_in_an_item(tmp_path, where):
    """ChecksummedReader hashes a tensor's data as it reads it into the target and the other bytes of
    the item separately: a flipped byte in either part, of a tensor larger than the in-place
    threshold, of a small tensor and of a pickled object, fails the load naming the entry (a damaged
    object is never handed on)."""
    state, good = _reader_state(), str(tmp_path / "good")
    dcp.save(state, storage_writer=integrity.ChecksummedWriter(good))
    for file, start, end, name in stored_items(good):
        data_bytes = state[name].numel() * state[name].element_size() if name != "obj" else 0
        position = {"first": start, "header": start + 40, "middle": (start + end) // 2, "last": end - 1}.get(where)
        if where in ("data_start", "data_end"):
            if not data_bytes:
                continue
            raw = open(f"{good}/{file}", "rb").read()[start:end]
            data_at = raw.find(state[name].contiguous().view(torch.uint8).numpy().tobytes())
            assert data_at > 0
            position = start + data_at + (0 if where == "data_start" else data_bytes - 1)
        damaged = tmp_path / f"damaged_{name}"
        shutil.copytree(good, damaged)
        flip_bits(damaged / file, position, 0x01)
        fresh = _reader_targets()
        with pytest.raises(dcp.CheckpointException, match=rf"{name}: its bytes {start}..{end} in data file {file} "
                                                         r".* do not match the checksum"):
            dcp.load(fresh, storage_reader=integrity.ChecksummedReader(str(damaged), read_metadata(str(damaged))))
        assert fresh["obj"] == ""
        shutil.rmtree(damaged)
