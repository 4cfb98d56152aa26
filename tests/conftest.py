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


def pytest_collection_modifyitems(items):
    """Marks per_device every test that takes the device fixture, so that `-m per_device` with
    FUSED_RL_OPS_TEST_DEVICES=cuda selects what runs on the GPU (scripts/gpu_check.sh); tests that
    need a GPU carry the mark themselves."""
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.per_device)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)



# Property tests (hypothesis) are reproducible in CI: derandomized (examples derived from the test
# itself), no example database, no per-example deadline (the first call of an op builds its
# thread pools). Each test sets its own small max_examples. Where hypothesis is not installed
# (a GPU machine without a package registry, say), only the property tests are skipped.
try:
    from hypothesis import HealthCheck, settings
except ImportError:
    pass
else:
    settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("ci")


@pytest.fixture
def checkpoint_dependencies():
    """Skips a test of save_sharded / load_sharded where they cannot run: no xxhash package."""
    from fused_rl_ops.checkpoint import integrity

    if integrity.xxhash is None:
        pytest.skip("the xxhash package (the [checkpoint] extra) is missing")
