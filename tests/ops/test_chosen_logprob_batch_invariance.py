"""chosen_logprob(batch_invariant=True): a token's logprob, entropy and hidden gradient are bitwise
the same whatever the other tokens of the call, their order, the leading shape, workspace_bytes and
whether ignored rows are skipped or computed; without and with a softcap."""
import pytest
import torch

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops._vocab_parallel.tiling import INVARIANT_TILING

PROBES = 6  # the tokens followed through every call
H = 40


def problem(device, dtype, softcap=None):
    """Weights spanning two full vocab chunks and a partial one (padding rows past vocab_size), the
    probes' hidden rows, ids (one in each chunk, one ignored) and upstream gradients, and a pool of
    other tokens (some ignored) to surround them with."""
    row_block, chunk = INVARIANT_TILING["cuda" if device == "cuda" else "cpu"]
    V, vocab_size = 2 * chunk + 300, 2 * chunk + 290
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g) * (3.0 / H**0.5)
    probe_ids = torch.tensor([0, chunk - 1, chunk, 2 * chunk + 7, vocab_size - 1, -100])
    others = 2 * row_block + 100
    other_ids = torch.randint(0, vocab_size, (others,), generator=g)
    other_ids[::7] = -100
    hidden = torch.randn(PROBES + others, H, generator=g)
    grads = torch.randn(2, PROBES + others, generator=g)
    to = dict(device=device)
    return dict(row_block=row_block, weight=weight.to(device, dtype), hidden=hidden.to(device, dtype), ids=torch.cat([probe_ids, other_ids]).to(**to),
                grad_lp=grads[0].to(**to), grad_ent=grads[1].to(**to), vocab_size=vocab_size, softcap=softcap)


def score(p, order, lead_shape=None, workspace_bytes=fused_rl_ops.DEFAULT_WORKSPACE_BYTES, misaligned=False,
          **options):
    """Scores rows `order` of the problem in one call (shaped lead_shape; misaligned: hidden is a
    view starting one element into its storage; options: more of chosen_logprob's); returns the
    probes' logprob, entropy and hidden gradient, in probe order."""
    shape = lead_shape or (len(order),)
    hidden = p["hidden"][order]
    if misaligned:
        hidden = torch.cat([hidden.new_zeros(H + 1), hidden.reshape(-1)])[H + 1 :].reshape(hidden.shape)
    h = hidden.reshape(*shape, H).detach().requires_grad_(True)
    lp, ent = fused_rl_ops.chosen_logprob(h, p["weight"], p["ids"][order].reshape(shape), temperature=0.9,
                                          softcap=p["softcap"], vocab_size=p["vocab_size"], return_entropy=True,
                                          workspace_bytes=workspace_bytes, batch_invariant=True, **options)
    loss = (lp.reshape(-1) * p["grad_lp"][order]).sum() + (ent.reshape(-1) * p["grad_ent"][order]).sum()
    loss.backward()
    where = torch.argsort(order)[:PROBES]  # position of probe i in the call
    return lp.reshape(-1)[where], ent.reshape(-1)[where], h.grad.reshape(-1, H)[where]


def bits(t):
    return t.detach().cpu().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_tokens_bitwise_equal_in_any_batch(device, dtype, softcap):
    p = problem(device, dtype, softcap)
    total = p["ids"].numel()
    probes, others = torch.arange(PROBES), torch.arange(PROBES, total)
    g = torch.Generator().manual_seed(1)
    together = score(p, probes)
    calls = {
        "each alone": [score(p, probes[i : i + 1]) for i in range(PROBES)],
        "batch of 13": score(p, torch.cat([others[:7], probes])),
        "all, permuted": score(p, torch.randperm(total, generator=g)),
        "all, permuted, small workspace": score(p, torch.randperm(total, generator=g), workspace_bytes=1),
        "all, misaligned hidden": score(p, torch.arange(total), misaligned=True),
        "packed [2, S] among other sequences": score(p, torch.cat([others[:301], probes, others[301:]]),
                                                     lead_shape=(2, total // 2)),
        "one full block, huge workspace": score(p, torch.cat([probes, others[: p["row_block"] - PROBES]]),
                                                  workspace_bytes=2**31),
        "all, every row computed (no host read)": score(p, torch.arange(total), check_tokens=False),
    }
    alone = calls.pop("each alone")
    for i in range(PROBES):
        for k in range(3):
            assert torch.equal(bits(alone[i][k]), bits(together[k][i : i + 1])), ("each alone", i, k)
    for name, got in calls.items():
        for k, what in enumerate(("logprob", "entropy", "hidden gradient")):
            assert torch.equal(bits(got[k]), bits(together[k])), (name, what)
    # The ignored probe: nothing, and the scored ones the same when ignored rows are computed in full.
    assert together[0][-1] == 0 and together[1][-1] == 0 and together[2][-1].eq(0).all()
    computed = score(p, torch.randperm(total, generator=g), skip_ignored=False)
    for k, what in enumerate(("logprob", "entropy", "hidden gradient")):
        assert torch.equal(bits(computed[k][:-1]), bits(together[k][:-1])), ("skip_ignored=False", what)
    assert computed[1][-1] > 0 and not computed[2][-1].eq(0).all()  # its entropy, and that gradient


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(device, dtype, softcap):
    p = problem(device, dtype, softcap)
    n = p["ids"].numel()
    h = p["hidden"].clone().requires_grad_(True)
    w = p["weight"].clone().requires_grad_(True)
    lp, ent = fused_rl_ops.chosen_logprob(h, w, p["ids"], temperature=0.9, softcap=softcap,
                                          vocab_size=p["vocab_size"], return_entropy=True, workspace_bytes=1,
                                          batch_invariant=True)
    (lp * p["grad_lp"] + ent * p["grad_ent"]).sum().backward()
    hd, wd = p["hidden"].double().cpu().requires_grad_(True), p["weight"].double().cpu().requires_grad_(True)
    ref_lp, ref_ent = reference.chosen_logprob(hd, wd, p["ids"].cpu(), temperature=0.9, vocab_size=p["vocab_size"],
                                               softcap=softcap)
    (ref_lp * p["grad_lp"].double().cpu() + ref_ent * p["grad_ent"].double().cpu()).sum().backward()
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for ours, ref in ((lp, ref_lp), (ent, ref_ent), (h.grad, hd.grad), (w.grad, wd.grad)):
        torch.testing.assert_close(ours.detach().double().cpu(), ref, **tol)
    assert lp.shape == (n,) and w.grad[p["vocab_size"]:].eq(0).all()
