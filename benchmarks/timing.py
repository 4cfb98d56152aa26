"""Timing (time_paths): each path runs a few warm-up calls, then interleaved rounds (each round calls
every path once), and reports the median and inter-quartile range over the rounds. On CUDA a call
is timed with CUDA events, after writing a buffer larger than the L2 cache so that no call finds
its inputs left in L2 by the previous one; on the CPU with perf_counter, with freed heap memory kept
(keep_freed_heap). A CPU row whose paths disagree between rounds is measured again (see
time_paths)."""
import ctypes
import statistics
import time

import torch

from .load import LoadProbe, is_busy

DISAGREEMENT = 1.3  # a row is measured again when a path's time relative to the first path varies more
RETRIES = 2  # ... at most this many more times,
RETRY_BUDGET_S = 60  # ... and only while its rounds so far took less than this
MEASUREMENT_COLUMNS = ("load_before", "load_after", "other_cores", "busy", "attempts", "disagreement")


# glibc's mallopt parameters, and its largest mmap threshold on 64-bit systems.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20


def keep_freed_heap():
    """Makes glibc's malloc keep the memory CPU tensors free for reuse, as PyTorch's CUDA caching
    allocator keeps freed blocks: the heap is never trimmed, and blocks under 32 MiB come from it
    (larger ones are mapped afresh, for every path alike). By default glibc's thresholds move with
    what was freed last, so a path's buffers may come back as fresh pages, each faulted in and zeroed
    on first touch, depending on which path ran before it (docs/benchmarks.md). Peak-memory probes
    release free memory first (benchmarks.peak_memory), so they see the same growth
    either way."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)


def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


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
    else:
        keep_freed_heap()
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
    timings.busy = device == "cpu" and is_busy(timings.load)
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
