"""--contention (bench_chosen_logprob, bench_vocab_divergence): an op's CPU path with a core taken. At
one shape (default (2048, 512, 32768) fp32), forward+backward of the fused op and of its own GEMMs run
plainly (given by the benchmark: chosen_logprob's four, vocab_divergence's six), with 1 and 2
threads, on a quiet machine and with one busy process (a Python busy loop) that the benchmark starts
and stops itself, on two cores (this process's threads and the busy process pinned to the first two
it may use). Each round times every combination once (busy process on, then off), so the machine's
own noise falls on all of them alike; medians over the rounds. The goals (docs/chosen_logprob.md,
"Threads and a busy machine"): with the busy process the fused op takes at most 1.2x its GEMMs, and
two threads are never slower than one (quiet or busy). Reported, never asserted; a --quick run
judges none (goals.py)."""
import contextlib
import os
import subprocess
import sys
import time

import torch

from . import goals
from .chosen_logprob_paths import gemm_runs, make_inputs, path_fn, run_once
from .load import BUSY_OTHER_CORES, LoadProbe
from .results import write_json
from .tables import print_row, summary_table
from .timing import Timing, keep_freed_heap, time_call

SHAPE = (2048, 512, 32768)
THREADS = (1, 2)
LOADS = ("quiet", "busy")
GOALS = {
    "goal_busy<=1.2x_gemms": ("with one busy process on the two cores, the fused op at most 1.2x its own "
                              "GEMMs run plainly (same thread count)",
                              lambda r: r["fused/gemms"] <= 1.2 if r["contention"] == "busy" else None),
    "goal_2threads<=1thread": ("the fused op with two threads no slower than with one (quiet and busy)",
                               lambda r: r["fused_2/1_threads"] <= 1.0 if r["threads"] == 2 else None),
}


def two_cores() -> list:
    """The first two CPUs this process may run on (fewer where it may use fewer)."""
    return sorted(os.sched_getaffinity(0))[:2]


@contextlib.contextmanager
def pinned(cpus):
    """Every thread of this process (OpenMP's workers too) on cpus, the old masks restored after."""
    tasks = {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
    try:
        for tid in tasks:
            os.sched_setaffinity(tid, cpus)
        yield
    finally:
        for tid, mask in tasks.items():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, mask)


@contextlib.contextmanager
def busy_process(cpus, on=True):
    """A Python busy loop on cpus while the block runs, yielded (None where on is False)."""
    if not on:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(proc.pid, cpus)
        time.sleep(0.2)  # started and spinning before the first timed call
        yield proc
    finally:
        proc.kill()
        proc.wait()


def chosen_logprob_paths(N, H, V, dtype) -> dict:
    """chosen_logprob's "fused" forward+backward (logprob only) and "gemms", its four GEMMs
    (chosen_logprob_paths.gemm_runs' "fused fwd+bwd": the logits twice, the hidden and weight
    gradients, one torch.mm each)."""
    hidden, weight, tokens = make_inputs(N, H, V, dtype, "cpu")
    return {"fused": run_once(path_fn("fused", False, {}), "fwd+bwd", hidden, weight, tokens),
            "gemms": gemm_runs(hidden, weight)["fused fwd+bwd"]}


