"""Megatron-core integration: chosen-token logprobs, entropy and values straight from the hidden states.

Tested with megatron-core 0.19.2. Importing this module imports megatron-core; the rest of
fused_rl_ops does not need it. In short::

    from fused_rl_ops.megatron import attach, rl_output_processor, with_clamped_swiglu_mlp

    model = GPTModel(config, with_clamped_swiglu_mlp(get_gpt_layer_local_spec()), padded_vocab, ...)
    attach(model, rl_output_processor(value_head=fused_rl_ops.ValueHead(config.hidden_size),
                                      vocab_size=tokenizer_vocab_size))
    outputs = model(tokens, position_ids, attention_mask, labels=tokens)
    outputs["logprobs"], outputs["entropy"], outputs["values"]  # fp32 [b, s]

examples/ppo_step.py runs a whole PPO step this way.

Output processor
----------------
``rl_output_processor(*, temperature=1.0, return_entropy=True, value_head=None, ignore_index=-100,
vocab_size=None)`` returns a callable with megatron-core's ``output_processor`` keyword contract
(``GPTModel.forward(..., output_processor=fn, output_processor_context=ctx)``, megatron-core >= 0.18).
Called by the model in place of its output layer, it returns a dict of fp32 ``[b, s]`` tensors:

- ``"logprobs"``: log-softmax of ``logits / temperature`` at the chosen tokens. The tokens are the
  ``labels`` the model was called with, or ``context["tokens"]`` (``[b, s]``); give one of the two.
  Positions where ``loss_mask`` is 0 or the token is ``ignore_index`` get 0 and no gradient.
- ``"entropy"`` (when ``return_entropy``): entropy of the same distribution, at every position
  (masked ones included: mask the loss).
- ``"values"`` (when ``value_head`` is given): a module mapping ``[..., H]`` to ``[...]`` (for
  example ``fused_rl_ops.ValueHead``), or a weight ``[H]`` / ``[1, H]`` for ``fused_rl_ops.value_head``.
  It reads the same hidden states, replicated over TP like the loss, so its parameters get full
  gradients on every rank.

The processor's ``output_names`` lists the dict's keys in order. It never materialises the logits:
``fused_rl_ops.chosen_logprob`` reads the output layer's local vocab shard (the tied embedding
weight when embeddings are shared, else ``output_layer.weight``) over the output layer's
tensor-parallel group. ``vocab_size`` is the tokenizer's vocabulary: Megatron's training scripts
pad the vocab (to a multiple of 128 x TP) and the padded rows would otherwise enter the softmax and
the entropy, so pass it to match what the sampler saw. With sequence parallel the hidden states are
gathered with Megatron's sequence-parallel gather, whose backward reduce-scatters, so the op leaves
the hidden gradient unreduced (summed exactly once). MuP output scaling is refused.

``NaiveRLOutputProcessor`` (same arguments) computes the same outputs through the materialised
logits: Megatron's output layer and ``vocab_parallel_cross_entropy``. It is the baseline the tests
and the example compare against.

Registration: ``attach(model, processor)`` / ``detach(model)``
------------------------------------------------------------
``attach`` makes every forward of ``model`` use ``processor`` without the caller passing it (call
it once per model chunk of a virtual pipeline). It unwraps Megatron's DDP / FSDP / Float16Module
wrappers to the language model, then:

- GPTModel with the native hook: a forward pre-hook adds ``output_processor=processor`` to every
  call (``output_processor_context`` is still passed per call; passing ``output_processor`` too is
  refused), and the model's ``build_schedule_plan`` gets the same processor. Two differences on the
  schedule-plan path, both forced by megatron-core 0.19.2: its post-process node carries only
  tensors, so the plan's output is the tuple of the dict's values (in ``output_names`` order), which
  a combined-1F1B ``loss_func`` receives as positional arguments; and for a dense last layer the
  plan skips ``decoder.final_layernorm``, so attach applies it before the processor, giving the same
  numbers as ``forward``. Use the processor on that path only through ``attach``: passed directly to
  ``build_schedule_plan`` it would fail on its dict output.
- Models without the hook (HybridModel in megatron-core 0.19.2; GPTModel before 0.18 calls its
  output layer the same way, but only HybridModel is tested): during each forward the output layer
  module is swapped for a stand-in that runs the processor, and the model returns the processor's
  dict. ``forward`` itself is untouched and the output layer is restored after every call, so
  parameters and state dicts are unchanged. Pass the tokens as
  ``model(..., output_processor_context={"tokens": tokens})`` (and ``loss_mask=`` if needed); a call
  with ``labels`` is refused, because the model would compute its cross entropy over the stand-in's
  output and return a meaningless loss. Models with multi-token prediction are refused (their MTP
  loss calls the output layer too).

Hooks run on ``model(...)`` calls, as Megatron's schedules make them; calling ``model.forward``
directly bypasses them. On a pipeline's earlier stages the model returns its hidden states as usual.

Clamped SwiGLU MLP
------------------
``with_clamped_swiglu_mlp(spec)`` returns a copy of a GPT or hybrid layer / block spec whose dense
Megatron ``MLP`` modules are ``ClampedSwiGLUMLP``: the same fc1 / fc2 layers and parameters, with
the gated activation computed by ``fused_rl_ops.clamped_swiglu`` from the config's
``activation_func`` (SiLU gate: alpha 1.0; quick-GELU gate: alpha 1.702),
``activation_func_clamp_value`` and ``glu_linear_offset``, as Megatron's unfused path does.
"""
import dataclasses
import functools
import inspect

