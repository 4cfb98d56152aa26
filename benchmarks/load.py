"""How busy the machine is while a benchmark runs: a timed row records the load average before and
after and how many cores other processes used meanwhile (from /proc/stat, less this process and
its children); a CPU row during which others used more than BUSY_OTHER_CORES is marked busy."""
import os
import time

BUSY_OTHER_CORES = 0.5  # other processes' average CPU use above which a CPU row counts as busy


def _busy_cpu_seconds() -> float:
    """CPU time the whole machine spent outside idle and iowait since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU time of this process and its finished children (peak-memory and distributed workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadProbe:
    """Measures, between start() and stop(), how many cores other processes used on average."""

    def start(self):
        self.load_before = os.getloadavg()[0]
        self._wall, self._busy, self._own = time.perf_counter(), _busy_cpu_seconds(), own_cpu_seconds()
        return self

    def stop(self, ranks_cpu_seconds: float = 0.0) -> dict:
        """ranks_cpu_seconds: CPU time meanwhile of the run's processes that are not this one's
        children (the other ranks of a distributed run), not counted as others'."""
        wall = time.perf_counter() - self._wall
        others = (_busy_cpu_seconds() - self._busy) - (own_cpu_seconds() - self._own) - ranks_cpu_seconds
        return {"load_before": round(self.load_before, 2), "load_after": round(os.getloadavg()[0], 2),
                "other_cores": round(max(others, 0.0) / wall, 2)}


whole_run = LoadProbe().start()  # the whole benchmark, from this module's import to write_json


def is_busy(load: dict) -> bool:
    return load["other_cores"] > BUSY_OTHER_CORES


def busy_note(load: dict) -> str:
    return (f"BUSY: other processes used {load['other_cores']:.2f} cores, load average "
            f"{load['load_before']:.2f} -> {load['load_after']:.2f}; CPU ratios on this row are not reliable")
