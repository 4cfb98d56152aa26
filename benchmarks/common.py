"""Timing, machine load, tables, plots and JSON for the benchmarks (each benchmarks/bench_<op>.py
measures one op; benchmarks/report.py gathers their JSON into bench_results/REPORT.md).

Timing (time_paths): each path runs a few warm-up calls, then interleaved rounds (each round calls
every path once), and reports the median and inter-quartile range over the rounds. On CUDA a call
is timed with CUDA events, after writing a buffer larger than the L2 cache so that no call finds
its inputs left in L2 by the previous one; on the CPU with perf_counter.

Machine load: on the 2-core machines we share, a busy neighbour moves CPU ratios by 2-3x. Every
timed row records the load average before and after and how many cores other processes used
while it ran (from /proc/stat less this process and its children); a row whose paths disagree
between rounds is measured again, and a row during which others used more than half a core is
marked busy, with a warning printed beside it."""
import argparse
import json
import os
import platform
import statistics
import time

import torch

BUSY_OTHER_CORES = 0.5  # other processes' average CPU use above which a CPU row counts as busy
DISAGREEMENT = 1.3  # a row is measured again when a path's time relative to the first path varies more
RETRIES = 2  # ... at most this many more times,
RETRY_BUDGET_S = 60  # ... and only while its rounds so far took less than this


def parse_args(description: str, extra=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON, and a plot next to it (.png)")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats (smoke run)")
    if extra:
        extra(parser)
    return parser.parse_args()


def png_path(json_path):
    """The plot's path, next to the JSON (no plot without --json)."""
    return os.path.splitext(json_path)[0] + ".png" if json_path else None


def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------- load


def _busy_cpu_seconds() -> float:
    """CPU time the whole machine spent outside idle and iowait since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU time of this process and its finished children (peak-memory and distributed workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadProbe:
    """Measures, between start() and stop(), how many cores other processes used on average."""

    def start(self):
        self.load_before = os.getloadavg()[0]
        self._wall, self._busy, self._own = time.perf_counter(), _busy_cpu_seconds(), _own_cpu_seconds()
        return self

    def stop(self) -> dict:
        wall = time.perf_counter() - self._wall
        others = (_busy_cpu_seconds() - self._busy) - (_own_cpu_seconds() - self._own)
        return {"load_before": round(self.load_before, 2), "load_after": round(os.getloadavg()[0], 2),
                "other_cores": round(max(others, 0.0) / wall, 2)}


_whole_run = LoadProbe().start()  # the whole benchmark, from this module's import to write_json


def busy_note(load: dict) -> str:
    return (f"BUSY: other processes used {load['other_cores']:.2f} cores, load average "
            f"{load['load_before']:.2f} -> {load['load_after']:.2f}; CPU ratios on this row can be off by 2-3x")


# -------------------------------------------------------------------------------------- timing


class Timing(float):
    """A path's median time in seconds over the rounds; q1 and q3 are its quartiles."""

    def __new__(cls, samples: list):
        timing = super().__new__(cls, statistics.median(samples))
        timing.q1, _, timing.q3 = (statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1
                                   else samples * 3)
        return timing


class Timings(dict):
    """name -> Timing of one row, plus how it was measured: device, load (LoadProbe's dict), busy,
    attempts, disagreement (the largest max / min over rounds of a path's time relative to the
    first path)."""


_l2_flush_buffer = None


