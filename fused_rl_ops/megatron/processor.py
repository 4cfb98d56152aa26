"""The RL output processor: megatron-core's `output_processor` contract, fused.

Megatron calls the processor in place of its output layer with keywords only (`hidden_states`
[s(/tp), b, h] after the final layernorm, `output_layer`, `output_weight` when embeddings are tied,
`labels` [b, s], `loss_mask`, `context`, `config`, ...). It returns a dict of fp32 [b, s] tensors,
keys in `output_names` order: "logprobs", then "entropy", "values" and "divergence" (the
divergence from a teacher's distribution: fused_rl_ops/megatron/distillation.py) when asked for, then
with top_logprobs=k "top_ids" and "top_logprobs" [b, s, k] (fused_rl_ops.top_logprobs: the model's
own k most likely tokens under the processor's logit map; positions not scored get ids ignore_index
and logprobs 0, and are not computed).

Tokens come from `labels` or `context["tokens"]` (exactly one), [b, s] like `loss_mask`, or from
the context [b, s, k] (k tokens per position: logprobs [b, s, k]; a position is scored when any of
its entries is). output_processor_context={"kept_ids": [b, s, k]} (ids padded with ignore_index):
the ids the rollout sampler kept at each position, in place of top_k / top_p (chosen_logprob's
kept_ids: logprobs renormalised over them, entropy over them). Positions with loss_mask 0 or ignore_index get logprob 0, entropy 0 and no
gradient, and are not computed (chosen_logprob's skip_ignored: its ops leave them out; under CUDA
graph capture every position is computed, with the same results). The
weight is the local vocab shard (tied embedding or output_layer.weight) over the output layer's TP
group. With sequence parallel the hidden states are gathered as Megatron's gather does (all-gather
along the sequence; the backward reduce-scatters), so chosen_logprob leaves its hidden gradient
unreduced (summed exactly once). The value head sees the gathered states: its values, and its
parameters' gradients, are complete and equal on every TP rank (fused_rl_ops.megatron.attach makes
it the model's submodule). MuP output scaling is refused. Under Megatron's DDP with
gradient_accumulation_fusion the output weight's gradient is added into its `main_grad` chunk by
chunk, as Megatron's own output layer does, instead of being returned as a [V_local, H] tensor.
"""
import dataclasses

import torch

import fused_rl_ops
from fused_rl_ops._checks import values_readable
from fused_rl_ops._vocab_parallel.tokens import check_token_range
from fused_rl_ops.logit_options import LogitOptions
from fused_rl_ops.top_logprobs import scored_top_logprobs

from .distillation import student_divergence
from .output_layer import OutputShard

__all__ = ["RLOutputProcessor", "rl_output_processor"]


