"""Small calls of every CUDA kernel, forward and backward, for compute-sanitizer (gpu_check.sh):
each op's cases, as tests.helpers.op_table lists the ops (the cases themselves are in
tests/helpers/sanitizer_cases.py). `python scripts/sanitizer_cases.py [DEVICE]`: cuda by
default; cpu for gpu_check.sh's rehearsal."""
import sys

import torch

from tests.helpers.op_table import OPS

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
for op in OPS:
    op.sanitizer_cases(device)
    if device == "cuda":
        torch.cuda.synchronize()  # an error of the op's kernels is reported before the next op's
    print(f"{op.name} cases ran")
