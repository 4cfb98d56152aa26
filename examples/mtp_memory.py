"""Peak memory of one training step of a GPTModel with multi-token prediction (2 MTP layers), at
tensor parallel 2 with sequence parallel: megatron-core's own path (its labels= loss; full-vocab
logits for the main head and for each MTP depth) against the attached rl_output_processor (main
logprobs and the MTP losses through chosen_logprob, no logits).

    python examples/mtp_memory.py [--quick]

Runs on the CPU with 2 gloo processes and the shims of fused_rl_ops/testing/megatron_cpu.py. The
same model takes both steps. Rank 0 prints, for each path, the peak memory of the tensors the step
allocated (torch's MemTracker), how often the output layer ran, and the MTP losses and acceptance
counts megatron-core's MTPLossLoggingHelper logged. tests/megatron/test_mtp.py checks the two paths'
gradients and logged values against each other.
"""
import logging
import sys
import warnings

import torch

# Third-party messages this example cannot act on, filtered here only. This runs in every rank.
for message in (
    r".*(Apex|Transformer Engine and Apex|absl\.logging) (is|are) not installed",
    r"full scope is deprecated",
    r"When using (async grad allreduce|sequence parallelism)",
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"Module is None\. Skipping (PRE|POST)_BW hook",
):
    warnings.filterwarnings("ignore", message=message)
logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _main(rank, world_size, vocab_size, seq_length, mtp_layers):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from torch.distributed._tools.mem_tracker import MemTracker

    from fused_rl_ops.megatron import attach, rl_output_processor
    from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model
    from fused_rl_ops.testing.ppo import model_inputs

    set_parallel_degrees(tp=world_size)
    config = tiny_config(hidden_size=64, ffn_hidden_size=128, sequence_parallel=True, mtp_num_layers=mtp_layers)
    padded_vocab = -(-vocab_size // (128 * world_size)) * 128 * world_size  # as Megatron's training scripts pad
    model = tiny_model("gpt", config, vocab_size=padded_vocab, seq_length=seq_length)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (2, seq_length), generator=generator)
    labels = torch.randint(0, vocab_size, (2, seq_length), generator=generator)
    inputs = (tokens, *model_inputs(tokens))
    output_layer_calls = []
    model.output_layer.register_forward_hook(lambda *args: output_layer_calls.append(1))

    def megatron_step():
        model(*inputs, labels=labels).mean().backward()

    def fused_step():
        (-model(*inputs, labels=labels)["logprobs"].mean()).backward()

    report = {}
    for name, step in (("megatron", megatron_step), ("fused", fused_step)):
        if name == "fused":
            attach(model, rl_output_processor(return_entropy=False))
        model.zero_grad(set_to_none=True)
        output_layer_calls.clear()
        tracker = MemTracker()
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        logged = {key: MTPLossLoggingHelper.tracker[key].tolist() for key in ("loss_values", "correct_values")}
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        report[name] = (peak, len(output_layer_calls), logged)

    if rank == 0:
        print(f"GPTModel with {mtp_layers} MTP layers, TP={world_size} + sequence parallel, vocab {vocab_size} "
              f"(padded {padded_vocab}), {tokens.shape[0]} x {seq_length} tokens, fp32")
        for name, (peak, calls, logged) in report.items():
            losses = ", ".join(f"{loss:.6f}" for loss in logged["loss_values"])
            print(f"[{name:8}] peak memory of the step {peak / 2**20:7.1f} MiB per rank; output layer ran "
                  f"{calls} times; MTP losses logged {losses}; accepted {logged['correct_values']}")
        print(f"peak memory megatron / fused: {report['megatron'][0] / report['fused'][0]:.1f}x")


if __name__ == "__main__":
    from fused_rl_ops.testing.distributed import run_distributed

    quick = "--quick" in sys.argv[1:]
    run_distributed(_main, 2, 4000 if quick else 50257, 64 if quick else 256, 2)
