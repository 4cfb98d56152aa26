"""chosen_logprob against the naive path and the peers, in one run.

Paths: fused (this package); fused_invariant (chosen_logprob(batch_invariant=True), in the main
rows only; invariant/fused is its time over the default's: the cost of batch invariance); naive
(materialised logits + log_softmax + gather, fused_rl_ops.reference); compile (torch.compile of the
naive path); torch_lce (torch.nn.functional.linear_cross_entropy(reduction="none",
options=LinearCrossEntropyOptions()), torch's own chunked path); megatron (Megatron's
vocab_parallel_cross_entropy at TP=1 on materialised fp32 logits); cce (Apple's Cut Cross-Entropy,
linear_cross_entropy(reduction="none"); on the CPU its impl="torch_compile", the one that runs
there); liger (Liger-Kernel's fused linear cross entropy, reduction="none"; CUDA only). The peers
give the cross entropy, whose negative is the chosen-token logprob at temperature 1; they have no
temperature and no entropy, so every path runs at temperature 1 and rows with entropy time fused,
naive and compile only. A peer that is not installed or cannot run here is listed as missing in
the JSON, with the reason.

Reports time (forward, forward+backward; median and IQR), extra peak memory beyond the inputs
(see chosen_logprob_paths.peak_mib), the max error of the logprob against float64 on the first
tokens, and TFLOP/s of every path counting the model's FLOPs: 2*N*H*V forward (the logits GEMM),
6*N*H*V forward+backward (plus the two gradient GEMMs). The fused path (and torch_lce, whose
reduction="none" backward recomputes too) also recomputes the logits in its backward, 8*N*H*V in
all: fused_hw_TFLOP/s counts those. gemm is the machine's GEMM rate, timed in the same rounds as
the paths: the plain GEMMs of those FLOPs at the same shapes and dtype (chosen_logprob_paths.gemm_runs);
<path>_%gemm is the path's TFLOP/s as a share of it (= gemm time / path time). The goal_* columns
say whether fused meets the project's goals on the row (reported, not asserted): time at most half
the peer's and at most the naive path's, extra peak memory at most the peer's. The peer (goal_peer)
is torch_lce; a torch without F.linear_cross_entropy (before 2.14: the GPU machine's 2.11) has none,
and the goals are judged against the fused peers instead, the faster (the smaller) of Liger and
Cut Cross-Entropy on the row. A --quick run (tiny shapes, where fixed costs dominate) judges no
goal here or in the modes below (goals.py).

The RL-shaped case (--masked-only runs it alone): at each main shape the same batch with 0%, 50% and
75% of its positions ignored (-100; the first part of every 512 positions, as prompts are),
forward+backward with entropy (fused, naive, compile) and logprob only (every path), time and extra
peak memory (logprob only). fused skips the ignored rows; the naive path, compile, torch_lce and
Megatron compute every row; Cut Cross-Entropy leaves ignored rows out too (its
linear_cross_entropy indexes the valid rows first). fused/unmasked is fused's time over its own at
0% (same entropy setting); the masked goals: at 75% fused/unmasked at most 0.45, at 50% fused faster
than every other path of the row. fused_compiled, timed in the same rounds, is the fused call under
torch.compile(fullgraph=True) (its ops leave the ignored rows out inside the graph too);
compiled/fused is its time over the eager call's, which should be about 1 at every masked share.

The CPU path with a core taken (--contention runs it alone, on the CPU; benchmarks/contention.py):
fused forward+backward against its own four GEMMs run plainly, with 1 and 2 threads, quiet and with
one busy process on the two cores, fused/gemms and fused_2/1_threads per row; the goals: busy, at
most 1.2x the GEMMs, and two threads never slower than one.

The sampler's filter (--sampler-filter runs it alone, at the main shapes): forward+backward of the
fused path, with entropy and logprob only, plain and with top_k=50, top_p=0.95 and both (the
filters of chosen_logprob: the distribution a sampler with those settings drew from), in the same
rounds; <filter>/plain is its time over the plain call's. The goals: top_k at most 1.5x of the plain
call, top_p (alone or after top_k) at most 2.5x.

The distillation case (--distillation runs it alone, at the main shapes; chosen_logprob_distillation):
forward+backward of chosen_logprob with k = 1, 8 and 64 tokens per position and of top_logprobs
(k = 64), fused and naive (materialised logits, log_softmax, gather / topk), and of the rollout
sampler's kept set (kept_ids of 63 ids: kept/k64, its time over chosen_logprob with the same 64
tokens), in the same rounds; goals: k = 64 at most 1.15x k = 1, top_logprobs at most 1.3x
chosen_logprob with one token.

The cost of batch invariance at a tensor-parallel degree (--tp N runs it alone, on the CPU;
benchmarks/tensor_parallel.py): chosen_logprob (with entropy) and top_logprobs forward+backward
with batch_invariant=True against the default path, both over N gloo ranks of one thread each, at
(2048, 512, 16384) and (2048, 512, 32768) fp32; goals: at most 1.10x the time, extra memory
independent of V.

The plot (--json PATH -> PATH.png) draws time and peak memory of forward+backward (logprob only)
against V and against N for every path (the sweeps), and against the masked share at the last main
shape (the RL-shaped case, with entropy dashed). On a CUDA device whose ceilings
benchmarks/roofline.py knows, every timed row of the main shapes also gives what the fused path's
kernels should take there from their FLOPs and bytes (fused_roofline_ms, and
fused_roofline_serial_ms with GEMM epilogues not overlapped) and fused/roofline, the measured time
over it; the JSON holds the ceilings and a per-kernel breakdown."""
import dataclasses

