"""The processor under Megatron's overlapped parameter all-gather (megatron-core 0.18 and 0.19, CPU / gloo).

With `DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True,
overlap_grad_reduce=True)`, Megatron's DDP all-gathers each bucket of updated parameters lazily and
waits for a bucket in the forward pre-hook of a module that owns one of its parameters. The
processor, the MTP loss and a value head given as a weight read their weights without running
their modules' forwards, so they run those modules' forward pre-hooks first
(fused_rl_ops/megatron/output_layer.py). Without that, the bucket holding the output weight alone
(`bucket_size` = its element count, as a real [V/tp, H] output weight is larger than Megatron's
bucket) is dispatched and never waited for, and the second step dies in Megatron's
`start_param_sync` (`assert self.param_gather_handle is None`).

A tiny bf16 GPTModel with a value head, inside Float16Module, Megatron's DDP and its
DistributedOptimizer (megatron_cpu.megatron_bf16_training), trains a few steps at DP 2, at TP 1
and at TP 2 with sequence parallel: untied output layer with a ValueHead module, and tied
embeddings with a value head given as a weight and an MTP layer. With overlap on, every step's
logprobs and values, the final bf16 parameters, fp32 main weights and Adam state are bitwise those of the
same run with overlap_param_gather off (overlap_grad_reduce and the bucket size the same in both:
the buckets decide the order the gradient norm is summed in, so another layout would change the
clipped updates in their last bits); and the bucket of the weight the processor reads was still being
gathered when the processor's call waited for it. Saved before the last step's all-gather, the
data-parallel replicas differ, and save_sharded's error names the cause and the fix
(`ddp_model.start_param_sync(force_sync=True)`).
"""
import pytest
import torch

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402

import fused_rl_ops  # noqa: E402
from fused_rl_ops.checkpoint import save_sharded  # noqa: E402
from fused_rl_ops.megatron import rl_output_processor  # noqa: E402
from tests.helpers.checkpoint import assert_same_megatron_state, megatron_training_state  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import megatron_bf16_training, set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import model_inputs, shifted_labels  # noqa: E402

B, S = 2, 8
VOCAB = 256
STEPS = 3


def value_head(tied, hidden_size):
    """A ValueHead module (its forward runs), or a weight parameter (only read), seeded alike on every rank."""
    torch.manual_seed(7)
    head = fused_rl_ops.ValueHead(hidden_size, bias=not tied)
    return head.weight if tied else head


def output_weight(model):
    """The weight the processor reads: the output layer's, or the embedding's when tied."""
    return model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else model.output_layer.weight


def build(tied, overlap):
    """(language model, DDP model, optimizer): the tiny bf16 policy at the current TP degree, the
    bucket that holds the weight the processor reads holding nothing else."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = tiny_config(bf16=True, params_dtype=torch.bfloat16, sequence_parallel=tp > 1,
                         mtp_num_layers=1 if tied else None)
    model = tiny_model("gpt", config, vocab_size=VOCAB, tied_embeddings=tied, seed=1)
    read_weight = output_weight(model)
    processor = rl_output_processor(value_head=value_head(tied, config.hidden_size), vocab_size=200)
    # overlap_grad_reduce in both runs: without it Megatron makes one bucket, and the bucket layout
    # decides how the gradient norm (clipping) is summed, so the runs would differ in the last bits.
    ddp_settings = dict(overlap_param_gather=overlap, overlap_grad_reduce=True, bucket_size=read_weight.numel())
    ddp_model, optimizer = megatron_bf16_training(model, distributed_optimizer=True, processor=processor,
                                                  ddp_settings=ddp_settings)
    return model, ddp_model, optimizer


def rollout(step):
    """This data-parallel rank's tokens, loss mask and returns at step."""
    g = torch.Generator().manual_seed(100 * step + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, 200, (B, S), generator=g)
    loss_mask = (torch.rand(B, S, generator=g) > 0.25).float()
    return tokens, loss_mask, torch.randn(B, S, generator=g)


