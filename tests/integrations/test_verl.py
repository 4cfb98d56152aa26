"""fused_rl_ops.verl against verl 0.9.1's own functions (the verl-like CI leg: Python 3.12, torch
2.11.0, megatron-core 0.18, verl 0.9.1; CPU / gloo).

- Through Megatron's hook at TP 2, without and with sequence parallel: the processor's log_probs
  and entropy, and every parameter's gradient of a loss of both, against verl's unfused path on the
  same model (the logits divided by the temperature, vocab_parallel_log_probs_from_logits and
  vocab_parallel_entropy).
- verl's own engine forward end to end on THD packed rows, at TP 2 with sequence parallel and at
  context parallel 2: fused_forward_model_engine with the processor installed against gptmodel_forward_model_engine
  with verl's functions as its logits processor; values and gradients.
- install refuses a verl or megatron-core it was not made for, and the plugin module installs the
  processor when verl imports it; the processor passes its options on and refuses wrong input.
"""
import dataclasses
import os
import subprocess
import sys
import types

import pytest
import torch
from torch.testing import assert_close

verl = pytest.importorskip("verl", reason="verl 0.9.x needs Python < 3.13; the verl-like CI leg runs these")
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from verl.models.mcore import model_forward_fused  # noqa: E402
from verl.models.mcore.model_forward import gptmodel_forward_model_engine  # noqa: E402
from verl.models.mcore.model_forward_fused import (FusedOutputProcessorContext,  # noqa: E402
                                                   fused_forward_model_engine, patch_fused_forward)
from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy, vocab_parallel_log_probs_from_logits  # noqa: E402
from verl.utils.model import CausalLMOutputForPPO  # noqa: E402

import fused_rl_ops.verl  # noqa: E402
from fused_rl_ops.megatron import rl_output_processor  # noqa: E402
from fused_rl_ops.testing.distributed import run_distributed  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import (set_parallel_degrees, tiny_config, tiny_model,  # noqa: E402
                                               with_self_only_attention)
from fused_rl_ops.testing.ppo import allreduce_sequence_parallel_grads, model_inputs  # noqa: E402
from tests.helpers.megatron import REAL_VOCAB, VOCAB, B, S, assert_close_by_name, take_grads  # noqa: E402

TEMPERATURE = 0.7
DOCUMENTS = (5, 3, 8)  # packed lengths, each padded by verl to a multiple of TP


def verls_own(logits, label):
    """verl's unfused Megatron path (its engine's logits processor) on [..., V/tp] logits: divided by
    the temperature, the entropy, then the log-probs of a copy (Megatron's cross entropy shifts its
    input in place)."""
    logits = logits / TEMPERATURE
    entropy = vocab_parallel_entropy(logits)
    return {"log_probs": vocab_parallel_log_probs_from_logits(logits.clone(), label), "entropy": entropy}


def _through_the_hook(rank, world_size):
    set_parallel_degrees(tp=2)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    coeff = torch.randn(2, B, S, generator=g)
    processor = fused_rl_ops.verl.output_processor()
    for sequence_parallel in (False, True):
        model = tiny_model("gpt", tiny_config(sequence_parallel=sequence_parallel, init_method_std=0.3))
        out = model(tokens, *model_inputs(tokens), labels=labels, output_processor=processor,
                    output_processor_context=FusedOutputProcessorContext(temperature=TEMPERATURE))
        assert isinstance(out, CausalLMOutputForPPO)
        assert out.log_probs.shape == out.entropy.shape == (B, S) and out.log_probs.dtype == torch.float32
        fused = {"log_probs": out.log_probs, "entropy": out.entropy}
        verl_path = verls_own(model(tokens, *model_inputs(tokens)), labels)
        grads = []
        for outputs in (fused, verl_path):
            (coeff[0] * outputs["log_probs"] + coeff[1] * outputs["entropy"]).sum().backward()
            allreduce_sequence_parallel_grads(model)
            grads.append(take_grads(model))
        what = f"sequence_parallel={sequence_parallel}"
        for name in fused:
            assert_close(fused[name], verl_path[name], msg=lambda message: f"{what} {name}: {message}")
        assert "output_layer.weight" in grads[1], what
        assert_close_by_name(*grads)


def test_through_megatrons_hook_at_tp2_matches_verls_functions():
    run_distributed(_through_the_hook, 2)