import torch

import fused_rl_ops
from fused_rl_ops import reference

from . import contention, goals, roofline, tensor_parallel
from .chosen_logprob_distillation import (DISTILLATION_GOALS, distillation_headline, distillation_table,
                                          measure_distillation)
from .chosen_logprob_paths import gemm_runs, load_peers, make_inputs, path_fn, paths_for, peak_mib, run_once
from .plots import pyplot, save_figure
from .results import RowLog, parse_args, png_path, write_json
from .tables import print_row, summary_table
from .timing import record_times, time_paths

FLOP_COUNTING = ("model FLOPs: 2*N*H*V forward (the logits GEMM), 6*N*H*V forward+backward (plus the hidden "
                 "and weight gradient GEMMs), whatever a path runs; fused_hw counts 8*N*H*V forward+backward "
                 "(the fused backward recomputes the logits). gemm: those FLOPs over the time of plain "
                 "torch.mm calls of the same shapes and dtype; <path>_%gemm = 100 * path TFLOP/s / gemm TFLOP/s")
# The goals' peer: torch's chunked linear cross entropy; on a torch without it, Liger's and Cut
# Cross-Entropy's fused kernels.
GOAL_PEERS = (["torch_lce"], ["liger", "cce"])


def goal_peer(row, unit):
    """The goals' peer on a row, by its column of `unit` (_ms, _MiB): torch_lce where it was measured,
    else the smallest of Liger's and Cut Cross-Entropy's; None where none was."""
    for peers in GOAL_PEERS:
        measured = [p for p in peers if f"{p}{unit}" in row]
        if measured:
            return min(measured, key=lambda p: row[f"{p}{unit}"])
    return None


def against_peer(row, unit, met):
    """met(fused's value, the peer's), with the peer's name in goal_peer; None without a peer."""
    peer = goal_peer(row, unit)
    if peer is None:
        return None
    row["goal_peer"] = peer
    return met(row[f"fused{unit}"], row[f"{peer}{unit}"])


GOALS = {  # column -> (what it checks, its value on a row: True / False, or None where a path is missing)
    "goal_time<=peer/2": ("fused time at most half of the peer's (goal_peer: torch_lce, or the faster of "
                          "liger and cce on a torch without F.linear_cross_entropy)",
                          lambda r: against_peer(r, "_ms", lambda fused, peer: fused <= peer / 2)),
    "goal_time<=naive": ("fused time at most the naive path's",
                         lambda r: r["fused_ms"] <= r["naive_ms"] if "naive_ms" in r else None),
    "goal_mem<=peer": ("fused extra peak memory at most the peer's (goal_peer: torch_lce, or the smaller of "
                       "liger and cce on a torch without F.linear_cross_entropy)",
                       lambda r: against_peer(r, "_MiB", lambda fused, peer: fused <= peer)),
}
MASKED = (0.0, 0.5, 0.75)  # the RL-shaped case's shares of ignored positions

SAMPLER_FILTERS = {"plain": {}, "top_k": dict(top_k=50), "top_p": dict(top_p=0.95),
                   "top_k+top_p": dict(top_k=50, top_p=0.95)}
