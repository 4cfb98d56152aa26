"""A trainer's loop end to end on megatron-core 0.18 and 0.19 (CPU / gloo with the test-only shims).

A tiny GPTModel (GLU MLP with biases, sequence parallel) with an attached value head trains with a
PPO loss at TP 2 x DP 2 inside Megatron's DistributedDataParallel, by an AdamW built from
`model.parameters()` only (two groups: no weight decay for biases and norms). Labels are shifted as
a trainer scores sampled tokens (label t = token t + 1, -100 at each sequence's end), and the old
logprobs are scored without gradient before each step. The checkpoint, `save_sharded(model, path,
optimizer=optimizer)` with the groups of megatron-core's parallel_state:
- at the same layout, a fresh model and optimizer loaded from it and trained on end bit for bit
  where the run that went on without interruption ends (parameters, optimizer state, hyperparameters);
- at TP 1 x DP 4 and at TP 4, a fresh model and optimizer hold exactly what the TP 2 ranks held,
  gathered and split by the test's own reference rule.
All comparisons are of integer views.
"""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.checkpoint import (assert_same_training_state, gathered, partition_of, reference_shard,
                                             same_bits)
from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402

import fused_rl_ops  # noqa: E402
from fused_rl_ops.checkpoint import load_sharded, save_sharded  # noqa: E402
from fused_rl_ops.megatron import attach, rl_output_processor  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import ddp_train_step, make_rollout, model_inputs, shifted_labels  # noqa: E402

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")

B, S = 2, 8  # S divisible by TP 4 (sequence parallel)
VOCAB, REAL_VOCAB = 256, 200  # the model's padded vocabulary, the tokenizer's
TEMPERATURE = 0.8  # the rollout's sampling temperature
STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE = 2, 2


def build(seed, lr=1e-2):
    """(GPTModel with an attached value head, its DDP wrapper, AdamW over model.parameters()) at
    the current TP degree (sequence parallel where TP > 1)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = tiny_config(sequence_parallel=tp > 1, gated_linear_unit=True, activation_func=F.silu,
                         add_bias_linear=True)
    model = tiny_model("gpt", config, vocab_size=VOCAB, seed=seed)  # seeds torch's RNG: the head too
    value_head = fused_rl_ops.ValueHead(config.hidden_size, bias=True)
    attach(model, rl_output_processor(value_head=value_head, vocab_size=REAL_VOCAB, temperature=TEMPERATURE))
    ddp_model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}],  # biases, norms
        lr=lr, betas=(0.9, 0.95))
    return model, ddp_model, optimizer


def train(ddp_model, optimizer, steps):
    """PPO steps; each step's rollout depends on the step and the data-parallel rank only."""
    for step in steps:
        seed = 100 * step + parallel_state.get_data_parallel_rank()
        tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))
        labels = shifted_labels(tokens)
        with torch.no_grad():
            old_logprobs = ddp_model(tokens, *model_inputs(tokens), labels=labels)["logprobs"]
        # The ignored end of each sequence scores 0; every sampled token a negative logprob.
        assert torch.all(old_logprobs[:, -1] == 0) and torch.all(old_logprobs[:, :-1] < 0)
        ddp_train_step(ddp_model, optimizer, make_rollout(tokens, old_logprobs, seed=seed))


def training_state(model, optimizer):
    """name -> {"param": the parameter, state key: optimizer state} of this rank."""
    return {name: {"param": p, **optimizer.state[p]} for name, p in model.named_parameters()}


def logical_training_state(model, optimizer):
    """training_state's tensors as logical tensors, gathered over the TP group (scalars as they are)."""
    group = parallel_state.get_tensor_model_parallel_group()
    splits = {name: partition_of(p) for name, p in model.named_parameters()}
    return {name: {key: gathered(value, None if value.dim() == 0 else splits[name], group)
                   for key, value in held.items()}
            for name, held in training_state(model, optimizer).items()}


def param_groups(optimizer):
    return optimizer.state_dict()["param_groups"]


def assert_holds_shards_of(model, optimizer, logical):
    """model and optimizer hold this TP rank's shards of logical (logical_training_state's)."""
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    held = training_state(model, optimizer)
    assert held.keys() == logical.keys()
    for name, tensors in held.items():
        split = partition_of(model.get_parameter(name))
        assert tensors.keys() == logical[name].keys(), (name, tensors.keys())
        for key, value in tensors.items():
            full = logical[name][key]
            expected = full if split is None or full.dim() == 0 else reference_shard(full, *split, tp, tp_rank)
            assert same_bits(value, expected), (name, key)


def _train_save_resume_reshard(rank, world_size, path):
    set_parallel_degrees(tp=2)  # TP 2 x DP 2
    model, ddp_model, optimizer = build(seed=1)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in model.value_head.parameters()} <= in_optimizer  # attach made it the model's
    initial_head = {name: p.detach().clone() for name, p in model.value_head.named_parameters()}
    train(ddp_model, optimizer, range(STEPS_BEFORE_SAVE))
    for name, initial in initial_head.items():
        assert torch.all(model.value_head.get_parameter(name) != initial), f"value_head.{name} did not train"

    save_sharded(model, path, optimizer=optimizer)  # TP and DP groups from parallel_state
    saved = logical_training_state(model, optimizer)
    saved_groups = param_groups(optimizer)

    # The same layout: resumed by a fresh model and optimizer, and the run that was not interrupted.
    train(ddp_model, optimizer, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE))
    resumed, resumed_ddp, resumed_optimizer = build(seed=2, lr=0.5)
    assert not same_bits(resumed.value_head.weight, model.value_head.weight)
    load_sharded(resumed, path, optimizer=resumed_optimizer)
    assert_holds_shards_of(resumed, resumed_optimizer, saved)
    assert param_groups(resumed_optimizer) == saved_groups  # lr 1e-2 again
    train(resumed_ddp, resumed_optimizer, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE))
    assert_same_training_state(resumed, resumed_optimizer, model, optimizer)

    # Other layouts: the model and optimizer state the TP 2 ranks held, gathered, at TP 1 and TP 4.
    for tp in (1, 4):
        set_parallel_degrees(tp=tp)
        other, _, other_optimizer = build(seed=3, lr=0.5)
        assert not other_optimizer.state
        load_sharded(other, path, optimizer=other_optimizer)
        assert_holds_shards_of(other, other_optimizer, saved)
        assert param_groups(other_optimizer) == saved_groups


def test_trainer_trains_saves_resumes_bit_for_bit_and_reshards_at_tp2_dp2(tmp_path):
    run_distributed(_train_save_resume_reshard, 4, str(tmp_path / "checkpoint"))
