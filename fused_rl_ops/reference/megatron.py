"""The naive Megatron baseline of fused_rl_ops.megatron's output processor: materialised logits
through Megatron's own output layer, vocab_parallel_cross_entropy and TP gathers, written apart
from the fused processor (no code shared with it). The tests and the example compare against it."""
import inspect

import torch
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import VocabUtility

from ..logit_options import LogitOptions
from . import apply_logit_map, sampler_filter

__all__ = ["NaiveRLOutputProcessor"]


def _vocab_parallel_cross_entropy(logits, tokens, tp_group):
    """Megatron's vocab_parallel_cross_entropy over tp_group; megatron-core 0.18's takes no group
    (it reduces over parallel_state's tensor-parallel group, the output layer's there)."""
    if "tp_group" in inspect.signature(vocab_parallel_cross_entropy).parameters:
        return vocab_parallel_cross_entropy(logits, tokens, tp_group=tp_group)
    return vocab_parallel_cross_entropy(logits, tokens)


class NaiveRLOutputProcessor:
    """An output processor with the fused one's keywords and outputs ([b, s] fp32 "logprobs", then
    "entropy", "values" as asked), computed the plain way: the output layer's logits under the
    logit map of its logit options (keywords of fused_rl_ops.LogitOptions, held as logit_options;
    fused_rl_ops.reference.apply_logit_map), padded rows at -inf, with top_k / top_p the tokens
    vLLM's sampler drops at -inf too (fused_rl_ops.reference's sampler_filter on the TP-gathered
    logits), -vocab_parallel_cross_entropy for the chosen tokens,
    entropy from the TP-gathered logits, values by F.linear from the value head's weight (and bias).
    Logprob and entropy are 0 where the label is ignore_index or loss_mask is 0.

    value_head: None, a [H] / [1, H] weight, or a module holding `weight` (and optionally `bias`)
    in nn.Linear(H, 1)'s layout, such as fused_rl_ops.ValueHead (its weight is read, the module is
    not called).
    """

    def __init__(self, *, return_entropy=True, value_head=None, ignore_index=-100, vocab_size=None, **logit_options):
        self.logit_options = LogitOptions(**logit_options)
        self.return_entropy = return_entropy
        self.value_head = value_head
        self.ignore_index = ignore_index
        self.vocab_size = vocab_size
        self.output_names = ("logprobs",) + (("entropy",) if return_entropy else ()) + (
            ("values",) if value_head is not None else ()
        )

    def __call__(self, *, hidden_states, output_layer, output_weight=None, labels=None, loss_mask=None,
                 context=None, **unused_keywords):
        tokens = labels if labels is not None else context["tokens"]  # [b, s]
        keep = tokens != self.ignore_index
        if loss_mask is not None:
            keep &= loss_mask != 0
        # The output layer gathers sequence-parallel hidden states itself: logits are [s, b, V/tp].
        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=False)
        # [b, s, V/tp], contiguous: vocab_parallel_cross_entropy views it as [b * s, V/tp].
        logits = apply_logit_map(logits.transpose(0, 1).contiguous().float(), self.logit_options.logit_map)
        tp_group = output_layer.tp_group
        if self.vocab_size is not None:
            rank, world = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
            first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.shape[-1], rank, world)
            padded = torch.arange(first, last, device=logits.device) >= self.vocab_size
            logits = logits.masked_fill(padded, float("-inf"))
        top_k, top_p = self.logit_options.top_k, self.logit_options.top_p
        if top_k is not None or top_p is not None:
            full_vocab_logits = gather_from_tensor_model_parallel_region(logits, group=tp_group)
            valid = self.vocab_size or full_vocab_logits.shape[-1]
            filtered = torch.cat([sampler_filter(full_vocab_logits[..., :valid], top_k, top_p),
                                  full_vocab_logits[..., valid:]], -1)
            rank = 0 if tp_group is None else tp_group.rank()
            logits = filtered.narrow(-1, rank * logits.shape[-1], logits.shape[-1]).contiguous()
        # vocab_parallel_cross_entropy overwrites its input; the entropy needs the logits.
        cross_entropy = _vocab_parallel_cross_entropy(logits.clone(), tokens.masked_fill(~keep, 0), tp_group)
        outputs = {"logprobs": torch.where(keep, -cross_entropy, 0.0)}
        if self.return_entropy:
            full_vocab_logits = gather_from_tensor_model_parallel_region(logits, group=tp_group)[..., : self.vocab_size]
            log_probs = torch.log_softmax(full_vocab_logits, dim=-1)
            # Tokens the filter drops have probability 0 and add nothing (0 * -inf would be NaN).
            plogp = log_probs.exp() * torch.where(log_probs.isneginf(), 0.0, log_probs)
            outputs["entropy"] = torch.where(keep, -plogp.sum(-1), 0.0)
        if self.value_head is not None:
            outputs["values"] = self._values(hidden_states, output_layer).transpose(0, 1)
        return {name: outputs[name].contiguous() for name in self.output_names}

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
