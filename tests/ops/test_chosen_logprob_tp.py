"""chosen_logprob across tensor-parallel ranks: real processes on gloo. Besides the results, NaN and
-inf across ranks, and invalid or mismatched arguments raising the same error on every rank."""
import pytest
import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops.testing.distributed import run_distributed
from tests.helpers.kernel_calls import KernelCalls

H, LOCAL_V, S, B = 24, 100, 6, 3


def shared_inputs(world, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g)
    weight = torch.randn(world * LOCAL_V, H, generator=g) * 0.5
    return hidden, weight


def fwd_bwd(hidden, weight, tokens, grad_lp, grad_ent, **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens, return_entropy=True, workspace_bytes=1, **kw)
    (lp * grad_lp + ent * grad_ent).sum().backward()
    return lp, ent, h.grad, w.grad


def tensor_parallel_checks(rank, world):
    group = dist.group.WORLD
    hidden, weight = shared_inputs(world)
    # The last rank's shard is (partly, at 4 ranks wholly) padding.
    vocab_size = world * LOCAL_V - (LOCAL_V + 10 if world == 4 else 10)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab_size, (S, B), generator=g)
    # ids on every shard edge, the last valid id, and one ignored position
    edges = [e for r in range(1, world) for e in (r * LOCAL_V - 1, r * LOCAL_V) if e < vocab_size]
    tokens.view(-1)[: len(edges) + 3] = torch.tensor(edges + [0, vocab_size - 1, -100])
    grad_lp, grad_ent = torch.randn(S, B, generator=g), torch.randn(S, B, generator=g)
    kw = dict(temperature=0.9, vocab_size=vocab_size)

    full = fwd_bwd(hidden, weight, tokens, grad_lp, grad_ent, **kw)
    shard = slice(rank * LOCAL_V, (rank + 1) * LOCAL_V)
    tp = fwd_bwd(hidden, weight[shard], tokens, grad_lp, grad_ent, tp_group=group, **kw)
    for ours, single in zip(tp[:3], full[:3]):
        torch.testing.assert_close(ours, single, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tp[3], full[3][shard], atol=1e-5, rtol=1e-5)
    if world == 4 and rank == 3:
        assert tp[3].eq(0).all()

    # reduce_hidden_grad=False leaves this rank's partial: summing over ranks gives the full grad.
    partial = fwd_bwd(hidden, weight[shard], tokens, grad_lp, grad_ent, tp_group=group, reduce_hidden_grad=False, **kw)
    assert not torch.allclose(partial[2], full[2], atol=1e-3)
    summed = partial[2].clone()
    dist.all_reduce(summed)
    torch.testing.assert_close(summed, full[2], atol=1e-5, rtol=1e-5)

    skipped_rows_checks(rank, hidden, weight, tokens, grad_lp, grad_ent, kw)
    nonfinite_checks(rank, world, hidden, weight, tokens, grad_lp, grad_ent, kw)
    if world == 2:  # in this run: a spawn costs more than the checks
        bad_group_checks(rank, world)


def skipped_rows_checks(rank, hidden, weight, tokens, grad_lp, grad_ent, kw):
    """Half the positions ignored: every rank's ops get every row and ignore_index (and leave the
    same rows out on every rank), and the results are the single-rank op's (itself tested against
    float64)."""
    shard = slice(rank * LOCAL_V, (rank + 1) * LOCAL_V)
    masked = tokens.clone()
    masked[: S // 2] = -100
    masked[-1, 1] = -100
    with KernelCalls() as calls:
        tp = fwd_bwd(hidden, weight[shard], masked, grad_lp, grad_ent, tp_group=dist.group.WORLD, **kw)
    for op in ("chosen_logprob_stats", "chosen_logprob_backward"):
        assert [t.tolist() for t in calls.tokens(op)] == [masked.reshape(-1).tolist()], op
        assert {call.args["ignore_index"] for call in calls.calls if call.op == op} == {-100}
    full = fwd_bwd(hidden, weight, masked, grad_lp, grad_ent, **kw)
    for ours, single in zip(tp[:3], full[:3]):
        torch.testing.assert_close(ours, single, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tp[3], full[3][shard], atol=1e-5, rtol=1e-5)
    ignored = masked == -100
    assert tp[0][ignored].eq(0).all() and tp[1][ignored].eq(0).all() and tp[2][ignored].eq(0).all()


def assert_same_with_nan(ours, single):
    for a, b in zip(ours, single):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)


def nonfinite_checks(rank, world, hidden, weight, tokens, grad_lp, grad_ent, kw):
    """A NaN in one rank's weight row reaches every rank's results; -inf logits filling a whole rank's
    shard leave the others' finite. Both as the single-rank op (itself tested against float64)."""
    shard = slice(rank * LOCAL_V, (rank + 1) * LOCAL_V)
    nan_weight = weight.clone()
    nan_weight[LOCAL_V + 3, 5] = float("nan")  # rank 1's shard
    full = fwd_bwd(hidden, nan_weight, tokens, grad_lp, grad_ent, **kw)
    tp = fwd_bwd(hidden, nan_weight[shard], tokens, grad_lp, grad_ent, tp_group=dist.group.WORLD, **kw)
    scored = tokens != -100
    assert tp[1][scored].isnan().all() and tp[2][scored].isnan().all() and tp[2][~scored].eq(0).all()
    assert_same_with_nan(tp[:3], full[:3])
    assert_same_with_nan(tp[3:], (full[3][shard],))

    minus_inf_hidden, minus_inf_weight = hidden.clone(), weight.clone()
    minus_inf_hidden[..., 7] = 1.0
    minus_inf_weight[:LOCAL_V, 7] = float("-inf")  # rank 0's whole shard
    full = fwd_bwd(minus_inf_hidden, minus_inf_weight, tokens, grad_lp, grad_ent, **kw)
    tp = fwd_bwd(minus_inf_hidden, minus_inf_weight[shard], tokens, grad_lp, grad_ent, tp_group=dist.group.WORLD,
                 **kw)
    assert tp[1].isfinite().all()
    assert_same_with_nan(tp[:3], full[:3])
    assert_same_with_nan(tp[3:], (full[3][shard],))


