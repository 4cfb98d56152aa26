"""verl's fused Megatron path scored by fused_rl_ops (verl 0.9.1 on megatron-core >= 0.18).

With `actor_rollout_ref.model.use_fused_kernels=True` and a megatron-core whose GPTModel has the
`output_processor` hook, verl's Megatron engine packs each micro-batch as THD rows ([1, total]
tokens, each sequence padded to a multiple of TP x CP, labels rolled within each sequence), then
calls the model with `output_processor=fused_output_processor` (a global of
verl.models.mcore.model_forward_fused, read at every call) and
`output_processor_context=FusedOutputProcessorContext(temperature)`, and reads `.log_probs` and
`.entropy` of the `CausalLMOutputForPPO` it returns.

`output_processor(**options)` is a processor with that contract, computed by fused_rl_ops.megatron's
RLOutputProcessor (chosen_logprob: no [tokens, vocab] logits; TP, sequence parallel) at the
context's temperature: fp32 [b, s] log_probs and entropy, [1, total] for verl's packed rows.
`install(processor)` makes verl's fused path call it, after checking that this verl and
megatron-core are the ones it was made for; `uninstall()` puts verl's own back. Importing
fused_rl_ops.verl.plugin installs the default processor (verl's VERL_USE_EXTERNAL_MODULES runs it in
every process that imports verl). docs/verl.md has the set-up.
"""
import dataclasses
import inspect

import verl
from megatron.core.models.gpt.gpt_model import GPTModel
from verl.models.mcore import model_forward_fused
from verl.models.mcore.model_forward_fused import FusedOutputProcessorContext
from verl.utils.model import CausalLMOutputForPPO

from fused_rl_ops.logit_options import LogitOptions
from fused_rl_ops.megatron.processor import RLOutputProcessor

__all__ = ["KNOWN_VERL_VERSIONS", "VerlOutputProcessor", "install", "output_processor", "uninstall"]

KNOWN_VERL_VERSIONS = ("0.9.1",)
# What install replaces, as verl 0.9.1 declares it: keyword-only parameters, then **kwargs.
_VERL_PROCESSOR_KEYWORDS = ("hidden_states", "output_layer", "output_weight", "labels", "context", "config")
_VERL_CONTEXT_FIELDS = ("temperature",)
_PROCESSOR_GLOBAL = "fused_output_processor"
_verl_own_processor = None  # verl's function while ours is installed


class VerlOutputProcessor:
    """What `output_processor` returns: called by Megatron's hook as verl's fused path calls it.

    logit_options: fused_rl_ops.LogitOptions' keywords but temperature, which is the context's
    (softcap; top_k / top_p: score the distribution the rollout sampler drew from, where verl's own
    path scores the full softmax). vocab_size: None scores every row of the output weight, as verl
    does (Megatron's vocab padding included); the tokenizer's size leaves the padding out.
    """

    def __init__(self, *, vocab_size=None, **logit_options):
        if "temperature" in logit_options:
            raise TypeError("fused_rl_ops.verl.output_processor: the temperature is verl's, from the context of "
                            "each call (its rollout temperature); do not pass one")
        LogitOptions(**logit_options)  # refuses bad options now, not at the first forward
        self.vocab_size = vocab_size
        self.logit_options = logit_options

    def __call__(self, *, hidden_states, labels=None, context=None, **keywords):
        if not isinstance(context, FusedOutputProcessorContext):
            raise TypeError(f"{type(self).__name__}: output_processor_context must be verl's "
                            f"FusedOutputProcessorContext, got {type(context).__name__}")
        if labels is None:
            raise ValueError(f"{type(self).__name__}: the model was called without labels; verl's fused path "
                             "passes the rolled input ids as labels")
        processor = RLOutputProcessor(vocab_size=self.vocab_size, temperature=context.temperature,
                                      **self.logit_options)
        outputs = processor(hidden_states=hidden_states, labels=labels, **keywords)
        # verl's own processor also returns the hidden states it got; its engine reads only these two.
        result = CausalLMOutputForPPO(loss=None, logits=None, past_key_values=None, hidden_states=hidden_states,
                                      attentions=None)
        result.log_probs, result.entropy = outputs["logprobs"], outputs["entropy"]
        return result