SAMPLER_GOALS = {
    "goal_top_k<=1.5x": ("top_k=50: fused time at most 1.5x of the plain call's",
                         lambda r: r["top_k/plain"] <= 1.5),
    "goal_top_p<=2.5x": ("top_p=0.95, alone and after top_k=50: fused time at most 2.5x of the plain call's",
                         lambda r: max(r["top_p/plain"], r["top_k+top_p/plain"]) <= 2.5),
}


def other_paths(row):
    """The paths timed on a row besides fused (and its compiled call)."""
    return [c[:-3] for c in row if c.endswith("_ms") and not c.endswith("iqr_ms")
            and c not in ("fused_ms", "fused_compiled_ms", "gemm_ms")]


MASKED_GOALS = {
    "goal_75%masked<=0.45x": ("75% masked: fused time at most 0.45x of its time with none masked",
                              lambda r: r["fused/unmasked"] <= 0.45 if r["masked_%"] == 75 else None),
    "goal_50%masked_fastest": ("50% masked: fused time below every other path's in the row",
                               lambda r: all(r["fused_ms"] < r[f"{p}_ms"] for p in other_paths(r))
                               if r["masked_%"] == 50 else None),
}


def max_error(fn, hidden, weight, tokens, rows=256):
    h, t = hidden[:rows], tokens[:rows]
    ref, _ = reference.chosen_logprob(h.double(), weight.double(), t)
    with torch.no_grad():
        got = fn(h, weight, t)[0]
    return (got.double() - ref).abs().max().item()


def add_ratios(row, paths, N, H, V, mode):
    """TFLOP/s and share of the GEMM rate of every path, and each path's time over the fused one
    (fused_invariant's: invariant/fused)."""
    flops = (2 if mode == "fwd" else 6) * N * H * V
    for path in paths + ["gemm"]:
        row[f"{path}_TFLOP/s"] = flops / (row[f"{path}_ms"] * 1e-3) / 1e12
    if mode != "fwd":
        row["fused_hw_TFLOP/s"] = 8 * N * H * V / (row["fused_ms"] * 1e-3) / 1e12
    for path in paths + (["fused_hw"] if mode != "fwd" else []):
        row[f"{path}_%gemm"] = 100 * row[f"{path}_TFLOP/s"] / row["gemm_TFLOP/s"]
    for path in paths[1:]:
        row["invariant/fused" if path == "fused_invariant" else f"{path}/fused"] = row[f"{path}_ms"] / row["fused_ms"]


ROOFLINE_COLUMNS = ["fused_roofline_ms", "fused_roofline_serial_ms", "fused/roofline"]


def add_roofline(row, dtype, ceilings):
    """What the fused path's kernels should take on the device (benchmarks/roofline.py) beside its
    measured time, and the measured time over it."""
    kernels = roofline.chosen_logprob_kernels(row["N"], row["H"], row["V"], dtype, row["mode"])
    expected = roofline.expected_ms(kernels, dtype, ceilings)
    row["fused_roofline_ms"] = expected["roofline_ms"]
    row["fused_roofline_serial_ms"] = expected["roofline_serial_ms"]
    row["fused/roofline"] = row["fused_ms"] / expected["roofline_ms"]


def roofline_table(N, H, V, dtype, ceilings):
    """The per-kernel roofline of the fused forward+backward at one shape, printed and for the JSON."""
    rows = roofline.breakdown(roofline.chosen_logprob_kernels(N, H, V, dtype, "fwd+bwd"), dtype, ceilings)
    title = (f"chosen_logprob: the fused path's kernels on {ceilings.name}, forward+backward at N={N} H={H} V={V} "
             f"(roofline: each at the larger of its GEMM and memory times)")
    return summary_table(title, rows, roofline.BREAKDOWN_COLUMNS)


def sweep(name, points, dtype, dev, peers, reps, log):
    """Forward+backward time and peak memory (logprob only) of every path at each (N, H, V); the
    times logged per point, the memory per path."""
    paths = paths_for(False, peers)
    curve = [{"N": N, "H": H, "V": V} for N, H, V in points]
    for point in curve:
        hidden, weight, tokens = make_inputs(point["N"], point["H"], point["V"], dtype, dev)
        times = time_paths({p: run_once(path_fn(p, False, peers), "fwd+bwd", hidden, weight, tokens) for p in paths},
                           dev, reps=reps)
        log(f"sweep {name}", record_times(point, times))
        del hidden, weight, tokens
    for path in paths:
        mibs = log(f"sweep {name} memory", {"path": path, "points": points,
                                            "MiB": peak_mib(path, points, dtype, dev, peers)})["MiB"]
        for point, mib in zip(curve, mibs):
            point[f"{path}_MiB"] = mib
    return curve


