"""Per-token logprobs of a Hugging Face causal LM without its [batch, seq, vocab] logits.

Needs the optional extra: pip install "fused_rl_ops[transformers]".
"""
import dataclasses
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from ._options import is_positive_finite
from .chosen_logprob import chosen_logprob
from .logit_options import LogitOptions
from .top_logprobs import scored_top_logprobs

IGNORE_INDEX = -100

# The CausalLM classes whose forward (transformers 5.23) computes
# logits = lm_head(base_model(...).last_hidden_state) and then at most the step named here:
#   None: nothing; "softcap": cap * tanh(z / cap), cap = config.final_logit_softcapping (None: no cap);
#   "logit_scale": z * model.logit_scale (Cohere); "logits_scaling": z / config.logits_scaling (Granite).
# tests/integrations/test_transformers.py checks every entry against the model's own logits. Any other forward
# (another class, a subclass overriding it, remote code) is refused: it may change the logits in
# ways this function would not reproduce.
LOGITS_AFTER_HEAD = {
    "LlamaForCausalLM": None, "MistralForCausalLM": None, "MixtralForCausalLM": None, "MinistralForCausalLM": None,
    "Qwen2ForCausalLM": None, "Qwen2MoeForCausalLM": None, "Qwen3ForCausalLM": None, "Qwen3MoeForCausalLM": None,
    "Phi3ForCausalLM": None, "Olmo2ForCausalLM": None, "Olmo3ForCausalLM": None, "SmolLM3ForCausalLM": None,
    "Glm4ForCausalLM": None, "Starcoder2ForCausalLM": None, "DeepseekV3ForCausalLM": None, "GemmaForCausalLM": None,
    "Gemma2ForCausalLM": "softcap", "Gemma3ForCausalLM": "softcap",
    "CohereForCausalLM": "logit_scale", "Cohere2ForCausalLM": "logit_scale",
    "GraniteForCausalLM": "logits_scaling", "GraniteMoeForCausalLM": "logits_scaling",
}
# Where each step reads its constant: the forward's own expression (config.x or model.x).
_STEP_CONSTANT = {"softcap": ("config", "final_logit_softcapping"), "logit_scale": ("model", "logit_scale"),
                  "logits_scaling": ("config", "logits_scaling")}


def _check_model(model):
    """The model's decoder (its base model) and LM head, or a clear error for a model whose logits
    this function cannot reproduce."""
    forward = type(model).forward
    verified_class = forward.__qualname__.partition(".")[0]
    if verified_class not in LOGITS_AFTER_HEAD or not forward.__module__.startswith("transformers.models."):
        raise ValueError(f"causal_lm_logprobs: model must be a transformers CausalLM with the forward of a verified "
                         f"class ({', '.join(sorted(LOGITS_AFTER_HEAD))}); got {type(model).__name__}, whose forward "
                         f"is {forward.__module__}.{forward.__qualname__}")
    config, decoder, head = model.config, model.base_model, model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise ValueError(f"causal_lm_logprobs: the LM head must be a plain torch.nn.Linear without bias, got "
                         f"{type(head).__name__}{' with a bias' if getattr(head, 'bias', None) is not None else ''}")
    if isinstance(head.weight, DTensor):
        raise ValueError("causal_lm_logprobs: the LM head's weight is a DTensor (sharded by FSDP2 or tensor "
                         "parallelism); causal_lm_logprobs needs the whole [vocab, hidden] weight on each rank")
    if head.weight.shape[0] != config.vocab_size:
        raise ValueError(f"causal_lm_logprobs: the LM head has {head.weight.shape[0]} rows but config.vocab_size "
                         f"is {config.vocab_size}")
    return decoder, head, LOGITS_AFTER_HEAD[verified_class]


def _logit_transform(model, step) -> tuple[float, Optional[float]]:
    """(scale, softcap) for the model's step after the head (a LOGITS_AFTER_HEAD value): its logits
    are cap(scale * h @ w.T), cap(z) = softcap * tanh(z / softcap) (no cap when softcap is None)."""
    if step is None:
        return 1.0, None
    owner, attribute = _STEP_CONSTANT[step]
    name, value = f"{owner}.{attribute}", getattr(model.config if owner == "config" else model, attribute, None)
    if step == "softcap" and value is None:
        return 1.0, None
    if not is_positive_finite(value):
        raise ValueError(f"causal_lm_logprobs: {name} must be a positive finite number, got {value!r}")
    if step == "softcap":
        return 1.0, float(value)
    return (float(value) if step == "logit_scale" else 1.0 / float(value)), None


