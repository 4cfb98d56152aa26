"""chosen_logprob(kept_ids=...): the sampled token's logprob renormalised over the rollout sampler's
kept set, and the entropy over it, against float64 over materialised logits
(fused_rl_ops.reference.kept_set) in fp32 and bf16, values and gradients; against top_k where the set
is the top k; one pass over the vocabulary; tensor parallel on gloo; non-finite values; bad input."""
import math
import re

import pytest
import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops.logit_options import LogitOptions
from fused_rl_ops.reference.kept_set import kept_set_logprob
from fused_rl_ops.testing.distributed import run_distributed
from tests.helpers.kernel_calls import KernelCalls
from tests.ops.test_chosen_logprob_many_tokens import assert_compiled_matches_eager  # noqa: E402

H, V, K = 16, 60, 6
TOLERANCE = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5),
             torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def inputs(seed=0, shape=(3, 5), vocab=V, dtype=torch.float64):
    """hidden, weight, sampled tokens [*shape] and kept_ids [*shape, K] with every case: a sampled
    token in its set (most positions), one outside it, an ignored sampled token, a set with
    ignore_index padding, an id given twice, a position with nothing kept."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, H, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    kept = torch.stack([torch.randperm(vocab - 5, generator=g)[:K] for _ in range(math.prod(shape))]).reshape(
        *shape, K)
    pick = torch.randint(0, K, shape, generator=g)
    tokens = kept.gather(-1, pick[..., None])[..., 0].clone()
    tokens[0, 1] = next(v for v in range(vocab - 5) if v not in kept[0, 1])  # sampled outside its set
    tokens[1, 2] = -100                 # an ignored position
    kept[0, 2, 4:] = -100               # padding
    kept[2, 1, 5] = kept[2, 1, 0]       # an id given twice
    kept[2, 3] = -100                   # nothing kept: the sampled token is outside
    tokens[0, 2], tokens[2, 1] = kept[0, 2, 0], kept[2, 1, 0]
    return hidden, weight, tokens, kept


def fwd_bwd(fn, hidden, weight, grad_lp, grad_ent):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent, is_kept = fn(h, w)
    ((torch.where(is_kept, lp, 0.0) * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    return lp.detach(), ent.detach(), is_kept, h.grad, w.grad


def gradients(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


SETTINGS = [dict(), dict(temperature=0.7, softcap=2.5), dict(vocab_size=V - 5), dict(batch_invariant=True)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s) or "plain")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kept_set_matches_float64(device, dtype, settings):
    """Values, is_kept and the hidden and weight gradients of any upstream gradient, against
    float64 log_softmax over the kept set of the same (rounded) inputs."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 inputs run on the CPU only")
    hidden, weight, tokens, kept = inputs(dtype=dtype)
    grad_lp, grad_ent = gradients(tokens.shape)
    logit_map = LogitOptions(**{n: settings[n] for n in ("temperature", "softcap") if n in settings}).logit_map
    ours = fwd_bwd(lambda h, w: fused_rl_ops.chosen_logprob(h, w, tokens.to(device), kept_ids=kept.to(device),
                                                            return_entropy=True, return_is_kept=True,
                                                            workspace_bytes=1, **settings),
                   hidden.to(device), weight.to(device), grad_lp.to(device), grad_ent.to(device))
    ours = tuple(t.cpu() for t in ours)
    expected = fwd_bwd(lambda h, w: kept_set_logprob(h, w, tokens, kept, logit_map=logit_map,
                                                     vocab_size=settings.get("vocab_size")),
                       hidden.double(), weight.double(), grad_lp, grad_ent)
    assert ours[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(ours[2], expected[2]) and not ours[2][0, 1] and not ours[2][2, 3] and ours[2].sum() == 12
    assert ours[0][0, 1] == -math.inf and ours[0][2, 3] == -math.inf and ours[0][1, 2] == 0
    assert ours[1][2, 3] == 0 and ours[1][1, 2] == 0
    for got, want, what in zip(ours[:2] + ours[3:], expected[:2] + expected[3:], ("logprob", "entropy", "hidden grad",
                                                                                   "weight grad")):
        torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype], msg=what)


