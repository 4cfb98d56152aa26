"""An MoE model's checkpoint across (TP, EP) layouts, end to end on megatron-core 0.19.2 (CPU / gloo):
the gpt-oss-style model of test_megatron_moe saved at TP 2 (sequence parallel) / EP 1, loaded at
TP 1 / EP 2, saved there and loaded back at TP 2 / EP 1."""
import pytest
import torch
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the GPU machine has none)")
from megatron.core import parallel_state  # noqa: E402

from fused_rl_ops.checkpoint import load_sharded, save_sharded  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import model_inputs  # noqa: E402
from test_megatron_moe import B, S, VOCAB, moe_config  # noqa: E402

LAYOUTS = {  # name: (parallel degrees, config overrides); no biases: the TP 2 layout cannot train them
    "tp2-ep1": (dict(tp=2, expert_tp=1), dict(sequence_parallel=True, add_bias_linear=False)),
    "tp1-ep2": (dict(tp=1, ep=2, expert_tp=1), dict(add_bias_linear=False)),
}


def groups():
    return dict(
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
        expert_tp_group=parallel_state.get_expert_tensor_parallel_group(),
    )


def model_at(layout, seed):
    degrees, overrides = LAYOUTS[layout]
    set_parallel_degrees(**degrees)
    return tiny_model("gpt", moe_config(**overrides), seed=seed, vocab_size=VOCAB, clamped_swiglu_mlp=True)


def logits(model):
    """Full-vocab logits [b, s, V] of a fixed batch (gathered over TP), without gradients."""
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        local = model(tokens, *model_inputs(tokens))
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def bits(t):
    return t.contiguous().view(torch.int32)


def _reshard(rank, world_size, path):
    source = model_at("tp2-ep1", seed=1)
    expected = logits(source)
    save_sharded(source, f"{path}/a", **groups())

    other = model_at("tp1-ep2", seed=2)
    assert not torch.allclose(logits(other), expected)  # different weights before the load
    load_sharded(other, f"{path}/a", **groups())
    # Another layout sums in another order: equal to fp32 rounding, not bitwise.
    assert_close(logits(other), expected, rtol=1e-5, atol=1e-5)
    save_sharded(other, f"{path}/b", **groups())

    back = model_at("tp2-ep1", seed=3)
    load_sharded(back, f"{path}/b", **groups())
    assert torch.equal(bits(logits(back)), bits(expected))  # the same layout again: bit for bit
    for (name, saved), (_, loaded) in zip(source.state_dict().items(), back.state_dict().items()):
        if isinstance(saved, torch.Tensor) and saved.is_floating_point():
            assert torch.equal(bits(saved.float()), bits(loaded.float())), name


def test_moe_checkpoint_reshards_between_tp_and_ep_layouts(tmp_path):
    run_distributed(_reshard, 2, str(tmp_path))
