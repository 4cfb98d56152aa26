"""The naive Megatron baseline of fused_rl_ops.megatron's output processor: materialised logits
through Megatron's own output layer and vocab_parallel_cross_entropy. The tests and the example
compare the fused processor against it."""
import torch
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)

from ..megatron.processor import RLOutputProcessor

__all__ = ["NaiveRLOutputProcessor"]


class NaiveRLOutputProcessor(RLOutputProcessor):
    """The same outputs through the materialised logits, the baseline to compare against: Megatron's
    output layer and vocab_parallel_cross_entropy, entropy from the TP-gathered logits, values from
    the weight by a plain matmul (a value-head module is called as is)."""

    def _per_token(self, hidden_states, output_layer, weight, tokens):
        tp_group = output_layer.tp_group
        logits, _ = output_layer(hidden_states, weight=weight, runtime_gather_output=False)
        logits = logits.float() / self.temperature
        if self.vocab_size is not None:
            vocab_start = torch.distributed.get_rank(tp_group) * logits.shape[-1] if tp_group is not None else 0
            global_ids = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
            logits = logits.masked_fill(global_ids >= self.vocab_size, float("-inf"))
        valid = tokens != self.ignore_index
        # vocab_parallel_cross_entropy works in place on its input; the entropy needs the logits.
        neg_logprobs = vocab_parallel_cross_entropy(logits.clone(), tokens.masked_fill(~valid, 0), tp_group=tp_group)
        per_token = (torch.where(valid, -neg_logprobs, 0.0),)
        if self.return_entropy:
            full_logits = gather_from_tensor_model_parallel_region(logits, group=tp_group)[..., : self.vocab_size]
            log_probs = torch.log_softmax(full_logits, dim=-1)
            per_token += (-(log_probs.exp() * log_probs).sum(-1),)
        if self.value_head is None:
            return per_token
        if output_layer.sequence_parallel:
            # Values are replicated over TP: the gather's backward keeps this rank's slice of the gradient.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=tp_group
            )
        return per_token + (self._apply_value_head(hidden_states),)

    def _value_from_weight(self, hidden_states):
        return hidden_states.float() @ self.value_head.float().reshape(-1)
