"""Peak resident memory of a piece of code (Linux), for the tests and the benchmarks."""
import concurrent.futures
import ctypes
import json
import multiprocessing
import os
import tempfile


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _release_free_heap():
    """Hands the C heap's free pages back to the system (glibc's malloc_trim), so that memory freed
    before a measurement is not reused unseen by it."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def peak_rss_growth(run) -> int:
    """Bytes by which this process's peak resident memory rises, while run() runs, above what it
    held just before (after freed heap memory is handed back)."""
    _release_free_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current resident memory
    before = _status_kib("VmRSS")
    run()
    return (_status_kib("VmHWM") - before) * 1024


def in_fresh_process(fn, *args):
    """fn(*args) in a newly spawned Python process, whose heap holds nothing left over from this
    one; returns its result (an exception there is raised here). fn must be a module-level function,
and the main module's own work must sit under `if __name__ == "__main__":` (the new process
imports it)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def peak_allocated(fn) -> int:
    """The most bytes torch's CPU allocator held at once during fn(), above what it held before
    (the allocations of every thread, in the order they happened, from torch's profiler): exact,
    where the resident memory (peak_rss_growth) moves with the C heap's state."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as directory:
        trace = os.path.join(directory, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            memory = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    events = [e["args"] for e in sorted(memory, key=lambda e: float(e["ts"]))]
    cpu = [e for e in events if e["Device Type"] == 0]
    if not cpu:
        return 0
    start = cpu[0]["Total Allocated"] - cpu[0]["Bytes"]
    return max(e["Total Allocated"] for e in cpu) - start
