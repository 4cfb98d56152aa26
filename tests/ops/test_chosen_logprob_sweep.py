"""Property-based sweep of chosen_logprob (hypothesis): random shapes (empty, N = 1, H = 1, V_local = 1,
V not a multiple of the chunk), dtypes, layouts (strided, transposed, expanded, storage offset),
token dtypes, workspaces, batch_invariant, softcaps, values from denormals to 1e4 and non-finite ones, against
float64 autograd; and every kind of invalid call raises a clear error."""
import math

import pytest
import torch

import fused_rl_ops
from fused_rl_ops import reference

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SMALLEST_NORMAL_LOG10 = {torch.float32: -38, torch.bfloat16: -38, torch.float16: -5}
LAYOUTS = ("contiguous", "strided", "transposed", "expanded", "offset")


def base_shape(layout, rows, cols):
    return {"contiguous": (rows, cols), "strided": (rows, 2 * cols), "transposed": (cols, rows),
            "expanded": (1, cols), "offset": (rows * cols + 3,)}[layout]


def view(base, layout, rows, cols):
    """The [rows, cols] operand the op sees, as a view of base (the tensor gradients are taken of)."""
    if layout == "strided":
        return base[:, ::2]
    if layout == "transposed":
        return base.t()
    if layout == "expanded":
        return base.expand(rows, cols)
    if layout == "offset":
        return base[3:].view(rows, cols)
    return base