def test_a_kept_set_of_the_top_k_is_top_k(device):
    """Where the set is each position's k largest logits, the call is the top_k call: logprob,
    entropy, is_kept and gradients (fp32, within rounding)."""
    hidden, weight, tokens, _ = inputs(dtype=torch.float32)
    top = (hidden.double() @ weight.double().T).topk(K, -1).indices
    tokens = torch.where(torch.arange(15).reshape(3, 5) % 3 == 0, tokens, top[..., 2])  # in and out of the top
    hidden, weight, tokens, top = (t.to(device) for t in (hidden, weight, tokens, top))
    grad_lp, grad_ent = (t.to(device) for t in gradients(tokens.shape))
    results = [fwd_bwd(lambda h, w: fused_rl_ops.chosen_logprob(h, w, tokens, return_entropy=True,
                                                                return_is_kept=True, **options),
                       hidden, weight, grad_lp.float(), grad_ent.float()) for options in (dict(kept_ids=top),
                                                                                          dict(top_k=K))]
    assert torch.equal(results[0][2], results[1][2]) and results[0][2].sum() >= 10 and not results[0][2].all()
    assert torch.equal(results[0][0].isneginf(), results[1][0].isneginf())
    for got, want in zip(results[0][:2] + results[0][3:], results[1][:2] + results[1][3:]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_one_pass_for_the_sampled_token_and_its_set():
    """The sampled token and its kept ids are one stats and one backward call of [N, 1 + k] entries;
    an ignored position's entries are all ignored (not computed), a repeated id is ignored."""
    hidden, weight, tokens, kept = inputs(dtype=torch.float32)
    h = hidden.clone().requires_grad_(True)
    with KernelCalls() as calls:
        lp, ent = fused_rl_ops.chosen_logprob(h, weight, tokens, kept_ids=kept, return_entropy=True)
        (torch.where(lp.isfinite(), lp, 0.0).sum() + ent.sum()).backward()
    assert [c.op for c in calls.calls] == ["chosen_logprob_stats", "chosen_logprob_combine",
                                           "chosen_logprob_backward"]
    [entries] = calls.tokens("chosen_logprob_stats")
    assert entries.shape == (15, 1 + K) and torch.equal(entries[:, 0], tokens.reshape(-1))
    assert entries[7].eq(-100).all() and (entries[11] == kept[2, 1, 0]).sum() == 2  # sampled, and kept once
    assert h.grad[1, 2].eq(0).all() and ent[1, 2] == 0


def test_duplicates_count_once_and_order_does_not_matter():
    hidden, weight, tokens, kept = inputs(dtype=torch.float32)
    once = kept.clone()
    once[2, 1, 5] = -100
    shuffled = kept.flip(-1)
    results = [fused_rl_ops.chosen_logprob(hidden, weight, tokens, kept_ids=k, return_entropy=True)
               for k in (kept, once, shuffled)]
    for other in results[1:]:
        torch.testing.assert_close(results[0], other, atol=1e-6, rtol=1e-6)


def test_many_sampled_tokens_per_position():
    """tokens [..., m] with kept_ids [..., k]: entry j is the one-token call on tokens[..., j]."""
    hidden, weight, tokens, kept = inputs(dtype=torch.float32)
    many = torch.stack([tokens, kept[..., 3], torch.full_like(tokens, -100)], -1)
    lp, ent, is_kept = fused_rl_ops.chosen_logprob(hidden, weight, many, kept_ids=kept, return_entropy=True,
                                                   return_is_kept=True)
    assert lp.shape == many.shape and ent.shape == tokens.shape
    for j in range(2):
        one = fused_rl_ops.chosen_logprob(hidden, weight, many[..., j], kept_ids=kept, return_entropy=True,
                                          return_is_kept=True)
        torch.testing.assert_close(lp[..., j], one[0], atol=1e-6, rtol=1e-6)
        assert torch.equal(is_kept[..., j], one[2])
    assert lp[..., 2].eq(0).all() and not is_kept[..., 2].any()


def test_nonfinite_values_are_never_hidden(device):
    """A NaN hidden row: NaN logprob (the sampled token in its set or not) and entropy there alone,
    as float64 gives. A NaN logit outside the set: NaN too (the full softmax is part of the
    computation; float64 over the set alone would not see it)."""
    hidden, weight, tokens, kept = (t.to(device) for t in inputs(dtype=torch.float32))
    hidden[0, 1, 3] = math.nan  # position (0, 1) samples outside its set
    hidden[0, 3, 3] = math.nan
    lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, tokens, kept_ids=kept, return_entropy=True)
    want, want_ent, _ = (t.to(device) for t in kept_set_logprob(hidden.double().cpu(), weight.double().cpu(),
                                                                tokens.cpu(), kept.cpu()))
    assert torch.equal(lp.isnan(), want.isnan()) and torch.equal(ent.isnan(), want_ent.isnan())
    assert lp[0, 1].isnan() and lp[0, 3].isnan() and lp.isnan().sum() == 2 and ent.isnan().sum() == 2
    weight[V - 1, 0] = math.nan  # no kept id names row V - 1
    lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, tokens, kept_ids=kept, return_entropy=True)
    scored = tokens != -100
    assert lp[scored].isnan().all() and lp[~scored].eq(0).all() and ent[kept.ne(-100).any(-1) & scored].isnan().all()


