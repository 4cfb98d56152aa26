"""What every benchmark takes (parse_args) and writes (write_json: rows, tables, headline figures,
the machine, the peers' versions), and find_peers, which reports a missing peer instead of dropping it."""
import argparse
import json
import os
import platform

import torch

from .load import whole_run
from .timing import copy_bandwidth


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
           "copy_GB/s": copy_bandwidth(device), "load": whole_run.stop()}
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
