import math

import pytest
import torch

import fused_rl_ops
from fused_rl_ops import reference

PRESETS = {"gpt-oss": dict(alpha=1.702, linear_offset=1.0), "clamped-silu": dict(alpha=1.0, linear_offset=0.0)}
FP32_TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def edge_input(rows, F, limit, dtype, device, interleaved):
    """Random x with gate and linear values exactly on -L and L, beyond them, and NaN / +-inf."""
    x = torch.randn(rows, 2 * F, dtype=torch.float64) * 5
    g, u = (x[:, 0::2], x[:, 1::2]) if interleaved else (x[:, :F], x[:, F:])
    specials = [limit, -limit, limit + 1, -limit - 1, math.nan, math.inf, -math.inf, 0.0]
    for k, v in enumerate(specials[: F]):
        g[0, k] = v
        u[-1, k] = v
    return x.to(device=device, dtype=dtype)


def assert_close_nonfinite(actual, expected, **tol):
    """Equal finite values; non-finite exactly where the reference is (inf and NaN may swap: with an
    infinite input, inf * (a + b) and inf * a + inf * b differ only in that)."""
    actual, expected = actual.double().cpu(), expected.cpu()
    assert torch.equal(actual.isfinite(), expected.isfinite())
    finite = expected.isfinite()
    torch.testing.assert_close(actual[finite], expected[finite], **tol)


def reference_grads(x, grad_out, limit, preset, interleaved):
    x64 = x.detach().double().requires_grad_(True)
    y64 = reference.clamped_swiglu(x64, limit, interleaved=interleaved, **preset)
    y64.backward(grad_out.double())
    return y64.detach(), x64.grad


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("limit", [7.0, None])
@pytest.mark.parametrize("shape", [(1, 8), (5, 7), (3, 4, 64), (33, 130)])
def test_matches_float64_reference(device, shape, limit, preset, interleaved):
    *lead, F = shape
    rows = math.prod(lead)
    x = edge_input(rows, F, limit or 7.0, torch.float32, device, interleaved).reshape(*lead, 2 * F)
    x.requires_grad_(True)
    grad_out = torch.randn(*lead, F, device=device)
    y = fused_rl_ops.clamped_swiglu(x, limit, interleaved=interleaved, **PRESETS[preset])
    y.backward(grad_out)
    y_ref, grad_ref = reference_grads(x, grad_out, limit, PRESETS[preset], interleaved)
    assert y.dtype == torch.float32 and y.shape == (*lead, F)
    torch.testing.assert_close(y.double().cpu(), y_ref.cpu(), equal_nan=True, **FP32_TOLERANCE)
    assert_close_nonfinite(x.grad, grad_ref, **FP32_TOLERANCE)


def test_gradient_masks_include_the_boundary(device):
    # Gate exactly at L and linear exactly at +-L still pass gradient (torch 2.14's clamp gradient is 0
    # there; see the README's "Gradient masks"); strictly beyond them the gradient is zero.
    L = 7.0
    x = torch.tensor([[L, L + 0.5, 1.0, 1.0, L, -L, L + 0.5, -L - 0.5]], device=device, requires_grad=True)
    fused_rl_ops.clamped_swiglu(x, L).sum().backward()
    dg, du = x.grad[0, :4], x.grad[0, 4:]
    assert dg[0] != 0 and dg[1] == 0 and dg[2] != 0
    assert du[0] != 0 and du[1] != 0 and du[2] == 0 and du[3] == 0


ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # relative spacing of the dtype, at worst


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("limit", [7.0, None])
def test_reduced_precision(device, dtype, interleaved, limit):
    # F = 200: three full SIMD tiles and a partial one per row; edge values (on and beyond +-L, NaN,
    # +-inf) in the first row's gate and the last row's linear half.
    x = edge_input(64, 200, limit or 7.0, torch.float32, device, interleaved).to(dtype)
    x.requires_grad_(True)
    grad_out = torch.randn(64, 200, device=device).to(dtype)
    y = fused_rl_ops.clamped_swiglu(x, limit, interleaved=interleaved)
    y.backward(grad_out)
    y_ref, grad_ref = reference_grads(x, grad_out, limit, PRESETS["gpt-oss"], interleaved)
    assert y.dtype == dtype and x.grad.dtype == dtype
    # Computed in fp32 and rounded once: within one ulp of the float64 result (atol covers values
    # that cancel to near zero in the gradient).
    torch.testing.assert_close(y.double().cpu(), y_ref.cpu(), equal_nan=True, atol=1e-6, rtol=ULP[dtype])
    assert_close_nonfinite(x.grad, grad_ref, atol=1e-4, rtol=ULP[dtype])


