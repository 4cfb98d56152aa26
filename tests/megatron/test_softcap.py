"""rl_output_processor(softcap=c) on a tiny Megatron GPTModel at TP 2, with and without sequence
parallel: logprobs, entropy and every parameter's gradient match the naive reference processor
(fused_rl_ops.reference.megatron), which caps the materialised logits the plain way."""
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from fused_rl_ops.megatron import detach, rl_output_processor  # noqa: E402
from fused_rl_ops.testing.distributed import run_distributed  # noqa: E402
from fused_rl_ops.testing.ppo import model_inputs  # noqa: E402
from tests.helpers.megatron import REAL_VOCAB, assert_matches_naive_processor, tp2_processor_cases  # noqa: E402

SOFTCAP = 0.5  # the tiny model's logits reach a few units: the cap changes them


def _processor_checks(rank, world_size):
    for tokens, coeff, config in tp2_processor_cases(seed=1):
        options = dict(softcap=SOFTCAP, temperature=0.8, vocab_size=REAL_VOCAB)
        fused, fused_outputs = assert_matches_naive_processor(config, options, tokens, coeff)
        assert list(fused_outputs) == ["logprobs", "entropy"]
        # The cap matters here: without it the logprobs are others.
        detach(fused)
        with torch.no_grad():
            uncapped = fused(tokens, *model_inputs(tokens), labels=tokens,
                             output_processor=rl_output_processor(temperature=0.8, vocab_size=REAL_VOCAB))["logprobs"]
        assert (uncapped - fused_outputs["logprobs"]).abs().max() > 0.1


def test_processor_with_softcap_matches_the_naive_reference():
    run_distributed(_processor_checks, 2)


def test_processor_refuses_a_bad_softcap():
    with pytest.raises(ValueError, match=r"LogitOptions: softcap must be None or a positive finite number, "
                                         r"got -1.0"):
        rl_output_processor(softcap=-1.0)