def plot(v_curve, n_curve, masked_rows, paths, path, device, dtype):
    """Time and memory against V and N (the sweeps) and against the masked share (masked_rows: the
    RL-shaped case at one shape), a column each where there are points."""
    plt = pyplot()
    columns = [(curve, x) for curve, x in ((v_curve, "V"), (n_curve, "N"), (masked_rows, "masked_%")) if curve]
    fig, axes = plt.subplots(2, len(columns), figsize=(max(5.5 * len(columns), 9), 8), squeeze=False)
    for col, (curve, x) in enumerate(columns):
        logprob_only = [p for p in curve if not p.get("entropy")]
        xs = [p[x] for p in logprob_only]
        for name in paths:
            axes[0, col].plot(xs, [p[f"{name}_ms"] for p in logprob_only], marker="o", label=name)
            axes[1, col].plot(xs, [p[f"{name}_MiB"] for p in logprob_only], marker="o", label=name)
        with_entropy = [p for p in curve if p.get("entropy")]
        for name in paths:
            if with_entropy and f"{name}_ms" in with_entropy[0]:
                axes[0, col].plot([p[x] for p in with_entropy], [p[f"{name}_ms"] for p in with_entropy],
                                  marker="x", linestyle="--", label=f"{name}, with entropy")
        fixed = ", ".join(f"{k}={curve[0][k]}" for k in ("N", "H", "V") if k != x)
        axes[0, col].set(ylabel="time (ms)", title=f"fwd+bwd time against {x} ({fixed})")
        axes[1, col].set(ylabel="extra peak memory (MiB)", title=f"fwd+bwd peak memory against {x} ({fixed})")
        for ax in axes[:, col]:
            ax.set(xlabel=x, xscale="linear" if x == "masked_%" else "log", yscale="log")
            ax.set_xticks(xs, [str(v) for v in xs], minor=False)
            ax.set_xticks([], minor=True)
    for ax in axes.flat:
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    busy = "  (! measured on a busy machine)" if any(p.get("busy") for p in v_curve + n_curve + masked_rows) else ""
    dashed = ", dashed: with entropy" if masked_rows else ""
    fig.suptitle(f"chosen_logprob (logprob only{dashed}; temperature 1) on {device}, "
                 f"{str(dtype).replace('torch.', '')}{busy}")
    save_figure(fig, path)


def timed_rows(N, H, V, dtype, dev, peers, reps, log, ceilings=None) -> list:
    """The timed rows of one shape (with and without entropy, forward and forward+backward), with
    the roofline columns where the device's ceilings are known, each logged as it is measured."""
    rows = []
    hidden, weight, tokens = make_inputs(N, H, V, dtype, dev)
    gemms = gemm_runs(hidden, weight)
    for entropy in (False, True):
        for mode in ("fwd", "fwd+bwd"):
            row = {"N": N, "H": H, "V": V, "dtype": str(dtype).replace("torch.", ""), "entropy": entropy,
                   "mode": mode}
            paths = ["fused", "fused_invariant"] + paths_for(entropy, peers)[1:]
            runs = {p: run_once(path_fn(p, entropy, peers), mode, hidden, weight, tokens) for p in paths}
            record_times(row, time_paths({**runs, "gemm": gemms[mode]}, dev, reps=reps))
            add_ratios(row, paths, N, H, V, mode)
            if ceilings:
                add_roofline(row, dtype, ceilings)
            rows.append(log("results", row))
            times = [c for c in row if c.endswith(("_ms", "/fused", "_%gemm")) and "iqr" not in c]
            print_row(row, ["N", "H", "V", "entropy", "mode", "fused_ms"] + [c for c in ROOFLINE_COLUMNS if c in row]
                      + [c for c in times if c != "fused_ms" and c not in ROOFLINE_COLUMNS])
    return rows


