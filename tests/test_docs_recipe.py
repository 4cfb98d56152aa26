"""docs/rl_recipe.md runs as written, so it cannot go stale.

Its python blocks run in order, as one program, on 2 gloo ranks at TP 2 after megatron-core's
parallel state is initialised (with the test-only CPU shims), given the inputs the recipe names: a
gpt-oss-style tiny config, a supervised checkpoint saved by save_sharded, and a rollout. All blocks
but the last train the policy and save it with its optimizer; the run then goes on for a few PPO
steps, and the last block (the resume: a fresh policy and optimizer loaded from the checkpoint) must
then give, over the same steps, bitwise the same losses, parameters and optimizer state.
"""
import re
from pathlib import Path

import pytest
import torch

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402

from fused_rl_ops.checkpoint import save_sharded  # noqa: E402
from fused_rl_ops.testing.checkpoint import assert_same_training_state, same_bits  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")

RECIPE = Path(__file__).resolve().parents[1] / "docs" / "rl_recipe.md"
B, S = 2, 8
VOCAB, PADDED_VOCAB = 200, 256
STEPS_AFTER_SAVE = 2


def recipe_blocks():
    """The recipe's python code blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", RECIPE.read_text(), flags=re.DOTALL | re.MULTILINE)


def recipe_inputs(root):
    """What the recipe is given: config, sizes, checkpoint paths (the supervised one saved here) and
    a rollout, the same on both TP ranks."""
    config = tiny_config(init_method_std=0.1, gated_linear_unit=True, activation_func=quick_gelu,
                         activation_func_clamp_value=0.5, glu_linear_offset=1.0)
    supervised = tiny_model("gpt", config, vocab_size=PADDED_VOCAB, clamped_swiglu_mlp=True, seq_length=S, seed=1)
    save_sharded(supervised, f"{root}/sft")
    generator = torch.Generator().manual_seed(2)
    response_mask = torch.zeros(B, S, dtype=torch.long)
    response_mask[:, S // 2:] = 1
    return dict(config=config, vocab_size=VOCAB, padded_vocab=PADDED_VOCAB, seq_length=S,
                sft_checkpoint=f"{root}/sft", checkpoint=f"{root}/rl",
                tokens=torch.randint(0, VOCAB, (B, S), generator=generator), response_mask=response_mask,
                rewards=torch.randn(B, generator=generator))


def _run_recipe(rank, world_size, root):
    set_parallel_degrees(tp=2)
    *program, resume = recipe_blocks()
    assert "load_sharded(policy, checkpoint, optimizer=optimizer)" in resume
    namespace = recipe_inputs(root)
    for index, block in enumerate(program):
        exec(compile(block, f"{RECIPE}, python block {index}", "exec"), namespace)
    policy, optimizer = namespace["policy"], namespace["optimizer"]
    assert {"value_head.weight"} <= policy.state_dict().keys()
    assert not same_bits(policy.output_layer.weight, namespace["reference"].output_layer.weight)  # it trained
    uninterrupted_losses = [namespace["ppo_step"]() for _ in range(STEPS_AFTER_SAVE)]

    exec(compile(resume, f"{RECIPE}, python block {len(program)}", "exec"), namespace)
    assert namespace["policy"] is not policy and namespace["optimizer"] is not optimizer
    resumed_losses = [namespace["ppo_step"]() for _ in range(STEPS_AFTER_SAVE)]
    assert all(same_bits(a, b) for a, b in zip(resumed_losses, uninterrupted_losses))
    assert_same_training_state(namespace["policy"], namespace["optimizer"], policy, optimizer)


def test_the_rl_recipe_runs_at_tp2_and_resumes_bit_for_bit(tmp_path):
    assert len(recipe_blocks()) == 6  # models, labels, old logprobs, update, save, resume
    run_distributed(_run_recipe, 2, str(tmp_path))