def call_per_rank(rank, hidden, weight, tokens, changes):
    """chosen_logprob on this rank's shard, with changes[rank] (a function of the call's arguments)."""
    call = dict(hidden=hidden, weight=weight[rank * LOCAL_V : (rank + 1) * LOCAL_V], tokens=tokens,
                tp_group=dist.group.WORLD)
    changes.get(rank, lambda c: None)(call)
    return fused_rl_ops.chosen_logprob(call.pop("hidden"), call.pop("weight"), call.pop("tokens"), **call)


def set_bf16(call):
    call.update(hidden=call["hidden"].bfloat16(), weight=call["weight"].bfloat16())


# (rank -> change of its call, pattern of the error every rank must raise, or {rank: pattern})
BAD_GROUP_CALLS = [
    ({1: lambda c: c.update(hidden=c["hidden"][:-1], tokens=c["tokens"][:-1])}, "disagree on the token count"),
    ({1: set_bf16}, "disagree on the dtype"),
    ({1: lambda c: c.update(hidden=torch.randn(S, B, H + 1), weight=torch.randn(LOCAL_V, H + 1))},
     "disagree on the hidden size"),
    ({1: lambda c: c.update(temperature=0.5)}, r"disagree on the temperature \(per rank: \[1.0, 0.5\]\)"),
    ({1: lambda c: c.update(tokens=c["tokens"].flip(0))}, "disagree on the token ids"),
    ({1: lambda c: c.update(reduce_hidden_grad=False)}, "disagree on the reduce_hidden_grad"),
    ({0: lambda c: c.update(skip_ignored=False)},
     r"disagree on the skipping of ignored rows \(skip_ignored\) \(per rank: \[0, 1\]\)"),
    ({0: lambda c: c.update(vocab_start=0), 1: lambda c: c.update(vocab_start=0)}, "tile"),
    ({1: lambda c: c.update(vocab_start=3 * LOCAL_V)}, "tile"),
    ({0: lambda c: c.update(vocab_size=2 * LOCAL_V + 1), 1: lambda c: c.update(vocab_size=2 * LOCAL_V + 1)},
     "beyond the 200 rows"),
    ({1: lambda c: c["tokens"].__setitem__((0, 0), 10**6)},
     {0: r"other ranks.*rank 1: ValueError: chosen_logprob: token ids", 1: "token ids must lie"}),
    ({1: lambda c: c.update(weight=c["weight"].double())},
     {0: r"other ranks.*rank 1: TypeError: chosen_logprob: weight must have", 1: "weight must have hidden's dtype"}),
    ({1: lambda c: c.update(vocab_start=-5)},
     {0: "rank 1: ValueError", 1: "vocab_start must be a non-negative integer"}),
]


def bad_group_checks(rank, world):
    hidden, weight = shared_inputs(world)
    tokens = torch.randint(0, world * LOCAL_V, (S, B), generator=torch.Generator().manual_seed(4))
    for changes, pattern in BAD_GROUP_CALLS:
        pattern = pattern[rank] if isinstance(pattern, dict) else pattern
        with pytest.raises((ValueError, TypeError), match=pattern):
            call_per_rank(rank, hidden.clone(), weight, tokens.clone(), changes)
    # The group is still in step: a valid call gives the single-rank result.
    single = fused_rl_ops.chosen_logprob(hidden, weight, tokens)
    torch.testing.assert_close(call_per_rank(rank, hidden, weight, tokens, {}), single, atol=1e-5, rtol=1e-5)


def megatron_checks(rank, world):
    """Against Megatron's own vocab_parallel_cross_entropy on the same logits."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    hidden, weight = shared_inputs(world, seed=2)
    weight_shard = weight[rank * LOCAL_V : (rank + 1) * LOCAL_V]
    tokens = torch.randint(0, world * LOCAL_V, (S, B), generator=torch.Generator().manual_seed(3))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    temperature = 1.3
    logits = (hidden @ weight_shard.T) / temperature  # [S, B, V_local]
    megatron_loss = vocab_parallel_cross_entropy(logits.clone(), tokens.clone())
    ours = fused_rl_ops.chosen_logprob(hidden, weight_shard, tokens, temperature=temperature,
                                       tp_group=parallel_state.get_tensor_model_parallel_group())
    torch.testing.assert_close(ours, -megatron_loss, atol=1e-5, rtol=1e-5)
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_rank(world):
    run_distributed(tensor_parallel_checks, world)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_megatron(world):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    run_distributed(megatron_checks, world)
