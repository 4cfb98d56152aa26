import math

import pytest
import torch

from fused_rl_ops import reference
from fused_rl_ops.value_head import ValueHead, value_head

ops = torch.ops.fused_rl_ops
# fp32 sums of up to a few thousand products of N(0, 1) values.
FP32_TOLERANCE = dict(atol=1e-4, rtol=1e-5)


def make_inputs(lead, H, device, hidden_dtype=torch.float32, param_dtype=torch.float32, weight_2d=False,
                bias_shape=None):
    hidden = torch.randn(*lead, H, device=device).to(hidden_dtype).requires_grad_(True)
    weight = torch.randn(*((1, H) if weight_2d else (H,)), device=device).to(param_dtype).requires_grad_(True)
    bias = None if bias_shape is None else torch.randn(bias_shape, device=device).to(param_dtype).requires_grad_(True)
    return hidden, weight, bias


def run_with_grads(fn, hidden, weight, bias, grad_out):
    """fn's values and the gradients of hidden, weight and bias (None where bias is None)."""
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    values = fn(hidden, weight, bias)
    values.backward(grad_out)
    return values.detach(), hidden.grad, weight.grad, None if bias is None else bias.grad


def reference_results(hidden, weight, bias, grad_out):
    """Values and gradients of reference.value_head, all in float64 on the CPU."""
    leaves = [None if t is None else t.detach().cpu().double().requires_grad_(True) for t in (hidden, weight, bias)]
    return run_with_grads(reference.value_head, *leaves, grad_out.detach().cpu().double())