class RLOutputProcessor:
    """What `rl_output_processor` returns (module docstring).

    logit_options: the LogitOptions its keywords make (temperature, the logit map and the rollout
    sampler's filter; LogitOptions documents them), passed on to chosen_logprob: logprobs and
    entropy of the distribution the sampler drew from. A token the filter drops gets logprob -inf
    (torch.isneginf counts them) and no logprob gradient.
    temperature: assign a new one between steps (`processor.temperature = 0.7`): logit_options is
    replaced, checked as in the constructor.
    output_names: the keys of the returned dict, in order ("logprobs", then "entropy", "values").
    batch_invariant: passed on to chosen_logprob (a token's outputs bitwise independent of the rest
    of the batch); the naive reference processor has no such option.
    host_checks: the token-range check (here, naming the caller's tensor and its [b, s] index, then
    chosen_logprob's) and chosen_logprob's TP group check; False skips them: an out-of-range token
    then gets a NaN logprob and NaN gradients, and a rank with invalid arguments raises alone. Under
    torch.compile and CUDA graph capture they are skipped whatever host_checks says (see
    chosen_logprob's check_tokens).
    divergence: None, or the kind of fused_rl_ops.vocab_divergence ("forward_kl", "reverse_kl",
    "jsd", with beta) from the teacher in output_processor_context={"teacher": ...}
    (fused_rl_ops/megatron/distillation.py).
    """

    def __init__(self, *, return_entropy=True, value_head=None, ignore_index=-100, vocab_size=None,
                 batch_invariant=False, host_checks=True, top_logprobs=None, divergence=None, beta=0.5,
                 **logit_options):
        self.logit_options = LogitOptions(**logit_options)
        self.divergence, self.beta = divergence, beta
        self.return_entropy = return_entropy
        self.value_head = value_head
        self.ignore_index = ignore_index
        self.vocab_size = vocab_size
        self.batch_invariant = batch_invariant
        self.host_checks = host_checks
        self.output_names = ("logprobs",)
        if return_entropy:
            self.output_names += ("entropy",)
        if value_head is not None:
            self.output_names += ("values",)
        if divergence is not None:
            self.output_names += ("divergence",)
        self.top_logprobs = top_logprobs
        if top_logprobs is not None:
            self.output_names += ("top_ids", "top_logprobs")

    @property
    def temperature(self):
        return self.logit_options.temperature

    @temperature.setter
    def temperature(self, temperature):
        self.logit_options = dataclasses.replace(self.logit_options, temperature=temperature)

    def __call__(self, *, hidden_states, output_layer, output_weight=None, labels=None, loss_mask=None,
                 context=None, config=None, **unused_keywords):
        if config is not None and config.use_mup and config.mup_output_mult != 1.0:
            raise ValueError(f"{type(self).__name__}: MuP output scaling (config.mup_output_mult) is not supported")
        sequence_parallel = output_layer.sequence_parallel
        seq_length = hidden_states.shape[0] * (
            torch.distributed.get_world_size(output_layer.tp_group) if sequence_parallel else 1
        )
        expected_shape = (hidden_states.shape[1], seq_length)
        tokens_name, tokens = self._tokens(labels, context, expected_shape, hidden_states)
        kept_ids = self._kept_ids(context, expected_shape, hidden_states)
        if loss_mask is not None:
            self._check_batch_shape("loss_mask", loss_mask, expected_shape, hidden_states)
            masked = (loss_mask == 0).reshape(*loss_mask.shape, *[1] * (tokens.dim() - 2))
            tokens = tokens.masked_fill(masked, self.ignore_index)
        # Megatron's DDP hooks (overlap_param_gather) wait for the weights' all-gather (output_layer.py).
        shard = OutputShard.read(output_layer, output_weight, batch_invariant=self.batch_invariant)
        if self.host_checks:
            check_token_ids(type(self).__name__, tokens_name, tokens, self.vocab_size or shard.total_rows(),
                            self.ignore_index)
        # Work in the model's [s, b] layout and transpose only the small per-token results.
        outputs = self._outputs(shard.gather(hidden_states), shard, tokens.transpose(0, 1), context, kept_ids)
        return {name: outputs[name].transpose(0, 1).contiguous() for name in self.output_names}

    def _tokens(self, labels, context, expected_shape, hidden_states):
        context_tokens = context.get("tokens") if isinstance(context, dict) else None
        if (labels is None) == (context_tokens is None):
            raise ValueError(
                f"{type(self).__name__}: give the chosen tokens once, as the model's labels or as "
                "output_processor_context={'tokens': tokens}"
                + (" (got both)" if labels is not None else " (got neither)")
            )
        name = "labels" if labels is not None else "output_processor_context['tokens']"
        tokens = self._check_batch_shape(name, labels if labels is not None else context_tokens, expected_shape,
                                         hidden_states, per_position=labels is None)
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{type(self).__name__}: {name} must be int64 or int32, got {tokens.dtype}")
        return name, tokens

    def _kept_ids(self, context, expected_shape, hidden_states):
        """output_processor_context['kept_ids'] [b, s, k] in the model's [s, b, k] layout, or None."""
        kept_ids = context.get("kept_ids") if isinstance(context, dict) else None
        if kept_ids is None:
            return None
        name = "output_processor_context['kept_ids']"
        if isinstance(kept_ids, torch.Tensor) and kept_ids.dim() != 3:
            raise ValueError(f"{type(self).__name__}: {name} must be [b, s, k] with [b, s] = {list(expected_shape)}, "
                             f"got {list(kept_ids.shape)}")
        return self._check_batch_shape(name, kept_ids, expected_shape, hidden_states, per_position=True).transpose(0, 1)

    def _check_batch_shape(self, name, tensor, expected_shape, hidden_states, per_position=False):
        """tensor, if it is a [b, s] tensor for these hidden states (per_position: or [b, s, k], k >=
        1 tokens per position); else a ValueError naming it."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: {name} must be a [b, s] tensor, got {type(tensor).__name__}")
        many = per_position and tensor.dim() == 3 and tensor.shape[2] >= 1
        if tuple(tensor.shape[:2] if many else tensor.shape) != expected_shape:
            raise ValueError(
                f"{type(self).__name__}: {name} must be [b, s]{' or [b, s, k]' if per_position else ''} = "
                f"{list(expected_shape)} for hidden states "
                f"{list(hidden_states.shape)} ([s, b, h], s split over TP ranks with sequence parallel), "
                f"got {list(tensor.shape)}"
            )
        if tensor.device != hidden_states.device:
            raise ValueError(f"{type(self).__name__}: {name} must be on the hidden states' device "
                             f"{hidden_states.device}, got {tensor.device}")
        return tensor

    def _outputs(self, hidden_states, shard, tokens, context, kept_ids):
        """The [s, b] outputs by name from the gathered [s, b, h] hidden states (kept_ids [s, b, k] or None)."""
        result = fused_rl_ops.chosen_logprob(
            hidden_states, shard.weight, tokens,
            logit_options=self.logit_options,
            ignore_index=self.ignore_index,
            vocab_size=self.vocab_size,
            tp_group=shard.tp_group,
            reduce_hidden_grad=shard.reduce_hidden_grad,
            return_entropy=self.return_entropy,
            main_grad=shard.main_grad,
            batch_invariant=self.batch_invariant,
            check_tokens=self.host_checks,
            check_group=self.host_checks,
            kept_ids=kept_ids,
        )
        outputs = dict(zip(("logprobs", "entropy"), result if self.return_entropy else (result,)))
        if self.divergence is not None:
            outputs["divergence"] = student_divergence(
                type(self).__name__, hidden_states, shard, context, kind=self.divergence, beta=self.beta,
                logit_map=self.logit_options.logit_map, mask=self.scored_positions(tokens),
                vocab_size=self.vocab_size, batch_invariant=self.batch_invariant, check_group=self.host_checks)
        if self.top_logprobs is not None:
            # The scored positions' top k, computed on those rows alone (left out inside the op: no host read).
            outputs["top_ids"], outputs["top_logprobs"] = scored_top_logprobs(
                hidden_states, shard.weight, self.top_logprobs, self.scored_positions(tokens), self.ignore_index,
                logit_map=self.logit_options.logit_map, vocab_size=self.vocab_size, tp_group=shard.tp_group,
                reduce_hidden_grad=shard.reduce_hidden_grad, batch_invariant=self.batch_invariant)
        if self.value_head is not None:
            outputs["values"] = self._apply_value_head(shard.replicated(hidden_states))
        return outputs

    def scored_positions(self, tokens):
        """[s, b] bool: the positions whose token (any of their k tokens) is not ignore_index."""
        scored = tokens != self.ignore_index
        return scored if scored.dim() == 2 else scored.any(-1)

    def _apply_value_head(self, hidden_states):
        if isinstance(self.value_head, torch.nn.Module):
            values = self.value_head(hidden_states)
        else:
            values = self._value_from_weight(hidden_states)
        if values.shape != hidden_states.shape[:-1]:
            raise ValueError(
                f"{type(self).__name__}: the value head must map [..., H] to [...]; it returned "
                f"{tuple(values.shape)} for hidden states {tuple(hidden_states.shape)}"
            )
        return values.float()

    def _value_from_weight(self, hidden_states):
        return fused_rl_ops.value_head(hidden_states, self.value_head)


def check_token_ids(caller, name, tokens, vocab_size, ignore_index):
    """Raises when an id of tokens (the caller's tensor `name`, [b, s] or [b, s, k]) is neither in
    [0, vocab_size) nor ignore_index, naming its index in that layout: checked here, before the
    processor transposes to Megatron's [s, b], so the op's own check (on the transposed ids) then
    passes (one more host read of two integers). Each rank checks its own ids: Megatron gives the
    ranks of a TP group the same. Skipped where the host may not read values (torch.compile, CUDA
    graph capture)."""
    if values_readable(tokens):
        check_token_range(caller, tokens, vocab_size, ignore_index, per_position=tokens.dim() == 2, name=name)


def rl_output_processor(*, return_entropy=True, value_head=None, ignore_index=-100, vocab_size=None,
                        batch_invariant=False, host_checks=True, top_logprobs=None, divergence=None, beta=0.5,
                        **logit_options):
    """An output processor returning fp32 [b, s] logprobs (+ entropy, values, divergence; with
    top_logprobs=k the model's top k ids and logprobs [b, s, k]); see the module docstring.
    logit_options: the keywords of fused_rl_ops.LogitOptions (temperature=1.0, ...)."""
    return RLOutputProcessor(return_entropy=return_entropy, value_head=value_head, ignore_index=ignore_index,
                             vocab_size=vocab_size, batch_invariant=batch_invariant, host_checks=host_checks,
                             top_logprobs=top_logprobs, divergence=divergence, beta=beta, **logit_options)


