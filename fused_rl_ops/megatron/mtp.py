"""Multi-token prediction (MTP) under an attached processor: the MTP heads' losses without logits.

megatron-core's `GPTModel._postprocess` (0.18 and 0.19) calls `process_mtp_loss` (a global of the
model's module) before the output processor. For each MTP depth it takes that depth's hidden states
through the output layer ([s, b, V/tp] logits), Megatron's cross entropy against the labels rolled
once more (`roll_tensor`), and injects the scaled loss into the main hidden states' gradient
(`MTPLossAutoScaler`), logging the loss and, from 0.19 on, argmax acceptance (`MTPLossLoggingHelper`).
Without labels, 0.19 derives them from the input ids; 0.18 computes no MTP loss (nor does this).

`route_mtp_loss(model, processor)` sends that call, for this model only (looked up by its output
layer; while any model is routed the module's global is a dispatcher that gives every other model
megatron-core's own function; the last undo puts that function back), to a `FusedMTPLoss`: the same
steps, with the cross entropy taken as -chosen_logprob on the same weight (detached under
`mtp_detach_heads`, 0.19), Megatron's own `roll_tensor` (context parallel, packed sequences), scaling and
`MTPLossAutoScaler`. Every path that reaches `_postprocess` (forward, schedule plan, pipeline last
stage) takes it. Differences from Megatron, all at positions Megatron weights by loss_mask: a
position with loss_mask 0 or label ignore_index adds exactly 0 and is not computed (chosen_logprob
skips it; Megatron adds loss_mask times its cross entropy: NaN where that is not finite, the whole
log-sum-exp for an ignore_index label); a
label is accepted when its logit equals the row's maximum, so every label tied for the maximum
counts (Megatron's argmax counts only the lowest tied id). Like Megatron's, the loss covers every
row of the output weight, padding included.
"""
import functools
import sys
import weakref

import torch
from megatron.core import parallel_state
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper, roll_tensor

import fused_rl_ops

from .output_layer import OutputShard
from .processor import RLOutputProcessor, check_token_ids

__all__ = ["FusedMTPLoss", "route_mtp_loss"]

_MEGATRON_PROCESS_MTP_LOSS = multi_token_prediction.process_mtp_loss
# A routed model's output layer -> (the module whose process_mtp_loss global is replaced, its FusedMTPLoss).
_routes = weakref.WeakKeyDictionary()


