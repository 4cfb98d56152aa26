"""--tp N (bench_chosen_logprob: chosen_logprob and top_logprobs; bench_vocab_divergence): the cost of
batch_invariant=True at tensor-parallel degree N, against the default path at the same degree, on
the CPU. Each op runs forward+backward over N ranks on gloo (fused_rl_ops.testing.distributed's
run_distributed: one process per rank, started together), every rank with the whole batch and its
[V/N, H] vocab shard of the weights, fp32, at (2048, 512, 16384) and (2048, 512, 32768) (--quick:
(128, 64, 2048) and (128, 64, 4096)). Each rank runs ONE thread (run_distributed sets it): on a
2-core machine TP 2 takes both cores, and the op's GEMMs are single-threaded.

Time: after a warm-up call of each path, interleaved rounds (each times the default path, then the
invariant one), every call started on all ranks together (a barrier) and timed as the slowest rank's;
the median and IQR over the rounds. Memory: the most bytes torch's allocator held at once during one
more call of each path on each rank, beyond what it held before (inputs; outputs and gradients
included: benchmarks.peak_memory.peak_allocated, exact where the resident memory moves
with the heap), the largest over the ranks; extra_MiB is the invariant path's over the default's
(both make the same outputs and gradients).
extra_MiB_growth, on the larger V of a shape pair, is how much extra_MiB grew from the smaller V,
beside how much the rank's weight shard grew (a cost that scales with V would be a multiple of it).
The goals (issue 45), reported and never asserted, judged by no --quick run (goals.py): the invariant
path at most 1.10x the default's time, and its extra memory independent of V (extra_MiB_growth at
most 1/16 of the weight shard's growth). The plot (--json PATH -> PATH.png) draws both paths' times
and extra peak memory per row."""
import json
import os
import tempfile

import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops.testing.distributed import run_distributed
from .peak_memory import peak_allocated

from . import goals
from .chosen_logprob_paths import make_inputs
from .load import LoadProbe, is_busy, own_cpu_seconds
from .plots import bars_figure
from .results import png_path, write_json
from .tables import print_row, summary_table
from .timing import Timing, keep_freed_heap, record_times, time_call

SHAPES = [(2048, 512, 16384), (2048, 512, 32768)]
QUICK_SHAPES = [(128, 64, 2048), (128, 64, 4096)]
PATHS = {"default": False, "invariant": True}  # path -> batch_invariant
TOP_K = 20  # top_logprobs' k
GOALS = {
    "goal_invariant<=1.10x": ("batch_invariant=True at most 1.10x the default path's time at the same TP degree",
                              lambda r: r["invariant/default"] <= 1.10),
    "goal_extra_mem_flat_in_V": ("batch_invariant=True's extra peak memory independent of V: its growth from the "
                                 "smaller V at most 1/16 of the rank's weight shard's growth",
                                 lambda r: r["extra_MiB_growth"] <= r["weight_shard_MiB_growth"] / 16
                                 if "extra_MiB_growth" in r else None),
}


def _shard(weight, rank, tp):
    """This rank's rows of weight, a tensor of its own (the whole weight is freed)."""
    rows = weight.shape[0] // tp
    return weight[rank * rows:(rank + 1) * rows].clone()


def _fwd_bwd(inputs, forward):
    """A closure running forward() (differentiable outputs) and backward with fixed upstream gradients."""
    upstream = []

    def run():
        for t in inputs:
            t.grad = None
        outputs = forward()
        if not upstream:
            g = torch.Generator().manual_seed(2)
            upstream.extend(torch.randn(o.shape, generator=g) for o in outputs)
        torch.autograd.backward(outputs, upstream)

    return run


def chosen_logprob_call(rank, tp, N, H, V, batch_invariant):
    """chosen_logprob with entropy on this rank's vocab shard, forward+backward."""
    hidden, weight, tokens = make_inputs(N, H, V, torch.float32, "cpu")
    hidden, weight = hidden.requires_grad_(True), _shard(weight, rank, tp).requires_grad_(True)
    return _fwd_bwd([hidden, weight], lambda: fused_rl_ops.chosen_logprob(
        hidden, weight, tokens, return_entropy=True, tp_group=dist.group.WORLD, batch_invariant=batch_invariant))


def top_logprobs_call(rank, tp, N, H, V, batch_invariant):
    """top_logprobs (k TOP_K) on this rank's vocab shard, forward+backward of the logprobs."""
    hidden, weight, _ = make_inputs(N, H, V, torch.float32, "cpu")
    hidden, weight = hidden.requires_grad_(True), _shard(weight, rank, tp).requires_grad_(True)
    return _fwd_bwd([hidden, weight], lambda: fused_rl_ops.top_logprobs(
        hidden, weight, TOP_K, tp_group=dist.group.WORLD, batch_invariant=batch_invariant)[1:])


def vocab_divergence_call(rank, tp, N, H, V, batch_invariant):
    """vocab_divergence (forward_kl) of this rank's vocab shards of student and teacher, forward+backward."""
    hidden, weight, _ = make_inputs(N, H, V, torch.float32, "cpu")
    teacher_hidden, teacher_weight, _ = make_inputs(N, H, V, torch.float32, "cpu", seed=1)
    hidden, weight = hidden.requires_grad_(True), _shard(weight, rank, tp).requires_grad_(True)
    teacher_weight = _shard(teacher_weight, rank, tp)
    return _fwd_bwd([hidden, weight], lambda: (fused_rl_ops.vocab_divergence(
        hidden, weight, teacher_hidden, teacher_weight, kind="forward_kl", tp_group=dist.group.WORLD,
        batch_invariant=batch_invariant),))


