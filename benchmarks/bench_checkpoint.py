"""Checkpoint adapter: save_sharded / load_sharded against plain DCP of the same state dict, at TP=2 on gloo.

The model is Megatron-shaped (fp32): per layer a column-parallel QKV, a row-parallel projection, a
column-parallel GLU fc1 with partition stride 2 and a row-parallel fc2, with replicated norms and
row biases; plus a vocab-parallel embedding; sized to about --params parameters in all. Plain DCP
saves the same local tensors wrapped as DTensors (Shard / Replicate) and loads them back into
DTensors; the adapter reads the legacy attributes, checks the TP ranks agree, checksums the
replicated tensors (save) or checks the checkpoint against the module (load), writes or reads
stride-2 tensors as two chunks, and hashes every stored item (XXH3) as it writes it or verifies
it before reading it; it skips the zip CRC32 that torch.save computes for plain DCP (and that
torch.load never checks). Times are medians over --reps, each save or load between barriers; the
files land on the disk under --dir (fsync'd by DCP's FileSystemWriter, for both)
and are read back from the page cache.

save_checksum_s / load_checksum_s are the parts of the adapter's save_s / load_s spent hashing,
timed around every hash call on rank 0; checksum_%_of_plain is that time against plain DCP's
save or load.

load_s is load_sharded's default path, which reads each stored chunk straight into its parameter
(plain DCP's reader loads it into a new tensor and copies that over); staged_load_s is
load_sharded(..., staged=True), which reads into fresh temporaries and copies them into the
parameters (the price of surviving an I/O error or a damaged item mid-read unchanged). At
page-cache speed on the CPU, where filling fresh memory means page faults, that copy is most of
the staged path's overhead; with parameters on a GPU the temporaries come from the caching
allocator and copy at device speed. The plot (--json PATH -> PATH.png) draws save and load times
per path."""
import itertools
import math
import os
import shutil
import tempfile
import time

import torch

from fused_rl_ops.testing.distributed import run_distributed

from .load import LoadProbe, busy_note, is_busy
from .plots import bars_figure
from .results import parse_args, png_path, write_json
from .tables import summary_table

TP = 2
LAYERS = 4
VOCAB = 32768


def _hidden_size_for(params: int) -> int:
    """h with LAYERS * 16 h^2 + VOCAB * h close to params, a multiple of 16."""
    h = (-VOCAB + math.sqrt(VOCAB**2 + 4 * 16 * LAYERS * params)) / (2 * 16 * LAYERS)
    return max(16, int(round(h / 16)) * 16)


