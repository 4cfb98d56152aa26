"""The benchmarks' plots (matplotlib, written to files next to the JSON)."""
from .timing import copy_bandwidth


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


def bars_figure(panels: list, title: str, path, busy=False):
    """Panels of grouped bars side by side, each a dict of bar_chart's arguments (groups, values,
    ylabel, and ceiling where it has one) with its "title"; the figure titled, marked where a row
    was measured on a busy machine, and saved to path."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        bar_chart(ax, **{k: v for k, v in panel.items() if k != "title"})
        ax.set_title(panel.get("title", ""), fontsize=9)
    fig.suptitle(title + ("  (! = busy machine)" if busy else ""), fontsize=10)
    save_figure(fig, path)


def bandwidth_figure(rows: list, paths: list, label, title: str, device: str, path):
    """Effective GB/s of every path per row (label(row) names the group), forward and forward+backward
    side by side, with the machine's copy bandwidth as the ceiling."""
    if not path:
        return
    panels = []
    for mode in sorted({r["mode"] for r in rows}):
        chosen = [r for r in rows if r["mode"] == mode]
        panels.append({"title": mode, "groups": [label(r) + (" !" if r.get("busy") else "") for r in chosen],
                       "values": {p: [r.get(f"{p}_GB/s") for r in chosen] for p in paths},
                       "ylabel": "effective GB/s", "ceiling": copy_bandwidth(device),
                       "ceiling_label": "measured copy bandwidth"})
    bars_figure(panels, f"{title} on {device}", path, busy=any(r.get("busy") for r in rows))