import torch
import torch.nn.functional as F
from megatron.core import activations
from megatron.core.fusions import fused_bias_geglu
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import unwrap_model

import fused_rl_ops

__all__ = [
    "ClampedSwiGLUMLP",
    "NaiveRLOutputProcessor",
    "RLOutputProcessor",
    "attach",
    "detach",
    "rl_output_processor",
    "with_clamped_swiglu_mlp",
]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `factor` in backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class RLOutputProcessor:
    """What `rl_output_processor` returns; see the module docstring.

    output_names: the keys of the returned dict, in order ("logprobs", then "entropy", "values").
    """

    def __init__(self, *, temperature=1.0, return_entropy=True, value_head=None, ignore_index=-100,
                 vocab_size=None):
        if not temperature > 0:
            raise ValueError(f"{type(self).__name__}: temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.return_entropy = return_entropy
        self.value_head = value_head
        self.ignore_index = ignore_index
        self.vocab_size = vocab_size
        self.output_names = ("logprobs",)
        if return_entropy:
            self.output_names += ("entropy",)
        if value_head is not None:
            self.output_names += ("values",)

    def __call__(self, *, hidden_states, output_layer, output_weight=None, labels=None, loss_mask=None,
                 context=None, config=None, **unused_keywords):
        if config is not None and config.use_mup and config.mup_output_mult != 1.0:
            raise ValueError(f"{type(self).__name__}: MuP output scaling (config.mup_output_mult) is not supported")
        tokens = self._tokens(labels, context)
        if loss_mask is not None:
            tokens = tokens.masked_fill(loss_mask == 0, self.ignore_index)
        sequence_parallel = output_layer.sequence_parallel
        seq_length = hidden_states.shape[0] * (
            torch.distributed.get_world_size(output_layer.tp_group) if sequence_parallel else 1
        )
        if tuple(tokens.shape) != (hidden_states.shape[1], seq_length):
            raise ValueError(
                f"{type(self).__name__}: tokens {tuple(tokens.shape)} do not match hidden states "
                f"{tuple(hidden_states.shape)} (tokens are [b, s], hidden states [s, b, h] per rank)"
            )
        weight = output_weight if output_weight is not None else output_layer.weight
        # Work in the model's [s, b] layout and transpose only the small per-token results.
        per_token = self._per_token(hidden_states, output_layer, weight, tokens.t())
        return {name: t.t().contiguous() for name, t in zip(self.output_names, per_token)}

    def _tokens(self, labels, context):
        context_tokens = context.get("tokens") if isinstance(context, dict) else None
        if (labels is None) == (context_tokens is None):
            raise ValueError(
                f"{type(self).__name__}: give the chosen tokens once, as the model's labels or as "
                "output_processor_context={'tokens': tokens}"
                + (" (got both)" if labels is not None else " (got neither)")
            )
        return labels if labels is not None else context_tokens

    def _per_token(self, hidden_states, output_layer, weight, tokens):
        """[s, b] logprobs, then entropy and values as asked, from [s(/tp), b, h] hidden states."""
        tp_group = output_layer.tp_group
        sequence_parallel = output_layer.sequence_parallel
        if sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=tp_group)
        result = fused_rl_ops.chosen_logprob(
            hidden_states, weight, tokens,
            temperature=self.temperature,
            ignore_index=self.ignore_index,
            vocab_size=self.vocab_size,
            tp_group=tp_group,
            reduce_hidden_grad=not sequence_parallel,
            return_entropy=self.return_entropy,
        )
        per_token = tuple(result) if self.return_entropy else (result,)
        if self.value_head is None:
            return per_token
        if sequence_parallel:
            # Every TP rank computes the same value loss from the gathered states, so each holds the
            # full gradient, and the gather's backward sums over the ranks: hence 1/tp.
            hidden_states = _ScaleGrad.apply(hidden_states, 1.0 / torch.distributed.get_world_size(tp_group))
        return per_token + (self._apply_value_head(hidden_states),)

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


