"""rl_output_processor(top_k=..., top_p=...) on a tiny Megatron GPTModel at TP 2, with and without
sequence parallel: logprobs (-inf for the tokens the filter drops), entropy and every parameter's
gradient match the naive reference processor (fused_rl_ops.reference.megatron), which applies
vLLM's masking to the TP-gathered logits."""
import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from fused_rl_ops.megatron import rl_output_processor  # noqa: E402
from fused_rl_ops.testing.distributed import run_distributed  # noqa: E402
from tests.helpers.megatron import REAL_VOCAB, assert_matches_naive_processor, tp2_processor_cases  # noqa: E402

FILTERS = [dict(top_k=40), dict(top_p=0.8), dict(top_k=120, top_p=0.9)]


def _processor_checks(rank, world_size):
    for tokens, coeff, config in tp2_processor_cases(seed=2):
        for filter_ in FILTERS:
            options = dict(temperature=0.8, vocab_size=REAL_VOCAB, **filter_)
            _, fused_outputs = assert_matches_naive_processor(config, options, tokens, coeff, what=str(filter_))
            dropped = fused_outputs["logprobs"].isneginf()
            assert dropped.any() and not dropped.all(), filter_  # the filter matters in this data


def test_processor_with_the_sampler_filter_matches_the_naive_reference():
    run_distributed(_processor_checks, 2)


@pytest.mark.parametrize("bad,message", [(dict(top_k=0), "top_k must be None or a positive integer, got 0"),
                                         (dict(top_p=1.5), r"top_p must be None or a number in \(0, 1\], got 1.5")])
def test_processor_refuses_a_bad_filter(bad, message):
    with pytest.raises(ValueError, match=f"LogitOptions: {message}"):
        rl_output_processor(**bad)
