"""chosen_logprob(softcap=c): logits c * tanh(h . w / c), then divided by the temperature, against
float64 autograd of log_softmax(c * tanh(h @ w.T / c) / T): every dtype, padded vocab, several
chunks, main_grad, return_is_max, near saturation (where the gradient goes to 0), non-finite
inputs, tensor-parallel ranks, and bad softcap values."""
import math

import pytest
import torch

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops.chosen_logprob import CombinedColumns
from fused_rl_ops.testing.distributed import run_distributed

TOLERANCE = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5),
             torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=5e-3, rtol=5e-3)}
N, H, V, VOCAB = 37, 33, 300, 290  # 128-row chunks with workspace_bytes=1: 128 + 128 + 34 valid rows
TEMPERATURE = 0.7


def make_inputs(softcap, dtype=torch.float32, seed=0, n=N, v=V, vocab=VOCAB):
    """Raw logits of about softcap in size (some far into tanh's saturation), tokens at the edges of
    the chunks and the vocabulary and one ignored; upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(v, H, generator=g, dtype=torch.float64) * (softcap / H**0.5)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    tokens[:6] = torch.tensor([0, 127, 128, 255, vocab - 1, -100]).clamp(max=vocab - 1)
    grads = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hidden.to(dtype), weight.to(dtype), tokens, grads


def float64_results(hidden, weight, tokens, grads, softcap, temperature=TEMPERATURE, vocab=VOCAB):
    """logprob, entropy and the gradients of hidden and weight (padded rows 0) of
    sum(g_lp * logprob + g_ent * entropy), by float64 autograd over the valid rows."""
    h = hidden.detach().double().cpu().requires_grad_(True)
    w = weight.detach().double().cpu()[:vocab].requires_grad_(True)
    lp, ent = reference.chosen_logprob(h, w, tokens.cpu(), temperature=temperature, softcap=softcap)
    (lp * grads[0].double() + ent * grads[1].double()).sum().backward()
    grad_w = torch.zeros(weight.shape, dtype=torch.float64)
    grad_w[:vocab] = w.grad
    return lp.detach(), ent.detach(), h.grad, grad_w


def fused_results(hidden, weight, tokens, grads, softcap, device, temperature=TEMPERATURE, vocab=VOCAB, **kw):
    h = hidden.to(device, copy=True).requires_grad_(True)
    w = weight.to(device, copy=True).requires_grad_(True)
    lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens.to(device), temperature=temperature, softcap=softcap,
                                          vocab_size=vocab, return_entropy=True, **kw)
    (lp * grads[0].to(device) + ent * grads[1].to(device)).sum().backward()
    return lp, ent, h.grad, w.grad


def assert_same(got, want, tol, what=("logprob", "entropy", "hidden grad", "weight grad")):
    """NaN exactly where float64 has it, the rest close."""
    for name, a, b in zip(what, got, want):
        a = a.detach().double().cpu()
        assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN at {a.isnan().nonzero().tolist()[:6]}, " \
                                                  f"float64 at {b.isnan().nonzero().tolist()[:6]}"
        torch.testing.assert_close(a, b, **tol, equal_nan=True, msg=lambda m: f"{name}: {m}")


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [2.5, 30.0])
@pytest.mark.parametrize("workspace", [1, 2**30])  # 128-row chunks, one chunk
def test_matches_float64(device, dtype, softcap, workspace):
    if dtype == torch.float64 and device != "cpu":
        pytest.skip("float64 is a CPU dtype of chosen_logprob")
    hidden, weight, tokens, grads = make_inputs(softcap, dtype)
    got = fused_results(hidden, weight, tokens, grads, softcap, device, workspace_bytes=workspace)
    want = float64_results(hidden, weight, tokens, grads, softcap)
    assert_same(got, want, TOLERANCE[dtype])
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got[2].dtype == got[3].dtype == dtype and got[3][VOCAB:].eq(0).all()
    # The cap changes the numbers: the uncapped logprobs are far off.
    uncapped = float64_results(hidden, weight, tokens, grads, None)
    assert (uncapped[0] - want[0]).abs().max() > 0.5


def test_temperature_acts_on_the_capped_logits():
    """z = c tanh(x / c) / T, not c tanh(x / (c T)): the sampler divides what the model outputs."""
    softcap, temperature = 3.0, 0.5
    hidden, weight, tokens, grads = make_inputs(softcap)
    got = fused_results(hidden, weight, tokens, grads, softcap, "cpu", temperature=temperature)
    assert_same(got, float64_results(hidden, weight, tokens, grads, softcap, temperature), TOLERANCE[torch.float32])
    h, w = hidden.double(), weight.double()[:VOCAB]
    capped_before = torch.log_softmax(softcap * torch.tanh(h @ w.T / softcap) / temperature, -1)
    capped_after = torch.log_softmax(softcap * torch.tanh(h @ w.T / (softcap * temperature)), -1)
    keep = tokens != -100
    assert_same([got[0][keep]], [capped_before[keep, tokens[keep]]], TOLERANCE[torch.float32], ["logprob"])
    assert (capped_after[keep, tokens[keep]] - got[0][keep].double()).abs().max() > 0.1


def test_main_grad_and_return_is_max(device):
    """main_grad takes the capped weight gradient; is_max marks the tokens whose capped logit is the
    row's largest (the cap is monotonic: the uncapped argmax)."""
    softcap = 4.0
    hidden, weight, tokens, grads = make_inputs(softcap)
    raw = hidden.double() @ weight.double()[:VOCAB].T
    tokens[10:20] = raw[10:20].argmax(-1)  # greedy picks
    want = float64_results(hidden, weight, tokens, grads, softcap)
    h, w = hidden.to(device).requires_grad_(True), weight.to(device).requires_grad_(True)
    main_grad = torch.full(weight.shape, 0.25, device=device)
    lp, ent, is_max = fused_rl_ops.chosen_logprob(h, w, tokens.to(device), temperature=TEMPERATURE, softcap=softcap,
                                                  vocab_size=VOCAB, main_grad=main_grad, return_entropy=True,
                                                  return_is_max=True, workspace_bytes=1)
    (lp * grads[0].to(device) + ent * grads[1].to(device)).sum().backward()
    assert_same([lp, ent, h.grad, main_grad - 0.25], want, TOLERANCE[torch.float32])
    capped = softcap * torch.tanh(raw / softcap)
    expected_max = (tokens >= 0) & (capped.gather(1, tokens.clamp(min=0)[:, None])[:, 0] == capped.amax(-1))
    assert torch.equal(is_max.cpu(), expected_max) and is_max[10:20].all() and not is_max[:6].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_near_saturation_the_gradients_keep_their_relative_precision(dtype):
    """Raw logits 4 to 12 caps away from 0: tanh is within 1e-3 to 1e-10 of +-1 and dz/dx =
    (1 - tanh^2) / T goes from 1e-3 to 1e-10. One token per call, only the logprob's gradient: each
    weight-gradient row is then one product, (1[v = token] - p_v) / (T cosh^2(x_v / c)) (hidden = 1),
    and keeps its relative precision, which 1 - tanh^2 would lose (in fp32 exactly 0 beyond 9 caps;
    even float64 autograd's keeps only 6 digits at 12 caps, so the expected values use cosh)."""
    softcap = 1.5
    g = torch.Generator().manual_seed(5)
    magnitude = softcap * (4 + 8 * torch.rand(64, generator=g, dtype=torch.float64))
    sign = torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0).double()
    weight = (sign * magnitude).reshape(64, 1).to(dtype)  # H = 1, hidden = 1: raw logit = weight
    hidden = torch.ones(1, 1, dtype=dtype)
    x = weight.double()[:, 0]
    log_p = torch.log_softmax(softcap * torch.tanh(x / softcap) / TEMPERATURE, -1)
    for token in (0, 17):
        tokens = torch.tensor([token])
        got = fused_results(hidden, weight, tokens, (torch.ones(1), torch.zeros(1)), softcap, "cpu", vocab=64)
        expected = (torch.nn.functional.one_hot(tokens[0], 64) - log_p.exp()) / (
            TEMPERATURE * torch.cosh(x / softcap) ** 2)
        assert expected.abs().min() < 1e-8  # deep in the saturation
        rtol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got[3].double()[:, 0], expected, atol=0, rtol=rtol)
        torch.testing.assert_close(got[0].double(), log_p[token].reshape(1), **TOLERANCE[dtype])