def rl_output_processor(*, temperature=1.0, return_entropy=True, value_head=None, ignore_index=-100,
                        vocab_size=None):
    """An output processor returning fp32 [b, s] logprobs (+ entropy, values); see the module docstring."""
    return RLOutputProcessor(
        temperature=temperature,
        return_entropy=return_entropy,
        value_head=value_head,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
    )


# ----------------------------------------------------------------------------------- registration

_ATTACHMENT = "_fused_rl_ops_output_processor_undo"


def attach(model, processor):
    """Makes every forward (and schedule plan) of `model` use `processor`; see the module docstring."""
    language_model = unwrap_model(model)
    if getattr(language_model, _ATTACHMENT, None) is not None:
        raise RuntimeError("attach: this model already has an output processor attached; detach it first")
    if "output_processor" in inspect.signature(language_model.forward).parameters:
        undo = _attach_through_native_hook(language_model, processor)
    else:
        undo = _attach_by_substituting_output_layer(language_model, processor)
    setattr(language_model, _ATTACHMENT, undo)


def detach(model):
    """Removes what `attach` added; the model computes its own output again."""
    language_model = unwrap_model(model)
    undo = getattr(language_model, _ATTACHMENT, None)
    if undo is None:
        raise RuntimeError("detach: no output processor is attached to this model")
    for step in undo:
        step()
    delattr(language_model, _ATTACHMENT)


def _refuse_explicit_processor(kwargs):
    if kwargs.get("output_processor") is not None:
        raise ValueError("an output processor is attached to this model; detach it before passing output_processor=")


def _attach_through_native_hook(model, processor):
    def add_processor(module, args, kwargs):
        _refuse_explicit_processor(kwargs)
        return args, {**kwargs, "output_processor": processor}

    hook = model.register_forward_pre_hook(add_processor, with_kwargs=True)
    build_schedule_plan = model.build_schedule_plan  # the class's method, bound to this model

    def build_schedule_plan_with_processor(*args, **kwargs):
        _refuse_explicit_processor(kwargs)
        plan_processor = _SchedulePlanProcessor(processor, _final_layernorm_skipped_by_schedule_plan(model))
        return build_schedule_plan(*args, output_processor=plan_processor, **kwargs)

    # An instance attribute shadows the class's method for this model only; detach deletes it.
    model.build_schedule_plan = build_schedule_plan_with_processor
    return [hook.remove, functools.partial(delattr, model, "build_schedule_plan")]


def _final_layernorm_skipped_by_schedule_plan(model):
    """The final layernorm when megatron-core's schedule plan would skip it, else None.

    In megatron-core 0.19.2 the plan applies decoder.final_layernorm in the MoE combine node of the
    last layer, or in the post-process node when this stage has no layers; a dense last layer
    applies none (the forward path applies it in TransformerBlock).
    """
    decoder = model.decoder
    final_layernorm = getattr(decoder, "final_layernorm", None)
    if final_layernorm is None or len(decoder.layers) == 0 or getattr(decoder.layers[-1], "is_moe_layer", False):
        return None
    return final_layernorm


class _SchedulePlanProcessor:
    """What `attach` passes to build_schedule_plan: restores the skipped final layernorm, and
    returns the processor's dict as a tuple, since the plan's nodes carry only tensors."""

    def __init__(self, processor, final_layernorm):
        self.processor = processor
        self.final_layernorm = final_layernorm

    def __call__(self, *, hidden_states, **kwargs):
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        outputs = self.processor(hidden_states=hidden_states, **kwargs)
        return tuple(outputs.values()) if isinstance(outputs, dict) else outputs


class _ProcessorOutputLayer(torch.nn.Module):
    """Takes a hook-less model's output layer's place for one forward: runs the processor on the
    hidden states and keeps its outputs; returns an empty [s, b, 0] "logits" tensor to the model."""

    def __init__(self, output_layer, processor, context, loss_mask, config):
        super().__init__()
        self.output_layer = output_layer
        self.processor = processor
        self.context = context
        self.loss_mask = loss_mask
        self.config = config
        self.outputs = None

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        self.outputs = self.processor(
            hidden_states=hidden_states,
            output_layer=self.output_layer,
            output_weight=weight,
            labels=None,
            loss_mask=self.loss_mask,
            runtime_gather_output=runtime_gather_output,
            context=self.context,
            config=self.config,
        )
        return hidden_states.new_empty(*hidden_states.shape[:2], 0), None


