"""Gathers the benchmarks' JSON files (default bench_results/) into one summary table of headline
figures per benchmark run, printed, and DIR/REPORT.md with every benchmark's tables and plot.

    python -m benchmarks.report [DIR]"""
import glob
import json
import os
import sys

from .load import BUSY_OTHER_CORES
from .tables import format_cell, print_table


def markdown_table(columns: list, rows: list) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def busy_rows(result: dict) -> tuple:
    """(rows measured on a busy machine, rows with timings) of one benchmark."""
    timed = [r for r in result["results"] if "busy" in r]
    return sum(bool(r["busy"]) for r in timed), len(timed)


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else "bench_results"
    # A run of a benchmark by its file's name (bench_chosen_logprob, bench_chosen_logprob_sampler_filter):
    # an op's benchmark may run more than once, with other options.
    paths = sorted(glob.glob(os.path.join(directory, "bench_*.json")))
    runs = {os.path.basename(path)[:-len(".json")]: json.load(open(path)) for path in paths}
    if not runs:
        sys.exit(f"no bench_*.json in {directory}")
    summary = [{"run": name, "headline": h["metric"], "value": h["value"],
                "load average": "{load_before} -> {load_after}".format(**r["environment"]["load"]),
                "busy": "BUSY" if h.get("busy") else ""} for name, r in runs.items() for h in r.get("headline", [])]
    columns = ["run", "headline", "value", "load average", "busy"]
    busy = {name: busy_rows(r) for name, r in runs.items()}
    busy_total, timed_total = sum(b for b, _ in busy.values()), sum(t for _, t in busy.values())
    env = next(iter(runs.values()))["environment"]
    machine = (f"{env.get('gpu') or env['machine']}, {env['cpus']} CPUs ({env.get('cpu_isa', '?')} row kernels), "
               f"torch {env['torch']}, "
               f"copy bandwidth {env['copy_GB/s']:.1f} GB/s")
    busy_line = (f"{busy_total} of {timed_total} timed rows were measured while other processes used more than "
                 f"{BUSY_OTHER_CORES} cores (marked busy; CPU ratios there are not reliable)")

    print("\n=== summary: headline figures per benchmark run (x / fused time: above 1 means fused is faster)")
    print(machine)
    print_table(summary, columns)
    print(busy_line)

    lines = ["# Benchmark report", "", f"Machine: {machine}.", "", busy_line + ".", "", "## Summary", "",
             markdown_table(columns, summary), ""]
    for name, result in runs.items():
        env = result["environment"]
        lines += [f"## {name}", "",
                  f"Device {env['device']}; load average {env['load']['load_before']} at the start, "
                  f"{env['load']['load_after']} at the end; other processes used {env['load']['other_cores']} "
                  f"cores on average; busy rows {busy[name][0]} of {busy[name][1]}.", ""]
        if result.get("peers"):
            lines += ["Peers: " + ", ".join(f"{peer} {version}" for peer, version in result["peers"].items()) + ".", ""]
        if result.get("plot"):
            lines += [f"![{result['benchmark']}]({result['plot']})", ""]
        for table in result.get("tables", []):
            lines += [f"**{table['title']}**", "", markdown_table(table["columns"], table["rows"]), ""]
    path = os.path.join(directory, "REPORT.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.abspath(path)}")


if __name__ == "__main__":
    main()
