"""value_head's CUDA kernels on the CPU (tests/helpers/kernels_on_cpu.py), against float64."""
import math

import pytest
import torch

from tests.helpers.kernels_on_cpu import (FP32_EPS, HALF_DTYPES, Buf, assert_passes, assert_rounded_once,  # noqa: F401
                                    assert_within, drivers, dtype_scalar, pytestmark, run_case, sum_tolerance)


# ---------------------------------------------------------------------------------------------
# value_head: value_head_forward_kernel, value_head_backward_hidden_kernel,
# value_head_partials_kernel and value_head_sum_partials_kernel (value_head/kernel.cuh)


# (rows, H, grid-stride passes, pointer offset in elements, vector path?). The forward's blocks
# take 8 rows, backward_hidden's [rows, H / N] tiles of 256 threads up to 32.
VALUE_HEAD_CASES = [
    (70, 40, "several", 0, True),
    (70, 40, "one", 0, True),
    (13, 37, "several", 0, False),  # H no width divides: the scalar path
    (13, 40, "one", 1, False),      # a misaligned pointer: the scalar path
    (9, 640, "several", 0, True),   # enough packs for the 4-loads-in-flight loop and its tail
]


@pytest.mark.parametrize("rows,H,passes,offset,vector", VALUE_HEAD_CASES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_value_head_forward_and_backward_hidden(drivers, tmp_path, rows, H, passes, offset, vector, dtype):
    hidden = torch.randn(rows, H).to(dtype)
    weight = torch.randn(H)
    bias = torch.randn(1)
    width = 16 // hidden.element_size() if vector else 1
    scalars = dict(rows=rows, H=H, dtype=dtype_scalar(dtype), has_bias=int(rows % 2))

    out, [launch] = run_case(drivers, "value_head", "forward",
                             {"hidden": Buf(hidden, offset), "weight": Buf(weight, offset), "bias": Buf(bias),
                              "out": Buf(torch.full((rows,), math.nan))},
                             scalars, passes=passes, block_order_seed=7, tmp_dir=tmp_path / "fwd")
    assert launch.width == width
    assert_passes(launch, rows, passes)
    terms = hidden.double() * weight.double()
    expected = terms.sum(1) + (bias.double() if rows % 2 else 0.0)
    assert_within(out["out"], expected, sum_tolerance(terms) + FP32_EPS * expected.abs(), "forward")

    grad_out = torch.randn(rows)
    out, [launch] = run_case(drivers, "value_head", "backward_hidden",
                             {"grad_out": Buf(grad_out), "weight": Buf(weight, offset),
                              "grad_hidden": Buf(torch.full((rows, H), math.nan).to(dtype), offset)},
                             scalars, passes=passes, tmp_dir=tmp_path / "bwd")
    assert launch.width == width
    assert_passes(launch, rows, passes)
    assert_rounded_once(out["grad_hidden"], grad_out.double()[:, None] * weight.double(), dtype, "grad_hidden")


@pytest.mark.parametrize("rows,H,offset", [
    (63, 40, 0),     # one partial row block
    (64, 40, 0),     # exactly one
    (65, 37, 0),     # one and a row; the scalar path
    (130, 300, 1),   # column tiles over blockIdx.y; a misaligned pointer
    (1093, 8, 0),    # 18 row blocks: stage 2 sums more partial rows than its 16 slices
])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_value_head_backward_params(drivers, tmp_path, rows, H, offset, dtype):
    hidden = torch.randn(rows, H).to(dtype)
    grad_out = torch.randn(rows)
    blocks = (rows + 63) // 64
    out, launches = run_case(drivers, "value_head", "backward_params",
                             {"grad_out": Buf(grad_out), "hidden": Buf(hidden, offset),
                              "weight_partials": Buf(torch.full((blocks, H), math.nan), offset),
                              "bias_partials": Buf(torch.full((blocks,), math.nan)),
                              "grad_weight": Buf(torch.full((H,), math.nan)),
                              "grad_bias": Buf(torch.full((1,), math.nan))},
                             dict(rows=rows, H=H, dtype=dtype_scalar(dtype)), block_order_seed=3, tmp_dir=tmp_path)
    vector = H % (16 // hidden.element_size()) == 0 and offset == 0
    assert launches[0].width == (16 // hidden.element_size() if vector else 1)
    g = grad_out.double()
    terms = g[:, None] * hidden.double()                           # [rows, H]
    padded = torch.cat([terms, terms.new_zeros(blocks * 64 - rows, H)]).view(blocks, 64, H).transpose(1, 2)
    assert_within(out["weight_partials"], padded.sum(-1), sum_tolerance(padded), "stage 1 weight partials")
    g_blocks = torch.cat([g, g.new_zeros(blocks * 64 - rows)]).view(blocks, 64)
    assert_within(out["bias_partials"], g_blocks.sum(-1), sum_tolerance(g_blocks), "stage 1 bias partials")
    assert_within(out["grad_weight"], terms.sum(0), sum_tolerance(terms.T), "grad_weight")
    assert_within(out["grad_bias"], g.sum()[None], sum_tolerance(g[None]), "grad_bias")
