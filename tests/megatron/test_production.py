"""The configuration RL runs use, in one test (megatron-core 0.18 and 0.19, CPU / gloo, 4 ranks).

Phase 1, TP 2 x DP 2 with sequence parallel: a tiny bf16 GPTModel inside Float16Module with an fp32
value head attached, Megatron's DistributedDataParallel and DistributedOptimizer with
overlap_param_gather and overlap_grad_reduce on (the output layer alone in its bucket), trains
GRPO-style steps. Each step the policy's weights (which the overlap gathers lazily) are gathered and
copied into a rollout engine, which samples 2 responses to each of 2 prompts with the sampler's
temperature and top_p (the response a quarter of each sequence: 3/4 of the positions masked); the
old logprobs are scored without gradient, then one clipped-ratio update with group-normalised
advantages and a value loss, the tokens top_p drops left out. Every processor call, with and
without gradient, is checked against the naive processor (fused_rl_ops.reference.megatron) on the
same hidden states and weights. After 2 steps the policy is saved with its optimizer; a third step
follows (the uninterrupted run); then a second save over the checkpoint is killed part-way (one rank
SIGKILLed after its first file operations), which ends the run.

Phase 2, TP 1 x DP 4: a fresh policy loads the checkpoint, which the killed save left intact: its
bf16 weights, fp32 main weights and Adam state are bitwise what was saved, and the third step, on
the same rollout, gives phase 1's loss and updated weights to bf16 rounding (another TP degree sums
in another order).

Run time: 4.5 to 8 minutes on a 2-core VM shared with other jobs (load average 30 to 35), two
spawned runs of 4 ranks; most of it is imports, builds and the ranks' start.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402

import fused_rl_ops  # noqa: E402
from fused_rl_ops.checkpoint import load_sharded, save_sharded  # noqa: E402
from fused_rl_ops.megatron import rl_output_processor  # noqa: E402
from fused_rl_ops.reference import sampler_filter  # noqa: E402
from fused_rl_ops.reference.megatron import NaiveRLOutputProcessor  # noqa: E402
from tests.helpers.checkpoint import assert_same_megatron_state, die_after_file_operation, megatron_training_state  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import (full_vocab_logits, megatron_bf16_training,  # noqa: E402
                                               set_parallel_degrees, tiny_config, tiny_model)
from fused_rl_ops.testing.ppo import model_inputs, shifted_labels  # noqa: E402

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")

GROUPS, GROUP_SIZE = 2, 2  # prompts, responses to each: the global batch is 4 sequences
S, PROMPT = 16, 12  # the response: the last quarter of each sequence
VOCAB, REAL_VOCAB = 256, 200
TEMPERATURE, TOP_P = 0.9, 0.9
LR, CLIP, VALUE_COEFF = 1e-3, 0.2, 0.5
STEPS_BEFORE_SAVE = 2


class CheckedProcessor:
    """The fused processor, each of whose calls is checked against the naive processor on the same
    hidden states and weights (upcast to fp32: the bf16 products the fused kernels sum in fp32)."""

    def __init__(self, value_head):
        options = dict(temperature=TEMPERATURE, top_p=TOP_P, value_head=value_head, vocab_size=REAL_VOCAB)
        self.fused = rl_output_processor(**options)
        self.naive = NaiveRLOutputProcessor(**options)
        self.value_head = value_head  # attach makes it the model's submodule
        self.calls = 0

    def __call__(self, *, hidden_states, output_layer, output_weight=None, **kwargs):
        outputs = self.fused(hidden_states=hidden_states, output_layer=output_layer, output_weight=output_weight,
                             **kwargs)
        weight = output_layer.weight if output_weight is None else output_weight
        with torch.no_grad():
            expected = self.naive(hidden_states=hidden_states.float(), output_layer=output_layer,
                                  output_weight=weight.float(), **kwargs)
        assert list(outputs) == list(expected)
        for name, tensor in expected.items():
            assert_close(outputs[name].detach(), tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        self.calls += 1
        return outputs


def build_policy(seed):
    """(language model, DDP model, optimizer, processor) at the current degrees: bf16 in Float16Module,
    an fp32 value head, overlapped DDP and the DistributedOptimizer."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = tiny_config(bf16=True, params_dtype=torch.bfloat16, sequence_parallel=tp > 1)
    model = tiny_model("gpt", config, vocab_size=VOCAB, seq_length=S, seed=seed)
    torch.manual_seed(seed + 1)  # the same on every rank: the head is replicated over TP
    processor = CheckedProcessor(fused_rl_ops.ValueHead(config.hidden_size, bias=True))
    overlap = dict(overlap_param_gather=True, overlap_grad_reduce=True, bucket_size=model.output_layer.weight.numel())
    ddp_model, optimizer = megatron_bf16_training(model, distributed_optimizer=True, lr=LR, processor=processor,
                                                  ddp_settings=overlap)
    return model, ddp_model, optimizer, processor


def gathered_weights(model, ddp_model):
    """The policy's weights, once the all-gather the overlap leaves for the next forward is done."""
    ddp_model.start_param_sync(force_sync=True)
    return {name: t for name, t in model.state_dict().items() if not name.startswith("value_head.")}