def test_non_contiguous_input(device):
    base = torch.randn(16, 40, 3, device=device) * 4
    x = base[..., 1]  # strided view, last-dim stride 3
    assert not x.is_contiguous()
    torch.testing.assert_close(fused_rl_ops.clamped_swiglu(x), fused_rl_ops.clamped_swiglu(x.contiguous()), rtol=0, atol=0)


def test_empty_input(device):
    x = torch.empty(0, 10, device=device, requires_grad=True)
    y = fused_rl_ops.clamped_swiglu(x)
    y.sum().backward()
    assert y.shape == (0, 5) and x.grad.shape == (0, 10)


def test_gradcheck_float64():
    for interleaved in (False, True):
        # F = 70: one full SIMD tile and a partial one per row
        x = (torch.randn(3, 140, dtype=torch.float64) * 3).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda t: fused_rl_ops.clamped_swiglu(t, 7.0, interleaved=interleaved), (x,))
        assert torch.autograd.gradcheck(lambda t: fused_rl_ops.clamped_swiglu(t, None, alpha=1.0, linear_offset=0.0), (x,))


@pytest.mark.parametrize("interleaved", [False, True])
def test_opcheck(device, interleaved):
    x = torch.randn(6, 20, device=device) * 4
    grad_out = torch.randn(6, 10, device=device)
    torch.library.opcheck(torch.ops.fused_rl_ops.clamped_swiglu, (x.requires_grad_(True), 7.0, 1.702, 1.0, interleaved))
    torch.library.opcheck(torch.ops.fused_rl_ops.clamped_swiglu_backward, (grad_out, x.detach(), None, 1.0, 0.0, interleaved))


def test_torch_compile_fullgraph(device):
    def mlp_act(x):
        return fused_rl_ops.clamped_swiglu(x * 2.0, 7.0).sum(dim=-1)

    compiled = torch.compile(mlp_act, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 32, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    compiled(x).sum().backward()
    mlp_act(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


def test_bad_inputs(device):
    with pytest.raises(ValueError, match="last dimension must be even"):
        fused_rl_ops.clamped_swiglu(torch.randn(3, 7, device=device))
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        fused_rl_ops.clamped_swiglu(torch.ones(3, 8, dtype=torch.int32, device=device))
    for limit in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="limit must be None or a positive number, got"):
            fused_rl_ops.clamped_swiglu(torch.randn(3, 8, device=device), limit)
    for bad in (dict(alpha=0.0), dict(alpha=-1.702), dict(alpha=math.inf), dict(alpha=math.nan)):
        with pytest.raises(ValueError, match="alpha must be a positive finite number, got"):
            fused_rl_ops.clamped_swiglu(torch.randn(3, 8, device=device), **bad)
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="linear_offset must be a finite number, got"):
            fused_rl_ops.clamped_swiglu(torch.randn(3, 8, device=device), linear_offset=bad)
    with pytest.raises(TypeError, match="x must be a tensor"):
        fused_rl_ops.clamped_swiglu([1.0, 2.0])


def test_mismatched_devices_in_backward_are_rejected():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="grad_out must match"):
        torch.ops.fused_rl_ops.clamped_swiglu_backward(torch.randn(3, 5), x, 7.0, 1.702, 1.0, False)


def test_ops_called_directly_reject_what_the_kernels_cannot_read():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="x's last dimension must be even"):
        torch.ops.fused_rl_ops.clamped_swiglu(torch.randn(3, 7), 7.0, 1.702, 1.0, False)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        torch.ops.fused_rl_ops.clamped_swiglu(torch.ones(3, 8, dtype=torch.int32), 7.0, 1.702, 1.0, False)
    with pytest.raises(ValueError, match="grad_out must match"):
        torch.ops.fused_rl_ops.clamped_swiglu_backward(torch.randn(3, 4).bfloat16(), x, 7.0, 1.702, 1.0, False)