def _attach_by_substituting_output_layer(model, processor):
    if getattr(model.config, "mtp_num_layers", None):
        raise ValueError(
            "attach: multi-token prediction calls the output layer for its own loss; a model "
            "without megatron-core's output_processor hook cannot use it with a processor"
        )
    forward_signature = inspect.signature(model.forward)

    def substitute_output_layer(module, args, kwargs):
        kwargs = dict(kwargs)
        context = kwargs.pop("output_processor_context", None)
        call = forward_signature.bind(*args, **kwargs).arguments
        if call.get("labels") is not None:
            raise ValueError(
                f"{type(module).__name__} with an attached output processor: do not pass labels "
                "(the model would compute its own loss over the processor's outputs); pass the "
                "tokens as output_processor_context={'tokens': tokens}"
            )
        if module.post_process:
            module.output_layer = _ProcessorOutputLayer(
                module.output_layer, processor, context, call.get("loss_mask"), module.config
            )
        return args, kwargs

    def restore_output_layer(module, args, output):
        substitute = module._modules.get("output_layer")
        if not isinstance(substitute, _ProcessorOutputLayer):
            return output  # a stage without an output layer: hidden states for the next stage
        module.output_layer = substitute.output_layer
        if substitute.outputs is None:
            raise RuntimeError(f"{type(module).__name__} did not reach its output layer; no processor outputs")
        return substitute.outputs

    pre_hook = model.register_forward_pre_hook(substitute_output_layer, with_kwargs=True)
    # always_call: the original output layer comes back even when forward raises.
    post_hook = model.register_forward_hook(restore_output_layer, always_call=True)
    return [pre_hook.remove, post_hook.remove]


# ------------------------------------------------------------------------------ clamped SwiGLU MLP


def _gate_alpha(config):
    """The sigmoid slope of the config's GLU gate: silu(g) = g * sigmoid(g), quick_gelu: 1.702."""
    if not config.gated_linear_unit:
        raise ValueError("ClampedSwiGLUMLP needs config.gated_linear_unit=True")
    if config.activation_func is F.silu:
        return 1.0
    # megatron-core has two quick_gelu functions; configs may name either.
    if config.activation_func in (activations.quick_gelu, fused_bias_geglu.quick_gelu):
        return 1.702
    raise ValueError(
        f"ClampedSwiGLUMLP supports a silu or quick_gelu gate, got config.activation_func={config.activation_func}"
    )


class ClampedSwiGLUMLP(MLP):
    """Megatron's MLP with the gated activation computed by fused_rl_ops.clamped_swiglu.

    Same submodules, parameters and [gate | linear] fc1 layout per TP rank as MLP; the activation
    follows config.activation_func (gate), activation_func_clamp_value and glu_linear_offset. One
    difference from Megatron's torch.clamp: an input exactly on the limit keeps its gradient.
    """

    def __init__(self, config, submodules, **kwargs):
        super().__init__(config, submodules, **kwargs)
        self.gate_alpha = _gate_alpha(config)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise NotImplementedError("ClampedSwiGLUMLP is a dense MLP; per_token_scale (experts) is not supported")
        intermediate, fc1_bias = self.linear_fc1(hidden_states)
        if fc1_bias is not None:
            intermediate = intermediate + fc1_bias
        intermediate = fused_rl_ops.clamped_swiglu(
            intermediate,
            self.config.activation_func_clamp_value,
            alpha=self.gate_alpha,
            linear_offset=self.config.glu_linear_offset,
        )
        return self.linear_fc2(intermediate)


def with_clamped_swiglu_mlp(spec):
    """A copy of a GPT / hybrid layer or block spec with every dense Megatron MLP a ClampedSwiGLUMLP."""
    replaced = []

    def swap(node):
        if isinstance(node, functools.partial) and node.func == MLP.as_mlp_submodule:
            replaced.append(node)
            return functools.partial(ClampedSwiGLUMLP.as_mlp_submodule, *node.args, **node.keywords)
        if isinstance(node, ModuleSpec) and node.module is MLP:
            # The form TransformerLayer itself rewraps into MLP.as_mlp_submodule.
            replaced.append(node)
            return functools.partial(ClampedSwiGLUMLP.as_mlp_submodule, submodules=node.submodules, **node.params)
        if isinstance(node, (list, tuple)):
            return type(node)(swap(item) for item in node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            fields = {f.name: swap(getattr(node, f.name)) for f in dataclasses.fields(node) if f.init}
            return dataclasses.replace(node, **fields)
        return node

    swapped = swap(spec)
    if not replaced:
        raise ValueError("with_clamped_swiglu_mlp: the spec has no dense megatron MLP to replace")
    return swapped
