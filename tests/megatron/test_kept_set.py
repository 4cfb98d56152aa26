"""The rollout sampler's kept set through the Megatron processor (output_processor_context=
{"kept_ids": [b, s, k]}) on a tiny GPTModel at TP 2, with and without sequence parallel: logprobs
renormalised over the set, entropy over it, and every parameter's gradient against log_softmax over
the set of the materialised, TP-gathered logits (fused_rl_ops.reference.kept_set), with masked
positions; the processor's own sampler filter and bad kept sets refused."""
import types

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from fused_rl_ops.megatron import attach, rl_output_processor  # noqa: E402
from fused_rl_ops.reference.kept_set import kept_set_log_softmax  # noqa: E402
from fused_rl_ops.testing.distributed import run_distributed  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from tests.helpers.megatron import assert_close_by_name, outputs_and_grads  # noqa: E402

B, S, K, REAL_VOCAB, TEMPERATURE = 2, 8, 5, 200, 0.8


class NaiveKeptSetProcessor:
    """logprobs and entropy over the context's kept sets from the logits of Megatron's own output
    layer, TP-gathered, in float64."""
    value_head = None
    output_names = ("logprobs", "entropy")

    def __call__(self, *, hidden_states, output_layer, output_weight=None, labels=None, loss_mask=None, context=None,
                 **unused):
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=False)
        full = gather_from_tensor_model_parallel_region(logits, group=output_layer.tp_group)
        logits = full.transpose(0, 1).double()[..., :REAL_VOCAB] / TEMPERATURE  # [b, s, V]
        labels = labels.masked_fill(loss_mask == 0, -100)
        logprob, entropy, _ = kept_set_log_softmax(logits, labels, context["kept_ids"])
        return {"logprobs": logprob, "entropy": entropy}


def batch():
    """tokens [b, s] each in its kept set [b, s, K] but one, a set padded with -100, an id given
    twice, a loss mask: the same on every rank."""
    g = torch.Generator().manual_seed(4)
    kept_ids = torch.stack([torch.randperm(REAL_VOCAB, generator=g)[:K] for _ in range(B * S)]).reshape(B, S, K)
    tokens = kept_ids[..., 0].clone()
    tokens[1, 3] = next(v for v in range(REAL_VOCAB) if v not in kept_ids[1, 3])
    kept_ids[0, 2, 3:] = -100
    kept_ids[1, 5, 4] = kept_ids[1, 5, 1]
    loss_mask = torch.ones(B, S)
    loss_mask[0, :2] = 0
    return tokens, kept_ids, loss_mask, torch.randn(2, B, S, generator=g)


def _checks(rank, world_size):
    set_parallel_degrees(tp=2)
    tokens, kept_ids, loss_mask, coeff = batch()
    for sequence_parallel in (False, True):
        config = tiny_config(sequence_parallel=sequence_parallel, init_method_std=0.3)
        fused, naive = tiny_model("gpt", config), tiny_model("gpt", config)
        naive.load_state_dict(fused.state_dict())
        attach(fused, rl_output_processor(temperature=TEMPERATURE, vocab_size=REAL_VOCAB))
        attach(naive, NaiveKeptSetProcessor())
        (ours, our_grads), (want, want_grads) = [
            outputs_and_grads(m, tokens, coeff, loss_mask=loss_mask, output_processor_context={"kept_ids": kept_ids})
            for m in (fused, naive)]
        assert ours["logprobs"][1, 3] == -torch.inf and ours["logprobs"].isneginf().sum() == 1
        assert ours["logprobs"][0, :2].eq(0).all() and ours["entropy"][0, :2].eq(0).all()
        for name in ("logprobs", "entropy"):
            assert_close(ours[name], want[name].float(), msg=lambda m: f"sp={sequence_parallel} {name}: {m}")
        assert "output_layer.weight" in our_grads
        assert_close_by_name(our_grads, want_grads)


def test_processor_kept_set_matches_materialised_logits():
    run_distributed(_checks, 2)


def test_processor_refuses_bad_kept_sets():
    hidden, weight = torch.randn(S, B, 16), torch.randn(256, 16)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens, kept_ids, _, _ = batch()

    def call(processor, kept):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens,
                  context={"kept_ids": kept})
    for bad in (kept_ids[..., 0], kept_ids[:, :4]):
        with pytest.raises(ValueError, match=r"output_processor_context\['kept_ids'\] must be \[b, s(, k\]|\] or)"):
            call(rl_output_processor(), bad)
    with pytest.raises(ValueError, match="give kept_ids or top_k / top_p, not both"):
        call(rl_output_processor(top_k=10), kept_ids)
