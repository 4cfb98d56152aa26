"""clamped_swiglu's CUDA kernels on the CPU (tests/helpers/kernels_on_cpu.py), against float64."""
import math

import pytest
import torch

from fused_rl_ops import reference
from tests.helpers.kernels_on_cpu import (FP32_EPS, HALF_DTYPES, Buf, assert_passes, assert_rounded_once,  # noqa: F401
                                    assert_within, drivers, dtype_scalar, pytestmark, run_case, sum_tolerance)


# ---------------------------------------------------------------------------------------------
# clamped_swiglu: clamped_swiglu_{forward,backward,scaled_backward}_kernel (clamped_swiglu/kernel.cuh)

SWIGLU = dict(alpha=1.702, limit=7.0, offset=1.0)


def clamped_swiglu_input(rows, F, dtype):
    """x [rows, 2F] with values on and beyond +-limit among random ones (finite)."""
    x = torch.randn(rows, 2 * F, dtype=torch.float64) * 5
    edges = torch.tensor([7.0, -7.0, 8.5, -8.5, 0.0], dtype=torch.float64)
    x.view(-1)[: len(edges)] = edges
    x.view(-1)[-len(edges):] = edges
    return x.to(dtype)


def clamped_swiglu_reference(x, dy, interleaved):
    x64 = x.double().requires_grad_(True)
    y = reference.clamped_swiglu(x64, SWIGLU["limit"], alpha=SWIGLU["alpha"], linear_offset=SWIGLU["offset"],
                                 interleaved=interleaved)
    y.backward(dy.double())
    return y.detach(), x64.grad


# (rows, F, grid-stride passes, pointer offset in elements, vector or scalar path). Blocks are
# [rows, F / N] tiles of 256 threads: with F = 64, 8 to 32 rows per tile.
SWIGLU_CASES = [
    (40, 64, "several", 0, "vector"),
    (40, 64, "one", 0, "vector"),
    (5, 37, "several", 0, "scalar"),  # an F no vector width divides: row tails
    (5, 64, "one", 1, "scalar"),      # an aligned F but a misaligned pointer
    (2, 2080, "several", 0, "vector"),  # more packs per row than threads: column passes too
]