def flush_l2():
    """Writes a buffer twice the L2 cache's size (at least 256 MiB) on the current CUDA device."""
    global _l2_flush_buffer
    if _l2_flush_buffer is None:
        l2_bytes = getattr(torch.cuda.get_device_properties(), "L2_cache_size", 0)
        _l2_flush_buffer = torch.empty(max(2 * l2_bytes, 256 << 20) // 4, dtype=torch.int32, device="cuda")
    _l2_flush_buffer.fill_(1)


def time_call(fn, device: str) -> float:
    """Seconds one call of fn takes: CUDA events after an L2 flush, or perf_counter on the CPU."""
    if device == "cuda":
        flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rounds(fns: dict, device: str, reps: int) -> dict:
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(time_call(fn, device))
    return samples


def _disagreement(samples: dict) -> float:
    """Over the paths, the largest max / min across rounds of the path's time relative to the first path's."""
    first = next(iter(samples.values()))
    spreads = [max(r) / min(r) for r in ([t / f for t, f in zip(times, first)] for times in samples.values())]
    return max(spreads) if len(first) > 1 else 1.0


def time_paths(fns: dict, device: str, warmup: int = 1, reps: int = 5) -> Timings:
    """Times every fns[name]() (see the module docstring): name -> Timing, median over `reps`
    interleaved rounds, after `warmup` calls of each. Interleaving puts the machine's noise and the
    allocator's state (a path that runs after one with large temporaries finds the heap grown and
    skips the page faults of fresh memory) on all paths alike. On CUDA at least 3 warm-up calls
    and 10 rounds, more for short calls (about half a second per path, at most 200); on the CPU a row whose
    paths disagree between rounds by more than DISAGREEMENT is measured again, up to RETRIES times
    while the row has taken less than RETRY_BUDGET_S, and the most consistent attempt is kept."""
    if device == "cuda":
        warmup = max(warmup, 3)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    if device == "cuda":
        slowest = max(time_call(fn, device) for fn in fns.values())
        reps = max(reps, min(200, max(10, int(0.5 / max(slowest, 1e-6)))))
    probe = LoadProbe().start()
    best, max_attempts, started = None, 1 + (RETRIES if device == "cpu" and reps > 1 else 0), time.perf_counter()
    for attempts in range(1, max_attempts + 1):
        samples = _rounds(fns, device, reps)
        disagreement = _disagreement(samples)
        if best is None or disagreement < best[1]:
            best = samples, disagreement
        if (disagreement <= DISAGREEMENT or attempts == max_attempts
                or time.perf_counter() - started > RETRY_BUDGET_S):
            break
        print(f"  (paths disagree between rounds by {disagreement:.2f}x: measuring the row again)")
    timings = Timings({name: Timing(s) for name, s in best[0].items()})
    timings.load = probe.stop()
    timings.busy = device == "cpu" and timings.load["other_cores"] > BUSY_OTHER_CORES
    timings.attempts, timings.disagreement = attempts, round(best[1], 3)
    timings.device = device
    return timings


def record_times(row: dict, times: dict) -> dict:
    """Puts each path's median and inter-quartile range (ms) into row, and, for Timings, how the
    row was measured (load, busy, attempts, disagreement)."""
    for name, t in times.items():
        row[f"{name}_ms"] = t * 1e3
        if isinstance(t, Timing):
            row[f"{name}_iqr_ms"] = (t.q3 - t.q1) * 1e3
    if isinstance(times, Timings):
        row.update(times.load, busy=times.busy, attempts=times.attempts, disagreement=times.disagreement)
    return row


MEASUREMENT_COLUMNS = ("load_before", "load_after", "other_cores", "busy", "attempts", "disagreement")


def print_row(row: dict, columns: list):
    """Prints one row as a table, with the busy warning under it when it applies."""
    print_table([row], columns)
    if row.get("busy"):
        print("  ! " + busy_note(row))


def add_times(row: dict, times: dict, bytes_moved: float, baselines: list) -> dict:
    """Fills row with each path's time (ms, median and IQR) and effective bandwidth, the fused
    path's share of the machine's copy bandwidth, and x_<baseline> = that baseline's time / the fused
    time; prints it as a one-row table and returns it."""
    record_times(row, times)
    for name, t in times.items():
        row[f"{name}_GB/s"] = bytes_moved / t / 1e9
    row["fused_%copy"] = 100 * row["fused_GB/s"] / copy_bandwidth(getattr(times, "device", "cpu"))
    for name in baselines:
        row[f"x_{name}"] = row[f"{name}_ms"] / row["fused_ms"]
    print_row(row, [c for c in row if not c.endswith("_iqr_ms") and c not in MEASUREMENT_COLUMNS])
    return row


def copy_bandwidth(device: str) -> float:
    """The machine's measured copy bandwidth in GB/s (bytes read + written per second by a large
    tensor copy: 256 MiB on the CPU, 1 GiB on CUDA), measured once per process."""
    if device not in _copy_bandwidth:
        numel = (1 << 30 if device == "cuda" else 256 << 20) // 4
        src = torch.ones(numel, device=device)
        dst = torch.empty_like(src)
        times = _rounds({"copy": lambda: dst.copy_(src)}, device, reps=2)  # warm-up: fault in dst
        times = _rounds({"copy": lambda: dst.copy_(src)}, device, reps=5 if device == "cpu" else 20)
        _copy_bandwidth[device] = 2 * src.nbytes / statistics.median(times["copy"]) / 1e9
    return _copy_bandwidth[device]


_copy_bandwidth = {}


# ----------------------------------------------------------------------------- shared closures


def fwd_bwd(fn, inputs, grads=None):
    """A closure running fn(*inputs) and backward through every output (grads: upstream grads)."""

    def run():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads if grads is not None else [torch.ones_like(o) for o in outs])

    return run


