"""Small calls of every CUDA kernel, forward and backward, for compute-sanitizer (gpu_check.sh):
odd sizes and a contiguous view starting one element into its storage, so both the vectorised
and the scalar paths run. `python scripts/sanitizer_cases.py [DEVICE]`: cuda by default; cpu for
gpu_check.sh's rehearsal."""
import sys

import torch

import fused_rl_ops
from fused_rl_ops.value_head import value_head

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def synchronize():
    if dev == "cuda":
        torch.cuda.synchronize()

for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for interleaved in (False, True):
        for F in (8, 7):
            storage = torch.randn(5 * 2 * F + 1, device=dev, dtype=dtype) * 8
            for offset in (0, 1):
                x = storage[offset : offset + 5 * 2 * F].view(5, 2 * F).detach().requires_grad_(True)
                fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved).sum().backward()
                scale = torch.rand(5, device=dev, requires_grad=True)
                fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved, scale=scale).sum().backward()
        # The weighted backward's row sum across several warps of one row, and rows past the grid.
        x = torch.randn(3000, 2 * 1000, device=dev, dtype=dtype, requires_grad=True)
        scale = torch.rand(3000, 1, device=dev, requires_grad=True)
        fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved, scale=scale).sum().backward()
synchronize()
print("sanitizer cases ran")

# chosen_logprob: several chunks (the last one partial), padded rows, an ignored token; the weight
# gradient returned and added into a main_grad.
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    hidden = torch.randn(37, 33, device=dev, dtype=dtype, requires_grad=True)
    weight = (torch.randn(300, 33, device=dev, dtype=dtype) * 0.2).requires_grad_(True)
    tokens = torch.randint(0, 290, (37,), device=dev)
    tokens[0] = -100
    for main_grad in (None, torch.zeros(300, 33, device=dev)):
        lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, tokens, temperature=0.7, vocab_size=290,
                                              return_entropy=True, workspace_bytes=1, main_grad=main_grad)
        (lp.sum() + ent.sum()).backward()
synchronize()
print("chosen_logprob cases ran")

# value_head: 70 rows (a full and a partial 64-row block of the weight gradient), H = 13 and a
# misaligned view for the scalar paths.
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for H in (16, 13):
        storage = torch.randn(70 * H + 1, device=dev, dtype=dtype)
        weight = torch.randn(1, H, device=dev, requires_grad=True)
        bias = torch.randn((), device=dev, requires_grad=True)
        for offset in (0, 1):
            hidden = storage[offset : offset + 70 * H].view(70, H).detach().requires_grad_(True)
            value_head(hidden, weight, bias).sum().backward()
synchronize()
print("value_head cases ran")