@pytest.mark.parametrize("rows,F,passes,offset,path", SWIGLU_CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_clamped_swiglu_forward_and_backward(drivers, tmp_path, rows, F, passes, offset, path, interleaved, dtype):
    x = clamped_swiglu_input(rows, F, dtype)
    dy = torch.randn(rows, F).to(dtype)
    y_ref, dx_ref = clamped_swiglu_reference(x, dy, interleaved)
    scalars = dict(rows=rows, F=F, dtype=dtype_scalar(dtype), interleaved=int(interleaved), has_scale=0, **SWIGLU)
    expected_width = (8 if interleaved else 16) // x.element_size() if path == "vector" else 1

    out, [launch] = run_case(drivers, "clamped_swiglu", "forward",
                             {"x": Buf(x, offset), "y": Buf(torch.full((rows, F), math.nan).to(dtype), offset)},
                             scalars, passes=passes, block_order_seed=rows, tmp_dir=tmp_path / "fwd")
    assert launch.width == expected_width
    assert_passes(launch, rows, passes)
    # u' + offset cancels for u' near -offset: an absolute fp32 error of eps |u'| |g' s| <= 50 eps.
    assert_rounded_once(out["y"], y_ref, dtype, "y", fp32_error=8 * FP32_EPS * 50)

    out, [launch] = run_case(drivers, "clamped_swiglu", "backward",
                             {"x": Buf(x, offset), "y": Buf(dy, offset),
                              "x_grad": Buf(torch.full((rows, 2 * F), math.nan).to(dtype), offset)},
                             scalars, passes=passes, tmp_dir=tmp_path / "bwd")
    assert launch.width == expected_width
    assert_passes(launch, rows, passes)
    # d/dg = dy (u' + offset) (s + alpha g' s (1 - s)) cancels between terms of up to ~100 in size
    # for |g|, |u| <= 7 (the clamp), |dy| <= 4: an absolute fp32 error of a few eps times 100.
    assert_rounded_once(out["x_grad"], dx_ref, dtype, "dx", fp32_error=8 * FP32_EPS * 100)


@pytest.mark.parametrize("rows,F,passes,offset,path", SWIGLU_CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_clamped_swiglu_weighted_forward_and_backward(drivers, tmp_path, rows, F, passes, offset, path, interleaved,
                                                      dtype):
    """The weighted form y = scale * swiglu(x): clamped_swiglu_forward_kernel with a scale buffer and
    clamped_swiglu_scaled_backward_kernel (dx and dscale). row_sum takes its shuffle-only branch where a
    row has at most a warp of threads (F = 64 on the vector path: 8 to 32 threads a row) and its
    shared-memory branch otherwise (64 or 256 threads a row)."""
    x = clamped_swiglu_input(rows, F, dtype)
    dy = torch.randn(rows, F).to(dtype)
    scale = torch.rand(rows) * 2  # routing weights; one of them 0
    scale[rows // 2] = 0.0
    x64, s64 = x.double().requires_grad_(True), scale.double().requires_grad_(True)
    y_ref = reference.clamped_swiglu(x64, SWIGLU["limit"], alpha=SWIGLU["alpha"], linear_offset=SWIGLU["offset"],
                                     interleaved=interleaved, scale=s64)
    y_ref.backward(dy.double())
    y_ref = y_ref.detach()
    scalars = dict(rows=rows, F=F, dtype=dtype_scalar(dtype), interleaved=int(interleaved), has_scale=1, **SWIGLU)
    expected_width = (8 if interleaved else 16) // x.element_size() if path == "vector" else 1
    row_fits_a_warp = F == 64 and path == "vector"

    out, [launch] = run_case(drivers, "clamped_swiglu", "forward",
                             {"x": Buf(x, offset), "scale": Buf(scale),
                              "y": Buf(torch.full((rows, F), math.nan).to(dtype), offset)},
                             scalars, passes=passes, block_order_seed=rows, tmp_dir=tmp_path / "fwd")
    assert launch.width == expected_width
    assert_passes(launch, rows, passes)
    # As the unweighted forward (its fp32 error times the scale), plus the product's rounding
    # (within the 8 eps relative).
    s = scale.double()[:, None]
    assert_rounded_once(out["y"], y_ref, dtype, "y", fp32_error=8 * FP32_EPS * 50 * s)

    out, [launch] = run_case(drivers, "clamped_swiglu", "scaled_backward",
                             {"x": Buf(x, offset), "y": Buf(dy, offset), "scale": Buf(scale),
                              "x_grad": Buf(torch.full((rows, 2 * F), math.nan).to(dtype), offset),
                              "dscale": Buf(torch.full((rows,), math.nan))},
                             scalars, passes=passes, block_order_seed=rows + 1, tmp_dir=tmp_path / "bwd")
    assert launch.width == expected_width
    assert (launch.block[0] <= 32) == row_fits_a_warp, launch
    assert_passes(launch, rows, passes)
    # dx: the unweighted backward's bound with dy * scale (one more rounding, within the 8 eps).
    assert_rounded_once(out["x_grad"], x64.grad, dtype, "dx", fp32_error=8 * FP32_EPS * 100 * s)
    # dscale = sum over the row of dy * swiglu(x): each term's fp32 error (8 eps relative and the
    # forward's 8 eps * 50 absolute, times |dy|), then the sum's, in any order.
    swiglu64 = reference.clamped_swiglu(x.double(), SWIGLU["limit"], alpha=SWIGLU["alpha"],
                                        linear_offset=SWIGLU["offset"], interleaved=interleaved)
    terms = dy.double() * swiglu64
    term_error = (8 * FP32_EPS * (terms.abs() + 50 * dy.double().abs())).sum(1)
    assert_within(out["dscale"], s64.grad, sum_tolerance(terms) + term_error, "dscale")
