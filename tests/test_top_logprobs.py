"""fused_rl_ops.top_logprobs against float64 over the materialised logits: ids, order and ties,
values and gradients, padded rows, the logit map as one object, bad k, opcheck, and tensor parallel
on gloo."""
import pytest
import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops.logit_options import LogitMap, LogitOptions
from fused_rl_ops.testing.distributed import run_distributed

ops = torch.ops.fused_rl_ops
H = 12


def float64_top(hidden, weight, k, vocab_size, temperature=1.0, softcap=None):
    """(ids, logprobs) by sorting the float64 log-softmax: descending, the lower id first."""
    z = reference.apply_logit_map(hidden.double() @ weight[:vocab_size].double().T, LogitMap(temperature, softcap))
    logp = z.log_softmax(-1)
    flat = logp.detach().reshape(-1, vocab_size)
    ids = torch.stack([torch.tensor(sorted(range(vocab_size), key=lambda i: (-row[i], i))[:k])
                       for row in flat.tolist()]).reshape(*hidden.shape[:-1], k)
    return ids, logp.gather(-1, ids)


@pytest.mark.parametrize("k,vocab_size,settings", [(1, 50, {}), (6, 50, dict(temperature=0.7, softcap=2.0)),
                                                   (9, 43, {}), (50, 50, {})])
def test_top_logprobs_match_float64(k, vocab_size, settings):
    g = torch.Generator().manual_seed(k)
    hidden = torch.randn(2, 7, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids, lp = fused_rl_ops.top_logprobs(hidden, weight, k, vocab_size=vocab_size, **settings)
    want_ids, want_lp = float64_top(hidden, weight, k, vocab_size, **settings)
    assert ids.dtype == torch.int64 and ids.shape == (2, 7, k)
    assert torch.equal(ids, want_ids)
    assert (ids < vocab_size).all()  # padded rows never selected
    torch.testing.assert_close(lp, want_lp, atol=1e-12, rtol=1e-12)
    upstream = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((lp * upstream).sum(), (hidden, weight))
    want = torch.autograd.grad((want_lp * upstream).sum(), (hidden, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert got[1][vocab_size:].eq(0).all()
    if k == vocab_size:  # the whole vocabulary: logsumexp of the logprobs is 0
        torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(2, 7, dtype=torch.float64))


def test_ties_put_the_lower_id_first():
    """Equal logits everywhere (zero hidden rows) and duplicated weight rows."""
    weight = torch.randn(40, H)
    weight[30] = weight[5]
    weight[12] = weight[5]
    hidden = torch.zeros(3, H)
    hidden[2] = weight[5] * 3  # ids 5, 12 and 30 tie at the top
    ids, lp = fused_rl_ops.top_logprobs(hidden, weight, 4)
    assert ids[0].tolist() == [0, 1, 2, 3] and ids[1].tolist() == [0, 1, 2, 3]
    assert ids[2, :3].tolist() == [5, 12, 30]
    assert lp[2, 0] == lp[2, 1] == lp[2, 2] and (lp[:, :-1] >= lp[:, 1:]).all()


def test_logit_map_object_gives_the_keywords_results():
    """logit_map=LogitMap(...) is temperature and softcap as one object: bitwise the keywords' ids,
    logprobs and gradients. Both at once, or another class, is refused."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, H, generator=g, requires_grad=True)
    weight = torch.randn(40, H, generator=g, requires_grad=True)
    upstream = torch.randn(2, 5, 4, generator=g)
    results = []
    for options in (dict(temperature=0.7, softcap=2.0), dict(logit_map=LogitMap(0.7, 2.0))):
        ids, lp = fused_rl_ops.top_logprobs(hidden, weight, 4, vocab_size=37, **options)
        results.append((ids, lp, *torch.autograd.grad((lp * upstream).sum(), (hidden, weight))))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(ValueError, match=r"top_logprobs: give the logit options either as keywords \(temperature, "
                                         r"softcap\) or as logit_map, not both"):
        fused_rl_ops.top_logprobs(hidden, weight, 4, softcap=2.0, logit_map=LogitMap(0.7, 2.0))
    with pytest.raises(TypeError, match="top_logprobs: logit_map must be a LogitMap, got LogitOptions"):
        fused_rl_ops.top_logprobs(hidden, weight, 4, logit_map=LogitOptions(temperature=0.7))


def test_bad_k_and_shapes():
    hidden, weight = torch.randn(4, H), torch.randn(30, H)
    for bad in (0, 31, -1, 2.0, True, None):
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, vocab_size = 30\]"):
            fused_rl_ops.top_logprobs(hidden, weight, bad)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, vocab_size = 20\]"):
        fused_rl_ops.top_logprobs(hidden, weight, 21, vocab_size=20)
    with pytest.raises(ValueError, match="expected hidden"):
        fused_rl_ops.top_logprobs(hidden, weight[:, :5], 2)
    with pytest.raises(TypeError, match="weight must have hidden's dtype"):
        fused_rl_ops.top_logprobs(hidden, weight.double(), 2)


def test_opcheck_top_logprobs_stats():
    hidden, weight = torch.randn(9, H), torch.randn(70, H)
    torch.library.opcheck(ops.top_logprobs_stats, (hidden, weight, 0.8, None, 0, 64, 32, 0, 0, 1, 5))
    torch.library.opcheck(ops.top_logprobs_stats, (hidden, weight, 1.0, 2.0, 0, None, 16, 0, 0, 1, 3))


def tensor_parallel_checks(rank, world):
    # Small integers: every logit exact whatever the GEMM's shape on each rank, and many ties.
    g = torch.Generator().manual_seed(7)
    local = 15
    hidden = torch.randint(-2, 3, (3, 4, H), generator=g).float()
    weight = torch.randint(-2, 3, (world * local, H), generator=g).float()
    weight[local + 2] = weight[1]  # a tie across ranks: id 1 before id local + 2
    hidden[0, 0] = weight[1] * 2
    vocab_size = world * local - 4
    shard = slice(rank * local, (rank + 1) * local)
    for k in (1, 8, vocab_size):  # k = vocab_size: every rank holds fewer
        h, w = hidden.clone().requires_grad_(True), weight[shard].clone().requires_grad_(True)
        ids, lp = fused_rl_ops.top_logprobs(h, w, k, temperature=0.9, vocab_size=vocab_size,
                                            tp_group=dist.group.WORLD)
        h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        single_ids, single_lp = fused_rl_ops.top_logprobs(h1, w1, k, temperature=0.9, vocab_size=vocab_size)
        assert torch.equal(ids, single_ids)
        torch.testing.assert_close(lp, single_lp, atol=1e-5, rtol=1e-5)
        upstream = torch.randn(lp.shape, generator=torch.Generator().manual_seed(k))
        (lp * upstream).sum().backward()
        (single_lp * upstream).sum().backward()
        torch.testing.assert_close(h.grad, h1.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.grad, w1.grad[shard], atol=1e-5, rtol=1e-5)
    assert ids[0, 0, :2].tolist() == [1, local + 2]
    with pytest.raises(ValueError, match="disagree on the k"):
        fused_rl_ops.top_logprobs(hidden, weight[shard], 3 + rank, tp_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="disagree on the softcap"):
        fused_rl_ops.top_logprobs(hidden, weight[shard], 3, logit_map=LogitMap(1.0, 2.0 + rank),
                                  tp_group=dist.group.WORLD)


@pytest.mark.parametrize("world", [2, 4])
def test_top_logprobs_tensor_parallel(world):
    run_distributed(tensor_parallel_checks, world)
