"""docs/rl_recipe.md runs as written, so it cannot go stale.

Its python blocks run in order, as one program, on 2 gloo ranks at TP 2 after megatron-core's
parallel state is initialised (with the test-only CPU shims), given the inputs the recipe names: a
gpt-oss-style tiny bf16 config, a supervised checkpoint saved by save_sharded, and a rollout. All
blocks but the last train the policy (bf16, Megatron's DDP and optimizer with fp32 main weights)
and save it with its optimizer; the run then goes on for a few PPO steps, and the last block (the
resume: a fresh policy and optimizer loaded from the checkpoint) must then give, over the same
steps, bitwise the same losses, bf16 parameters, fp32 main weights and Adam state.

Every optimizer step of the program, before and after the resume, is checked (CheckedSteps):
every element of every fp32 main weight changes (the value head's fp32 parameters, which the
optimizer steps themselves, are their own main weights; weight decay moves the elements without a
gradient, such as the embedding rows of tokens not in the rollout and the output layer's padding
rows, and the biases and norms, which Megatron does not decay, have a gradient in every element),
and each bf16 parameter is bitwise its main weight rounded to bf16. The recipe as written uses the
DistributedOptimizer; it runs again with Float16OptimizerWithFloat16Params, its one documented
alternative (use_distributed_optimizer=False).
"""
import re
from pathlib import Path

import pytest
import torch

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402

from fused_rl_ops.checkpoint import save_sharded  # noqa: E402
from tests.helpers.checkpoint import assert_same_megatron_state, megatron_training_state, same_bits  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")

RECIPE = Path(__file__).resolve().parents[2] / "docs" / "rl_recipe.md"
B, S = 2, 8
VOCAB, PADDED_VOCAB = 200, 256
STEPS_AFTER_SAVE = 2
DISTRIBUTED = "use_distributed_optimizer=True"


def recipe_blocks(distributed_optimizer=True):
    """The recipe's python code blocks, in order; with distributed_optimizer=False, set up for
    Float16OptimizerWithFloat16Params instead (in the DDP config and the optimizer config)."""
    blocks = re.findall(r"^```python\n(.*?)^```$", RECIPE.read_text(), flags=re.DOTALL | re.MULTILINE)
    if distributed_optimizer:
        return blocks
    assert sum(block.count(DISTRIBUTED) for block in blocks) == 2
    return [block.replace(DISTRIBUTED, "use_distributed_optimizer=False") for block in blocks]


def recipe_inputs(root):
    """What the recipe is given: a bf16 config, sizes, checkpoint paths (the supervised one saved
    here, bf16) and a rollout, the same on both TP ranks."""
    config = tiny_config(bf16=True, params_dtype=torch.bfloat16, init_method_std=0.1, gated_linear_unit=True,
                         activation_func=quick_gelu, activation_func_clamp_value=0.5, glu_linear_offset=1.0)
    supervised = tiny_model("gpt", config, vocab_size=PADDED_VOCAB, clamped_swiglu_mlp=True, seq_length=S, seed=1)
    save_sharded(supervised, f"{root}/sft")
    generator = torch.Generator().manual_seed(2)
    response_mask = torch.zeros(B, S, dtype=torch.long)
    response_mask[:, S // 2:] = 1
    return dict(config=config, vocab_size=VOCAB, padded_vocab=PADDED_VOCAB, seq_length=S,
                sft_checkpoint=f"{root}/sft", checkpoint=f"{root}/rl",
                tokens=torch.randint(0, VOCAB, (B, S), generator=generator), response_mask=response_mask,
                rewards=torch.randn(B, generator=generator))


class CheckedSteps:
    """Takes the place of a Megatron optimizer's step and checks each step (module docstring)."""

    def __init__(self, model, optimizer):
        self.language_model = unwrap_model(model)
        self.optimizer = optimizer
        self.step = optimizer.step
        self.steps = 0
        optimizer.step = self

    def __call__(self):
        before = megatron_training_state(self.language_model, self.optimizer)
        result = self.step()
        after = megatron_training_state(self.language_model, self.optimizer)
        assert after.keys() == dict(self.language_model.named_parameters()).keys()
        for name, state in after.items():
            main, param = state["main_param"], state["param"]
            assert main.dtype == torch.float32, name
            unchanged = torch.count_nonzero(main.view(torch.int32) == before[name]["main_param"].view(torch.int32))
            assert unchanged == 0, f"{name}: {unchanged} of {main.numel()} elements of its fp32 main weight did not change"
            if name.startswith("value_head."):
                assert param.dtype == torch.float32, name  # stepped itself: it is its main weight
            else:
                assert same_bits(param, main.to(torch.bfloat16)), f"{name} is not its main weight rounded to bf16"
        self.steps += 1
        return result


def _run_recipe(rank, world_size, root, distributed_optimizer):
    set_parallel_degrees(tp=2)
    *program, resume = recipe_blocks(distributed_optimizer)
    assert "load_sharded(unwrap_model(policy), checkpoint, optimizer=optimizer)" in resume
    namespace = recipe_inputs(root)
    exec(compile(program[0], f"{RECIPE}, python block 0", "exec"), namespace)
    policy, optimizer = namespace["policy"], namespace["optimizer"]
    checked = CheckedSteps(policy, optimizer)
    for index, block in enumerate(program[1:], start=1):
        exec(compile(block, f"{RECIPE}, python block {index}", "exec"), namespace)
    assert checked.steps == 2  # the update block's
    kind = "DistributedOptimizer" if distributed_optimizer else "Float16OptimizerWithFloat16Params"
    assert [type(member).__name__ for member in optimizer.chained_optimizers] == [kind]
    assert {"value_head.weight"} <= unwrap_model(policy).state_dict().keys()
    uninterrupted_losses = [namespace["ppo_step"]() for _ in range(STEPS_AFTER_SAVE)]
    uninterrupted = megatron_training_state(unwrap_model(policy), optimizer)

    exec(compile(resume, f"{RECIPE}, python block {len(program)}", "exec"), namespace)
    assert namespace["policy"] is not policy and namespace["optimizer"] is not optimizer
    CheckedSteps(namespace["policy"], namespace["optimizer"])
    resumed_losses = [namespace["ppo_step"]() for _ in range(STEPS_AFTER_SAVE)]
    assert all(same_bits(a, b) for a, b in zip(resumed_losses, uninterrupted_losses))
    assert_same_megatron_state(megatron_training_state(unwrap_model(namespace["policy"]), namespace["optimizer"]),
                               uninterrupted)


@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["distributed_optimizer", "float16_optimizer"])
def test_the_rl_recipe_trains_bf16_at_tp2_and_resumes_bit_for_bit(tmp_path, distributed_optimizer):
    assert len(recipe_blocks()) == 6  # models, labels, old logprobs, update, save, resume
    run_distributed(_run_recipe, 2, str(tmp_path), distributed_optimizer)