def _engine_forward_end_to_end(rank, world_size):
    """verl's fused engine forward (the processor installed) against its unfused one, on the THD
    rows verl packs: TP 2 with sequence parallel, then context parallel 2 (verl's zigzag split). The
    model scores each position on its own (self-only attention: Megatron's local attention refuses
    THD rows on the CPU) and has no position embedding (verl's packed path passes no position ids)."""
    for tp, cp in ((2, 1), (1, 2)):
        set_parallel_degrees(tp=tp, cp=cp)
        model = tiny_model("gpt", tiny_config(sequence_parallel=tp > 1, init_method_std=0.3),
                           edit_spec=with_self_only_attention, seq_length=2 * sum(DOCUMENTS))
        model.embedding.add_position_embedding = False
        patch_fused_forward(model)  # what verl's engine does when use_fused_kernels is on
        g = torch.Generator().manual_seed(12)
        input_ids = torch.nested.as_nested_tensor([torch.randint(0, VOCAB, (n,), generator=g) for n in DOCUMENTS],
                                                  layout=torch.jagged)
        coeff = torch.randn(2, sum(DOCUMENTS), generator=g)
        fused_rl_ops.verl.install()
        try:
            fused = fused_forward_model_engine(vision_model=False)(
                model, input_ids, input_ids.clone(), {}, TEMPERATURE, calculate_entropy=True, pad_token_id=0)
        finally:
            fused_rl_ops.verl.uninstall()
        verl_path = gptmodel_forward_model_engine(model, input_ids, {}, logits_processor=verls_own,
                                                  logits_processor_args={"label": input_ids.clone()})
        grads = []
        for outputs in (fused, verl_path):
            assert outputs["log_probs"].is_nested and outputs["log_probs"].size(0) == len(DOCUMENTS)
            (coeff[0] * outputs["log_probs"].values() + coeff[1] * outputs["entropy"].values()).sum().backward()
            allreduce_sequence_parallel_grads(model)
            grads.append(take_grads(model))
        what = f"TP {tp} CP {cp}"
        for name in ("log_probs", "entropy"):
            assert_close(fused[name].values(), verl_path[name].values(),
                         msg=lambda message: f"{what} {name}: {message}")
        assert "output_layer.weight" in grads[1], what
        assert_close_by_name(*grads)


def test_verls_engine_forward_on_packed_rows_end_to_end():
    run_distributed(_engine_forward_end_to_end, 2)


@pytest.fixture
def verl_own():
    """verl's own processor; whatever a test installs is taken out after it."""
    own = model_forward_fused.fused_output_processor
    yield own
    fused_rl_ops.verl.uninstall()
    assert model_forward_fused.fused_output_processor is own


def test_install_replaces_verls_processor_and_uninstall_puts_it_back(verl_own):
    processor = fused_rl_ops.verl.output_processor(top_k=20)
    fused_rl_ops.verl.install(processor)
    assert model_forward_fused.fused_output_processor is processor
    fused_rl_ops.verl.install()  # again: replaces ours, keeps verl's to put back
    assert isinstance(model_forward_fused.fused_output_processor, fused_rl_ops.verl.VerlOutputProcessor)
    assert model_forward_fused.fused_output_processor is not processor
    fused_rl_ops.verl.uninstall()
    assert model_forward_fused.fused_output_processor is verl_own
    with pytest.raises(TypeError, match="expected a processor from fused_rl_ops.verl.output_processor"):
        fused_rl_ops.verl.install(rl_output_processor())


def test_docs_verl_page_runs_as_written(verl_own, monkeypatch):
    """docs/verl.md's python block (install, install with the sampler's filter, uninstall) as written."""
    from tests.tooling.test_docs_code import run_page

    installed, install = [], fused_rl_ops.verl.install

    def recording_install(processor=None):
        install(processor)
        installed.append(model_forward_fused.fused_output_processor)

    monkeypatch.setattr(fused_rl_ops.verl, "install", recording_install)
    run_page("verl.md", lambda index, namespace: {})
    assert [type(p) for p in installed] == [fused_rl_ops.verl.VerlOutputProcessor] * 2
    assert installed[1].logit_options == {"top_k": 50, "top_p": 0.95}
    assert model_forward_fused.fused_output_processor is verl_own


def _processor_without_output_weight(*, hidden_states, output_layer, labels, context, config, **kwargs):
    """A fused_output_processor of another signature."""


def _engine_reading_no_global(vision_model=False):
    """A fused_forward_model_engine whose forward does not read the module's fused_output_processor."""
    def forward(model, **kwargs):
        return model(**kwargs)
    return forward


