"""chosen_logprob with NaN and +-inf inputs: the results and gradients of float64 autograd over the
valid rows, for one chunk and for 128-row chunks (NaN in SIMD lanes, in the scalar tail, in every
chunk position)."""
import math

import pytest
import torch

import fused_rl_ops
from fused_rl_ops import reference

N, H, V, VOCAB = 7, 16, 300, 290  # 128-row chunks: 128 + 128 + 34 valid rows (32 SIMD + 2 tail)
WORKSPACES = [1, 2**30]  # 128-row chunks, one chunk
TEMPERATURE = 0.8


def make_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5
    tokens = torch.tensor([0, 127, 128, 255, 289, -100, 5])
    grad_lp, grad_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden.float(), weight.float(), tokens, grad_lp, grad_ent


def reference_results(hidden, weight, tokens, grad_lp, grad_ent):
    """Float64 logprob, entropy and their autograd gradients, the softmax over the valid rows only (the
    weight sliced, so its padding rows, whatever they hold, take no part: a masked [N, V] GEMM would
    carry 0 * NaN from them); the padded rows of the weight gradient are 0."""
    h = hidden.detach().double().cpu().requires_grad_(True)
    w = weight.detach().double().cpu()[:VOCAB].requires_grad_(True)
    lp, ent = reference.chosen_logprob(h, w, tokens.cpu(), temperature=TEMPERATURE)
    (lp * grad_lp.double().cpu() + ent * grad_ent.double().cpu()).sum().backward()
    grad_w = torch.zeros(weight.shape, dtype=torch.float64)
    grad_w[:VOCAB] = w.grad
    return lp.detach(), ent.detach(), h.grad, grad_w


def ours(hidden, weight, tokens, grad_lp, grad_ent, device, workspace):
    h = hidden.to(device, copy=True).requires_grad_(True)
    w = weight.to(device, copy=True).requires_grad_(True)
    lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens.to(device), temperature=TEMPERATURE, vocab_size=VOCAB,
                                          return_entropy=True, workspace_bytes=workspace)
    (lp * grad_lp.to(device) + ent * grad_ent.to(device)).sum().backward()
    return tuple(t.detach().double().cpu() for t in (lp, ent, h.grad, w.grad))


def check(hidden, weight, tokens, device, workspace, grad_lp, grad_ent):
    """Asserts ours equals the reference: NaN and inf exactly where it has them, finite values close.
    Returns ours."""
    got = ours(hidden, weight, tokens, grad_lp, grad_ent, device, workspace)
    want = reference_results(hidden, weight, tokens, grad_lp, grad_ent)
    for name, a, b in zip(("logprob", "entropy", "hidden grad", "weight grad"), got, want):
        assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN at {a.isnan().nonzero().tolist()}, " \
                                                  f"reference at {b.isnan().nonzero().tolist()}"
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, equal_nan=True, msg=lambda m: f"{name}: {m}")
    return got


@pytest.mark.parametrize("workspace", WORKSPACES)
@pytest.mark.parametrize("column", [0, 5, 15])
def test_nan_in_a_hidden_row_makes_that_token_nan_only(device, workspace, column):
    hidden, weight, tokens, grad_lp, grad_ent = make_inputs()
    hidden[2, column] = math.nan
    lp, ent, grad_h, grad_w = check(hidden, weight, tokens, device, workspace, grad_lp, grad_ent)
    others = torch.arange(N) != 2
    assert lp[2].isnan() and ent[2].isnan() and grad_h[2].isnan().all()
    assert lp[others].isfinite().all() and ent[others].isfinite().all() and grad_h[others].isfinite().all()
    # Every valid weight row's gradient sums over the tokens, token 2 included.
    assert grad_w[:VOCAB].isnan().all() and grad_w[VOCAB:].eq(0).all()


@pytest.mark.parametrize("workspace", WORKSPACES)
@pytest.mark.parametrize("row", [0, 1, 7, 127, 128, 200, 263, 288, 289])  # lanes, chunk edges, scalar tail
def test_nan_in_a_valid_weight_row_makes_every_token_nan(device, workspace, row):
    hidden, weight, tokens, grad_lp, grad_ent = make_inputs()
    weight[row, 3] = math.nan
    lp, ent, grad_h, grad_w = check(hidden, weight, tokens, device, workspace, grad_lp, grad_ent)
    scored = tokens != -100
    assert ent[scored].isnan().all() and lp[scored].isnan().all() and grad_h[scored].isnan().all()
    assert lp[~scored].eq(0).all() and ent[~scored].eq(0).all() and grad_h[~scored].eq(0).all()  # left out
    assert grad_w[:VOCAB].isnan().all() and grad_w[VOCAB:].eq(0).all()


