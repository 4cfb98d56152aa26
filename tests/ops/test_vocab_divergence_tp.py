"""vocab_divergence across tensor-parallel ranks: real processes on gloo, each holding its vocab
shard of both models' output layers. Results against the float64 reference over the whole vocabulary
(every kind, temperature, both softcaps, a last shard of padding, a mask), the hidden gradient left
to the caller, a NaN position, and bad or mismatched arguments raising the same error on every rank;
and the shards' ops merged in one process, on every device."""
import pytest
import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops.logit_options import LogitMap
from fused_rl_ops.testing.distributed import run_distributed
from tests.ops.test_vocab_divergence import reference_keywords

H, H_T, LOCAL_V, S, B = 16, 24, 100, 5, 3
KINDS = ["forward_kl", "reverse_kl", "jsd"]
TOLERANCE = dict(atol=2e-5, rtol=2e-5)


def shared_inputs(world, seed=0):
    """Both models' hidden states and whole output layers (every rank makes the same), correlated,
    the mask and the upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g)
    weight = torch.randn(world * LOCAL_V, H, generator=g) * 0.5
    teacher_hidden = torch.cat([hidden, torch.randn(S, B, H_T - H, generator=g)], -1)
    teacher_weight = torch.cat([weight, torch.randn(world * LOCAL_V, H_T - H, generator=g) * 0.3], -1)
    mask = torch.rand(S, B, generator=g) > 0.25
    return hidden, weight, teacher_hidden, teacher_weight, mask, torch.randn(S, B, generator=g)


def fwd_bwd(fn, hidden, weight, teacher_hidden, teacher_weight, grad, **kw):
    h, w = hidden.clone().double().requires_grad_(True), weight.clone().double().requires_grad_(True)
    if fn is fused_rl_ops.vocab_divergence:
        h, w = h.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    else:
        kw = reference_keywords(kw)
    divergence = fn(h, w, teacher_hidden.to(h.dtype), teacher_weight.to(h.dtype), **kw)
    (divergence * grad.to(h.dtype)).sum().backward()
    return divergence.detach().double(), h.grad.double(), w.grad.double()


def tensor_parallel_checks(rank, world):
    group = dist.group.WORLD
    hidden, weight, teacher_hidden, teacher_weight, mask, grad = shared_inputs(world)
    shard = slice(rank * LOCAL_V, (rank + 1) * LOCAL_V)
    # The last rank's shard is partly (at 4 ranks wholly) padding.
    vocab_size = world * LOCAL_V - (LOCAL_V + 10 if world == 4 else 10)
    for kind in KINDS:
        kw = dict(kind=kind, temperature=0.8, softcap=4.0, teacher_softcap=3.0, vocab_size=vocab_size, mask=mask,
                  beta=0.35)
        full = fwd_bwd(reference.vocab_divergence, hidden, weight, teacher_hidden, teacher_weight, grad, **kw)
        tp = fwd_bwd(fused_rl_ops.vocab_divergence, hidden, weight[shard], teacher_hidden, teacher_weight[shard],
                     grad, tp_group=group, workspace_bytes=1, **kw)
        torch.testing.assert_close(tp[0], full[0], **TOLERANCE)
        torch.testing.assert_close(tp[1], full[1], **TOLERANCE)
        torch.testing.assert_close(tp[2], full[2][shard], **TOLERANCE)
        assert full[0][mask].gt(1e-3).all() and tp[0][~mask].eq(0).all()
        if world == 4 and rank == 3:
            assert tp[2].eq(0).all()

    # reduce_hidden_grad=False leaves this rank's partial: the sum over ranks is the full gradient.
    kw = dict(kind="jsd", vocab_size=vocab_size)
    full = fwd_bwd(reference.vocab_divergence, hidden, weight, teacher_hidden, teacher_weight, grad, **kw)
    partial = fwd_bwd(fused_rl_ops.vocab_divergence, hidden, weight[shard], teacher_hidden, teacher_weight[shard],
                      grad, tp_group=group, reduce_hidden_grad=False, **kw)[1]
    assert not torch.allclose(partial, full[1], atol=1e-3)
    dist.all_reduce(partial)
    torch.testing.assert_close(partial, full[1], **TOLERANCE)

    # A NaN in one position of the teacher's hidden states: NaN there on every rank, and only there.
    nan_teacher = teacher_hidden.clone()
    nan_teacher[1, 2, 0] = float("nan")
    ours = fused_rl_ops.vocab_divergence(hidden, weight[shard], nan_teacher, teacher_weight[shard], kind="reverse_kl",
                                         tp_group=group)
    expected = torch.zeros(S, B, dtype=torch.bool)
    expected[1, 2] = True
    assert torch.equal(ours.isnan(), expected)
    if world == 2:  # in this run: a spawn costs more than the checks
        bad_group_checks(rank, world)


def call_per_rank(rank, inputs, changes):
    hidden, weight, teacher_hidden, teacher_weight = inputs
    shard = slice(rank * LOCAL_V, (rank + 1) * LOCAL_V)
    call = dict(hidden=hidden, weight=weight[shard], teacher_hidden=teacher_hidden, teacher_weight=teacher_weight[shard],
                kind="jsd", tp_group=dist.group.WORLD)
    changes.get(rank, lambda c: None)(call)
    return fused_rl_ops.vocab_divergence(call.pop("hidden"), call.pop("weight"), call.pop("teacher_hidden"),
                                         call.pop("teacher_weight"), **call)


# (rank -> change of its call, pattern of the error every rank must raise, or {rank: pattern})
BAD_GROUP_CALLS = [
    ({1: lambda c: c.update(kind="reverse_kl")}, r"disagree on the kind \(per rank: \[2, 1\]\)"),
    ({1: lambda c: c.update(beta=0.25)}, r"disagree on the beta \(per rank: \[0.5, 0.25\]\)"),
    ({0: lambda c: c.update(teacher_softcap=5.0)}, "disagree on the teacher_softcap"),
    ({1: lambda c: c.update(temperature=0.5)}, "disagree on the temperature"),
    ({1: lambda c: c.update(logit_map=LogitMap(1.0, 3.0))}, "disagree on the softcap"),
    ({1: lambda c: c.update(mask=torch.ones(S, B, dtype=torch.bool))}, "disagree on the mask"),
    ({1: lambda c: c.update(teacher_hidden=torch.randn(S, B, H_T + 1), teacher_weight=torch.randn(LOCAL_V, H_T + 1))},
     "disagree on the teacher hidden size"),
    ({1: lambda c: c.update(teacher_hidden=c["teacher_hidden"].bfloat16(),
                            teacher_weight=c["teacher_weight"].bfloat16())}, "disagree on the teacher dtype"),
    ({1: lambda c: c.update(kind="kl")}, {0: r"other ranks.*rank 1: ValueError: vocab_divergence: kind must be",
                                         1: "kind must be one of"}),
    ({0: lambda c: c.update(beta=1.5)}, {0: r"beta must be a number in \(0, 1\)", 1: r"rank 0: ValueError"}),
    ({1: lambda c: c.update(teacher_weight=c["teacher_weight"][:-1])},
     {0: "rank 1: ValueError", 1: r"teacher_weight must be \[V_local, H_t\]"}),
]


def bad_group_checks(rank, world):
    inputs = shared_inputs(world, seed=4)[:4]
    for changes, pattern in BAD_GROUP_CALLS:
        pattern = pattern[rank] if isinstance(pattern, dict) else pattern
        with pytest.raises((ValueError, TypeError), match=pattern):
            call_per_rank(rank, inputs, changes)
    # The group is still in step: a valid call gives the whole vocabulary's result.
    single = fused_rl_ops.vocab_divergence(*inputs, kind="jsd")
    torch.testing.assert_close(call_per_rank(rank, inputs, {}), single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_float64_reference(world):
    run_distributed(tensor_parallel_checks, world)


def test_shards_merged_in_one_process_give_the_whole_vocabulary(device):
    """What the ranks' ops compute, run in one process (so on CUDA too): 4 shards of the vocabulary,
    the third partly and the last wholly padding, each shard's partials merged by
    vocab_divergence_combine, jsd's second-pass sums added, each shard's backward from the merged
    rows: the divergence, the summed hidden gradient and each shard's weight gradient are the
    whole-vocabulary call's."""
    world, ops = 4, torch.ops.fused_rl_ops
    hidden, weight, teacher_hidden, teacher_weight, mask, grad = (
        t.to(device).flatten(0, 1) if t.dim() > 2 else t.to(device) for t in shared_inputs(world))
    mask, grad = mask.flatten(), grad.flatten()
    vocab_size = world * LOCAL_V - LOCAL_V - 10
    shards = [slice(r * LOCAL_V, (r + 1) * LOCAL_V) for r in range(world)]
    for kind in KINDS:
        own = dict(kind=KINDS.index(kind), beta=0.35)

        # One rank's call: the student's map (0.8, softcap 4.0), the teacher's (0.8, 3.0), 128-row chunks.
        def shard_call(op, shard, *tensors):
            valid = min(max(vocab_size - shard.start, 0), LOCAL_V)
            return op(hidden, weight[shard], teacher_hidden, teacher_weight[shard], mask, *tensors, 0.8, 4.0, 0.8, 3.0,
                      shard.start, valid, 128, 0, 0, **own)

        rows = ops.vocab_divergence_combine(torch.stack([shard_call(ops.vocab_divergence_stats, s) for s in shards]))
        divergence, term = rows[:, 4], torch.zeros_like(rows[:, 0])
        if kind == "reverse_kl":
            divergence = term = rows[:, 5].contiguous()
        elif kind == "jsd":
            sums = sum(shard_call(ops.vocab_divergence_mixture, s, rows) for s in shards)
            divergence, term = 0.35 * sums[:, 0] + 0.65 * sums[:, 1], sums[:, 1].contiguous()
        upstream = torch.where(mask, grad, 0.0)
        grads = [shard_call(ops.vocab_divergence_backward, s, rows, term, upstream, None) for s in shards]
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        whole = fused_rl_ops.vocab_divergence(h, w, teacher_hidden, teacher_weight, kind=kind, mask=mask,
                                              temperature=0.8, softcap=4.0, teacher_softcap=3.0, beta=0.35,
                                              vocab_size=vocab_size, workspace_bytes=1)
        (whole * grad).sum().backward()
        torch.testing.assert_close(torch.where(mask, divergence, 0.0), whole.detach(), **TOLERANCE)
        torch.testing.assert_close(sum(g[0] for g in grads), h.grad, **TOLERANCE)
        torch.testing.assert_close(torch.cat([g[1] for g in grads]), w.grad, **TOLERANCE)
        assert grads[3][1].eq(0).all() and whole[mask].gt(1e-3).all()