def run_mode(fn, inputs, grads, mode: str):
    """A closure timing one mode: fn(*inputs) without autograd ("fwd"), or forward and backward."""
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn(*inputs)

        return run
    return fwd_bwd(fn, inputs, grads)


# ---------------------------------------------------------------------------------------- peers


def find_peers(candidates: dict) -> tuple:
    """candidates: name -> (distribution, loader), loader() returning the path's function or
    raising (ImportError, RuntimeError, ...) with why it cannot run here. Returns ({name: fn} of
    those that load, {name: version or "missing: why"} of all) so a missing peer is reported,
    not dropped."""
    from importlib import metadata

    found, versions = {}, {}
    for name, (distribution, loader) in candidates.items():
        try:
            found[name] = loader()
            versions[name] = metadata.version(distribution) if distribution else torch.__version__
        except Exception as exc:  # noqa: BLE001  (any failure to load means: not available here)
            versions[name] = f"missing: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    for name, version in versions.items():
        print(f"peer {name}: {version}")
    return found, versions


# --------------------------------------------------------------------------------- tables, JSON


def print_table(rows: list, columns: list):
    """Prints rows (dicts) as an aligned table of the given columns; floats get 4 significant digits."""
    cells = [[format_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def format_cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def summary_table(title: str, rows: list, columns: list) -> dict:
    """Prints a titled table and returns it for write_json (REPORT.md shows it); rows that were
    measured on a busy machine get a trailing '!' column."""
    columns = columns + (["busy"] if any(r.get("busy") for r in rows) else [])
    print(f"\n{title}")
    print_table(rows, columns)
    busy = sum(bool(r.get("busy")) for r in rows)
    if busy:
        print(f"  ! {busy} of {len(rows)} rows were measured while other processes used more than "
              f"{BUSY_OTHER_CORES} cores")
    return {"title": title, "columns": columns, "rows": [{c: r.get(c, "") for c in columns} for r in rows]}


def environment(device: str) -> dict:
    env = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "copy_GB/s": copy_bandwidth(device), "load": _whole_run.stop()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def write_json(path, name: str, device: str, rows: list, headline=(), tables=(), peers=None, plot=None, **extra):
    """Writes the results: rows, the summary tables, headline figures ({"metric", "value",
    "busy"}: what bench.sh's summary shows), the peers' versions and the plot's file name."""
    if path:
        result = {"benchmark": name, "environment": environment(device), "results": rows,
                  "headline": list(headline), "tables": list(tables), "peers": peers or {},
                  "plot": os.path.basename(plot) if plot else None, **extra}
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")


# ---------------------------------------------------------------------------------------- plots


def pyplot():
    """matplotlib.pyplot with the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    print(f"wrote {path}")


def bar_chart(ax, groups: list, values: dict, ylabel: str, ceiling=None, ceiling_label=""):
    """Grouped bars: one group per label in groups, one bar per name in values (name -> list of
    numbers, one per group; None for no bar), and a dashed horizontal line at ceiling."""
    width = 0.8 / max(len(values), 1)
    for i, (name, numbers) in enumerate(values.items()):
        xs = [g + (i - (len(values) - 1) / 2) * width for g in range(len(groups))]
        ax.bar([x for x, v in zip(xs, numbers) if v is not None], [v for v in numbers if v is not None],
               width, label=name)
    if ceiling:
        ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, label=ceiling_label)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def bandwidth_figure(rows: list, paths: list, label, title: str, device: str, path):
    """Effective GB/s of every path per row (label(row) names the group), forward and forward+backward
    side by side, with the machine's copy bandwidth as the ceiling."""
    if not path:
        return
    plt = pyplot()
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        chosen = [r for r in rows if r["mode"] == mode]
        bar_chart(ax, [label(r) + (" !" if r.get("busy") else "") for r in chosen],
                  {p: [r.get(f"{p}_GB/s") for r in chosen] for p in paths}, "effective GB/s",
                  ceiling=copy_bandwidth(device), ceiling_label="measured copy bandwidth")
        ax.set_title(mode)
    fig.suptitle(f"{title} on {device}" + ("  (! = busy machine)" if any(r.get("busy") for r in rows) else ""))
    save_figure(fig, path)
