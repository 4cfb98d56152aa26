"""fused_rl_ops.megatron's rl_output_processor called in process, without a TP group, as Megatron's
output layer calls it: against float64, skipping masked positions (what reaches the kernels),
batch_invariant and host_checks passed on to chosen_logprob, and the calls it refuses."""
import types

import pytest
import torch
from torch.testing import assert_close

from tests.helpers.kernel_calls import KernelCalls, scored

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the GPU machine has none)")
import fused_rl_ops  # noqa: E402
from fused_rl_ops.megatron import rl_output_processor  # noqa: E402
from tests.helpers.megatron import REAL_VOCAB, VOCAB, B, S, float64_reference  # noqa: E402


def test_processor_on_one_rank_matches_float64():
    """No TP group: padded vocab, temperature, loss_mask and a value-head weight, against float64."""
    hidden, weight, value_weight = torch.randn(S, B, 16), torch.randn(VOCAB, 16), torch.randn(16)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens = torch.randint(0, REAL_VOCAB, (B, S))
    loss_mask = (torch.rand(B, S) > 0.3).float()
    processor = rl_output_processor(temperature=0.8, value_head=value_weight, vocab_size=REAL_VOCAB)
    outputs = processor(hidden_states=hidden, output_layer=output_layer, labels=tokens, loss_mask=loss_mask)
    logprobs, entropy = float64_reference(hidden, weight, tokens, 0.8, REAL_VOCAB)
    assert list(outputs) == list(processor.output_names) == ["logprobs", "entropy", "values"]
    assert_close(outputs["logprobs"], (logprobs * loss_mask).float())
    kept = loss_mask == 1
    assert_close(outputs["entropy"][kept], entropy.float()[kept])
    assert_close(outputs["values"], (hidden.double() @ value_weight.double()).t().float())


def test_processor_takes_every_keyword_of_megatrons_hook_and_later_ones():
    """The call megatron-core 0.18 / 0.19 and Megatron-LM main make (their keywords are the same), and
    one with a keyword a later Megatron might add: the outputs of the bare call."""
    hidden, weight = torch.randn(S, B, 16), torch.randn(VOCAB, 16)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens = torch.randint(0, VOCAB, (B, S))
    processor = rl_output_processor()
    bare = processor(hidden_states=hidden, output_layer=output_layer, labels=tokens)
    hook_call = dict(
        hidden_states=hidden, output_layer=output_layer, output_weight=None, labels=tokens, loss_mask=None,
        input_ids=tokens, position_ids=torch.arange(S).expand(B, S), attention_mask=None, decoder_input=None,
        inference_context=None, packed_seq_params=None, runtime_gather_output=None, context=None,
        compute_language_model_loss=lambda labels, logits: None, scale_logits=lambda logits: logits,
        config=types.SimpleNamespace(use_mup=False, mup_output_mult=1.0))
    for call in (hook_call, {**hook_call, "a_keyword_of_a_later_megatron": object()}):
        outputs = processor(**call)
        assert outputs.keys() == bare.keys() and all(torch.equal(outputs[k], bare[k]) for k in bare)


@pytest.mark.parametrize("host_checks", [True, False])
def test_processor_skips_masked_positions(host_checks):
    """loss_mask 0 is an ignored label: logprob and entropy 0, no gradient, and no row the ops
    compute (they get every position and leave these out, with the host checks or without)."""
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(S, B, 16, generator=g), torch.randn(VOCAB, 16, generator=g)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=g)
    tokens[1, -1] = -100
    loss_mask = (torch.rand(B, S, generator=g) > 0.5).float()
    coeffs = torch.randn(2, B, S, generator=g)
    scored_tokens = tokens.masked_fill(loss_mask == 0, -100)
    h = hidden.clone().requires_grad_(True)
    with KernelCalls() as calls:
        outputs = rl_output_processor(vocab_size=REAL_VOCAB, host_checks=host_checks)(
            hidden_states=h, output_layer=output_layer, labels=tokens, loss_mask=loss_mask)
        (coeffs[0] * outputs["logprobs"] + coeffs[1] * outputs["entropy"]).sum().backward()
    # In the processor's [s, b] order: every position (the masked ones ignored), of which the ops
    # compute the scored ones, host checks or not.
    for op in ("chosen_logprob_stats", "chosen_logprob_backward"):
        [got], [computed] = calls.tokens(op), calls.computed_tokens(op)
        assert torch.equal(got, scored_tokens.t().reshape(-1)) and torch.equal(computed, scored(scored_tokens.t())), op
    kept = scored_tokens != -100
    logprobs, entropy = float64_reference(hidden, weight, tokens.clamp(min=0), 1.0, REAL_VOCAB)
    assert_close(outputs["logprobs"], torch.where(kept, logprobs, 0.0).float())
    assert_close(outputs["entropy"], torch.where(kept, entropy, 0.0).float())
    assert h.grad.transpose(0, 1)[~kept].eq(0).all() and h.grad.transpose(0, 1)[kept].ne(0).any(-1).all()


