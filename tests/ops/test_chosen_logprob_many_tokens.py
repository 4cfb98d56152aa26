"""chosen_logprob with several tokens per position (tokens [..., k]) against float64 over the
materialised logits, with every option; one pass over the vocabulary for all k; tensor parallel on
gloo."""
import math
import re

import pytest
import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops.logit_options import LogitOptions
from fused_rl_ops.testing.distributed import run_distributed
from tests.helpers.kernel_calls import KernelCalls

ops = torch.ops.fused_rl_ops
H, V, K = 16, 60, 4
# float64 inputs (CPU) and fp32 (CUDA: no float64 kernels there) against float64 of the same values.
TOLERANCE = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5)}


def inputs(seed=0, shape=(3, 5), vocab=V, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, H, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    tokens = torch.randint(0, vocab - 5, (*shape, K), generator=g)
    tokens[0, 0, 1] = -100           # an ignored entry
    tokens[1, 2] = -100              # a position with every entry ignored
    tokens[2, 1, 3] = tokens[2, 1, 0]  # one id named twice
    return hidden, weight, tokens


def float64_reference(hidden, weight, tokens, options: LogitOptions, vocab_size):
    """(logprob [..., k], entropy [...]) over the materialised float64 logits of the real vocabulary."""
    z = reference.apply_logit_map(hidden.double() @ weight[:vocab_size].double().T, options.logit_map)
    z = reference.sampler_filter(z, options.top_k, options.top_p)
    logp = z.log_softmax(-1)
    p = logp.exp()
    ignored = tokens == -100
    logprob = torch.where(ignored, 0.0, logp.gather(-1, tokens.clamp(min=0)))
    entropy = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    return logprob, torch.where(ignored.all(-1), 0.0, entropy)


def fwd_bwd(fn, hidden, weight, grad_lp, grad_ent):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fn(h, w)
    ((torch.where(lp.isfinite(), lp, 0.0) * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    return lp, ent, h.grad, w.grad


SETTINGS = [dict(), dict(temperature=0.7, softcap=2.5), dict(top_k=9), dict(top_p=0.8),
            dict(top_k=12, top_p=0.7, temperature=1.3), dict(batch_invariant=True), dict(skip_ignored=False)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s) or "plain")
@pytest.mark.parametrize("padded", [False, True])
def test_many_tokens_match_float64(device, settings, padded):
    """float64 inputs on the CPU, fp32 on CUDA (no float64 kernels there), against float64 of the same
    values."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    hidden, weight, tokens = inputs(dtype=dtype)
    vocab_size = V - 5 if padded else V
    logit = LogitOptions(**{n: settings[n] for n in ("temperature", "softcap", "top_k", "top_p") if n in settings})
    g = torch.Generator().manual_seed(1)
    grad_lp, grad_ent = torch.randn(tokens.shape, generator=g, dtype=torch.float64), torch.randn(
        tokens.shape[:-1], generator=g, dtype=torch.float64)
    ours = fwd_bwd(lambda h, w: fused_rl_ops.chosen_logprob(h, w, tokens.to(device), return_entropy=True,
                                                            workspace_bytes=1, vocab_size=vocab_size, **settings),
                   hidden.to(device), weight.to(device), grad_lp.to(device, dtype), grad_ent.to(device, dtype))
    ours = [t.cpu().double() for t in ours]
    hidden, weight = hidden.double(), weight.double()
    expected = fwd_bwd(lambda h, w: float64_reference(h, w, tokens, logit, vocab_size), hidden, weight, grad_lp,
                       grad_ent)
    assert ours[0].shape == tokens.shape and ours[1].shape == tokens.shape[:-1]
    if settings.get("skip_ignored") is False:  # the all-ignored position's entropy is computed
        lp, ent = float64_reference(hidden, weight, tokens[..., :1].clamp(min=0), logit, vocab_size)
        expected = (expected[0], torch.where((tokens == -100).all(-1), ent, expected[1]), *expected[2:])
        ent_grad = fwd_bwd(lambda h, w: (torch.zeros_like(tokens, dtype=h.dtype), float64_reference(
            h, w, tokens[..., :1].clamp(min=0), logit, vocab_size)[1] * (tokens == -100).all(-1)), hidden, weight,
            grad_lp, grad_ent)
        expected = (*expected[:2], expected[2] + ent_grad[2], expected[3] + ent_grad[3])
    assert torch.equal(ours[0].isneginf(), expected[0].isneginf())  # the entries the filter drops
    for got, want, what in zip(ours, expected, ("logprob", "entropy", "hidden grad", "weight grad")):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype], msg=what)
    assert ours[3][vocab_size:].eq(0).all()  # padded rows get no gradient


def test_entries_equal_one_token_calls_and_take_one_pass(device):
    """Column j of a [..., k] call is the one-token call on tokens[..., j] (bitwise, fp32), and the
    k entries cost one stats and one backward call with every entry, not k."""
    hidden, weight, tokens = (t.to(device) for t in inputs(dtype=torch.float32))
    with KernelCalls() as calls:
        lp, ent, is_max, is_kept = fused_rl_ops.chosen_logprob(hidden, weight, tokens, return_entropy=True,
                                                               return_is_max=True, return_is_kept=True, top_k=7)
    assert [c.op for c in calls.calls] == ["chosen_logprob_stats", "chosen_logprob_combine"]
    assert calls.tokens("chosen_logprob_stats")[0].shape == (15, K)
    for j in range(K):
        one = fused_rl_ops.chosen_logprob(hidden, weight, tokens[..., j], return_entropy=True, return_is_max=True,
                                          return_is_kept=True, top_k=7)
        assert torch.equal(lp[..., j], one[0]) and torch.equal(is_max[..., j], one[2])
        assert torch.equal(is_kept[..., j], one[3])
        scored = tokens[..., j] != -100
        assert torch.equal(ent[scored], one[1][scored])
    h = hidden.clone().requires_grad_(True)
    with KernelCalls() as calls:
        fused_rl_ops.chosen_logprob(h, weight, tokens).sum().backward()
    assert [c.op for c in calls.calls].count("chosen_logprob_backward") == 1


def test_positions_whose_entries_are_all_ignored_are_not_computed(device):
    hidden, weight, tokens = (t.to(device) for t in inputs(dtype=torch.float32))
    h = hidden.clone().requires_grad_(True)
    with KernelCalls() as calls:
        lp, ent = fused_rl_ops.chosen_logprob(h, weight, tokens, return_entropy=True)
        (lp.sum() + ent.sum()).backward()
    for op in ("chosen_logprob_stats", "chosen_logprob_backward"):
        [call] = [c for c in calls.calls if c.op == op]
        computed = ~(call.args["tokens"] == call.args["ignore_index"]).all(1)
        assert int(computed.sum()) == 14
    assert lp[1, 2].eq(0).all() and ent[1, 2] == 0 and h.grad[1, 2].eq(0).all()
    assert lp[0, 0, 1] == 0


def test_bad_shapes_and_ids_are_named():
    hidden, weight, tokens = inputs(dtype=torch.float32)
    for bad in (tokens[..., :0], tokens[:, :4], tokens[..., None]):
        with pytest.raises(ValueError, match=r"tokens must have hidden's leading shape \(3, 5\).*got "
                                             + re.escape(str(tuple(bad.shape)))):
            fused_rl_ops.chosen_logprob(hidden, weight, bad)
    wrong = tokens.clone()
    wrong[2, 3, 1] = V
    with pytest.raises(ValueError, match=r"found \[60\], the first at tokens\[2, 3, 1\]"):
        fused_rl_ops.chosen_logprob(hidden, weight, wrong)
    lp = fused_rl_ops.chosen_logprob(hidden, weight, wrong, check_tokens=False)
    assert lp[2, 3, 1].isnan() and lp[2, 3, 0].isfinite()


def test_opcheck_many_tokens():
    hidden, weight, tokens = inputs(dtype=torch.float32)
    h, t = hidden.reshape(-1, H), tokens.reshape(-1, K)
    torch.library.opcheck(ops.chosen_logprob_stats, (h, weight, t, 0.9, None, 0, None, 16, 0, 0, 1, -100, 5))
    stats = ops.chosen_logprob_stats(h, weight, t, 0.9, None, 0, None, 16)
    torch.library.opcheck(ops.chosen_logprob_combine, (torch.stack([stats, stats]),))
    merged = ops.chosen_logprob_combine(stats[None])
    per_row = (merged[:, 0], merged[:, 1], merged[:, 1] - merged[:, 2])
    torch.library.opcheck(ops.chosen_logprob_backward, (h, weight, t, *per_row, torch.randn(15, K), torch.randn(15),
                                                        None, 0.9, None, 0, None, 16, 0, 0, 1, -100, 0))


def tensor_parallel_checks(rank, world):
    hidden, weight, tokens = inputs(seed=3, vocab=world * 20, dtype=torch.float32)
    vocab_size = world * 20 - 7  # the last rank's rows partly padding
    tokens = tokens % vocab_size
    tokens[0, 0] = torch.tensor([0, 19, 20, vocab_size - 1]) % vocab_size  # ids on shard edges
    tokens[1, 2] = -100
    g = torch.Generator().manual_seed(5)
    grad_lp, grad_ent = torch.randn(tokens.shape, generator=g), torch.randn(tokens.shape[:-1], generator=g)
    shard = slice(rank * 20, (rank + 1) * 20)
    for settings in (dict(temperature=0.8), dict(top_k=6, softcap=3.0), dict(top_p=0.85)):
        def call(h, w, **kw):
            return fused_rl_ops.chosen_logprob(h, w, tokens, return_entropy=True, vocab_size=vocab_size,
                                               workspace_bytes=1, **settings, **kw)
        tp = fwd_bwd(lambda h, w: call(h, w, tp_group=dist.group.WORLD), hidden, weight[shard], grad_lp, grad_ent)
        single = fwd_bwd(call, hidden, weight, grad_lp, grad_ent)
        for ours, want in zip(tp[:3], single[:3]):
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tp[3], single[3][shard], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_many_tokens_tensor_parallel_matches_single_rank(world):
    run_distributed(tensor_parallel_checks, world)


def test_nonfinite_row_is_nan_for_every_entry(device):
    hidden, weight, tokens = (t.to(device) for t in inputs(dtype=torch.float32))
    hidden[0, 1, 0] = math.nan
    lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, tokens, return_entropy=True)
    assert lp[0, 1].isnan().all() and ent[0, 1].isnan() and lp[0, 2].isfinite().all()



def test_many_tokens_and_top_logprobs_under_torch_compile():
    """fullgraph=True (the fake kernels give the [N, 3 + k] and top shapes): eager's values and
    gradients."""
    hidden, weight, tokens = inputs(dtype=torch.float32)

    def step(h, w):
        lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens, return_entropy=True, top_k=9)
        _, top = fused_rl_ops.top_logprobs(h, w, 5)
        return torch.where(lp.isfinite(), lp, 0.0).sum() + ent.sum() + top.sum()

    assert_compiled_matches_eager(step, hidden, weight)


def assert_compiled_matches_eager(step, hidden, weight):
    """step(h, w) -> loss under torch.compile(fullgraph=True) against eager: the loss and both gradients."""
    results = []
    for fn in (torch.compile(step, fullgraph=True, backend="aot_eager"), step):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = fn(h, w)
        loss.backward()
        results.append((loss, h.grad, w.grad))
    for compiled, eager in zip(*results):
        torch.testing.assert_close(compiled, eager)