class FusedMTPLoss:
    """`process_mtp_loss` with chosen_logprob in place of the output layer and cross entropy (module
    docstring). ignore_index, batch_invariant, host_checks: as for RLOutputProcessor. The loss is
    Megatron's cross entropy of the output layer's own logits, so chosen_logprob takes the default
    LogitOptions (no temperature, map or filter), whatever the processor's."""

    def __init__(self, *, ignore_index=-100, batch_invariant=False, host_checks=True):
        self.ignore_index = ignore_index
        self.batch_invariant = batch_invariant
        self.host_checks = host_checks

    @classmethod
    def for_processor(cls, processor):
        """Takes the processor's options when it is an RLOutputProcessor, else the defaults."""
        if not isinstance(processor, RLOutputProcessor):
            return cls()
        return cls(ignore_index=processor.ignore_index, batch_invariant=processor.batch_invariant,
                   host_checks=processor.host_checks)

    def __call__(self, *, hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
                 is_training, compute_language_model_loss, config, cp_group=None, tp_group=None,
                 packed_seq_params=None, scale_logits_fn=None, input_ids=None):
        """process_mtp_loss's keywords and result: the main hidden states, carrying the MTP losses.
        runtime_gather_output, compute_language_model_loss, tp_group and scale_logits_fn go unused:
        the loss is taken over the output layer's vocab shards in its TP group; MuP is refused."""
        if config.use_mup and config.mup_output_mult != 1.0:
            raise ValueError("FusedMTPLoss: MuP output scaling (config.mup_output_mult) is not supported")
        depths = config.mtp_num_layers
        main_hidden, *depth_hidden = torch.chunk(hidden_states, 1 + depths, dim=0)
        roll = functools.partial(roll_tensor, shifts=-1, dims=-1, cp_group=cp_group,
                                 packed_seq_params=packed_seq_params)
        labels_from_input_ids = labels is None
        if labels_from_input_ids:
            if input_ids is None:
                return main_hidden
            labels, _ = roll(input_ids)  # the next token, as Megatron derives labels for RL
        if loss_mask is None:
            loss_mask = torch.ones_like(labels)
        if labels_from_input_ids:
            loss_mask, _ = roll(loss_mask)  # the last position has no next token
        # megatron-core 0.18 has no mtp_detach_heads
        shard = OutputShard.read(output_layer, output_weight, detach=getattr(config, "mtp_detach_heads", False),
                                 batch_invariant=self.batch_invariant)
        if self.host_checks and not labels_from_input_ids:  # before rolling: the index in the caller's labels
            check_token_ids("FusedMTPLoss", "labels", labels.masked_fill(loss_mask == 0, self.ignore_index),
                            shard.total_rows(), self.ignore_index)
        # Megatron rescales by the unrolled token count under calculate_per_token_loss.
        main_num_tokens = loss_mask.sum()
        depth_labels = labels
        for depth, hidden in enumerate(depth_hidden):
            depth_labels, _ = roll(depth_labels)
            loss_mask, num_tokens = roll(loss_mask)
            logprob, is_max = self._logprob(hidden, shard, depth_labels, loss_mask)
            mtp_loss = loss_mask * -logprob
            if is_training:
                _log(mtp_loss, num_tokens, is_max, loss_mask.bool(), depth, depths)
            scaled = config.mtp_loss_scaling_factor / depths * mtp_loss
            if config.calculate_per_token_loss:
                scaled = scaled * (main_num_tokens / num_tokens.clamp(min=1))
            else:
                scaled = scaled / num_tokens.clamp(min=1)
            main_hidden = MTPLossAutoScaler.apply(main_hidden, scaled)
        return main_hidden

    def _logprob(self, hidden, shard, labels, loss_mask):
        """[b, s] logprobs of labels and whether each label's logit is its row's maximum."""
        tokens = labels.masked_fill(loss_mask == 0, self.ignore_index).t()
        logprob, is_max = fused_rl_ops.chosen_logprob(
            shard.gather(hidden), shard.weight, tokens,
            ignore_index=self.ignore_index,
            tp_group=shard.tp_group,
            reduce_hidden_grad=shard.reduce_hidden_grad,
            main_grad=shard.main_grad,
            batch_invariant=self.batch_invariant,
            check_tokens=self.host_checks,
            check_group=self.host_checks,
            return_is_max=True,
        )
        return logprob.t(), is_max.t()


def _log(mtp_loss, num_tokens, is_max, valid, depth, depths):
    """What megatron-core logs of an MTP depth: its loss, and from 0.19 on the labels its argmax accepts."""
    loss = mtp_loss.sum() * (num_tokens > 0).to(mtp_loss.dtype) / num_tokens.clamp(min=1)
    avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker"):
        MTPLossLoggingHelper.save_metrics_to_tracker(loss, (is_max & valid).sum().float(), valid.sum().float(),
                                                     depth, depths, avg_group=avg_group)
    else:  # megatron-core 0.18
        MTPLossLoggingHelper.save_loss_to_tracker(loss, depth, depths, avg_group=avg_group)


def _process_mtp_loss(*args, **kwargs):
    """What a routed model's module calls in place of process_mtp_loss; Megatron's for the rest."""
    route = _routes.get(kwargs["output_layer"]) if "output_layer" in kwargs and not args else None
    if route is None:
        return _MEGATRON_PROCESS_MTP_LOSS(*args, **kwargs)
    return route[1](**kwargs)


def route_mtp_loss(model, processor):
    """Routes the MTP loss of `model` (a GPTModel with MTP layers on this pipeline stage) through a
    FusedMTPLoss with the processor's options; returns the steps that undo it (none without MTP)."""
    if not (model.config.mtp_num_layers and model.post_process):
        return []
    module = sys.modules[type(model)._postprocess.__module__]
    if (getattr(module, "process_mtp_loss", None) not in (_MEGATRON_PROCESS_MTP_LOSS, _process_mtp_loss)
            or type(model).compute_language_model_loss is not LanguageModule.compute_language_model_loss):
        raise ValueError(
            f"attach: {type(model).__name__} computes its multi-token prediction loss other than megatron-core "
            "0.18 / 0.19's GPTModel does (process_mtp_loss from its _postprocess, LanguageModule's cross entropy); "
            "fused_rl_ops cannot take it over"
        )
    _routes[model.output_layer] = (module, FusedMTPLoss.for_processor(processor))
    module.process_mtp_loss = _process_mtp_loss
    return [functools.partial(_unroute, model.output_layer)]


def _unroute(output_layer):
    module, _ = _routes.pop(output_layer)
    if all(other is not module for other, _ in _routes.values()):
        module.process_mtp_loss = _MEGATRON_PROCESS_MTP_LOSS