def causal_lm_logprobs(model, input_ids: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
                       labels: Optional[torch.Tensor] = None, temperature: float = 1.0, return_entropy: bool = False,
                       top_k: Optional[int] = None, top_p: Optional[float] = None,
                       top_logprobs: Optional[int] = None, kept_ids: Optional[torch.Tensor] = None,
                       **forward_kwargs):
    """log softmax(logits[:, t] / temperature)[labels[:, t + 1]] for t < seq - 1, without the logits.

    model is a transformers CausalLM of a class in LOGITS_AFTER_HEAD. Runs its base model (the
    decoder, final norm included) on input_ids [batch, seq] with attention_mask and
    forward_kwargs (use_cache defaults to False), then fused_rl_ops.chosen_logprob on the last hidden
    states and the LM head's weight (tied to the embedding or not), with the model's own step after
    the head (softcap, logit scale); the LM head module never runs and no [batch, seq, vocab] tensor
    exists, forward or backward. labels (default input_ids) are unshifted, as a CausalLM takes them:
    position t scores labels[:, t + 1]. Position t is skipped when labels[:, t + 1] is -100 or, with
    a [batch, seq] attention_mask, when the token it scores is padding (attention_mask[:, t + 1] ==
    0; a mask of another form, such as a 4-D one, goes to the model and skips nothing): it gets
    logprob 0 and entropy 0, no gradient, and no work (chosen_logprob's skip_ignored). Returns
    logprob [batch, seq - 1] in float32 (float64 for a float64 model), or (logprob, entropy) with
    return_entropy=True (the entropy of the tempered next-token distribution). Differentiable in
    every parameter the logits depend on. A MoE model's router auxiliary loss, part of its CausalLM
    loss, is not included.
    top_k, top_p: the rollout engine's sampler filter (pass its values; None: none): logprob and
    entropy of the distribution the sampler drew from, the tokens it keeps renormalised (see
    chosen_logprob). A token the filter drops gets logprob -inf and no logprob gradient.
    kept_ids [batch, seq, k] (ids padded with -100; unshifted like labels: kept_ids[:, t + 1] the ids
    the sampler kept when it drew labels[:, t + 1]): in place of top_k / top_p, logprob renormalised
    over them (-inf for a token outside) and entropy over them (chosen_logprob's kept_ids).
    labels [batch, seq, k]: k tokens per position (position t scores labels[:, t + 1, :]; an entry
    of -100 is ignored, a position whose entries all are is skipped); logprob is then [batch, seq -
    1, k]. top_logprobs=k appends (top_ids, top_logprobs) [batch, seq - 1, k]: the model's own k most
    likely next tokens under temperature and its step after the head (fused_rl_ops.top_logprobs,
    without top_k / top_p), ids -100 and logprobs 0 at skipped positions, which are not computed.
    """
    decoder, head, step = _check_model(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"causal_lm_logprobs: input_ids must be a [batch, seq] tensor with seq >= 2, got {got}")
    labels = input_ids if labels is None else labels
    many = isinstance(labels, torch.Tensor) and labels.dim() == 3 and labels.shape[2] >= 1
    if not isinstance(labels, torch.Tensor) or (labels.shape[:2] if many else labels.shape) != input_ids.shape:
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"causal_lm_logprobs: labels must have input_ids' shape {tuple(input_ids.shape)} "
                         f"(unshifted), or that shape and k tokens per position, got {got}")
    if kept_ids is not None and (not isinstance(kept_ids, torch.Tensor) or kept_ids.dim() != 3
                                 or kept_ids.shape[:2] != input_ids.shape):
        got = tuple(kept_ids.shape) if isinstance(kept_ids, torch.Tensor) else type(kept_ids).__name__
        raise ValueError(f"causal_lm_logprobs: kept_ids must be [batch, seq, k] with input_ids' shape "
                         f"{tuple(input_ids.shape)} (unshifted), got {got}")
    options = LogitOptions(temperature=temperature, top_k=top_k, top_p=top_p)
    scale, softcap = _logit_transform(model, step)
    options = dataclasses.replace(options, temperature=options.temperature / scale, softcap=softcap)
    scored_labels = labels[:, 1:]
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == input_ids.shape:
        padding = (attention_mask[:, 1:] == 0).reshape(*scored_labels.shape[:2], *[1] * many)
        scored_labels = scored_labels.masked_fill(padding, IGNORE_INDEX)  # padding scores nothing

    forward_kwargs.setdefault("use_cache", False)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, **forward_kwargs).last_hidden_state
    weight = head.weight
    # As nn.Linear would need: the hidden states in the head's dtype.
    hidden = hidden[:, :-1].to(weight.dtype)
    result = chosen_logprob(hidden, weight, scored_labels, logit_options=options, ignore_index=IGNORE_INDEX,
                            vocab_size=model.config.vocab_size, return_entropy=return_entropy,
                            kept_ids=None if kept_ids is None else kept_ids[:, 1:])
    if top_logprobs is None:
        return result
    scored = scored_labels != IGNORE_INDEX
    top = scored_top_logprobs(hidden, weight, top_logprobs, scored.any(-1) if many else scored, IGNORE_INDEX,
                              logit_map=options.logit_map, vocab_size=model.config.vocab_size)
    return (*(result if return_entropy else (result,)), *top)
