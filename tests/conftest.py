import os

import pytest
import torch

import fused_rl_ops

# Every op test runs on the CPU, and on CUDA too where a GPU and the CUDA kernels are present
# (the GPU script, scripts/gpu_check.sh). FUSED_RL_OPS_TEST_DEVICES=cuda restricts to one.
_available = ["cpu"] + (["cuda"] if torch.cuda.is_available() and fused_rl_ops.has_cuda_kernels() else [])
DEVICES = [d for d in os.environ.get("FUSED_RL_OPS_TEST_DEVICES", ",".join(_available)).split(",") if d]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
