"""Gathers the benchmarks' JSON files (default bench_results/) into one summary table of headline
figures per op, printed, and DIR/REPORT.md with every benchmark's tables and plot.

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
    results = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(directory, "bench_*.json")))]
    if not results:
        sys.exit(f"no bench_*.json in {directory}")
    summary = [{"op": r["benchmark"], "headline": h["metric"], "value": h["value"],
                "load average": "{load_before} -> {load_after}".format(**r["environment"]["load"]),
                "busy": "BUSY" if h.get("busy") else ""} for r in results for h in r.get("headline", [])]
    columns = ["op", "headline", "value", "load average", "busy"]
    busy = {r["benchmark"]: busy_rows(r) for r in results}
    busy_total, timed_total = sum(b for b, _ in busy.values()), sum(t for _, t in busy.values())
    env = results[0]["environment"]
    machine = (f"{env.get('gpu') or env['machine']}, {env['cpus']} CPUs, torch {env['torch']}, "
               f"copy bandwidth {env['copy_GB/s']:.1f} GB/s")
    busy_line = (f"{busy_total} of {timed_total} timed rows were measured while other processes used more than "
                 f"{BUSY_OTHER_CORES} cores (marked busy; CPU ratios there are not reliable)")

    print("\n=== summary: headline figures per op (x / fused time: above 1 means fused is faster)")
    print(machine)
    print_table(summary, columns)
    print(busy_line)

    lines = ["# Benchmark report", "", f"Machine: {machine}.", "", busy_line + ".", "", "## Summary", "",
             markdown_table(columns, summary), ""]
    for result in results:
        env = result["environment"]
        lines += [f"## {result['benchmark']}", "",
                  f"Device {env['device']}; load average {env['load']['load_before']} at the start, "
                  f"{env['load']['load_after']} at the end; other processes used {env['load']['other_cores']} "
                  f"cores on average; busy rows {busy[result['benchmark']][0]} of {busy[result['benchmark']][1]}.", ""]
        if result.get("peers"):
            lines += ["Peers: " + ", ".join(f"{name} {version}" for name, version in result["peers"].items()) + ".", ""]
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