def train(ddp_model, optimizer):
    """Each step's outputs (logprobs, entropy, values), after STEPS steps of Megatron's loop."""
    outputs = []
    for step in range(STEPS):
        tokens, loss_mask, returns = rollout(step)
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        out = ddp_model(tokens, *model_inputs(tokens), labels=shifted_labels(tokens), loss_mask=loss_mask)
        loss = -(out["logprobs"] * loss_mask).sum() / loss_mask.sum() + ((out["values"] - returns) ** 2).mean()
        loss.backward()
        finalize_model_grads([ddp_model])
        optimizer.step()
        outputs.append({name: t.detach() for name, t in out.items()})
    return outputs


class PendingAtWait:
    """Records, at each finish_param_sync of a bucket group, whether its all-gather was in flight."""

    def __init__(self, bucket_group):
        self.finish = bucket_group.finish_param_sync
        self.bucket_group = bucket_group
        self.pending = []
        bucket_group.finish_param_sync = self

    def __call__(self, *args, **kwargs):
        self.pending.append(self.bucket_group.param_gather_handle is not None)
        return self.finish(*args, **kwargs)


def final_state(model, ddp_model, optimizer):
    """Each parameter's logical bf16 tensor, fp32 main weight and Adam state (megatron_training_state)."""
    ddp_model.start_param_sync(force_sync=True)  # with overlap, the last step's update is gathered now
    return megatron_training_state(model, optimizer)


def check_save_names_the_pending_gather(model, ddp_model, optimizer, path):
    """Saved after the last step and before its all-gather, the data-parallel replicas differ: the
    error names the pending all-gather and the fix, with the optimizer given or the DDP model saved;
    after the fix (final_state's start_param_sync(force_sync=True)) the save succeeds."""
    fix = r"different bytes; .*overlap_param_gather .*start_param_sync\(force_sync=True\) before saving"
    with pytest.raises(ValueError, match=fix):
        save_sharded(model, path, optimizer=optimizer)
    with pytest.raises(ValueError, match=fix):
        save_sharded(ddp_model, path)
    state = final_state(model, ddp_model, optimizer)
    save_sharded(model, path, optimizer=optimizer)
    return state


def _overlap_matches_no_overlap(rank, world_size, tp, path):
    set_parallel_degrees(tp=tp)
    for tied in (False, True):
        runs = {}
        for overlap in (False, True):
            model, ddp_model, optimizer = build(tied, overlap)
            read_weight = output_weight(model)
            bucket_group = ddp_model.param_to_bucket_group[read_weight]
            spy = PendingAtWait(bucket_group)
            initial_head = model.value_head.weight.detach().clone()
            outputs = train(ddp_model, optimizer)
            if overlap and not tied:
                runs[overlap] = outputs, check_save_names_the_pending_gather(model, ddp_model, optimizer, path)
            else:
                runs[overlap] = outputs, final_state(model, ddp_model, optimizer)
            if overlap and not tied:
                assert [p for bucket in bucket_group.buckets for p in bucket.params_list] == [read_weight]
                # Dispatched by the previous bucket's wait and still in flight when the processor waited.
                assert any(spy.pending[1:]), spy.pending
        (outputs, state), (overlapped_outputs, overlapped_state) = runs[False], runs[True]
        for step, (expected, actual) in enumerate(zip(outputs, overlapped_outputs)):
            for name in expected:
                assert torch.equal(actual[name], expected[name]), (tied, step, name)
        assert_same_megatron_state(overlapped_state, state)
        assert not torch.equal(state["value_head.weight"]["param"], initial_head)  # it trains


@pytest.mark.parametrize("tp", [1, 2])
def test_training_with_overlapped_param_gather_is_bitwise_that_without(tp, tmp_path, checkpoint_dependencies):
    """DP 2 at TP 1 (2 ranks) and at TP 2 with sequence parallel (4 ranks)."""
    run_distributed(_overlap_matches_no_overlap, 2 * tp, tp, str(tmp_path / "checkpoint"))