NONFINITE_CASES = {
    # (tensor, index, value): what float64 gives. A raw +-inf is capped to a finite +-c / T, which
    # has probability > 0 and passes no gradient through tanh; the 0 gradient then meets the inf in
    # the other GEMM operand (0 * inf = NaN), as it does in float64 autograd.
    "NaN in a hidden row": ("hidden", (2, 5), math.nan),
    "+inf in a hidden row": ("hidden", (3, 5), math.inf),
    "-inf in a hidden row": ("hidden", (4, 0), -math.inf),
    "NaN in a weight row": ("weight", (130, 3), math.nan),
    "+inf in a weight row": ("weight", (7, 3), math.inf),
    "-inf in a weight row, last valid row": ("weight", (VOCAB - 1, 8), -math.inf),
    "NaN in a padding row": ("weight", (VOCAB + 3, 8), math.nan),
}


@pytest.mark.parametrize("case", list(NONFINITE_CASES))
@pytest.mark.parametrize("workspace", [1, 2**30])
def test_nonfinite_inputs_give_what_float64_gives(device, case, workspace):
    softcap = 5.0
    hidden, weight, tokens, grads = make_inputs(softcap)
    name, index, value = NONFINITE_CASES[case]
    (hidden if name == "hidden" else weight)[index] = value
    got = fused_results(hidden, weight, tokens, grads, softcap, device, workspace_bytes=workspace)
    want = float64_results(hidden, weight, tokens, grads, softcap)
    assert_same(got, want, TOLERANCE[torch.float32])
    if math.isinf(value):
        assert got[0].isfinite().all() and got[1].isfinite().all()  # capped: finite, unlike without a cap