def measure_contention(N, H, V, dtype, reps, log, paths) -> list:
    """One row per (load, threads) of paths ("fused" and "gemms" closures at (N, H, V) in dtype):
    their median times (ms), fused/gemms, and the fused op's time with 2 threads over its time with
    1 on the same load; each row logged."""
    samples = {(load, t, p): [] for load in LOADS for t in THREADS for p in paths}
    probes = {load: [] for load in LOADS}
    threads_before, cpus = torch.get_num_threads(), two_cores()
    keep_freed_heap()
    try:
        with pinned(cpus):
            for rnd in range(reps + 1):  # round 0 warms every combination up, untimed
                for load in LOADS[::-1]:
                    with busy_process(cpus, on=load == "busy"):
                        probe = LoadProbe().start()
                        for t in THREADS:
                            torch.set_num_threads(t)
                            for p, fn in paths.items():
                                elapsed = time_call(fn, "cpu")
                                if rnd:
                                    samples[(load, t, p)].append(elapsed)
                        probes[load].append(probe.stop())
    finally:
        torch.set_num_threads(threads_before)
    rows = []
    for load in LOADS:
        for t in THREADS:
            row = {"N": N, "H": H, "V": V, "dtype": str(dtype).replace("torch.", ""), "mode": "fwd+bwd",
                   "contention": load, "threads": t, "cpus": len(cpus)}
            for p in paths:
                timing = Timing(samples[(load, t, p)])
                row[f"{p}_ms"], row[f"{p}_iqr_ms"] = timing * 1e3, (timing.q3 - timing.q1) * 1e3
            row["fused/gemms"] = row["fused_ms"] / row["gemms_ms"]
            rows.append(row)
        one, two = rows[-2], rows[-1]
        two["fused_2/1_threads"] = two["fused_ms"] / one["fused_ms"]
        two["gemms_2/1_threads"] = two["gemms_ms"] / one["gemms_ms"]
        # Cores other processes used while these rows ran (the busy process's one among them); the rows
        # are noisy (busy) where the machine's own processes used more than BUSY_OTHER_CORES.
        timed = probes[load][1:] or probes[load]
        for row in (one, two):
            row["other_cores"] = round(sum(probe["other_cores"] for probe in timed) / len(timed), 2)
            row["load_before"], row["load_after"] = timed[0]["load_before"], timed[-1]["load_after"]
            row["busy"] = row["other_cores"] - (load == "busy") > BUSY_OTHER_CORES
    for row in rows:
        log("contention", row)
        print_row(row, COLUMNS)
    return rows


COLUMNS = ["N", "H", "V", "contention", "threads", "fused_ms", "gemms_ms", "fused/gemms", "fused_2/1_threads",
           "gemms_2/1_threads", "other_cores"]


def contention_table(op, rows) -> dict:
    return summary_table(f"{op} with a core taken: fwd+bwd time (ms) of the fused op and its own GEMMs run "
                         "plainly, 1 and 2 threads, quiet and with one busy process on the two cores; "
                         "goals: " + "; ".join(f"{c}: {what}" for c, (what, _) in GOALS.items()),
                         rows, COLUMNS + goals.judged_columns(rows, GOALS))


def contention_headline(rows) -> list:
    return [{"metric": f"fused / its GEMMs, fwd+bwd, {r['contention']}, {r['threads']} thread(s), "
                       "N={N} H={H} V={V}".format(**r), "value": r["fused/gemms"], "busy": r["busy"]} for r in rows] + [
        {"metric": f"fused 2 threads / 1 thread, fwd+bwd, {r['contention']}, N={r['N']} H={r['H']} V={r['V']}",
         "value": r["fused_2/1_threads"], "busy": r["busy"]} for r in rows if "fused_2/1_threads" in r]


def run_contention(op, args, log, make_paths):
    """--contention of op's benchmark (its --quick, --json and --shape where it has one), on the CPU:
    make_paths(N, H, V, dtype) gives the "fused" and "gemms" closures."""
    shape = getattr(args, "shape", None)
    N, H, V = shape[0] if shape else (256, 128, 8192) if args.quick else SHAPE
    rows = goals.judge(measure_contention(N, H, V, torch.float32, 1 if args.quick else 5, log,
                                          make_paths(N, H, V, torch.float32)), GOALS, args.quick)
    write_json(args.json, op, "cpu", rows, headline=contention_headline(rows), tables=[contention_table(op, rows)],
               goals=goals.described(GOALS, args.quick))
    goals.print_verdicts(rows, GOALS, args.quick)