class MegatronShapedModel(torch.nn.Module):
    """This TP rank's shards, with Megatron's legacy attributes; replicated tensors equal on all ranks."""

    def __init__(self, hidden: int, tp_rank: int):
        super().__init__()
        self._seeds = itertools.count()
        self._tp_rank = tp_rank
        self.embedding = self._param((VOCAB // TP, hidden), dim=0)
        self.layers = torch.nn.ModuleList()
        for _ in range(LAYERS):
            layer = torch.nn.Module()
            layer.norm1 = self._param((hidden,))
            layer.qkv_weight = self._param((3 * hidden // TP, hidden), dim=0)
            layer.qkv_bias = self._param((3 * hidden // TP,), dim=0)
            layer.proj_weight = self._param((hidden, hidden // TP), dim=1)
            layer.proj_bias = self._param((hidden,))
            layer.norm2 = self._param((hidden,))
            layer.fc1_weight = self._param((8 * hidden // TP, hidden), dim=0, stride=2)
            layer.fc1_bias = self._param((8 * hidden // TP,), dim=0, stride=2)
            layer.fc2_weight = self._param((hidden, 4 * hidden // TP), dim=1)
            layer.fc2_bias = self._param((hidden,))
            self.layers.append(layer)

    def _param(self, shape, dim=None, stride=1):
        # shards differ per rank; replicated tensors are seeded alike on every rank
        generator = torch.Generator().manual_seed(10 * next(self._seeds) + (self._tp_rank if dim is not None else 0))
        param = torch.nn.Parameter(torch.randn(shape, generator=generator), requires_grad=False)
        param.tensor_model_parallel = dim is not None
        param.partition_dim = -1 if dim is None else dim
        param.partition_stride = stride
        return param


def _plain_dcp_state(model, mesh) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    state = {}
    for name, param in model.state_dict(keep_vars=True).items():
        placement = Shard(param.partition_dim) if param.tensor_model_parallel else Replicate()
        state[name] = DTensor.from_local(param.detach(), mesh, [placement], run_check=False)
    return state


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


class _TimedHashing:
    """Stands in for the xxhash module used by fused_rl_ops.checkpoint_integrity, adding up the
    time spent hashing."""

    def __init__(self, real):
        self.real = real
        self.seconds = 0.0

    def _timed(self, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        self.seconds += time.perf_counter() - start
        return result

    def xxh3_64_intdigest(self, data):
        return self._timed(self.real.xxh3_64_intdigest, data)

    def xxh3_64(self):
        hasher = self.real.xxh3_64()
        timed = self

        class Hasher:
            def update(self, data):
                timed._timed(hasher.update, data)

            def intdigest(self):
                return hasher.intdigest()

        return Hasher()


def _worker(rank, world_size, hidden, reps, root, results_path):
    import statistics

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import init_device_mesh

    from fused_rl_ops.checkpoint import integrity as checkpoint_integrity
    from fused_rl_ops.checkpoint import load_sharded, save_sharded

    timed_hashing = checkpoint_integrity.xxhash = _TimedHashing(checkpoint_integrity.xxhash)

    model = MegatronShapedModel(hidden, rank)
    mesh = init_device_mesh("cpu", (world_size,))
    plain_state = _plain_dcp_state(model, mesh)
    operations = {
        ("plain", "save"): lambda path: dcp.save(plain_state,
                                                 storage_writer=dcp.FileSystemWriter(path, overwrite=True)),
        ("adapter", "save"): lambda path: save_sharded(model, path, tp_group=dist.group.WORLD),
        ("plain", "load"): lambda path: dcp.load(plain_state, checkpoint_id=path),
        ("adapter", "load"): lambda path: load_sharded(model, path, tp_group=dist.group.WORLD),
        ("adapter", "staged_load"): lambda path: load_sharded(model, path, tp_group=dist.group.WORLD, staged=True),
    }
    times = {key: [] for key in operations}
    checksum_times = {key: [] for key in operations}
    for _ in range(reps + 1):  # the first round warms up
        for (writer, op), run in operations.items():
            path = f"{root}/{writer}"
            dist.barrier()
            timed_hashing.seconds = 0.0
            start = time.perf_counter()
            run(path)
            dist.barrier()
            times[(writer, op)].append(time.perf_counter() - start)
            checksum_times[(writer, op)].append(timed_hashing.seconds)
    if rank == 0:
        params = sum(p.numel() * (TP if p.tensor_model_parallel else 1) for p in model.parameters())
        rows = []
        for writer in ("plain", "adapter"):
            rows.append({"writer": writer, "params": params, "hidden": hidden, "tp": TP,
                         "save_s": statistics.median(times[(writer, "save")][1:]),
                         "load_s": statistics.median(times[(writer, "load")][1:]),
                         "bytes_written": _directory_bytes(f"{root}/{writer}")})
        rows[1]["staged_load_s"] = statistics.median(times[("adapter", "staged_load")][1:])
        rows[1]["save_checksum_s"] = statistics.median(checksum_times[("adapter", "save")][1:])
        rows[1]["load_checksum_s"] = statistics.median(checksum_times[("adapter", "load")][1:])
        torch.save(rows, results_path)


def main():
    def options(parser):
        parser.add_argument("--params", type=float, default=1e8, help="model size in parameters (default 1e8)")
        parser.add_argument("--reps", type=int, default=5, help="timed rounds after one warm-up (default 5)")
        parser.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")

    args = parse_args(__doc__, options)
    reps = 1 if args.quick else args.reps
    params = 1e6 if args.quick else args.params
    root = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir)
    probe = LoadProbe().start()
    try:
        results_path = os.path.join(root, "results.pt")
        run_distributed(_worker, TP, _hidden_size_for(int(params)), reps, root, results_path)
        rows = torch.load(results_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = probe.stop()
    for row in rows:
        row.update(load, busy=is_busy(load))
    plain, adapter = rows
    for row in rows:
        row["save_overhead_%"] = 100 * (row["save_s"] / plain["save_s"] - 1)
        row["load_overhead_%"] = 100 * (row["load_s"] / plain["load_s"] - 1)
    adapter["staged_load_overhead_%"] = 100 * (adapter["staged_load_s"] / plain["load_s"] - 1)
    adapter["save_checksum_%_of_plain"] = 100 * adapter["save_checksum_s"] / plain["save_s"]
    adapter["load_checksum_%_of_plain"] = 100 * adapter["load_checksum_s"] / plain["load_s"]
    table = summary_table(f"checkpoint at TP={TP} on gloo, {adapter['params'] / 1e6:.1f}M parameters (fp32), "
                          f"medians of {reps}", rows, ["writer", "params", "save_s", "load_s", "staged_load_s",
                                                       "bytes_written", "save_overhead_%", "load_overhead_%",
                                                       "staged_load_overhead_%", "save_checksum_s",
                                                       "load_checksum_s", "save_checksum_%_of_plain",
                                                       "load_checksum_%_of_plain"])
    if adapter["busy"]:
        print("  ! " + busy_note(adapter))
    plot_file = png_path(args.json)
    if plot_file:
        bars_figure([{"groups": ["save", "load", "staged load"], "ylabel": "seconds",
                      "values": {row["writer"]: [row["save_s"], row["load_s"], row.get("staged_load_s")]
                                 for row in rows}}],
                    f"checkpoint save / load, TP={TP} on gloo, {adapter['params'] / 1e6:.1f}M fp32 parameters",
                    plot_file, busy=adapter["busy"])
    headline = [{"metric": f"adapter {op} overhead over plain DCP (%)", "value": adapter[f"{op}_overhead_%"],
                 "busy": adapter["busy"]} for op in ("save", "load", "staged_load")]
    write_json(args.json, "checkpoint", "cpu", rows, headline=headline, tables=[table], plot=plot_file, reps=reps)


if __name__ == "__main__":
    main()
