"""Value head: fused kernel vs F.linear on hidden.float() and F.linear in hidden's dtype, forward and
forward+backward.

The fused op runs with an fp32 weight (bf16 hidden with an fp32 head), the fp32 path is
reference.value_head (F.linear(hidden.float(), w)), the native path F.linear with the weight in
hidden's dtype. Effective bandwidth counts the bytes that must move: forward reads hidden and
writes the values; backward reads hidden and grad_out and writes the hidden gradient. The plot
(--json PATH -> PATH.png) draws every path's GB/s per shape under the machine's measured copy
bandwidth."""
import torch
import torch.nn.functional as F

from fused_rl_ops import reference
from fused_rl_ops.value_head import value_head

from .plots import bandwidth_figure
from .results import RowLog, parse_args, png_path, write_json
from .tables import add_times, summary_table
from .timing import run_mode, time_paths

args = parse_args(__doc__)
log = RowLog(args.json)
dev = args.device
shapes = [(2048, 4096)] if args.quick else [(n, h) for n in (8192, 32768) for h in (4096, 8192)]
dtypes = [torch.bfloat16, torch.float32]
reps = 3 if dev == "cpu" else 5


def native(hidden, weight):
    return F.linear(hidden, weight.to(hidden.dtype)).squeeze(-1)


paths = {"fused": value_head, "fp32": reference.value_head, "native": native}

rows = []
for tokens, H in shapes:
    for dtype in dtypes:
        hidden = torch.randn(tokens, H, device=dev, dtype=dtype, requires_grad=True)
        weight = (torch.randn(1, H, device=dev) / H**0.5).requires_grad_(True)
        grad = torch.randn(tokens, device=dev)
        hidden_bytes = tokens * H * hidden.element_size()
        for mode, bytes_moved in (("fwd", hidden_bytes + 4 * tokens), ("fwd+bwd", 3 * hidden_bytes + 12 * tokens)):
            row = {"tokens": tokens, "H": H, "dtype": str(dtype).replace("torch.", ""), "mode": mode}
            runs = {name: run_mode(fn, [hidden, weight], [grad.to(fn(hidden, weight).dtype)], mode)
                    for name, fn in paths.items()}
            times = time_paths(runs, dev, reps=reps)
            rows.append(log("results", add_times(row, times, bytes_moved, ["fp32", "native"])))
        del hidden, weight, grad

table = summary_table("value_head, speedup x_<path> = path time / fused time", rows,
                      ["tokens", "H", "dtype", "mode", "fused_ms", "fused_GB/s", "fused_%copy", "fp32_ms", "native_ms",
                       "x_fp32", "x_native"])
plot_file = png_path(args.json)
bandwidth_figure(rows, list(paths), lambda r: f"{r['tokens']}x{r['H']} {r['dtype']}", "value_head", dev, plot_file)
top = [r for r in rows if r["mode"] == "fwd+bwd" and r["dtype"] == "bfloat16"][-1]
shape = f"{top['tokens']}x{top['H']} bf16 fwd+bwd"
headline = [{"metric": f"{p} / fused time, {shape}", "value": top[f"x_{p}"], "busy": top["busy"]}
            for p in ("fp32", "native")]
headline.append({"metric": f"fused % of copy bandwidth, {shape}", "value": top["fused_%copy"], "busy": top["busy"]})
write_json(args.json, "value_head", dev, rows, headline=headline, tables=[table], plot=plot_file)
