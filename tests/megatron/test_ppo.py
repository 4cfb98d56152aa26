"""End to end on megatron-core 0.18 and 0.19 (CPU / gloo): a PPO step of a GPTModel with the fused pieces
(ClampedSwiGLUMLP, rl_output_processor, fused_rl_ops.ValueHead) against the same model with the
naive ones (Megatron's MLP, the reference processor on materialised logits), at TP 2 with and
without sequence parallelism and over two pipeline stages under get_forward_backward_func: the
same outputs, losses, gradients and updated parameters, and logprobs equal to float64's and to
Megatron's own cross entropy."""
import contextlib
import functools
import math

import pytest
import torch
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the GPU machine has none)")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

import fused_rl_ops  # noqa: E402
from fused_rl_ops.megatron import attach, rl_output_processor  # noqa: E402
from fused_rl_ops.reference.megatron import NaiveRLOutputProcessor  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import full_vocab_logits, set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import forward_backward, make_rollout, model_inputs, ppo_loss, score  # noqa: E402
from tests.helpers.megatron import (  # noqa: E402
    REAL_VOCAB,
    VOCAB,
    B,
    RecordingProcessor,
    S,
    assert_close_by_name,
    grads_by_name,
    make_batch,
    output_layer_inputs,
    same_on_all_ranks,
)


def build_policy_pair(config, **processor_options):
    """The same GPTModel twice, with a processor each, not attached:
    fused: ClampedSwiGLUMLP, rl_output_processor, fused_rl_ops.ValueHead;
    naive: Megatron's MLP, the reference processor (materialised logits), a copy of the value head.
    Returns [(model, processor)] for fused, then naive; attach makes each value head its model's."""
    fused = tiny_model("gpt", config, clamped_swiglu_mlp=True)
    naive = tiny_model("gpt", config)
    naive.load_state_dict(fused.state_dict())
    value_head = fused_rl_ops.ValueHead(config.hidden_size)
    with torch.no_grad():
        value_head.weight.copy_(same_on_all_ranks(*value_head.weight.shape, seed=7))
    naive_value_head = fused_rl_ops.ValueHead(config.hidden_size)
    naive_value_head.load_state_dict(value_head.state_dict())
    return [
        (fused, rl_output_processor(value_head=value_head, **processor_options)),
        (naive, NaiveRLOutputProcessor(value_head=naive_value_head, **processor_options)),
    ]


def ppo_config(**overrides):
    """gpt-oss-style MLP (quick-GELU gate, offset 1) with a clamp the tiny model's activations reach."""
    return tiny_config(
        init_method_std=0.1, gated_linear_unit=True, activation_func=quick_gelu,
        activation_func_clamp_value=0.5, glu_linear_offset=1.0, **overrides,
    )


def assert_same_outputs(fused_outputs, naive_outputs):
    assert list(fused_outputs) == list(naive_outputs)
    for name in fused_outputs:
        assert_close(fused_outputs[name], naive_outputs[name], msg=lambda message: f"{name}: {message}")


def assert_same_step(policies):
    """Fused and naive have the same gradient for every parameter (the value head's, on the stage
    that has it, among them); after an SGD step each over model.parameters(), the same parameters."""
    (fused, _), (naive, _) = policies
    fused_grads, naive_grads = grads_by_name(fused), grads_by_name(naive)
    assert ("value_head.weight" in fused_grads) == parallel_state.is_pipeline_last_stage()
    assert_close_by_name(fused_grads, naive_grads)
    for model, _ in policies:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert_close_by_name(dict(fused.named_parameters()), dict(naive.named_parameters()))