# The weighted form: y = clamped_swiglu(x) * scale, one scale per row (an MoE expert's routing weights).

def scale_for(x, form, dtype):
    """Routing-weight-like scales in (0, 1], of shape x.shape[:-1] ("rows") or x.shape[:-1] + (1,)."""
    lead = tuple(x.shape[:-1])
    s = torch.rand(lead, dtype=torch.float64) * 0.9 + 0.1
    return (s if form == "rows" else s.unsqueeze(-1)).to(device=x.device, dtype=dtype)


def reference_scaled(x, scale, grad_out, limit, preset, interleaved):
    x64 = x.detach().double().requires_grad_(True)
    s64 = scale.detach().double().requires_grad_(True)
    y64 = reference.clamped_swiglu(x64, limit, interleaved=interleaved, scale=s64, **preset)
    y64.backward(grad_out.double())
    return y64.detach(), x64.grad, s64.grad


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("form", ["rows", "rows1"])
@pytest.mark.parametrize("shape", [(1, 8), (5, 7), (3, 4, 64), (33, 130)])
def test_scaled_matches_float64_reference(device, shape, form, preset, interleaved):
    *lead, F = shape
    x = edge_input(math.prod(lead), F, 7.0, torch.float32, device, interleaved).reshape(*lead, 2 * F)
    x.requires_grad_(True)
    scale = scale_for(x, form, torch.float32).requires_grad_(True)
    grad_out = torch.randn(*lead, F, device=device)
    y = fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved, scale=scale, **PRESETS[preset])
    y.backward(grad_out)
    y_ref, gx_ref, gs_ref = reference_scaled(x, scale, grad_out, 7.0, PRESETS[preset], interleaved)
    assert y.dtype == torch.float32 and y.shape == (*lead, F)
    assert scale.grad.dtype == torch.float32 and scale.grad.shape == scale.shape
    torch.testing.assert_close(y.double().cpu(), y_ref.cpu(), equal_nan=True, **FP32_TOLERANCE)
    assert_close_nonfinite(x.grad, gx_ref, **FP32_TOLERANCE)
    # The scale's gradient sums F terms: fp32 rounding grows with the row's length and magnitude.
    assert_close_nonfinite(scale.grad, gs_ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", ["fp32", "x"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_scaled_reduced_precision(device, dtype, scale_dtype, interleaved):
    # Computed in fp32 (the scale widened exactly) and rounded once: y within one ulp of float64.
    x = edge_input(64, 200, 7.0, torch.float32, device, interleaved).to(dtype).requires_grad_(True)
    scale = scale_for(x, "rows1", torch.float32 if scale_dtype == "fp32" else dtype).requires_grad_(True)
    grad_out = torch.randn(64, 200, device=device).to(dtype)
    y = fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved, scale=scale)
    y.backward(grad_out)
    y_ref, gx_ref, gs_ref = reference_scaled(x, scale, grad_out, 7.0, PRESETS["gpt-oss"], interleaved)
    assert y.dtype == dtype and x.grad.dtype == dtype and scale.grad.dtype == scale.dtype
    torch.testing.assert_close(y.double().cpu(), y_ref.cpu(), equal_nan=True, atol=1e-6, rtol=ULP[dtype])
    assert_close_nonfinite(x.grad, gx_ref, atol=1e-4, rtol=ULP[dtype])
    # Summed in fp32, then rounded once to the scale's dtype.
    scale_ulp = ULP.get(scale.dtype, 1e-5)
    assert_close_nonfinite(scale.grad, gs_ref, atol=1e-3, rtol=scale_ulp)


def test_scale_of_one_is_the_plain_op(device):
    x = torch.randn(7, 2 * 150, device=device) * 5
    ones = torch.ones(7, device=device)
    for interleaved in (False, True):
        plain = fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved)
        scaled = fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved, scale=ones)
        assert torch.equal(plain, scaled)


def test_scaled_empty_input(device):
    for rows, F in ((0, 5), (3, 0)):
        x = torch.randn(rows, 2 * F, device=device, requires_grad=True)
        scale = torch.rand(rows, device=device, requires_grad=True)
        y = fused_rl_ops.clamped_swiglu(x, scale=scale)
        y.sum().backward()
        assert y.shape == (rows, F) and x.grad.shape == x.shape
        assert torch.equal(scale.grad, torch.zeros_like(scale))  # an empty row's sum is 0