@pytest.mark.parametrize("change, message", [
    (lambda mp: mp.setattr(verl, "__version__", "0.10.0"), r"verl 0\.10\.0 is not a version it knows \(0\.9\.1\)"),
    (lambda mp: mp.setattr(model_forward_fused, "fused_output_processor", _processor_without_output_weight),
     r"fused_output_processor is not the function it replaces: expected keyword-only \('hidden_states', "
     r"'output_layer', 'output_weight', 'labels', 'context', 'config'\) and \*\*kwargs, got "
     r"_processor_without_output_weight with keyword-only \('hidden_states', 'output_layer', 'labels', 'context', "
     r"'config'\) and \*\*kwargs"),
    (lambda mp: mp.setattr(model_forward_fused, "FusedOutputProcessorContext",
                           dataclasses.make_dataclass("FusedOutputProcessorContext", ["temperature", "top_k"])),
     r"FusedOutputProcessorContext has fields \('temperature', 'top_k'\), expected \('temperature',\)"),
    (lambda mp: mp.setattr(GPTModel, "forward", lambda self, input_ids, labels=None: None),
     "GPTModel.forward has no output_processor hook"),
    (lambda mp: mp.setattr(model_forward_fused, "fused_forward_model_engine", _engine_reading_no_global),
     "_engine_reading_no_global does not call the module's fused_output_processor"),
])
def test_install_refuses_a_verl_it_was_not_made_for(verl_own, monkeypatch, change, message):
    change(monkeypatch)
    with pytest.raises(RuntimeError, match=message) as refused:
        fused_rl_ops.verl.install()
    assert str(refused.value).startswith("fused_rl_ops.verl.install: ") and "Nothing was installed" in str(refused.value)
    assert model_forward_fused.fused_output_processor is not None and not isinstance(
        model_forward_fused.fused_output_processor, fused_rl_ops.verl.VerlOutputProcessor)


PLUGIN_CHECK = """
import pytest
from megatron.core.models.gpt.gpt_model import GPTModel
with_hook = GPTModel.forward
GPTModel.forward = lambda self, input_ids, labels=None: None
with pytest.raises(RuntimeError, match="GPTModel.forward has no output_processor hook"):
    import verl  # the plugin refuses a megatron-core without the hook, and with it the import
GPTModel.forward = with_hook
import verl  # again: verl imports the plugin again, which installs this time
from verl.models.mcore import model_forward_fused
import fused_rl_ops.verl
assert isinstance(model_forward_fused.fused_output_processor, fused_rl_ops.verl.VerlOutputProcessor)
"""


def test_plugin_installs_when_verl_imports_it():
    """VERL_USE_EXTERNAL_MODULES=fused_rl_ops.verl.plugin: `import verl` installs the processor, or
    fails with install's reason."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="fused_rl_ops.verl.plugin")
    result = subprocess.run([sys.executable, "-c", PLUGIN_CHECK], cwd=root, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def _call(processor, **overrides):
    g = torch.Generator().manual_seed(5)
    output_layer = types.SimpleNamespace(weight=torch.randn(VOCAB, 16, generator=g), tp_group=None,
                                         sequence_parallel=False)
    keywords = dict(hidden_states=torch.randn(S, 1, 16, generator=g), output_layer=output_layer, output_weight=None,
                    labels=torch.randint(0, REAL_VOCAB, (1, S), generator=g),
                    context=FusedOutputProcessorContext(temperature=TEMPERATURE), config=None,
                    loss_mask=None, packed_seq_params=None, compute_language_model_loss=None, scale_logits=None)
    keywords.update(overrides)
    return processor(**keywords), keywords


def test_processor_passes_its_options_and_the_context_temperature_on():
    """The options (and verl's temperature) reach chosen_logprob as fused_rl_ops.megatron's processor
    takes them: the same numbers, bitwise; Megatron-LM main's extra keywords are accepted."""
    options = dict(vocab_size=REAL_VOCAB, softcap=3.0, top_k=40, top_p=0.9)
    out, keywords = _call(fused_rl_ops.verl.output_processor(**options))
    keywords.pop("context")
    expected = rl_output_processor(temperature=TEMPERATURE, **options)(**keywords)
    assert torch.equal(out.log_probs, expected["logprobs"]) and torch.equal(out.entropy, expected["entropy"])
    assert out.hidden_states is keywords["hidden_states"] and out.logits is None


@pytest.mark.parametrize("make, overrides, error, message", [
    (dict(temperature=0.5), {}, TypeError, "the temperature is verl's"),
    (dict(top_p=1.5), {}, ValueError, "top_p"),
    ({}, dict(context=None), TypeError, "must be verl's FusedOutputProcessorContext, got NoneType"),
    ({}, dict(context={"temperature": 0.7}), TypeError, "FusedOutputProcessorContext, got dict"),
    ({}, dict(context=FusedOutputProcessorContext(temperature=0.0)), ValueError, "temperature"),
    ({}, dict(labels=None), ValueError, "called without labels"),
    ({}, dict(labels=torch.zeros(S, 1, dtype=torch.long)), ValueError, r"labels must be \[b, s\]"),
])
def test_processor_refuses_wrong_input(make, overrides, error, message):
    with pytest.raises(error, match=message):
        _call(fused_rl_ops.verl.output_processor(**make), **overrides)