@pytest.mark.parametrize("workspace", WORKSPACES)
def test_padding_rows_take_no_part_whatever_they_hold(device, workspace):
    hidden, weight, tokens, grad_lp, grad_ent = make_inputs()
    clean = ours(hidden, weight, tokens, grad_lp, grad_ent, device, workspace)
    weight[VOCAB:, ::3] = math.nan
    weight[VOCAB:, 1::3] = math.inf
    weight[VOCAB:, 2::3] = -math.inf
    for a, b in zip(ours(hidden, weight, tokens, grad_lp, grad_ent, device, workspace), clean):
        assert torch.equal(a, b)


def split_signs(hidden, column):
    """Hidden values of one column: positive for tokens 0, 2, 4, 6, negative for the others."""
    hidden[:, column] = torch.tensor([1.0, -1.0] * (N // 2) + [1.0])[:N]


@pytest.mark.parametrize("workspace", WORKSPACES)
def test_inf_weight_gives_plus_inf_logits_nan_and_minus_inf_logits_probability_zero(device, workspace):
    """weight[v, j] = +inf: tokens with hidden[:, j] > 0 get a +inf logit (log_softmax gives NaN), the
    others a -inf logit (probability 0, entropy finite; logprob -inf when it is the chosen token)."""
    hidden, weight, tokens, grad_lp, grad_ent = make_inputs()
    split_signs(hidden, 4)
    weight[128, 4] = math.inf  # token 2 chose row 128
    lp, ent, _, _ = check(hidden, weight, tokens, device, workspace, grad_lp, grad_ent)
    plus = hidden[:, 4] > 0
    assert lp[plus & (tokens != -100)].isnan().all() and ent[plus].isnan().all()
    assert ent[~plus].isfinite().all()
    assert lp[~plus & (tokens != 128) & (tokens != -100)].isfinite().all()


@pytest.mark.parametrize("workspace", WORKSPACES)
@pytest.mark.parametrize("rows", [slice(128, 256), slice(0, 1), slice(256, 290), slice(0, 289)])
def test_minus_inf_logits_have_probability_zero(device, workspace, rows):
    """-inf logits in one row, in a whole 128-row chunk, in the last chunk, and in all rows but one:
    entropy stays finite, a chosen -inf logit gives logprob -inf; gradients as the reference's."""
    hidden, weight, tokens, grad_lp, grad_ent = make_inputs()
    hidden[:, 4] = 1.0
    weight[rows, 4] = -math.inf
    lp, ent, grad_h, grad_w = check(hidden, weight, tokens, device, workspace, grad_lp, grad_ent)
    assert ent.isfinite().all()
    chosen_minus_inf = torch.zeros(N, dtype=torch.bool)
    valid = tokens >= 0
    chosen_minus_inf[valid] = torch.arange(V)[rows].unsqueeze(0).eq(tokens[valid].unsqueeze(1)).any(1)
    assert lp[chosen_minus_inf].eq(-math.inf).all() and lp[~chosen_minus_inf].isfinite().all()


@pytest.mark.parametrize("workspace", WORKSPACES)
def test_all_logits_minus_inf_give_nan(device, workspace):
    """log_softmax of a row of -inf logits is NaN (no finite maximum), in the reference and here."""
    hidden, weight, tokens, grad_lp, grad_ent = make_inputs()
    hidden[:, 4] = 1.0
    weight[:VOCAB, 4] = -math.inf
    lp, ent, _, _ = check(hidden, weight, tokens, device, workspace, grad_lp, grad_ent)
    scored = tokens != -100
    assert ent[scored].isnan().all() and lp[scored].isnan().all() and ent[~scored].eq(0).all()


def test_logprob_combine_merges_nan_and_skips_only_empty_partials(device):
    """The cross-shard merge: a shard whose partial holds a NaN is never dropped, whatever its place;
    a shard marked empty (max -inf, sums 0) changes nothing."""
    stats = torch.ops.fused_rl_ops.chosen_logprob_stats
    hidden, weight, tokens, _, _ = make_inputs()
    hidden, weight, tokens = hidden.to(device), weight.to(device), tokens.to(device).clamp(min=0)
    full = torch.ops.fused_rl_ops.chosen_logprob_combine(
        stats(hidden, weight[:VOCAB], tokens, 1.0, None, 0, None, 128)[None])
    shards = [stats(hidden, weight[a:b], tokens, 1.0, None, a, None, 128) for a, b in ((0, 100), (100, 200), (200, VOCAB))]
    empty = stats(hidden, weight[:0], tokens, 1.0, None, VOCAB, None, 128)
    assert empty[:, 0].eq(-math.inf).all() and empty[:, 1:].eq(0).all()
    merged = torch.ops.fused_rl_ops.chosen_logprob_combine(torch.stack([empty] + shards + [empty]))
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
    for k in range(3):
        poisoned = [s.clone() for s in shards]
        poisoned[k][3, 1] = math.nan  # one token's sum on shard k
        merged = torch.ops.fused_rl_ops.chosen_logprob_combine(torch.stack(poisoned + [empty]))
        assert merged[3, 1:3].isnan().all() and merged[torch.arange(N) != 3].isfinite().all()
