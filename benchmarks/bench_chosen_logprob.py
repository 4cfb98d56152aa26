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
say whether fused meets the project's goals on the row (reported, not asserted): time at most half torch_lce's and at most the
naive path's, extra peak memory at most torch_lce's. The plot (--json PATH -> PATH.png) draws time
and peak memory of forward+backward (logprob only) against V and against N for every path."""
import torch

from fused_rl_ops import reference

from .chosen_logprob_paths import gemm_runs, load_peers, make_inputs, path_fn, paths_for, peak_mib, run_once
from .plots import pyplot, save_figure
from .results import RowLog, parse_args, png_path, write_json
from .tables import print_row, summary_table
from .timing import record_times, time_paths

FLOP_COUNTING = ("model FLOPs: 2*N*H*V forward (the logits GEMM), 6*N*H*V forward+backward (plus the hidden "
                 "and weight gradient GEMMs), whatever a path runs; fused_hw counts 8*N*H*V forward+backward "
                 "(the fused backward recomputes the logits). gemm: those FLOPs over the time of plain "
                 "torch.mm calls of the same shapes and dtype; <path>_%gemm = 100 * path TFLOP/s / gemm TFLOP/s")
GOALS = {  # column -> (what it checks, its value on a row: True / False, or None where a path is missing)
    "goal_time<=torch_lce/2": ("fused time at most half of torch_lce's",
                               lambda r: r["fused_ms"] <= r["torch_lce_ms"] / 2 if "torch_lce_ms" in r else None),
    "goal_time<=naive": ("fused time at most the naive path's",
                         lambda r: r["fused_ms"] <= r["naive_ms"] if "naive_ms" in r else None),
    "goal_mem<=torch_lce": ("fused extra peak memory at most torch_lce's",
                            lambda r: r["fused_MiB"] <= r["torch_lce_MiB"] if "torch_lce_MiB" in r else None),
}
TIME_GOALS, MEMORY_GOALS = ["goal_time<=torch_lce/2", "goal_time<=naive"], ["goal_mem<=torch_lce"]


def add_goals(row, goals):
    for column in goals:
        met = GOALS[column][1](row)
        if met is not None:
            row[column] = met


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


def plot(v_curve, n_curve, paths, path, device, dtype):
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, (curve, x) in enumerate(((v_curve, "V"), (n_curve, "N"))):
        xs = [p[x] for p in curve]
        for name in paths:
            axes[0, col].plot(xs, [p[f"{name}_ms"] for p in curve], marker="o", label=name)
            axes[1, col].plot(xs, [p[f"{name}_MiB"] for p in curve], marker="o", label=name)
        fixed = ", ".join(f"{k}={curve[0][k]}" for k in ("N", "H", "V") if k != x)
        axes[0, col].set(ylabel="time (ms)", title=f"fwd+bwd time against {x} ({fixed})")
        axes[1, col].set(ylabel="extra peak memory (MiB)", title=f"fwd+bwd peak memory against {x} ({fixed})")
        for ax in axes[:, col]:
            ax.set(xlabel=x, xscale="log", yscale="log")
            ax.set_xticks(xs, [str(v) for v in xs], minor=False)
            ax.set_xticks([], minor=True)
    for ax in axes.flat:
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    busy = "  (! measured on a busy machine)" if any(p.get("busy") for p in v_curve + n_curve) else ""
    fig.suptitle(f"chosen_logprob (logprob only, temperature 1) on {device}, {str(dtype).replace('torch.', '')}{busy}")
    save_figure(fig, path)


def measure_shape(N, H, V, dtype, dev, peers, reps, log) -> list:
    """The timed rows (with and without entropy, forward and forward+backward) and the peak memory
    row of one shape, each logged as it is measured."""
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
            add_goals(row, TIME_GOALS)
            rows.append(log("results", row))
            print_row(row, ["N", "H", "V", "entropy", "mode"]
                      + [c for c in row if c.endswith(("_ms", "/fused", "_%gemm")) and "iqr" not in c]
                      + [c for c in TIME_GOALS if c in row])
    del gemms
    memory = {"N": N, "H": H, "V": V, "mode": "peak fwd+bwd"}
    for path in paths_for(False, peers):
        memory[f"{path}_MiB"] = peak_mib(path, [(N, H, V)], dtype, dev, peers)[0]
        memory[f"{path}_max_err"] = max_error(path_fn(path, False, peers), hidden, weight, tokens)
    memory["naive/fused_mem"] = memory["naive_MiB"] / memory["fused_MiB"]
    add_goals(memory, MEMORY_GOALS)
    rows.append(log("results", memory))
    print_row(memory, list(memory))
    return rows


def summary_tables(rows, all_paths):
    timed = [r for r in rows if "fused_ms" in r]
    key = ["N", "H", "V", "entropy", "mode"]
    return [
        summary_table("chosen_logprob: median time (ms); ratios are path time / fused time",
                      timed, key + [f"{p}_ms" for p in all_paths] + ["gemm_ms"]
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
        summary_table("chosen_logprob: goals (" + "; ".join(f"{c}: {GOALS[c][0]}" for c in GOALS) + ")",
                      [r for r in rows if any(c in r for c in GOALS)],
                      ["N", "H", "V", "entropy", "mode", "fused_ms", "torch_lce_ms", "naive_ms", "fused_MiB",
                       "torch_lce_MiB"] + list(GOALS)),
    ]


def shape_options(parser):
    parser.add_argument("--no-sweeps", action="store_true",
                        help="measure the main shapes only: no V and N sweeps, no plot")
    parser.add_argument("--shape", nargs=3, type=int, action="append", metavar=("N", "H", "V"),
                        help="a main shape to measure instead of the device's defaults (repeatable)")


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
    if args.shape:
        shapes = [tuple(shape) for shape in args.shape]
    peers, versions = load_peers(dev)
    rows = [row for N, H, V in shapes for row in measure_shape(N, H, V, dtype, dev, peers, reps, log)]
    all_paths = paths_for(False, peers)
    tables = summary_tables(rows, all_paths)

    v_curve = [] if args.no_sweeps else sweep("V", v_sweep, dtype, dev, peers, reps, log)
    n_curve = [] if args.no_sweeps else sweep("N", n_sweep, dtype, dev, peers, reps, log)
    if not args.no_sweeps:
        tables.append(summary_table("chosen_logprob sweeps: fwd+bwd (logprob only) time (ms) and peak memory (MiB)",
                                    v_curve + n_curve, ["N", "H", "V"] + [f"{p}_ms" for p in all_paths]
                                    + [f"{p}_MiB" for p in all_paths]))
    plot_file = None if args.no_sweeps else png_path(args.json)
    if plot_file:
        plot(v_curve, n_curve, all_paths, plot_file, dev, dtype)

    largest = [r for r in rows if (r["N"], r["H"], r["V"]) == shapes[-1]]
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
    if "torch_lce_MiB" in memory:
        headline.append({"metric": f"torch_lce / fused extra peak memory, fwd+bwd, {shape}",
                         "value": memory["torch_lce_MiB"] / memory["fused_MiB"], "busy": False})
    headline.append({"metric": f"batch_invariant=True / default time, fwd+bwd with entropy, {shape}",
                     "value": with_entropy["invariant/fused"], "busy": with_entropy["busy"]})
    write_json(args.json, "chosen_logprob", dev, rows, headline=headline, tables=tables, peers=versions,
               plot=plot_file, sweeps={"V": v_curve, "N": n_curve}, flop_counting=FLOP_COUNTING,
               goals={column: what for column, (what, _) in GOALS.items()})


if __name__ == "__main__":
    main()