def measure_shape(N, H, V, dtype, dev, peers, reps, log, ceilings=None) -> list:
    """The timed rows and the peak memory row of one shape, each logged as it is measured."""
    rows = timed_rows(N, H, V, dtype, dev, peers, reps, log, ceilings)
    hidden, weight, tokens = make_inputs(N, H, V, dtype, dev)
    memory = {"N": N, "H": H, "V": V, "mode": "peak fwd+bwd"}
    for path in paths_for(False, peers):
        memory[f"{path}_MiB"] = peak_mib(path, [(N, H, V)], dtype, dev, peers)[0]
        memory[f"{path}_max_err"] = max_error(path_fn(path, False, peers), hidden, weight, tokens)
    memory["naive/fused_mem"] = memory["naive_MiB"] / memory["fused_MiB"]
    rows.append(log("results", memory))
    print_row(memory, list(memory))
    return rows


def measure_masked(N, H, V, dtype, dev, peers, reps, log) -> list:
    """The RL-shaped case at one shape (module docstring): a forward+backward row per masked share,
    with entropy and logprob only, and each path's extra peak memory on the logprob-only rows; each
    row logged as it is measured."""
    rows = []
    for entropy in (True, False):
        paths = paths_for(entropy, peers)
        for masked in MASKED:
            row = {"N": N, "H": H, "V": V, "dtype": str(dtype).replace("torch.", ""), "masked_%": round(100 * masked),
                   "entropy": entropy, "mode": "fwd+bwd"}
            hidden, weight, tokens = make_inputs(N, H, V, dtype, dev, masked=masked)
            runs = {p: run_once(path_fn(p, entropy, peers), "fwd+bwd", hidden, weight, tokens)
                    for p in paths + ["fused_compiled"]}
            record_times(row, time_paths(runs, dev, reps=reps))
            del hidden, weight, tokens, runs
            unmasked = row if masked == 0 else next(r for r in rows if r["entropy"] == entropy and r["masked_%"] == 0)
            row["fused/unmasked"] = row["fused_ms"] / unmasked["fused_ms"]
            row["compiled/fused"] = row["fused_compiled_ms"] / row["fused_ms"]
            for path in paths[1:]:
                row[f"{path}/fused"] = row[f"{path}_ms"] / row["fused_ms"]
            if not entropy:
                for path in paths:
                    row[f"{path}_MiB"] = peak_mib(path, [(N, H, V)], dtype, dev, peers, masked=masked)[0]
            rows.append(log("masked", row))
            print_row(row, ["N", "H", "V", "masked_%", "entropy", "fused/unmasked"]
                      + [c for c in row if c.endswith(("_ms", "/fused", "_MiB")) and "iqr" not in c])
    return rows


def measure_sampler_filter(N, H, V, dtype, dev, reps, log) -> list:
    """The sampler's filter at one shape (module docstring): a forward+backward row with entropy and
    one with logprob only, each filter's time and its ratio to the plain call's."""
    rows = []
    hidden, weight, tokens = make_inputs(N, H, V, dtype, dev)
    for entropy in (True, False):
        row = {"N": N, "H": H, "V": V, "dtype": str(dtype).replace("torch.", ""), "entropy": entropy,
               "mode": "fwd+bwd"}

        def fused(filter_):
            return lambda h, w, t: fused_rl_ops.chosen_logprob(h, w, t, return_entropy=True, **filter_) if entropy \
                else (fused_rl_ops.chosen_logprob(h, w, t, **filter_),)

        runs = {name: run_once(fused(f), "fwd+bwd", hidden, weight, tokens) for name, f in SAMPLER_FILTERS.items()}
        record_times(row, time_paths(runs, dev, reps=reps))
        for name in list(SAMPLER_FILTERS)[1:]:
            row[f"{name}/plain"] = row[f"{name}_ms"] / row["plain_ms"]
        rows.append(log("sampler_filter", row))
        print_row(row, ["N", "H", "V", "entropy"] + [f"{name}_ms" for name in SAMPLER_FILTERS]
                  + [f"{name}/plain" for name in list(SAMPLER_FILTERS)[1:]])
    return rows


