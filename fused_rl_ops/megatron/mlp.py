"""ClampedSwiGLUMLP: Megatron's MLP with its gated activation computed by fused_rl_ops.clamped_swiglu,
and with_clamped_swiglu_mlp, which puts it into a layer or block spec."""
import dataclasses
import functools

import torch.nn.functional as F
from megatron.core import activations
from megatron.core.fusions import fused_bias_geglu
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

import fused_rl_ops

__all__ = ["ClampedSwiGLUMLP", "with_clamped_swiglu_mlp"]


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
