"""What every benchmark takes (parse_args) and writes (RowLog: each row as it is measured;
write_json: rows, tables, headline figures, the machine, the peers' versions), and find_peers, which
reports a missing peer instead of dropping it."""
import argparse
import importlib.util
import json
import os
import platform

import torch

from fused_rl_ops._library import cpu_isa

from .load import whole_run
from .timing import copy_bandwidth


def parse_args(description: str, extra=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON, and a plot next to it (.png)")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats (smoke run)")
    if extra:
        extra(parser)
    args = parser.parse_args()
    print(f"CPU row kernels: {cpu_isa()} (ATen's CPU capability; ATEN_CPU_CAPABILITY=avx2 or default forces a lower one)")
    return args


def png_path(json_path):
    """The plot's path, next to the JSON; None (no plot) without --json, or without matplotlib (a
    GPU machine may lack it; the numbers still go to the JSON)."""
    if not json_path:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        print("no plot: matplotlib is not installed")
        return None
    return os.path.splitext(json_path)[0] + ".png"


class RowLog:
    """Appends each row, as soon as it is measured, as one JSON line {"table": ..., **row} to
    PATH.jsonl next to the --json PATH (emptied at the start), so a run cut short still leaves its
    numbers; write_json writes the whole result at the end. log(table, row) returns row."""

    def __init__(self, json_path):
        self.path = os.path.splitext(json_path)[0] + ".jsonl" if json_path else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            open(self.path, "w").close()

    def __call__(self, table: str, row: dict) -> dict:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"table": table, **row}) + "\n")
        return row


def find_peers(candidates: dict) -> tuple:
    """candidates: name -> (distribution, loader), loader() returning the path's function or
    raising (ImportError, RuntimeError, ...) with why it cannot run here. Returns ({name: fn} of
    those that load, {name: version or "missing: why"} of all) so a missing peer is reported,
    not dropped. A distribution of None means a part of torch (its version is torch's)."""
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


def environment(device: str) -> dict:
    env = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "cpu_isa": cpu_isa(), "copy_GB/s": copy_bandwidth(device), "load": whole_run.stop()}
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