def next_token_logprobs(logits, tokens, temperature, vocab_size):
    """float64 [b, s] from full-vocab logits [b, s, V]: position t's logprob of token t + 1, and 0 at
    each sequence's last position (nothing follows it)."""
    log_probs = torch.log_softmax(logits[..., :vocab_size].double() / temperature, dim=-1)
    chosen = log_probs[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([chosen, chosen.new_zeros(len(tokens), 1)], dim=1)


def _check_ppo_step(sequence_parallel):
    """The PPO step of fused_rl_ops.testing.ppo (what examples/ppo_step.py runs): the old logprobs
    (score) and the step's logprobs (make_rollout's labels) are each position's logprob of the next
    token, as float64 has it; fused and naive agree on every output, gradient and updated parameter."""
    config = ppo_config(sequence_parallel=sequence_parallel)
    policies = build_policy_pair(config, vocab_size=REAL_VOCAB, temperature=0.9)
    (fused, _), _ = policies
    tokens = make_batch(REAL_VOCAB, seed=8)[0]
    with torch.no_grad():
        expected_logprobs = next_token_logprobs(full_vocab_logits(fused, tokens), tokens, 0.9, REAL_VOCAB).float()
    for model, processor in policies:
        attach(model, processor)
    with torch.no_grad():
        old_logprobs = score(fused, tokens)["logprobs"]
    assert_close(old_logprobs, expected_logprobs)
    rollout = make_rollout(tokens, old_logprobs, seed=9)
    assert torch.all(rollout["mask"][:, -1] == 0)  # the last position has no next token
    (fused_outputs, fused_loss), (naive_outputs, naive_loss) = [forward_backward(m, rollout) for m, _ in policies]
    assert list(fused_outputs) == ["logprobs", "entropy", "values"]
    assert_close(fused_outputs["logprobs"], expected_logprobs)
    assert_same_outputs(fused_outputs, naive_outputs)
    assert_close(fused_loss, naive_loss)
    assert_same_step(policies)
    with torch.no_grad():
        fused_after, naive_after = [score(m, tokens)["logprobs"] for m, _ in policies]
    assert_close(fused_after, naive_after)
    assert not torch.allclose(fused_after, fused_outputs["logprobs"])  # the step moved the policy


def _ppo_step_tensor_parallel(rank, world_size):
    set_parallel_degrees(tp=2)
    _check_ppo_step(sequence_parallel=False)
    _check_ppo_step(sequence_parallel=True)


def test_ppo_step_tensor_parallel_with_and_without_sequence_parallel():
    run_distributed(_ppo_step_tensor_parallel, 2)


def run_schedule(model, rollouts, loss_func, forward_only=False):
    """Megatron's pipeline schedule over the rollouts as microbatches; loss_func(output, rollout)."""
    def forward_step(data_iterator, model):
        rollout = next(data_iterator)
        tokens = rollout["tokens"]
        output = model(tokens, *model_inputs(tokens), labels=rollout["labels"])
        return output, functools.partial(loss_func, rollout=rollout)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(rollouts), model=[model],
        num_microbatches=len(rollouts), seq_length=S, micro_batch_size=B, forward_only=forward_only,
    )


def megatron_logprobs_loss(cross_entropy, rollout):
    return cross_entropy.sum(), {"logprobs": -cross_entropy.detach()}


def ppo_loss_and_outputs(outputs, rollout):
    loss = ppo_loss(outputs, rollout)
    return loss, {"loss": loss.detach(), **{name: t.detach() for name, t in outputs.items()}}


def _pipeline_parallel(rank, world_size):
    """2 stages through get_forward_backward_func: the last stage's processor sees the output layer's
    input and matches Megatron's cross entropy; the PPO step matches the naive path on both stages."""
    set_parallel_degrees(tp=1, pp=2)
    policies = build_policy_pair(ppo_config(pipeline_dtype=torch.float32))
    (fused, fused_processor), (naive, naive_processor) = policies
    rollouts = [
        make_rollout(make_batch(seed=10 + i)[0], torch.full((B, S), -math.log(VOCAB)), seed=20 + i) for i in range(2)
    ]
    last_stage = parallel_state.is_pipeline_last_stage()

    with output_layer_inputs(fused) if last_stage else contextlib.nullcontext([]) as hidden_states:
        megatron_results = run_schedule(fused, rollouts, megatron_logprobs_loss, forward_only=True)
    recorder = RecordingProcessor(fused_processor)
    attach(fused, recorder)
    attach(naive, naive_processor)
    fused_results = run_schedule(fused, rollouts, ppo_loss_and_outputs)
    naive_results = run_schedule(naive, rollouts, ppo_loss_and_outputs)

    assert len(fused_results) == len(naive_results) == len(megatron_results) == (2 if last_stage else 0)
    assert len(recorder.hidden_states) == len(hidden_states) == (2 if last_stage else 0)
    for recorded, expected in zip(recorder.hidden_states, hidden_states):
        assert_close(recorded, expected, rtol=0, atol=0)
    for fused_outputs, naive_outputs, megatron_outputs in zip(fused_results, naive_results, megatron_results):
        # The last position's label is ignore_index: logprob 0 here, Megatron's cross entropy has no such label.
        assert_close(fused_outputs["logprobs"][:, :-1], megatron_outputs["logprobs"][:, :-1])
        assert torch.all(fused_outputs["logprobs"][:, -1] == 0)
        assert_same_outputs(fused_outputs, naive_outputs)
    assert_same_step(policies)


def test_pipeline_parallel_two_stages():
    run_distributed(_pipeline_parallel, 2)