def sampler_filter_table(rows):
    return summary_table(
        "chosen_logprob with the sampler's filter: fwd+bwd time (ms) of the fused path, plain and with top_k=50, "
        "top_p=0.95 and both, and each over the plain call; goals: "
        + "; ".join(f"{c}: {what}" for c, (what, _) in SAMPLER_GOALS.items()),
        rows, ["N", "H", "V", "entropy"] + [f"{name}_ms" for name in SAMPLER_FILTERS]
        + [f"{name}/plain" for name in list(SAMPLER_FILTERS)[1:]] + goals.judged_columns(rows, SAMPLER_GOALS))


def sampler_filter_headline(rows) -> list:
    return [{"metric": f"{name} / plain fused time, fwd+bwd {'with entropy' if r['entropy'] else 'logprob only'}, "
                       "N={N} H={H} V={V}".format(**r), "value": r[f"{name}/plain"], "busy": r["busy"]}
            for r in rows for name in list(SAMPLER_FILTERS)[1:]]


def summary_tables(rows, all_paths):
    timed = [r for r in rows if "fused_ms" in r]
    key = ["N", "H", "V", "entropy", "mode"]
    expected = [c for c in ROOFLINE_COLUMNS if any(c in r for r in timed)]
    tables = [
        summary_table("chosen_logprob: median time (ms); ratios are path time / fused time"
                      + ("; fused_roofline*: what the fused kernels should take on the device" if expected else ""),
                      timed, key + ["fused_ms"] + expected + [f"{p}_ms" for p in all_paths[1:]] + ["gemm_ms"]
                      + [f"{p}/fused" for p in all_paths[1:]]),
        summary_table("chosen_logprob: the cost of batch_invariant=True (fused_invariant time / fused time)",
                      timed, key + ["fused_ms", "fused_invariant_ms", "invariant/fused"]),
        summary_table("chosen_logprob: TFLOP/s (2NHV forward, 6NHV forward+backward; fused_hw adds the "
                      "2NHV recompute) and % of the GEMM rate (plain GEMMs of the same shapes, same rounds)",
                      timed, key + ["gemm_TFLOP/s"] + [f"{p}_TFLOP/s" for p in all_paths] + ["fused_hw_TFLOP/s"]
                      + [f"{p}_%gemm" for p in all_paths] + ["fused_hw_%gemm"]),
        summary_table("chosen_logprob: extra peak memory (MiB) and max |error| against float64",
                      [r for r in rows if "fused_MiB" in r], ["N", "H", "V"] + [f"{p}_MiB" for p in all_paths]
                      + ["naive/fused_mem"] + [f"{p}_max_err" for p in all_paths]),
    ]
    judged = [r for r in rows if any(c in r for c in GOALS)]
    if judged:
        tables.append(summary_table(
            "chosen_logprob: goals (" + "; ".join(f"{c}: {GOALS[c][0]}" for c in GOALS) + ")", judged,
            ["N", "H", "V", "entropy", "mode", "goal_peer", "fused_ms", "torch_lce_ms", "liger_ms", "cce_ms",
             "naive_ms", "fused_MiB", "torch_lce_MiB", "liger_MiB", "cce_MiB"] + list(GOALS)))
    return tables


def masked_table(rows, all_paths):
    return summary_table(
        "chosen_logprob, RL-shaped batch: fwd+bwd time (ms) with 0/50/75% of positions ignored (fused skips them; "
        "Cut Cross-Entropy leaves them out too, the others compute every row), fused/unmasked = fused time over "
        "its own at 0%, compiled/fused = fused under torch.compile(fullgraph=True) over eager, path time / fused "
        "time, extra peak memory (MiB, logprob only); goals: "
        + "; ".join(f"{c}: {what}" for c, (what, _) in MASKED_GOALS.items()),
        rows, ["N", "H", "V", "masked_%", "entropy"] + [f"{p}_ms" for p in all_paths]
        + ["fused_compiled_ms", "fused/unmasked", "compiled/fused"]
        + [f"{p}/fused" for p in all_paths[1:]] + [f"{p}_MiB" for p in all_paths]
        + goals.judged_columns(rows, MASKED_GOALS))