@pytest.mark.parametrize("bias_shape", [None, (), (1,)])
@pytest.mark.parametrize("weight_2d", [False, True])
@pytest.mark.parametrize("lead, H", [((1,), 1), ((5,), 7), ((3, 4), 64), ((130,), 130), ((2, 67), 1003)])
def test_matches_float64_reference(device, lead, H, weight_2d, bias_shape):
    # 130 and 134 rows cross the 64-row blocks of the weight-gradient reduction; 1003 leaves a tail
    # after every SIMD width and takes the CUDA kernels' scalar path.
    hidden, weight, bias = make_inputs(lead, H, device, weight_2d=weight_2d, bias_shape=bias_shape)
    grad_out = torch.randn(*lead, device=device)
    results = run_with_grads(value_head, hidden, weight, bias, grad_out)
    expected = reference_results(hidden, weight, bias, grad_out)
    assert results[0].dtype == torch.float32 and results[0].shape == lead
    for name, got, want, like in zip(("values", "hidden grad", "weight grad", "bias grad"), results, expected,
                                     (results[0], hidden, weight, bias)):
        if want is None:
            assert got is None
            continue
        assert got.dtype == like.dtype and got.shape == like.shape, name
        torch.testing.assert_close(got.cpu().double(), want, **FP32_TOLERANCE, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("hidden_dtype, param_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                       (torch.bfloat16, torch.bfloat16)])
def test_reduced_precision_hidden(device, hidden_dtype, param_dtype):
    # Inputs are exact in their dtype, so the fp32 accumulation must match float64 closely; only the
    # outputs stored in a reduced dtype are rounded once.
    hidden, weight, bias = make_inputs((3, 70), 1000, device, hidden_dtype, param_dtype, bias_shape=())
    grad_out = torch.randn(3, 70, device=device)
    values, grad_hidden, grad_weight, grad_bias = run_with_grads(value_head, hidden, weight, bias, grad_out)
    expected = reference_results(hidden, weight, bias, grad_out)
    assert values.dtype == torch.float32
    assert (grad_hidden.dtype, grad_weight.dtype, grad_bias.dtype) == (hidden_dtype, param_dtype, param_dtype)
    torch.testing.assert_close(values.cpu().double(), expected[0], **FP32_TOLERANCE)
    rounding = dict(atol=1e-5, rtol=2 ** -8 if torch.bfloat16 in (hidden_dtype, param_dtype) else 2 ** -11)
    torch.testing.assert_close(grad_hidden.cpu().double(), expected[1].to(hidden_dtype).double(), **rounding)
    for got, want in zip((grad_weight, grad_bias), expected[2:]):
        torch.testing.assert_close(got.cpu().double(), want.to(param_dtype).double(), **rounding)


def test_gradcheck_float64():
    hidden = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    for weight_shape, bias_shape in (((5,), ()), ((1, 5), (1,))):
        weight = torch.randn(weight_shape, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(bias_shape, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(value_head, (hidden, weight, bias))
    assert torch.autograd.gradcheck(value_head, (hidden, weight, None))


def test_opcheck(device):
    hidden, weight, bias = make_inputs((6, 5), 40, device, torch.bfloat16, bias_shape=(1,))
    grad_out = torch.randn(6, 5, device=device)
    torch.library.opcheck(ops.value_head, (hidden, weight, bias))
    torch.library.opcheck(ops.value_head, (hidden, weight.detach(), None))
    torch.library.opcheck(ops.value_head_backward_hidden, (grad_out, weight.detach(), torch.bfloat16))
    torch.library.opcheck(ops.value_head_backward_params, (grad_out, hidden.detach()))


def test_torch_compile_fullgraph(device):
    head = ValueHead(48, bias=True).to(device)

    def critic(hidden):
        return head(torch.tanh(hidden)) * 2.0

    compiled = torch.compile(critic, fullgraph=True, backend="aot_eager")
    hidden = torch.randn(4, 9, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(4, 9, device=device)
    grads = []
    for fn in (compiled, critic):
        hidden.grad = head.weight.grad = head.bias.grad = None
        fn(hidden).backward(grad_out)
        grads.append((hidden.grad, head.weight.grad, head.bias.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_deterministic(device):
    hidden, weight, bias = make_inputs((333,), 520, device, torch.bfloat16, bias_shape=())
    grad_out = torch.randn(333, device=device)
    first = run_with_grads(value_head, hidden, weight, bias, grad_out)
    second = run_with_grads(value_head, hidden, weight, bias, grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_cpu_results_do_not_depend_on_thread_count():
    hidden, weight, bias = make_inputs((700,), 300, "cpu", bias_shape=())
    grad_out = torch.randn(700)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_with_grads(value_head, hidden, weight, bias, grad_out)
        torch.set_num_threads(max(2, threads))
        multi = run_with_grads(value_head, hidden, weight, bias, grad_out)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(single, multi):
        assert torch.equal(a, b)


def test_non_contiguous_hidden(device):
    # Megatron's [s, b, h] read as [b, s, h], and a view whose rows are strided slices.
    base = torch.randn(6, 3, 2 * 40, device=device)
    weight = torch.randn(40, device=device)
    for view in (base[..., :40].transpose(0, 1), base[..., 1::2]):
        assert not view.is_contiguous()
        hidden = view.detach().requires_grad_(True)
        values = value_head(hidden, weight)
        values.backward(torch.ones_like(values))
        dense = view.contiguous().requires_grad_(True)
        dense_values = value_head(dense, weight)
        dense_values.backward(torch.ones_like(dense_values))
        assert torch.equal(values, dense_values) and torch.equal(hidden.grad, dense.grad)


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_empty_input(device, lead):
    hidden, weight, bias = make_inputs(lead, 16, device, bias_shape=())
    values, grad_hidden, grad_weight, grad_bias = run_with_grads(
        value_head, hidden, weight, bias, torch.empty(lead, device=device))
    assert values.shape == lead and grad_hidden.shape == (*lead, 16)
    assert torch.equal(grad_weight, torch.zeros_like(weight)) and grad_bias.item() == 0


def test_value_head_module():
    torch.manual_seed(1)
    head = ValueHead(4096)
    assert head.bias is None and head.weight.shape == (1, 4096) and head.weight.dtype == torch.float32
    assert math.isclose(head.weight.std().item(), 1 / 4097, rel_tol=0.05) and abs(head.weight.mean().item()) < 1e-4
    # Its state dict is an nn.Linear(H, 1)'s.
    linear = torch.nn.Linear(4096, 1, bias=False)
    linear.load_state_dict(head.state_dict())
    hidden = torch.randn(2, 3, 4096, dtype=torch.bfloat16)
    torch.testing.assert_close(head(hidden), linear(hidden.float()).squeeze(-1), **FP32_TOLERANCE)
    with_bias = ValueHead(8, bias=True, dtype=torch.bfloat16)
    assert with_bias.bias.shape == (1,) and with_bias.bias.item() == 0 and with_bias.weight.dtype == torch.bfloat16
    assert "bias=True" in repr(with_bias)


def test_bad_inputs(device):
    hidden = torch.randn(3, 8, device=device)
    weight = torch.randn(8, device=device)
    cases = [
        (ValueError, "weight must be \\[H\\] or \\[1, H\\]", (hidden, torch.randn(7, device=device))),
        (ValueError, "weight must be \\[H\\] or \\[1, H\\]", (hidden, torch.randn(2, 8, device=device))),
        (ValueError, "H >= 1", (torch.randn(3, 0, device=device), torch.randn(0, device=device))),
        (ValueError, "H >= 1", (torch.tensor(1.0, device=device), weight)),
        (TypeError, "hidden must be float32, bfloat16 or float16",
         (torch.ones(3, 8, dtype=torch.int32, device=device), weight)),
        (TypeError, "weight must be float32 or hidden's dtype",
         (hidden.bfloat16(), weight.half())),
        (TypeError, "bias must be float32 or hidden's dtype", (hidden, weight, torch.tensor(1.0, dtype=torch.half))),
        (ValueError, "bias must be a scalar tensor or \\[1\\]", (hidden, weight, torch.randn(2, device=device))),
        (ValueError, "all tensors must be on one device", (hidden, weight.to("meta"))),
        (TypeError, "weight must be a tensor", (hidden, [1.0] * 8)),
    ]
    if device == "cuda":
        cases.append((TypeError, "float64 only on CPU", (hidden.double(), weight.double())))
    for error, message, args in cases:
        with pytest.raises(error, match=message):
            value_head(*args)
        if all(isinstance(a, torch.Tensor) for a in args):  # the op called directly keeps the same contract
            with pytest.raises(error, match=message):
                ops.value_head(*args, *[None] * (3 - len(args)))


def test_backward_ops_check_their_arguments():
    hidden, weight = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="grad_out must match"):
        ops.value_head_backward_params(torch.randn(5), hidden)
    with pytest.raises(ValueError, match="grad_out must match"):
        ops.value_head_backward_params(torch.randn(4, dtype=torch.float64), hidden)
    with pytest.raises(ValueError, match="grad_out must match"):
        ops.value_head_backward_hidden(torch.randn(4).bfloat16(), weight, torch.bfloat16)
    with pytest.raises(ValueError, match="weight must be H >= 1 values"):
        ops.value_head_backward_hidden(torch.randn(4), torch.randn(0), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 1003])  # SIMD / vectorised only, and with a scalar tail
@pytest.mark.parametrize("where, value", [("hidden", math.nan), ("hidden", math.inf), ("hidden", -math.inf),
                                          ("hidden zero weight", math.inf), ("weight", math.nan),
                                          ("weight", math.inf), ("bias", math.nan), ("bias", -math.inf)])
def test_non_finite_values_and_gradients_as_float64_linear(device, dtype, H, where, value):
    """NaN / inf in hidden, weight or bias reach the values and the gradients exactly where F.linear in
    float64 puts them (inf * 0 = NaN included); everything else stays finite and close."""
    hidden, weight, bias = make_inputs((130,), H, device, dtype, bias_shape=(1,))
    with torch.no_grad():
        if where.startswith("hidden"):
            hidden[[3, 70], H - 1] = value
            if where == "hidden zero weight":
                weight[H - 1] = 0.0
        elif where == "weight":
            weight[H - 1] = value
        else:
            bias.fill_(value)
    grad_out = torch.randn(130, device=device)
    results = run_with_grads(value_head, hidden, weight, bias, grad_out)
    expected = reference_results(hidden, weight, bias, grad_out)
    for name, got, want in zip(("values", "hidden grad", "weight grad", "bias grad"), results, expected):
        got = got.double().cpu()
        assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN at {got.isnan().nonzero().tolist()[:5]}"
        assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()]), name
        rounding = 2**-8 if dtype == torch.bfloat16 and name == "hidden grad" else 0.0
        torch.testing.assert_close(got, want, atol=1e-4, rtol=max(1e-5, rounding), equal_nan=True,
                                   msg=lambda m: f"{name}: {m}")