def test_processor_passes_batch_invariant():
    """batch_invariant=True reaches chosen_logprob: the processor's logprobs and entropy are bitwise
    those of chosen_logprob(batch_invariant=True), which differ from the default tiling's here (600
    tokens, more than one row block; a vocabulary over one fixed chunk)."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(200, 3, 16, generator=g), torch.randn(2500, 16, generator=g)
    tokens = torch.randint(0, 2500, (3, 200), generator=g)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    outputs = rl_output_processor(batch_invariant=True)(hidden_states=hidden, output_layer=output_layer,
                                                        labels=tokens)

    def direct(batch_invariant):
        return fused_rl_ops.chosen_logprob(hidden, weight, tokens.t(), return_entropy=True,
                                           batch_invariant=batch_invariant)

    (logprobs, entropy), (default_logprobs, _) = direct(True), direct(False)
    assert not torch.equal(logprobs, default_logprobs)
    assert torch.equal(outputs["logprobs"], logprobs.t()) and torch.equal(outputs["entropy"], entropy.t())


def test_processor_host_checks_off_skips_both_checks_and_marks_bad_tokens_nan(monkeypatch):
    """host_checks=False reaches chosen_logprob as check_tokens=False and check_group=False: an
    out-of-range label no longer raises but gets a NaN logprob, and every other output is bitwise
    that of the checked processor with that label ignored (batch-invariant: the checked one skips
    that row, the unchecked one computes every row)."""
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(S, B, 16, generator=g), torch.randn(32, 16, generator=g)
    tokens = torch.randint(0, 32, (B, S), generator=g)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens[1, 2] = 40
    with pytest.raises(ValueError, match="token ids must lie in"):
        rl_output_processor()(hidden_states=hidden, output_layer=output_layer, labels=tokens)
    calls = []
    real_chosen_logprob = fused_rl_ops.chosen_logprob

    def recording_chosen_logprob(*args, **kwargs):
        calls.append((kwargs["check_tokens"], kwargs["check_group"]))
        return real_chosen_logprob(*args, **kwargs)

    monkeypatch.setattr(fused_rl_ops, "chosen_logprob", recording_chosen_logprob)
    unchecked = rl_output_processor(host_checks=False, batch_invariant=True)(
        hidden_states=hidden, output_layer=output_layer, labels=tokens)
    checked = rl_output_processor(batch_invariant=True)(hidden_states=hidden, output_layer=output_layer,
                                                        labels=tokens.masked_fill(tokens == 40, -100))
    assert calls == [(False, False), (True, True)]
    bad = tokens == 40
    assert unchecked["logprobs"][bad].isnan().all() and checked["entropy"][bad].eq(0).all()
    assert torch.equal(unchecked["logprobs"][~bad], checked["logprobs"][~bad])
    assert torch.equal(unchecked["entropy"][~bad], checked["entropy"][~bad])


def test_processor_refuses_bad_calls():
    hidden, weight = torch.randn(S, B, 16), torch.randn(32, 16)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    tokens = torch.randint(0, 32, (B, S))
    processor = rl_output_processor()
    with pytest.raises(ValueError, match="got neither"):
        processor(hidden_states=hidden, output_layer=output_layer)
    with pytest.raises(ValueError, match="got both"):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens, context={"tokens": tokens})
    with pytest.raises(ValueError, match=r"labels must be \[b, s\] = \[2, 8\]"):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens.t().contiguous())
    mup = types.SimpleNamespace(use_mup=True, mup_output_mult=0.5)
    with pytest.raises(ValueError, match="MuP"):
        processor(hidden_states=hidden, output_layer=output_layer, labels=tokens, config=mup)
    with pytest.raises(ValueError, match="value head must map"):
        rl_output_processor(value_head=torch.nn.Linear(16, 1))(hidden_states=hidden, output_layer=output_layer, labels=tokens)
    with pytest.raises(ValueError, match="temperature"):
        rl_output_processor(temperature=0.0)
