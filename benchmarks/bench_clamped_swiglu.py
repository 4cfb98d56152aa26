"""Clamped SwiGLU: fused kernel vs eager PyTorch, torch.compile of it, and Transformer Engine's
ClampedSwiGLU op where importable (CUDA; listed as missing otherwise), forward and forward+backward;
then the weighted form (an MoE expert's activation times its fp32 routing weights, at gpt-oss's
expert width F = 2880 and 512..8192 tokens per expert) against megatron-core's eager weighted path
and torch.compile of it.

Effective bandwidth counts the bytes that must move: forward reads x and writes y (3 elements per
output), backward reads x and dy and writes dx (5 elements per output); the routing weights (one
fp32 value per token each way) are left out. The plot (--json PATH -> PATH.png) draws every path's
GB/s per shape (unweighted) under the machine's measured copy bandwidth."""
import torch

import fused_rl_ops
from fused_rl_ops import reference

from .plots import bandwidth_figure
from .results import RowLog, find_peers, parse_args, png_path, write_json
from .tables import add_times, summary_table
from .timing import run_mode, time_paths


def load_transformer_engine():
    if dev != "cuda":
        raise RuntimeError("Transformer Engine runs on CUDA only")
    from transformer_engine.pytorch import ops as te_ops

    return te_ops.ClampedSwiGLU(limit=7.0, alpha=1.702)


args = parse_args(__doc__)
log = RowLog(args.json)
dev = args.device
shapes = [(1024, 2880)] if args.quick else [(4096, 2880), (4096, 8192), (16384, 2880), (16384, 8192)]
dtypes = [torch.float32, torch.bfloat16]
reps = 2 if args.quick else 5
# One compiled graph per shape and dtype: raise dynamo's recompile limit (8 by default), past which
# it silently falls back to eager.
torch._dynamo.config.recompile_limit = 64
compiled_reference = torch.compile(reference.clamped_swiglu, dynamic=False)
paths = {"fused": fused_rl_ops.clamped_swiglu, "eager": reference.clamped_swiglu, "compile": compiled_reference}
peers, versions = find_peers({"te": ("transformer-engine", load_transformer_engine)})
paths.update(peers)

rows = []
for tokens, F in shapes:
    for dtype in dtypes:
        x = torch.randn(tokens, 2 * F, device=dev, dtype=dtype) * 4
        x.requires_grad_(True)
        grad = torch.randn(tokens, F, device=dev, dtype=dtype)
        elem_bytes = tokens * F * x.element_size()
        for mode, bytes_moved in (("fwd", 3 * elem_bytes), ("fwd+bwd", 8 * elem_bytes)):
            row = {"tokens": tokens, "F": F, "dtype": str(dtype).replace("torch.", ""), "mode": mode}
            times = time_paths({name: run_mode(fn, [x], [grad], mode) for name, fn in paths.items()}, dev, reps=reps)
            rows.append(log("results", add_times(row, times, bytes_moved, [p for p in paths if p != "fused"])))



def weighted(fn):
    return lambda x, probs: fn(x, scale=probs)


weighted_paths = {name: weighted(paths[name]) for name in ("fused", "eager", "compile")}
expert_tokens = [512] if args.quick else [512, 2048, 8192]
weighted_rows = []
for tokens in expert_tokens:
    F = 2880
    for dtype in dtypes:
        x = (torch.randn(tokens, 2 * F, device=dev, dtype=dtype) * 4).requires_grad_(True)
        probs = torch.rand(tokens, device=dev).requires_grad_(True)
        grad = torch.randn(tokens, F, device=dev, dtype=dtype)
        elem_bytes = tokens * F * x.element_size()
        for mode, bytes_moved in (("fwd", 3 * elem_bytes), ("fwd+bwd", 8 * elem_bytes)):
            row = {"tokens": tokens, "F": F, "dtype": str(dtype).replace("torch.", ""), "mode": mode}
            closures = {name: run_mode(fn, [x, probs], [grad], mode) for name, fn in weighted_paths.items()}
            weighted_rows.append(log("weighted", add_times(row, time_paths(closures, dev, reps=reps), bytes_moved,
                                                           ["eager", "compile"])))

baselines = [p for p in paths if p != "fused"]
columns = ["tokens", "F", "dtype", "mode", "fused_ms", "fused_GB/s", "fused_%copy"]
tables = [summary_table("clamped_swiglu, speedup x_<path> = path time / fused time", rows,
                        columns + [f"{p}_ms" for p in baselines] + [f"x_{p}" for p in baselines]),
          summary_table("clamped_swiglu weighted by fp32 routing weights (scale=), speedup x_<path> = path time / "
                        "fused time", weighted_rows, columns + ["eager_ms", "compile_ms", "x_eager", "x_compile"])]
plot_file = png_path(args.json)
bandwidth_figure(rows, list(paths), lambda r: f"{r['tokens']}x{r['F']} {r['dtype']}", "clamped_swiglu", dev, plot_file)
top = [r for r in rows if r["mode"] == "fwd+bwd" and r["dtype"] == "bfloat16"][-1]
shape = f"{top['tokens']}x{top['F']} bf16 fwd+bwd"
headline = [{"metric": f"{p} / fused time, {shape}", "value": top[f"x_{p}"], "busy": top["busy"]} for p in baselines]
headline.append({"metric": f"fused % of copy bandwidth, {shape}", "value": top["fused_%copy"], "busy": top["busy"]})
write_json(args.json, "clamped_swiglu", dev, rows, headline=headline, tables=tables, peers=versions, plot=plot_file,
           weighted=weighted_rows)