def test_bad_kept_sets_are_named():
    hidden, weight, tokens, kept = inputs(dtype=torch.float32)
    for options in (dict(top_k=5), dict(top_p=0.9), dict(logit_options=LogitOptions(top_k=3))):
        with pytest.raises(ValueError, match=r"kept_ids is the sampler's kept set, in place of its filter"):
            fused_rl_ops.chosen_logprob(hidden, weight, tokens, kept_ids=kept, **options)
    for bad in (kept[:, :4], kept[..., 0], kept[None]):
        with pytest.raises(ValueError, match=r"kept_ids must be \[\.\.\., k\] with the tokens' leading shape \(3, 5\)"
                                             + r".*got " + re.escape(str(tuple(bad.shape)))):
            fused_rl_ops.chosen_logprob(hidden, weight, tokens, kept_ids=bad)
    with pytest.raises(TypeError, match="kept_ids must be int64 or int32, got torch.float32"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens, kept_ids=kept.float())
    for value in (V, -3):
        wrong = kept.clone()
        wrong[2, 4, 1] = value
        with pytest.raises(ValueError, match=rf"must lie in \[0, {V}\).*found \[{value}\], the first at kept_ids\[2, 4, 1\]"):
            fused_rl_ops.chosen_logprob(hidden, weight, tokens, kept_ids=wrong)
    wrong = kept.clone()
    wrong[2, 4, 1] = V
    lp = fused_rl_ops.chosen_logprob(hidden, weight, tokens, kept_ids=wrong, check_tokens=False)
    assert lp[2, 4].isnan() and lp.isnan().sum() == 1  # unchecked: NaN, never a finite number


def tensor_parallel_checks(rank, world):
    """Shards of 20 rows (the last partly padding), ids on the shards' edges: the TP call equals the
    one-rank call, values and gradients, and the bad input raises on every rank."""
    hidden, weight, tokens, kept = inputs(seed=3, vocab=world * 20, dtype=torch.float32)
    vocab_size = world * 20 - 7
    kept = torch.where(kept == -100, kept, kept % vocab_size)
    kept[0, 0] = torch.tensor([0, 19, 20, vocab_size - 1, 21, -100])
    tokens = torch.where(tokens == -100, tokens, tokens % vocab_size)
    tokens[0, 0] = 20
    grad_lp, grad_ent = (g.float() for g in gradients(tokens.shape, seed=5))
    shard = slice(rank * 20, (rank + 1) * 20)

    def call(h, w, **kw):
        return fused_rl_ops.chosen_logprob(h, w, tokens, kept_ids=kept, return_entropy=True, return_is_kept=True,
                                           vocab_size=vocab_size, workspace_bytes=1, temperature=0.8, **kw)
    tp = fwd_bwd(lambda h, w: call(h, w, tp_group=dist.group.WORLD), hidden, weight[shard], grad_lp, grad_ent)
    single = fwd_bwd(call, hidden, weight, grad_lp, grad_ent)
    assert torch.equal(tp[2], single[2])
    for ours, want in zip(tp[:2] + tp[3:4], single[:2] + single[3:4]):
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tp[4], single[4][shard], atol=1e-5, rtol=1e-5)
    bad = kept.clone()
    bad[1, 1, 1] = vocab_size
    with pytest.raises(ValueError, match=r"the first at kept_ids\[1, 1, 1\]"):
        fused_rl_ops.chosen_logprob(hidden, weight[shard], tokens, kept_ids=bad, vocab_size=vocab_size,
                                    tp_group=dist.group.WORLD)


def test_kept_set_tensor_parallel_matches_single_rank():
    run_distributed(tensor_parallel_checks, 2)


def test_kept_set_under_torch_compile():
    """fullgraph=True: eager's values and gradients (no graph break, no host read)."""
    hidden, weight, tokens, kept = inputs(dtype=torch.float32)

    def step(h, w):
        lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens, kept_ids=kept, return_entropy=True)
        return torch.where(lp.isfinite(), lp, 0.0).sum() + ent.sum()

    assert_compiled_matches_eager(step, hidden, weight)