def shape_options(parser):
    parser.add_argument("--no-sweeps", action="store_true",
                        help="no V and N sweeps (the plot then shows the RL-shaped case only)")
    parser.add_argument("--masked-only", action="store_true",
                        help="the RL-shaped case only (at the main shapes): no main rows, no sweeps")
    parser.add_argument("--sampler-filter", action="store_true",
                        help="the sampler's filter only (top_k, top_p against the plain call, at the main shapes)")
    parser.add_argument("--distillation", action="store_true",
                        help="only the distillation case: k tokens per position and top_logprobs")
    parser.add_argument("--contention", action="store_true",
                        help="the CPU path with a core taken only (benchmarks/contention.py): fused against its "
                             "four GEMMs, 1 and 2 threads, quiet and with a busy process, at the first --shape "
                             "(default 2048 512 32768)")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="only the cost of batch_invariant=True at tensor-parallel degree N (chosen_logprob and "
                             "top_logprobs, N gloo ranks of one thread each on the CPU; benchmarks/tensor_parallel.py)")
    parser.add_argument("--shape", nargs=3, type=int, action="append", metavar=("N", "H", "V"),
                        help="a main shape to measure instead of the device's defaults (repeatable)")


def masked_headline(rows) -> list:
    """The RL-shaped case's figures at one shape: fused at 75% masked over none masked, fused under
    torch.compile(fullgraph=True) over eager at 75% masked, and the fastest other path over fused at
    50% masked, with entropy and logprob only."""
    headline = []
    for entropy, what in ((True, "with entropy"), (False, "logprob only")):
        at = {r["masked_%"]: r for r in rows if r["entropy"] == entropy}
        shape = "N={N} H={H} V={V}".format(**at[0])
        fastest = min(other_paths(at[50]), key=lambda p: at[50][f"{p}_ms"])
        headline += [{"metric": f"fused time, 75% / 0% of positions masked, fwd+bwd {what}, {shape}",
                      "value": at[75]["fused/unmasked"], "busy": at[75]["busy"] or at[0]["busy"]},
                     {"metric": f"fused under torch.compile(fullgraph=True) / eager time, 75% masked, fwd+bwd "
                                f"{what}, {shape}", "value": at[75]["compiled/fused"], "busy": at[75]["busy"]},
                     {"metric": f"fastest other path ({fastest}) / fused time, 50% masked, fwd+bwd {what}, {shape}",
                      "value": at[50][f"{fastest}/fused"], "busy": at[50]["busy"]}]
    return headline


def main_headline(rows, shape, all_paths) -> list:
    largest = [r for r in rows if (r["N"], r["H"], r["V"]) == shape]
    with_entropy = next(r for r in largest if r.get("entropy") and r["mode"] == "fwd+bwd")
    logprob_only = next(r for r in largest if r.get("entropy") is False and r["mode"] == "fwd+bwd")
    memory = largest[-1]
    shape = "N={N} H={H} V={V}".format(**with_entropy)
    headline = [{"metric": f"naive / fused time, fwd+bwd with entropy, {shape}",
                 "value": with_entropy["naive/fused"], "busy": with_entropy["busy"]},
                {"metric": f"naive / fused extra peak memory, fwd+bwd, {shape}",
                 "value": memory["naive/fused_mem"], "busy": False}]
    headline += [{"metric": f"{p} / fused time, fwd+bwd logprob only, {shape}", "value": logprob_only[f"{p}/fused"],
                  "busy": logprob_only["busy"]} for p in all_paths[1:]]
    headline.append({"metric": f"fused % of the GEMM rate (6NHV), fwd+bwd logprob only, {shape}",
                     "value": logprob_only["fused_%gemm"], "busy": logprob_only["busy"]})
    peer = goal_peer(memory, "_MiB")
    if peer:
        headline.append({"metric": f"{peer} / fused extra peak memory, fwd+bwd, {shape}",
                         "value": memory[f"{peer}_MiB"] / memory["fused_MiB"], "busy": False})
    headline.append({"metric": f"batch_invariant=True / default time, fwd+bwd with entropy, {shape}",
                     "value": with_entropy["invariant/fused"], "busy": with_entropy["busy"]})
    return headline


