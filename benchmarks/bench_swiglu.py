"""Clamped SwiGLU: fused kernel vs eager PyTorch and torch.compile of it, forward and forward+backward;
then the weighted form (an MoE expert's activation times its fp32 routing weights, at gpt-oss's
expert width F = 2880 and 512..8192 tokens per expert) against megatron-core's eager weighted path
and torch.compile of it.

Effective bandwidth counts the bytes that must move: forward reads x and writes y (3 elements per
output), backward reads x and dy and writes dx (5 elements per output); the routing weights (one
fp32 value per token each way) are left out."""
import torch

import fused_rl_ops
from fused_rl_ops import reference
from common import add_times, parse_args, print_table, run_mode, time_paths, write_json

args = parse_args(__doc__)
dev = args.device
shapes = [(1024, 2880)] if args.quick else [(4096, 2880), (4096, 8192), (16384, 2880), (16384, 8192)]
dtypes = [torch.float32, torch.bfloat16]
reps = 2 if args.quick else 5
# One compiled graph per shape and dtype: raise dynamo's recompile limit (8 by default), past which
# it silently falls back to eager.
torch._dynamo.config.recompile_limit = 64
compiled_reference = torch.compile(reference.clamped_swiglu, dynamic=False)
paths = {"fused": fused_rl_ops.clamped_swiglu, "eager": reference.clamped_swiglu, "compile": compiled_reference}

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
            rows.append(add_times(row, times, bytes_moved, ["eager", "compile"]))


def weighted(fn):
    return lambda x, probs: fn(x, scale=probs)


weighted_paths = {name: weighted(fn) for name, fn in paths.items()}
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
            weighted_rows.append(add_times(row, time_paths(closures, dev, reps=reps), bytes_moved, ["eager", "compile"]))

columns = ["tokens", "F", "dtype", "mode", "fused_ms", "fused_GB/s", "eager_ms", "compile_ms", "x_eager", "x_compile"]
print("\nclamped_swiglu, speedup = baseline time / fused time")
print_table(rows, columns)
print("\nclamped_swiglu weighted by fp32 routing weights (scale=), speedup = baseline time / fused time")
print_table(weighted_rows, columns)
write_json(args.json, "clamped_swiglu", dev, rows, weighted=weighted_rows)
