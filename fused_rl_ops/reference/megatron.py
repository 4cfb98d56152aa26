"""The naive Megatron baseline of fused_rl_ops.megatron's output processor: materialised logits
through Megatron's own output layer, vocab_parallel_cross_entropy and TP gathers, written apart
from the fused processor (no code shared with it). The tests and the example compare against it."""
import dataclasses
import inspect

import torch
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import VocabUtility

from ..logit_options import LogitOptions
from . import apply_logit_map, divergence_of_logprobs, sampler_filter

__all__ = ["NaiveRLOutputProcessor"]


def _vocab_parallel_cross_entropy(logits, tokens, tp_group):
    """Megatron's vocab_parallel_cross_entropy over tp_group; megatron-core 0.18's takes no group
    (it reduces over parallel_state's tensor-parallel group, the output layer's there)."""
    if "tp_group" in inspect.signature(vocab_parallel_cross_entropy).parameters:
        return vocab_parallel_cross_entropy(logits, tokens, tp_group=tp_group)
    return vocab_parallel_cross_entropy(logits, tokens)


class NaiveRLOutputProcessor:
    """An output processor with the fused one's keywords and outputs ("logprobs", then "entropy",
    "values", "divergence" as asked, then "top_ids" and "top_logprobs"), computed the plain way:
    the output layer's logits under the logit map of its logit options (keywords of
    fused_rl_ops.LogitOptions, held as logit_options; fused_rl_ops.reference.apply_logit_map),
    padded rows at -inf, with top_k / top_p the tokens vLLM's sampler drops at -inf too
    (fused_rl_ops.reference's sampler_filter on the TP-gathered logits); then:

    - logprobs: -vocab_parallel_cross_entropy of each chosen token ([b, s] labels or context
      tokens, or [b, s, k] context tokens: one call per entry); 0 for an ignore_index entry;
    - entropy: of the TP-gathered (filtered) logits' softmax;
    - values: F.linear from the value head's weight (and bias) on every position's hidden states;
    - divergence (divergence=kind, beta): fused_rl_ops.reference.divergence_of_logprobs between
      the student's softmax and the teacher's, both over the whole TP-gathered vocabulary without
      the sampler's filter; the teacher's logits from its hidden states and output-weight shard in
      output_processor_context={"teacher": ...} (teacher_output_processor's dict), under the
      student's temperature and the teacher's softcap, with no gradient;
    - top_ids, top_logprobs (top_logprobs=k): the k largest of the TP-gathered log-softmax without
      the filter, descending, the lower id first between equal ones.

    A position whose entries are all ignore_index, or whose loss_mask is 0, gets 0 everywhere
    (ids ignore_index) but its value. value_head: None, a [H] / [1, H] weight, or a module holding
    `weight` (and optionally `bias`) in nn.Linear(H, 1)'s layout, such as fused_rl_ops.ValueHead
    (its weight is read, the module is not called).
    """

    def __init__(self, *, return_entropy=True, value_head=None, ignore_index=-100, vocab_size=None, top_logprobs=None,
                 divergence=None, beta=0.5, **logit_options):
        self.logit_options = LogitOptions(**logit_options)
        self.return_entropy = return_entropy
        self.value_head = value_head
        self.ignore_index = ignore_index
        self.vocab_size = vocab_size
        self.top_logprobs = top_logprobs
        self.divergence, self.beta = divergence, beta
        asked = {"entropy": return_entropy, "values": value_head is not None, "divergence": divergence is not None,
                 "top_ids": top_logprobs is not None, "top_logprobs": top_logprobs is not None}
        self.output_names = ("logprobs",) + tuple(name for name, wanted in asked.items() if wanted)

    def __call__(self, *, hidden_states, output_layer, output_weight=None, labels=None, loss_mask=None,
                 context=None, **unused_keywords):
        tokens = labels if labels is not None else context["tokens"]  # [b, s], or [b, s, k] from the context
        entries = tokens if tokens.dim() == 3 else tokens[..., None]
        keep = entries != self.ignore_index
        if loss_mask is not None:
            keep &= (loss_mask != 0)[..., None]
        scored = keep.any(-1)
        tp_group = output_layer.tp_group
        # The output layer gathers sequence-parallel hidden states itself: logits are [s, b, V/tp].
        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=False)
        # [b, s, V/tp], contiguous: vocab_parallel_cross_entropy views it as [b * s, V/tp].
        mapped = self._without_padding(
            apply_logit_map(logits.transpose(0, 1).contiguous().float(), self.logit_options.logit_map), tp_group)
        sampled = self._sampler_filtered(mapped, tp_group)
        logprobs = torch.stack([self._logprobs(sampled, entries[..., j], keep[..., j], tp_group)
                                for j in range(entries.shape[-1])], -1)
        outputs = {"logprobs": logprobs if tokens.dim() == 3 else logprobs[..., 0]}
        if self.return_entropy:
            log_probs = torch.log_softmax(self._gathered(sampled, tp_group), dim=-1)
            # Tokens the filter drops have probability 0 and add nothing (0 * -inf would be NaN).
            plogp = log_probs.exp() * torch.where(log_probs.isneginf(), 0.0, log_probs)
            outputs["entropy"] = torch.where(scored, -plogp.sum(-1), 0.0)
        if self.value_head is not None:
            outputs["values"] = self._values(hidden_states, output_layer).transpose(0, 1)
        if self.divergence is not None or self.top_logprobs is not None:
            log_q = torch.log_softmax(self._gathered(mapped, tp_group), dim=-1)  # without the sampler's filter
        if self.divergence is not None:
            log_p = torch.log_softmax(self._teacher_logits(context["teacher"], tp_group), dim=-1)
            divergence = divergence_of_logprobs(log_q, log_p, kind=self.divergence, beta=self.beta)
            outputs["divergence"] = torch.where(scored, divergence, 0.0)
        if self.top_logprobs is not None:
            ids = log_q.detach().sort(dim=-1, descending=True, stable=True).indices[..., :self.top_logprobs]
            outputs["top_ids"] = torch.where(scored[..., None], ids, self.ignore_index)
            outputs["top_logprobs"] = torch.where(scored[..., None], log_q.gather(-1, ids), 0.0)
        return {name: outputs[name].contiguous() for name in self.output_names}

    def _without_padding(self, logits, tp_group):
        """logits [..., V/tp] of this rank's vocab shard with the rows at or past vocab_size at -inf."""
        if self.vocab_size is None:
            return logits
        rank, world = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.shape[-1], rank, world)
        return logits.masked_fill(torch.arange(first, last, device=logits.device) >= self.vocab_size, float("-inf"))

    def _gathered(self, logits, tp_group):
        """This rank's [..., V/tp] logits gathered over the TP group, up to vocab_size: [..., V]."""
        return gather_from_tensor_model_parallel_region(logits, group=tp_group)[..., : self.vocab_size]

    def _sampler_filtered(self, logits, tp_group):
        """This rank's shard of the logits with the tokens vLLM's sampler drops (top_k / top_p over the
        TP-gathered vocabulary) at -inf."""
        top_k, top_p = self.logit_options.top_k, self.logit_options.top_p
        if top_k is None and top_p is None:
            return logits
        full_vocab_logits = gather_from_tensor_model_parallel_region(logits, group=tp_group)
        valid = self.vocab_size or full_vocab_logits.shape[-1]
        filtered = torch.cat([sampler_filter(full_vocab_logits[..., :valid], top_k, top_p),
                              full_vocab_logits[..., valid:]], -1)
        rank = 0 if tp_group is None else tp_group.rank()
        return filtered.narrow(-1, rank * logits.shape[-1], logits.shape[-1]).contiguous()

    @staticmethod
    def _logprobs(logits, tokens, keep, tp_group):
        """[b, s] logprobs of tokens from this rank's logits shard; 0 where keep is False."""
        # vocab_parallel_cross_entropy overwrites its input; the entropy needs the logits.
        cross_entropy = _vocab_parallel_cross_entropy(logits.clone(), tokens.masked_fill(~keep, 0), tp_group)
        return torch.where(keep, -cross_entropy, 0.0)

    def _teacher_logits(self, teacher, tp_group):
        """[b, s, V] logits of the teacher (teacher_output_processor's dict), TP-gathered, under the
        student's temperature and the teacher's softcap; constants."""
        with torch.no_grad():
            hidden = teacher["hidden_states"]
            if teacher["sequence_parallel"]:
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=tp_group)
            logits = torch.matmul(hidden, teacher["output_weight"].t()).transpose(0, 1).float()
            logit_map = dataclasses.replace(self.logit_options.logit_map, softcap=teacher["softcap"])
            return self._gathered(apply_logit_map(logits, logit_map), tp_group)

    def _values(self, hidden_states, output_layer):
        """[s, b] values from all positions' hidden states."""
        if output_layer.sequence_parallel:
            # Every TP rank computes the same values from the whole sequence; the gather's backward
            # keeps this rank's slice of the (already complete) gradient.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=output_layer.tp_group
            )
        if isinstance(self.value_head, torch.nn.Module):
            weight, bias = self.value_head.weight, getattr(self.value_head, "bias", None)
        else:
            weight, bias = self.value_head, None
        return torch.nn.functional.linear(
            hidden_states.float(), weight.float().reshape(1, -1), None if bias is None else bias.float().reshape(1)
        ).squeeze(-1)