def test_scale_gradient_is_deterministic_across_thread_counts():
    # One row per task, summed in a fixed order: bitwise the same at 1 thread and at several.
    x = (torch.randn(257, 2 * 2880) * 4).requires_grad_(True)
    scale = torch.rand(257).requires_grad_(True)
    grad_out = torch.randn(257, 2880)
    grads = []
    threads = torch.get_num_threads()
    for n in (1, max(threads, 2)):
        torch.set_num_threads(n)
        try:
            x.grad = scale.grad = None
            fused_rl_ops.clamped_swiglu(x, scale=scale).backward(grad_out)
            grads.append((x.grad.clone(), scale.grad.clone()))
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_scaled_gradcheck_float64():
    for interleaved in (False, True):
        x = (torch.randn(3, 140, dtype=torch.float64) * 3).requires_grad_(True)
        scale = (torch.rand(3, dtype=torch.float64) + 0.1).requires_grad_(True)
        assert torch.autograd.gradcheck(
            lambda t, s: fused_rl_ops.clamped_swiglu(t, 7.0, interleaved=interleaved, scale=s), (x, scale)
        )
        assert torch.autograd.gradcheck(
            lambda t, s: fused_rl_ops.clamped_swiglu(t, None, alpha=1.0, linear_offset=0.0, scale=s),
            (x, scale.detach().unsqueeze(-1).requires_grad_(True)),
        )


@pytest.mark.parametrize("interleaved", [False, True])
def test_scaled_opcheck(device, interleaved):
    x = torch.randn(6, 20, device=device) * 4
    scale = torch.rand(6, 1, device=device)
    grad_out = torch.randn(6, 10, device=device)
    torch.library.opcheck(
        torch.ops.fused_rl_ops.clamped_swiglu,
        (x.requires_grad_(True), 7.0, 1.702, 1.0, interleaved, scale.requires_grad_(True)),
    )
    torch.library.opcheck(
        torch.ops.fused_rl_ops.clamped_swiglu_scaled_backward,
        (grad_out, x.detach(), scale.detach().squeeze(-1).bfloat16().float(), None, 1.0, 0.0, interleaved),
    )


def test_scaled_torch_compile_fullgraph(device):
    def expert_act(x, probs):
        return fused_rl_ops.clamped_swiglu(x * 2.0, 7.0, scale=probs.unsqueeze(-1)).sum(dim=-1)

    compiled = torch.compile(expert_act, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 32, device=device, requires_grad=True)
    probs = torch.rand(8, device=device, requires_grad=True)
    x_ref, probs_ref = (t.detach().clone().requires_grad_(True) for t in (x, probs))
    compiled(x, probs).sum().backward()
    expert_act(x_ref, probs_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(probs.grad, probs_ref.grad, rtol=0, atol=0)


def test_bad_scale(device):
    x = torch.randn(4, 3, 8, device=device)
    with pytest.raises(ValueError, match=r"scale must have shape x.shape\[:-1\]"):
        fused_rl_ops.clamped_swiglu(x, scale=torch.rand(4, device=device))
    with pytest.raises(ValueError, match=r"scale must have shape x.shape\[:-1\]"):
        fused_rl_ops.clamped_swiglu(x, scale=torch.rand(4, 3, 4, device=device))
    with pytest.raises(TypeError, match="scale must be float32 or x's dtype"):
        fused_rl_ops.clamped_swiglu(x, scale=torch.rand(4, 3, device=device, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="scale must be a tensor or None"):
        fused_rl_ops.clamped_swiglu(x, scale=0.5)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        fused_rl_ops.clamped_swiglu(x, scale=torch.rand(4, 3, device="meta"))
    # The C++ entry points check too (the op called directly).
    with pytest.raises(TypeError, match="scale must be float32 or x's dtype"):
        torch.ops.fused_rl_ops.clamped_swiglu(x, 7.0, 1.702, 1.0, False, torch.rand(4, 3, device=device).double())
    with pytest.raises(ValueError, match="scale must have shape"):
        torch.ops.fused_rl_ops.clamped_swiglu_scaled_backward(
            torch.randn(4, 3, 4, device=device), x, torch.rand(3, device=device), 7.0, 1.702, 1.0, False
        )
