"""Timing, tables and JSON for the benchmarks (each benchmarks/bench_<op>.py measures one op)."""
import argparse
import json
import platform
import statistics
import time

import torch


def parse_args(description: str, extra=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats (smoke run)")
    if extra:
        extra(parser)
    return parser.parse_args()


def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def time_paths(fns: dict, device: str, warmup: int = 1, reps: int = 5) -> dict:
    """name -> median wall time in seconds of fns[name](), after warmup calls of each. Repetitions
    are interleaved (each round calls every path once), so the machine's noise and the memory
    allocator's state (a path that runs after one with large temporaries finds the heap grown and
    skips the page faults of fresh memory) fall on all paths alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


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


def add_times(row: dict, times: dict, bytes_moved: float, baselines: list) -> dict:
    """Fills row with each path's time (ms) and effective bandwidth, and x_<baseline> = that
    baseline's time / the fused time; prints it as a one-row table and returns it."""
    for name, t in times.items():
        row[f"{name}_ms"] = t * 1e3
        row[f"{name}_GB/s"] = bytes_moved / t / 1e9
    for name in baselines:
        row[f"x_{name}"] = row[f"{name}_ms"] / row["fused_ms"]
    print_table([row], list(row))
    return row


def environment(device: str) -> dict:
    env = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def print_table(rows: list, columns: list):
    """Prints rows (dicts) as an aligned table of the given columns; floats get 4 significant digits."""
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_json(path, name: str, device: str, rows: list, **extra):
    if path:
        with open(path, "w") as f:
            json.dump({"benchmark": name, "environment": environment(device), "results": rows, **extra}, f, indent=2)
        print(f"wrote {path}")