def spanning_values(shape, generator, log10_low, log10_high):
    """Random signs times 10^U(log10_low, log10_high): denormals to 1e4 when asked."""
    exponent = torch.rand(shape, generator=generator, dtype=torch.float64) * (log10_high - log10_low) + log10_low
    sign = torch.randint(0, 2, shape, generator=generator).double() * 2 - 1
    return sign * 10.0**exponent


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    N = draw(st.sampled_from([0, 1, 2, 7, 33]))
    H = draw(st.sampled_from([1, 3, 8, 17]))
    V = draw(st.sampled_from([1, 2, 127, 129, 300]))
    vocab_size = V - draw(st.integers(0, V - 1))
    low = draw(st.sampled_from([-3, SMALLEST_NORMAL_LOG10[dtype] - 4]))  # below the normals: denormals
    high = draw(st.sampled_from([0, 2 if dtype == torch.float16 else 4]))
    specials = draw(st.lists(st.tuples(st.sampled_from(["hidden", "weight"]), st.sampled_from([math.nan, math.inf,
                                       -math.inf]), st.floats(0, 1, exclude_max=True)), max_size=2))
    return dict(
        dtype=dtype, N=N, H=H, V=V, vocab_size=vocab_size, log10_range=(low, high), specials=specials,
        hidden_layout=draw(st.sampled_from(LAYOUTS)), weight_layout=draw(st.sampled_from(LAYOUTS)),
        token_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        strided_tokens=draw(st.booleans()),
        temperature=draw(st.sampled_from([0.5, 1.0, 1.7])),
        softcap=draw(st.sampled_from([None, None, 0.5, 30.0])),
        workspace=draw(st.sampled_from([1, 5000, 2**26])),
        batch_invariant=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def build(case):
    """Float64 bases (rounded to the case's dtype) with the specials written in, tokens, upstream grads."""
    g = torch.Generator().manual_seed(case["seed"])
    N, H, V, dtype = case["N"], case["H"], case["V"], case["dtype"]
    bases = {}
    for name, rows, layout in (("hidden", N, case["hidden_layout"]), ("weight", V, case["weight_layout"])):
        values = spanning_values(base_shape(layout, rows, H), g, *case["log10_range"])
        if name == "weight":
            values = values / max(H, 1) ** 0.5
        bases[name] = values.to(dtype).double()
    for name, value, where in case["specials"]:
        flat = bases[name].view(-1)
        if flat.numel():
            flat[int(where * flat.numel())] = value
    tokens = torch.randint(0, case["vocab_size"], (2 * N,), generator=g)
    tokens[: N // 3] = -100
    tokens = tokens[::2] if case["strided_tokens"] else tokens[:N]
    grads = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    return bases, tokens.to(case["token_dtype"]), grads


def run(case, bases, tokens, grads, *, fused, acc=torch.float64):
    """Outputs and the gradients of the two bases: fused (the op in the case's dtype), or the naive
    reference over the valid rows in acc (float64: the reference; float32: what a plain fp32
    computation of the same rounded inputs gets, the measure of the tolerance)."""
    dtype = case["dtype"] if fused else acc
    h_base = bases["hidden"].to(dtype, copy=True).requires_grad_(True)
    w_base = bases["weight"].to(dtype, copy=True).requires_grad_(True)
    hidden = view(h_base, case["hidden_layout"], case["N"], case["H"])
    weight = view(w_base, case["weight_layout"], case["V"], case["H"])
    kw = dict(temperature=case["temperature"], softcap=case["softcap"])
    if fused:
        lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, tokens, vocab_size=case["vocab_size"],
                                              return_entropy=True, workspace_bytes=case["workspace"],
                                              batch_invariant=case["batch_invariant"], **kw)
    else:
        lp, ent = reference.chosen_logprob(hidden, weight[: case["vocab_size"]], tokens.long(), **kw)
    (lp * grads[0].to(lp.dtype) + ent * grads[1].to(lp.dtype)).sum().backward()
    results = [lp.detach(), ent.detach(), h_base.grad, w_base.grad]
    return [torch.zeros(0) if t is None else t.double() for t in results]


def term_scales(case, bases, tokens, grads):
    """Per output entry, the sum of the magnitudes of the float64 terms it adds up (rounding errors
    scale with these, not with a result that cancels to 0): |logit| + |lse| for logprob and entropy;
    sums over the vocabulary / tokens of |d logit| |w| z' and |d logit| |h| z' for the gradients
    (z' = dz / dx of the raw logit x: 1 / T, or (1 - tanh^2(x / c)) / T with a softcap c),
    taken through each layout's view as its gradient is. Also how many of the op's gradient entries
    each entry sums (an expanded operand's)."""
    h_base = bases["hidden"].clone().requires_grad_(True)
    w_base = bases["weight"].clone().requires_grad_(True)
    hidden = view(h_base, case["hidden_layout"], case["N"], case["H"])
    weight = view(w_base, case["weight_layout"], case["V"], case["H"])[: case["vocab_size"]]
    with torch.no_grad():
        x, softcap = hidden @ weight.T, case["softcap"]
        if softcap is None:
            z, slope = x / case["temperature"], 1 / case["temperature"]
        else:
            z = softcap * torch.tanh(x / softcap) / case["temperature"]
            # + 2^-52: float64's own 1 - tanh^2 is that far from the true value (0 where tanh rounds
            # to 1, where the kernels' is still > 0).
            slope = (1 - torch.tanh(x / softcap) ** 2 + 2.0**-52) / case["temperature"]
        lse = torch.logsumexp(z, -1, keepdim=True)
        p = (z - lse).exp()
        mean = torch.where(p > 0, p * z, 0.0).sum(-1, keepdim=True)
        tok = tokens.long()
        chosen = torch.zeros_like(z).scatter_(1, tok.clamp(min=0).unsqueeze(1), 1.0) * (tok >= 0).unsqueeze(1)
        gl = (grads[0].abs() * (tok >= 0)).unsqueeze(1)
        # |z| too: a logit's own rounding moves z - mean by about ulp(z) even where z = mean.
        dz = gl * (p + chosen) + grads[1].abs().unsqueeze(1) * torch.where(p > 0, p * ((z - mean).abs() + z.abs()), 0.0)
        # Ignored rows are left out (skip_ignored): no terms, whatever their hidden states hold.
        scored = (tok >= 0).unsqueeze(1)
        output_scale = z.abs().amax(-1) + lse.squeeze(-1).abs()  # V >= 1
    dx = torch.where(scored, dz * slope, 0.0)
    (hidden * (dx @ weight.abs())).sum().backward()
    grad_w_scale = torch.zeros(case["V"], case["H"], dtype=torch.float64)
    grad_w_scale[: case["vocab_size"]] = dx.T @ torch.where(scored, hidden.detach().abs(), 0.0)
    w_base.grad = None
    (view(w_base, case["weight_layout"], case["V"], case["H"]) * grad_w_scale).sum().backward()
    counts = []
    for name, rows in (("hidden", case["N"]), ("weight", case["V"])):
        base = torch.zeros_like(bases[name], requires_grad=True)
        view(base, case[name + "_layout"], rows, case["H"]).sum().backward()
        counts.append(base.grad)
    ones = torch.ones_like(output_scale)
    return [output_scale, output_scale, h_base.grad, w_base.grad], [ones, ones, *counts]


def assert_matches(got, want, naive, scales, counts, dtypes):
    """NaN and +-inf exactly where float64 has them; finite values within 4 times the error of a plain
    fp32 computation plus 16 fp32 roundings and 4 roundings in the output dtype of the terms'
    magnitudes, plus the output dtype's subnormal spacing."""
    for name, a, b, c, scale, count, dtype in zip(("logprob", "entropy", "hidden grad", "weight grad"), got, want,
                                                  naive, scales, counts, dtypes):
        assert a.shape == b.shape, name
        assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN at {a.isnan().nonzero().tolist()[:5]}, " \
                                                  f"float64 at {b.isnan().nonzero().tolist()[:5]}"
        assert torch.equal(a.isinf(), b.isinf()) and torch.equal(a[a.isinf()], b[b.isinf()]), name
        finite = b.isfinite() & c.isfinite()
        if not finite.any():
            continue
        # An expanded operand's gradient sums per-row gradients each rounded to dtype: the rounding
        # scales with the terms
        # scale too; below the normals the output dtype's spacing is absolute, once per summed entry.
        subnormal_spacing = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
        tol = (4 * (c - b)[finite].abs().max() + subnormal_spacing * count.reshape(b.shape)
               + (4 * UNIT_ROUNDOFF[dtype] + 16 * 2.0**-24) * torch.nan_to_num(scale.reshape(b.shape), nan=0.0))
        bad = (a - b).abs() > tol
        assert not bad[finite].any(), f"{name}: {a[bad & finite][:5].tolist()} vs {b[bad & finite][:5].tolist()}"


@settings(max_examples=400)
@given(case=cases())
def test_matches_float64_on_random_cases(case):
    # What the examples cover, in --hypothesis-show-statistics.
    for event in (str(case["dtype"]), "hidden " + case["hidden_layout"], "weight " + case["weight_layout"]):
        hypothesis.event(event)
    hypothesis.event("non-finite inputs" if case["specials"] else "finite inputs")
    hypothesis.event("padded vocab" if case["vocab_size"] < case["V"] else "no padding")
    bases, tokens, grads = build(case)
    got = run(case, bases, tokens, grads, fused=True)
    want = run(case, bases, tokens, grads, fused=False)
    naive = run(case, bases, tokens, grads, fused=False, acc=torch.float32)
    dtypes = (torch.float32, torch.float32, case["dtype"], case["dtype"])
    assert_matches(got, want, naive, *term_scales(case, bases, tokens, grads), dtypes)


def valid_call(N, H, V):
    g = torch.Generator().manual_seed(N * 1000 + H * 10 + V)
    return dict(hidden=torch.randn(N, H, generator=g), weight=torch.randn(V, H, generator=g),
                tokens=torch.randint(0, V, (N,), generator=g))


# (what is wrong, how the call is changed, the error type, a pattern of its message)
BAD_CALLS = [
    ("hidden dtype", lambda c: c.update(hidden=c["hidden"].int()), TypeError, "hidden must be float32"),
    ("weight dtype", lambda c: c.update(weight=c["weight"].half()), TypeError, "weight must have hidden's dtype"),
    ("float64 and float32", lambda c: c.update(hidden=c["hidden"].double()), TypeError, "hidden's dtype"),
    ("token dtype", lambda c: c.update(tokens=c["tokens"].float()), TypeError, "tokens must be int64 or int32"),
    ("int16 tokens", lambda c: c.update(tokens=c["tokens"].short()), TypeError, "tokens must be int64 or int32"),
    ("scalar hidden", lambda c: c.update(hidden=c["hidden"][0, 0]), ValueError, r"hidden \[\.\.\., H\]"),
    ("1-d weight", lambda c: c.update(weight=c["weight"][0]), ValueError, r"weight \[V_local, H\]"),
    ("hidden size", lambda c: c.update(weight=torch.randn(c["weight"].shape[0], c["hidden"].shape[1] + 1)),
     ValueError, r"weight \[V_local, H\]"),
    ("token shape", lambda c: c.update(tokens=c["tokens"][:-1]), ValueError, "tokens must have hidden's leading"),
    ("device", lambda c: c.update(weight=c["weight"].to("meta")), ValueError, "one device"),
    ("token too large", lambda c: c["tokens"].__setitem__(-1, c["weight"].shape[0]), ValueError, "token ids must lie"),
    ("negative token", lambda c: c["tokens"].__setitem__(0, -1), ValueError, "token ids must lie"),
    ("token in the padding", lambda c: (c.update(vocab_size=c["weight"].shape[0] - 1),
                                        c["tokens"].__setitem__(0, c["weight"].shape[0] - 1)),
     ValueError, "token ids must lie"),
    ("zero temperature", lambda c: c.update(temperature=0.0), ValueError, "temperature"),
    ("negative temperature", lambda c: c.update(temperature=-1.0), ValueError, "temperature"),
    ("NaN temperature", lambda c: c.update(temperature=math.nan), ValueError, "temperature"),
    ("inf temperature", lambda c: c.update(temperature=math.inf), ValueError, "temperature"),
    ("zero softcap", lambda c: c.update(softcap=0.0), ValueError, "softcap must be None or a positive finite"),
    ("negative softcap", lambda c: c.update(softcap=-30.0), ValueError, "softcap must be None or a positive"),
    ("NaN softcap", lambda c: c.update(softcap=math.nan), ValueError, "softcap must be None or a positive"),
    ("inf softcap", lambda c: c.update(softcap=math.inf), ValueError, "softcap must be None or a positive"),
    ("vocab_size 0", lambda c: c.update(vocab_size=0), ValueError, "vocab_size must be >= 1"),
    ("vocab_size beyond the rows", lambda c: c.update(vocab_size=c["weight"].shape[0] + 1), ValueError,
     "whole vocabulary"),
    ("vocab_start beyond the vocabulary", lambda c: c.update(vocab_start=c["weight"].shape[0]), ValueError,
     "vocab_start must be 0"),
    ("negative vocab_start", lambda c: c.update(vocab_start=-1), ValueError,
     "vocab_start must be a non-negative integer"),
    ("main_grad shape", lambda c: c.update(main_grad=torch.zeros(1, 1)), ValueError, "main_grad must be"),
    ("main_grad dtype", lambda c: c.update(main_grad=torch.zeros(c["weight"].shape, dtype=torch.float64)),
     ValueError, "main_grad must be"),
]


@settings(max_examples=100)
@given(bad=st.sampled_from(BAD_CALLS), N=st.sampled_from([1, 5]), H=st.sampled_from([1, 6]),
       V=st.sampled_from([2, 130]))
def test_invalid_calls_raise_clear_errors(bad, N, H, V):
    _, corrupt, error, pattern = bad
    call = valid_call(N, H, V)
    corrupt(call)
    with pytest.raises(error, match=pattern):
        fused_rl_ops.chosen_logprob(call.pop("hidden"), call.pop("weight"), call.pop("tokens"), **call)
