"""Printed tables of benchmark rows, and the summary tables that the JSON and REPORT.md carry."""
from .load import BUSY_OTHER_CORES, busy_note
from .timing import MEASUREMENT_COLUMNS, copy_bandwidth, record_times


def format_cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def print_table(rows: list, columns: list):
    """Prints rows (dicts) as an aligned table of the given columns; floats get 4 significant digits."""
    cells = [[format_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def print_row(row: dict, columns: list):
    """Prints one row as a table, with the busy warning under it when it applies."""
    print_table([row], columns)
    if row.get("busy"):
        print("  ! " + busy_note(row))


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