def test_capped_minus_inf_logits_keep_probability():
    """A token whose raw logits are all -inf but one: without a cap only that one has probability;
    capped, every -inf becomes -c / T and shares it, as in float64."""
    softcap = 2.0
    hidden, weight, tokens, grads = make_inputs(softcap, n=8)
    hidden[1, 0] = math.inf
    weight[:, 0] = -1.0
    weight[40, 0] = 1.0  # token 1: raw logit +inf at row 40, -inf elsewhere
    tokens[1] = 40
    capped = fused_results(hidden, weight, tokens, grads, softcap, "cpu")
    assert_same(capped, float64_results(hidden, weight, tokens, grads, softcap), TOLERANCE[torch.float32])
    uncapped = fused_rl_ops.chosen_logprob(hidden, weight, tokens, temperature=TEMPERATURE, vocab_size=VOCAB)
    assert uncapped[1].isnan()  # +inf - lse without a cap
    expected = math.log(math.exp(softcap / TEMPERATURE) / (math.exp(softcap / TEMPERATURE)
                                                            + (VOCAB - 1) * math.exp(-softcap / TEMPERATURE)))
    assert capped[0][1].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("softcap", [0, -1.0, math.inf, math.nan, True, "30", torch.tensor(30.0)])
def test_invalid_softcap_is_refused(softcap):
    hidden, weight, tokens, _ = make_inputs(1.0, n=8)
    with pytest.raises(ValueError, match=r"LogitOptions: softcap must be None or a positive finite number, got"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens, softcap=softcap)


def tensor_parallel_checks(rank, world):
    """Each rank caps its own shard's logits before the partials: the merged results and every
    rank's gradients are float64's over the whole vocabulary (the last shard partly padding); a
    rank with another softcap makes every rank raise."""
    import torch.distributed as dist

    softcap, local = 3.0, 96
    vocab = world * local - 20
    hidden, weight, tokens, grads = make_inputs(softcap, n=29, v=world * local, vocab=vocab, seed=world)
    tokens[6:6 + 2 * (world - 1)] = torch.tensor([e for r in range(1, world) for e in (r * local - 1, r * local)])
    shard = slice(rank * local, (rank + 1) * local)
    want = float64_results(hidden, weight, tokens, grads, softcap, vocab=vocab)
    for batch_invariant in (False, True):
        got = fused_results(hidden, weight[shard], tokens, grads, softcap, "cpu", vocab=vocab,
                            tp_group=dist.group.WORLD, workspace_bytes=1, batch_invariant=batch_invariant)
        assert_same(got, want[:3] + (want[3][shard],), TOLERANCE[torch.float32])
    if world == 2:
        with pytest.raises(ValueError, match=r"disagree on the softcap \(per rank: \[3.0, None\]\)"):
            fused_rl_ops.chosen_logprob(hidden, weight[shard], tokens, vocab_size=vocab, tp_group=dist.group.WORLD,
                                        softcap=softcap if rank == 0 else None)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_float64(world):
    run_distributed(tensor_parallel_checks, world)


def test_opcheck_and_gradcheck(device):
    """The ops' schemas and fake kernels take softcap; float64 gradients through tanh are exact."""
    hidden, weight, tokens, _ = make_inputs(2.0, n=9, v=200, vocab=200)
    hidden, weight, tokens = hidden.to(device), weight.to(device), tokens.to(device)
    ops = torch.ops.fused_rl_ops
    torch.library.opcheck(ops.chosen_logprob_stats, (hidden, weight, tokens, 0.9, 2.0, 0, None, 128))
    stats = ops.chosen_logprob_stats(hidden, weight, tokens, 0.9, 2.0, 0, None, 128)
    row = CombinedColumns(*ops.chosen_logprob_combine(stats[None]).unbind(1))
    per_token = [row.row_max.contiguous(), row.log_sum.contiguous(), (row.log_sum - row.entropy).contiguous(),
                 torch.randn(9, device=device), torch.randn(9, device=device)]
    torch.library.opcheck(ops.chosen_logprob_backward, (hidden, weight, tokens, *per_token, None, 0.9, 2.0, 0, 150, 128,
                                                        4, 8))
    h, w = hidden[:4].double().cpu().requires_grad_(True), weight[:40].double().cpu().requires_grad_(True)
    ids = torch.tensor([0, 39, 17, -100])

    def fn(h, w):
        return fused_rl_ops.chosen_logprob(h, w, ids, temperature=0.9, softcap=2.0, return_entropy=True)

    assert torch.autograd.gradcheck(fn, (h, w))


def test_compiles_fullgraph_with_a_softcap():
    hidden, weight, tokens, grads = make_inputs(3.0, n=12)

    def step(h, w, t):
        lp, ent = fused_rl_ops.chosen_logprob(h, w, t, temperature=TEMPERATURE, softcap=3.0, vocab_size=VOCAB,
                                              return_entropy=True)
        return (lp * grads[0] + ent * grads[1]).sum(), lp, ent

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, lp, ent = compiled(h, w, tokens)
    loss.backward()
    assert_same([lp, ent, h.grad, w.grad], float64_results(hidden, weight, tokens, grads, 3.0),
                TOLERANCE[torch.float32])
