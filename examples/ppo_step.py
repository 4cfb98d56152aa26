"""One PPO step on a Megatron-core GPTModel at tensor parallel 2, fused against naive.

    python examples/ppo_step.py

Runs on the CPU with 2 gloo processes: megatron-core 0.19.2 needs a few CUDA-only calls replaced,
and the shims in fused_rl_ops/testing/megatron_cpu.py do that (on GPUs you would not need them).

Both policies have the same weights. The fused one uses ClampedSwiGLUMLP and rl_output_processor
(chosen-token logprobs, entropy and values straight from the hidden states); the naive one uses
Megatron's unfused MLP and materialises the logits (NaiveRLOutputProcessor). attach makes each
value head part of its model, so each Adam optimizer is built from model.parameters() alone. As a
trainer scores a rollout, each position is scored on the token that follows it (labels shifted by
one, the last position ignored). Each runs a clipped PPO loss with an entropy bonus and a value
loss, backward and an Adam step. Rank 0 prints the logprob / entropy / value statistics of both and
the peak memory of the tensors each step allocated (torch's MemTracker). The rollout, loss and
forward-backward are in fused_rl_ops/testing/ppo.py; tests/megatron/test_ppo.py runs them and checks
fused against naive (outputs, every gradient, the updated parameters) to fp32 tolerance, and the
scoring against float64 logprobs of the next tokens.
"""
import logging
import warnings

import torch

from fused_rl_ops.testing.ppo import forward_backward, make_rollout, score

# Third-party messages this example cannot act on, filtered here only (not in the package). This
# runs in every rank: the spawned ranks import this file again.
for message in (
    r".*(Apex|Transformer Engine and Apex|absl\.logging) (is|are) not installed",  # megatron-core without them
    r"full scope is deprecated",  # megatron-core's own default config
    r"When using async grad allreduce",  # CUDA-only advice from megatron-core
    r"`torch\.distributed\.all_gather_into_tensor` is deprecated",  # called inside megatron-core
    r"Module is None\. Skipping (PRE|POST)_BW hook",  # torch's MemTracker
):
    warnings.filterwarnings("ignore", message=message)
logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)  # "GPTModel IS DEPRECATED"
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found" (CPU run)


def _masked_stats(name, values, mask):
    picked = values.detach()[mask.bool()]
    return f"{name} mean {picked.mean():+.4f} std {picked.std():.4f} min {picked.min():+.4f} max {picked.max():+.4f}"


def _main(rank, world_size, vocab_size, seq_length):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from torch.distributed._tools.mem_tracker import MemTracker

    import fused_rl_ops
    from fused_rl_ops.megatron import attach, rl_output_processor, with_clamped_swiglu_mlp
    from fused_rl_ops.reference.megatron import NaiveRLOutputProcessor
    from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config

    set_parallel_degrees(tp=world_size)
    # gpt-oss's MLP activation: quick-GELU gate, linear offset 1, clamp 7.
    config = tiny_config(
        hidden_size=64, ffn_hidden_size=128, init_method_std=0.1, gated_linear_unit=True,
        activation_func=quick_gelu, activation_func_clamp_value=7.0, glu_linear_offset=1.0,
    )
    padded_vocab = -(-vocab_size // (128 * world_size)) * 128 * world_size  # as Megatron's training scripts pad

    def policy(layer_spec):
        return GPTModel(
            config=config, transformer_layer_spec=layer_spec, vocab_size=padded_vocab,
            max_sequence_length=seq_length, position_embedding_type="rope",
        )

    torch.manual_seed(0)  # Megatron draws full master weights from the CPU RNG: the same on every rank
    fused = policy(with_clamped_swiglu_mlp(get_gpt_layer_local_spec()))
    naive = policy(get_gpt_layer_local_spec())
    naive.load_state_dict(fused.state_dict())
    value_head = fused_rl_ops.ValueHead(config.hidden_size)
    with torch.no_grad():
        value_head.weight.copy_(0.1 * torch.randn(value_head.weight.shape, generator=torch.Generator().manual_seed(2)))
    naive_value_head = fused_rl_ops.ValueHead(config.hidden_size)
    naive_value_head.load_state_dict(value_head.state_dict())
    # attach makes each value head a submodule of its model: model.parameters() holds it.
    attach(fused, rl_output_processor(value_head=value_head, vocab_size=vocab_size))
    attach(naive, NaiveRLOutputProcessor(value_head=naive_value_head, vocab_size=vocab_size))

    tokens = torch.randint(0, vocab_size, (2, seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the old logprobs: each position scored on the token that follows it
        old_logprobs = score(fused, tokens)["logprobs"]
    rollout = make_rollout(tokens, old_logprobs, seed=1)

    report = {}
    for name, model in (("naive", naive), ("fused", fused)):
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        tracker = MemTracker()
        with tracker:
            outputs, loss = forward_backward(model, rollout)
        optimizer.step()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        report[name] = (outputs, loss.item(), peak)

    if rank == 0:
        mask = rollout["mask"]
        print(f"PPO step, GPTModel TP={world_size}, vocab {vocab_size} (padded {padded_vocab}), "
              f"{tokens.shape[0]} x {seq_length} tokens, {int(mask.sum())} in the loss")
        for name, (outputs, loss, peak) in report.items():
            print(f"[{name}] loss {loss:.6f}   peak memory of the step {peak / 2**20:.1f} MiB")
            for key in ("logprobs", "entropy", "values"):
                print(f"[{name}]   {_masked_stats(key, outputs[key], mask)}")
        fused_outputs, naive_outputs = report["fused"][0], report["naive"][0]
        for key in ("logprobs", "entropy", "values"):
            difference = (fused_outputs[key] - naive_outputs[key]).abs().max().item()
            print(f"max |fused - naive| {key}: {difference:.2e}")
        print(f"peak memory naive / fused: {report['naive'][2] / report['fused'][2]:.1f}x")


if __name__ == "__main__":
    from fused_rl_ops.testing.distributed import run_distributed

    run_distributed(_main, 2, 50257, 256)