CALLS = {"chosen_logprob": chosen_logprob_call, "top_logprobs": top_logprobs_call,
         "vocab_divergence": vocab_divergence_call}


def _largest_over_ranks(value: float, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def _time_on_ranks(runs: dict, reps: int):
    """name -> Timing of the slowest rank per call, over reps interleaved rounds, and the machine's
    load meanwhile (the other ranks' CPU time not counted as others')."""
    samples = {name: [] for name in runs}
    probe, own = LoadProbe().start(), own_cpu_seconds()
    for _ in range(reps):
        for name, run in runs.items():
            dist.barrier()
            samples[name].append(time_call(run, "cpu"))
    own = own_cpu_seconds() - own
    load = probe.stop(ranks_cpu_seconds=_largest_over_ranks(own, dist.ReduceOp.SUM) - own)
    slowest = torch.tensor(list(samples.values()), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {name: Timing(times) for name, times in zip(runs, slowest.tolist())}, load


def _rank_body(rank, tp, ops, shapes, reps, out_dir):
    keep_freed_heap()
    rows = []
    for op in ops:
        for N, H, V in shapes:
            runs = {path: CALLS[op](rank, tp, N, H, V, invariant) for path, invariant in PATHS.items()}
            for run in runs.values():
                run()  # warm-up
            row = {"op": op, "N": N, "H": H, "V": V, "tp": tp, "threads_per_rank": torch.get_num_threads(),
                   "dtype": "float32", "mode": "fwd+bwd"}
            for path, run in runs.items():
                row[f"{path}_MiB"] = _largest_over_ranks(peak_allocated(run)) / 2**20
            times, load = _time_on_ranks(runs, reps)
            record_times(row, times)
            row.update(load, busy=is_busy(load))
            rows.append(row)
            del runs
    if rank == 0:
        with open(os.path.join(out_dir, "rows.json"), "w") as f:
            json.dump(rows, f)


def add_ratios(rows: list) -> list:
    """invariant/default time, extra_MiB, the weight shard's MiB, and on the larger V of a shape
    pair the growth of extra_MiB and of the weight shard from the smaller."""
    for row in rows:
        row["invariant/default"] = row["invariant_ms"] / row["default_ms"]
        row["extra_MiB"] = row["invariant_MiB"] - row["default_MiB"]
        row["weight_shard_MiB"] = row["V"] // row["tp"] * row["H"] * 4 / 2**20
    for row in rows:
        smaller = [r for r in rows if (r["op"], r["N"], r["H"]) == (row["op"], row["N"], row["H"]) and r["V"] < row["V"]]
        if smaller:
            base = max(smaller, key=lambda r: r["V"])
            row["extra_MiB_growth"] = row["extra_MiB"] - base["extra_MiB"]
            row["weight_shard_MiB_growth"] = row["weight_shard_MiB"] - base["weight_shard_MiB"]
    return rows


COLUMNS = ["op", "N", "H", "V", "tp", "threads_per_rank", "default_ms", "invariant_ms", "invariant/default",
           "default_MiB", "invariant_MiB", "extra_MiB", "extra_MiB_growth", "weight_shard_MiB_growth"]


def _label(row) -> str:
    return "{op} V={V}".format(**row) + (" !" if row.get("busy") else "")


def run_tensor_parallel(benchmark, ops, args, log):
    """--tp of benchmark (its --quick and --json): ops (names in CALLS) at degree args.tp, on the CPU."""
    if args.device != "cpu":
        raise SystemExit(f"{benchmark} --tp: the ranks run on gloo, on the CPU (pass --device cpu)")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    with tempfile.TemporaryDirectory() as out_dir:
        run_distributed(_rank_body, args.tp, list(ops), shapes, 2 if args.quick else 5, out_dir)
        with open(os.path.join(out_dir, "rows.json")) as f:
            rows = add_ratios(json.load(f))
    for row in rows:
        print_row(log(f"tp{args.tp}", row), [c for c in COLUMNS if c in row])
    goals.judge(rows, GOALS, args.quick)
    table = summary_table(f"{', '.join(ops)}: batch_invariant=True against the default path at TP {args.tp} "
                          f"(fwd+bwd, fp32, {args.tp} gloo ranks of one thread each; time of the slowest rank; "
                          f"peak allocated per rank beyond the inputs)", rows, COLUMNS + goals.judged_columns(rows, GOALS))
    headline = [{"metric": f"{r['op']} batch_invariant=True / default time at TP {r['tp']}, fwd+bwd, "
                           f"N={r['N']} H={r['H']} V={r['V']}", "value": r["invariant/default"], "busy": r["busy"]}
                for r in rows]
    headline += [{"metric": f"{r['op']} batch_invariant=True extra peak memory per rank (MiB) at TP {r['tp']}, "
                            f"N={r['N']} H={r['H']} V={r['V']}", "value": r["extra_MiB"], "busy": False} for r in rows]
    plot_file = png_path(args.json)
    if plot_file:
        groups = [_label(r) for r in rows]
        bars_figure([{"title": "fwd+bwd time (ms), the slowest rank", "groups": groups, "ylabel": "ms",
                      "values": {path: [r[f"{path}_ms"] for r in rows] for path in PATHS}},
                     {"title": "peak allocated per rank (MiB)", "groups": groups, "ylabel": "MiB",
                      "values": {path: [r[f"{path}_MiB"] for r in rows] for path in PATHS}}],
                    f"batch_invariant=True against the default path at TP {args.tp} (CPU, one thread per rank)",
                    plot_file, busy=any(r["busy"] for r in rows))
    write_json(args.json, benchmark, "cpu", rows, headline=headline, tables=[table], plot=plot_file,
               goals=goals.described(GOALS, args.quick))
    goals.print_verdicts(rows, GOALS, args.quick)