def sample_rollout(engine, step):
    """The global batch, the same on every rank: GROUPS prompts, GROUP_SIZE responses to each,
    sampled by the engine at TEMPERATURE with top_p over the tokenizer's vocabulary; labels and the
    loss mask of the response positions; one reward per sequence, advantages normalised per group."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, REAL_VOCAB, (GROUPS, PROMPT), generator=generator).repeat_interleave(GROUP_SIZE, 0)
    with torch.no_grad():
        while tokens.shape[1] < S:
            logits = full_vocab_logits(engine, tokens)[:, -1, :REAL_VOCAB] / TEMPERATURE
            probs = torch.softmax(sampler_filter(logits, top_p=TOP_P), dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
    loss_mask = torch.zeros(tokens.shape)
    loss_mask[:, PROMPT - 1:S - 1] = 1.0  # the positions whose label is a response token
    rewards = torch.randn(GROUPS, GROUP_SIZE, generator=generator)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    return {"tokens": tokens, "labels": shifted_labels(tokens), "loss_mask": loss_mask,
            "rewards": rewards.reshape(-1, 1).expand(tokens.shape), "advantages": advantages.reshape(-1, 1)}


def this_rank(rollout):
    """This data-parallel rank's rows of the global batch."""
    per_rank = GROUPS * GROUP_SIZE // parallel_state.get_data_parallel_world_size()
    start = parallel_state.get_data_parallel_rank() * per_rank
    return {name: t[start:start + per_rank] for name, t in rollout.items()}


def grpo_step(ddp_model, optimizer, rollout):
    """Old logprobs, then one update; returns the global loss. The loss is summed over the scored
    tokens and divided by their global count, so the update is the same at any data-parallel degree."""
    batch = this_rank(rollout)
    inputs = (batch["tokens"], *model_inputs(batch["tokens"]))
    score = dict(labels=batch["labels"], loss_mask=batch["loss_mask"])
    with torch.no_grad():
        old = ddp_model(*inputs, **score)["logprobs"]
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    out = ddp_model(*inputs, **score)
    # A token top_p dropped scores -inf: left out before any arithmetic (-inf - -inf is NaN).
    scored = batch["loss_mask"] * ~(torch.isneginf(out["logprobs"]) | torch.isneginf(old))
    ratio = torch.exp(torch.where(scored > 0, out["logprobs"] - old, 0.0))
    advantages = batch["advantages"]
    policy_loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    per_token = policy_loss + VALUE_COEFF * (out["values"] - batch["rewards"]) ** 2
    dp_group = parallel_state.get_data_parallel_group()
    scored_tokens = scored.sum()
    dist.all_reduce(scored_tokens, group=dp_group)
    loss = (per_token * scored).sum() / scored_tokens * dist.get_world_size(dp_group)  # DDP averages over DP
    loss.backward()
    finalize_model_grads([ddp_model])
    update_successful, _, _ = optimizer.step()
    assert update_successful
    global_loss = loss.detach() / dist.get_world_size(dp_group)
    dist.all_reduce(global_loss, group=dp_group)
    return global_loss


def _train_save_and_kill(rank, world_size, root):
    set_parallel_degrees(tp=2)  # DP 2
    model, ddp_model, optimizer, processor = build_policy(seed=1)
    engine = tiny_model("gpt", tiny_config(), vocab_size=VOCAB, seq_length=S, seed=9)  # fp32, weights synced below
    for step in range(STEPS_BEFORE_SAVE + 1):
        engine.load_state_dict(gathered_weights(model, ddp_model))  # the weight sync to the rollout engine
        if step == STEPS_BEFORE_SAVE:  # the weights are gathered: the data-parallel replicas agree
            save_sharded(model, f"{root}/checkpoint", optimizer=optimizer)
            saved = megatron_training_state(model, optimizer)
        rollout = sample_rollout(engine, step)
        loss = grpo_step(ddp_model, optimizer, rollout)
    assert processor.calls == 2 * (STEPS_BEFORE_SAVE + 1)
    ddp_model.start_param_sync(force_sync=True)
    uninterrupted = megatron_training_state(model, optimizer)
    if rank == 0:
        torch.save({"saved": saved, "rollout": rollout, "loss": loss, "uninterrupted": uninterrupted},
                   f"{root}/phase1.pt")
    dist.barrier()
    if rank == 1:
        die_after_file_operation(2)  # its first data file written, before the save commits
    save_sharded(model, f"{root}/checkpoint", optimizer=optimizer)


def _resume_at_another_layout(rank, world_size, root):
    set_parallel_degrees(tp=1)  # DP 4
    phase1 = torch.load(f"{root}/phase1.pt")
    model, ddp_model, optimizer, processor = build_policy(seed=5)
    load_sharded(model, f"{root}/checkpoint", optimizer=optimizer)
    assert_same_megatron_state(megatron_training_state(model, optimizer), phase1["saved"])
    loss = grpo_step(ddp_model, optimizer, phase1["rollout"])
    assert processor.calls == 2
    assert_close(loss, phase1["loss"], rtol=1e-3, atol=1e-5)
    ddp_model.start_param_sync(force_sync=True)
    state = megatron_training_state(model, optimizer)
    for name, expected in phase1["uninterrupted"].items():
        assert_close(state[name]["param"].float(), expected["param"].float(), rtol=1e-2, atol=2 * LR,
                     msg=lambda m: f"{name}: {m}")


def test_grpo_at_tp2_dp2_with_overlap_saves_survives_a_killed_save_and_resumes_at_tp1_dp4(tmp_path):
    root = str(tmp_path)
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        run_distributed(_train_save_and_kill, 4, root)
    assert os.path.exists(f"{root}/phase1.pt")
    run_distributed(_resume_at_another_layout, 4, root)