def main():
    args = parse_args(__doc__, shape_options)
    log = RowLog(args.json)
    dev = args.device
    if dev == "cpu":
        shapes = [(256, 128, 8192)] if args.quick else [(2048, 512, 32768), (4096, 1024, 65536)]
        dtype, reps = torch.float32, 3 if args.quick else 2
        v_sweep = [(256, 128, V) for V in (2048, 8192, 32768)] if args.quick else \
            [(1024, 256, V) for V in (4096, 8192, 16384, 32768)]
        n_sweep = [(N, 128, 8192) for N in (64, 256, 1024)] if args.quick else \
            [(N, 256, 16384) for N in (256, 1024, 4096)]
    else:
        shapes = [(2048, 1024, 32768)] if args.quick else [(8192, 4096, 131072)]
        dtype, reps = torch.bfloat16, 10
        v_sweep = [(2048, 1024, V) for V in (16384, 32768, 65536)] if args.quick else \
            [(4096, 4096, V) for V in (32768, 65536, 131072, 262144)]
        n_sweep = [(N, 1024, 32768) for N in (1024, 2048, 4096)] if args.quick else \
            [(N, 4096, 131072) for N in (2048, 4096, 8192, 16384)]
    if args.contention:
        return contention.run_contention("chosen_logprob", args, log, contention.chosen_logprob_paths)
    if args.tp:
        return tensor_parallel.run_tensor_parallel("chosen_logprob", ("chosen_logprob", "top_logprobs"), args, log)
    if args.shape:
        shapes = [tuple(shape) for shape in args.shape]
    if args.sampler_filter:
        rows = [row for N, H, V in shapes for row in measure_sampler_filter(N, H, V, dtype, dev, reps, log)]
        goals.judge(rows, SAMPLER_GOALS, args.quick)
        write_json(args.json, "chosen_logprob", dev, rows, headline=sampler_filter_headline(rows),
                   tables=[sampler_filter_table(rows)], goals=goals.described(SAMPLER_GOALS, args.quick))
        goals.print_verdicts(rows, SAMPLER_GOALS, args.quick)
        return
    if args.distillation:
        rows = [row for N, H, V in shapes for row in measure_distillation(N, H, V, dtype, dev, reps, log)]
        goals.judge(rows, DISTILLATION_GOALS, args.quick)
        write_json(args.json, "chosen_logprob", dev, rows, headline=distillation_headline(rows),
                   tables=[distillation_table(rows)], goals=goals.described(DISTILLATION_GOALS, args.quick))
        goals.print_verdicts(rows, DISTILLATION_GOALS, args.quick)
        return
    peers, versions = load_peers(dev)
    all_paths = paths_for(False, peers)
    ceilings = roofline.ceilings_for(dev)
    rows = [] if args.masked_only else [row for N, H, V in shapes
                                        for row in measure_shape(N, H, V, dtype, dev, peers, reps, log, ceilings)]
    goals.judge(rows, GOALS, args.quick)
    tables = summary_tables(rows, all_paths) if rows else []
    if ceilings and rows:
        tables += [roofline_table(N, H, V, dtype, ceilings) for N, H, V in shapes]
    masked_rows = [row for N, H, V in shapes for row in measure_masked(N, H, V, dtype, dev, peers, reps, log)]
    goals.judge(masked_rows, MASKED_GOALS, args.quick)
    tables.append(masked_table(masked_rows, all_paths))

    sweeps = not (args.no_sweeps or args.masked_only)
    v_curve = sweep("V", v_sweep, dtype, dev, peers, reps, log) if sweeps else []
    n_curve = sweep("N", n_sweep, dtype, dev, peers, reps, log) if sweeps else []
    if sweeps:
        tables.append(summary_table("chosen_logprob sweeps: fwd+bwd (logprob only) time (ms) and peak memory (MiB)",
                                    v_curve + n_curve, ["N", "H", "V"] + [f"{p}_ms" for p in all_paths]
                                    + [f"{p}_MiB" for p in all_paths]))
    last_masked = [r for r in masked_rows if (r["N"], r["H"], r["V"]) == shapes[-1]]
    plot_file = png_path(args.json)
    if plot_file:
        plot(v_curve, n_curve, last_masked, all_paths, plot_file, dev, dtype)

    headline = masked_headline(last_masked)
    if rows:
        headline = main_headline(rows, shapes[-1], all_paths) + headline
    write_json(args.json, "chosen_logprob", dev, rows + masked_rows, headline=headline, tables=tables, peers=versions,
               plot=plot_file, sweeps={"V": v_curve, "N": n_curve}, flop_counting=FLOP_COUNTING,
               goals=goals.described({**GOALS, **MASKED_GOALS}, args.quick),
               roofline={"ceilings": dataclasses.asdict(ceilings), "model": roofline.__doc__} if ceilings else None)
    goals.print_verdicts(rows + masked_rows, {**GOALS, **MASKED_GOALS}, args.quick)


if __name__ == "__main__":
    main()