def output_processor(*, vocab_size=None, **logit_options):
    """A processor for verl's fused path; see VerlOutputProcessor."""
    return VerlOutputProcessor(vocab_size=vocab_size, **logit_options)


def install(processor=None):
    """Makes verl's fused path call `processor` (default: output_processor()) in this process, in
    place of verl's own processor; refuses (RuntimeError, saying what differs) a verl or
    megatron-core it was not made for. Installing again replaces the installed processor."""
    processor = output_processor() if processor is None else processor
    if not isinstance(processor, VerlOutputProcessor):
        raise TypeError(f"install: expected a processor from fused_rl_ops.verl.output_processor, got "
                        f"{type(processor).__name__}")
    global _verl_own_processor
    current = getattr(model_forward_fused, _PROCESSOR_GLOBAL, None)
    verl_own = _verl_own_processor if isinstance(current, VerlOutputProcessor) else current
    _check_verl(verl_own)
    _verl_own_processor = verl_own
    setattr(model_forward_fused, _PROCESSOR_GLOBAL, processor)


def uninstall():
    """Puts verl's own processor back (nothing to do when none of ours is installed)."""
    global _verl_own_processor
    if _verl_own_processor is not None:
        setattr(model_forward_fused, _PROCESSOR_GLOBAL, _verl_own_processor)
        _verl_own_processor = None


def _check_verl(verl_own):
    """A RuntimeError naming what differs unless verl and megatron-core are those install was made for."""
    where = f"verl {verl.__version__}"
    if verl.__version__ not in KNOWN_VERL_VERSIONS:
        _refuse(f"{where} is not a version it knows ({', '.join(KNOWN_VERL_VERSIONS)}); its fused path may call "
                "the output processor otherwise")
    hook = {"output_processor", "output_processor_context"}
    if not hook <= inspect.signature(GPTModel.forward).parameters.keys():
        _refuse("this megatron-core's GPTModel.forward has no output_processor hook (megatron-core >= 0.18 has "
                "it); without it verl runs its own patched forward, which calls no output processor")
    if not callable(verl_own) or _keywords(verl_own) != (_VERL_PROCESSOR_KEYWORDS, True):
        _refuse(f"{where}'s model_forward_fused.{_PROCESSOR_GLOBAL} is not the function it replaces: expected "
                f"keyword-only {_VERL_PROCESSOR_KEYWORDS} and **kwargs, got {_describe(verl_own)}")
    fields = tuple(field.name for field in dataclasses.fields(model_forward_fused.FusedOutputProcessorContext))
    if fields != _VERL_CONTEXT_FIELDS:
        _refuse(f"{where}'s FusedOutputProcessorContext has fields {fields}, expected {_VERL_CONTEXT_FIELDS}")
    for make in (model_forward_fused.fused_forward_model_engine, model_forward_fused.fused_forward_model_gen):
        if _PROCESSOR_GLOBAL not in make(False).__code__.co_names:
            _refuse(f"{where}'s {make.__name__} does not call the module's {_PROCESSOR_GLOBAL}")


def _keywords(function):
    """(the names of function's keyword-only parameters, whether it takes **kwargs)."""
    parameters = inspect.signature(function).parameters.values()
    return (tuple(p.name for p in parameters if p.kind is p.KEYWORD_ONLY),
            any(p.kind is p.VAR_KEYWORD for p in parameters))


def _describe(function):
    if not callable(function):
        return repr(function)
    names, var_keyword = _keywords(function)
    return f"{getattr(function, '__qualname__', type(function).__name__)} with keyword-only {names}" + (
        " and **kwargs" if var_keyword else "")


def _refuse(what):
    raise RuntimeError(f"fused_rl_ops.verl.install: {what}. Nothing was installed; fused_rl_ops.verl is made for "
                       f"verl {' / '.join(KNOWN_VERL_VERSIONS)} on megatron-core >= 0.18 (docs/verl.md)")
