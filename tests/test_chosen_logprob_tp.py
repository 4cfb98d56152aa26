"""chosen_logprob across tensor-parallel ranks: real processes on gloo."""
import pytest
import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops.testing.distributed import run_distributed

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
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the GPU machine has none)")
    run_distributed(megatron_checks, world)
