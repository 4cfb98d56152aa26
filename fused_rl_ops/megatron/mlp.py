"""The clamped SwiGLU MLP for megatron-core (tested with 0.18 and 0.19): ClampedSwiGLUMLP (dense MLPs and MoE
experts, routing weights fused), ClampedSwiGLUSequentialMLP (SequentialMLP with those experts),
ClampedSwiGLUTEGroupedMLP (grouped-GEMM experts with a SiLU gate),
with_clamped_swiglu_mlp, which puts them into a layer or block spec, and check_clamp_not_dropped,
which refuses a model whose configured clamp some module would silently ignore."""
import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core import activations
from megatron.core.fusions import fused_bias_geglu
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import InferenceGroupedMLP, SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec

import fused_rl_ops

__all__ = [
    "ClampedSwiGLUMLP",
    "ClampedSwiGLUSequentialMLP",
    "ClampedSwiGLUTEGroupedMLP",
    "ClampedSwiGLUNotAppliedError",
    "check_clamp_not_dropped",
    "with_clamped_swiglu_mlp",
]

# megatron-core has two quick_gelu functions; configs may name either.
_QUICK_GELUS = (activations.quick_gelu, fused_bias_geglu.quick_gelu)


def _gate_alpha(config):
    """The sigmoid slope of the config's GLU gate: silu(g) = g * sigmoid(g), quick_gelu: 1.702."""
    if not config.gated_linear_unit:
        raise ValueError("ClampedSwiGLUMLP needs config.gated_linear_unit=True")
    if config.activation_func is F.silu:
        return 1.0
    if config.activation_func in _QUICK_GELUS:
        return 1.702
    raise ValueError(
        f"ClampedSwiGLUMLP supports a silu or quick_gelu gate, got config.activation_func={config.activation_func}"
    )


class ClampedSwiGLUMLP(MLP):
    """Megatron's MLP with the gated activation computed by fused_rl_ops.clamped_swiglu.

    Same submodules, parameters and [gate | linear] fc1 layout per TP rank as MLP; the activation
    follows config.activation_func (gate), activation_func_clamp_value and glu_linear_offset, and
    config's activation fusion settings are not used. As an MoE expert it takes the routing
    weights (per_token_scale, [tokens]) as MLP does: the activation is multiplied by them inside
    the op (in fp32, rounded once; weights neither float32 nor the activation's dtype are taken in
    float32), and an fc2 bias is added times the weight. One difference from Megatron's
    torch.clamp: an input exactly on the limit keeps its gradient.
    """

    def __init__(self, config, submodules, **kwargs):
        super().__init__(config, submodules, **kwargs)
        _gate_alpha(config)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        intermediate, fc1_bias = self.linear_fc1(hidden_states)
        if fc1_bias is not None:
            intermediate = intermediate + fc1_bias
        scale = per_token_scale
        if scale is not None and scale.dtype not in (torch.float32, intermediate.dtype):
            scale = scale.float()
        intermediate = fused_rl_ops.clamped_swiglu(
            intermediate,
            self.config.activation_func_clamp_value,
            alpha=_gate_alpha(self.config),
            linear_offset=self.config.glu_linear_offset,
            scale=scale,
        )
        output, output_bias = self.linear_fc2(intermediate)
        if per_token_scale is not None and output_bias is not None:
            # As MLP.forward for an expert: the bias scaled by the routing weight, added here (in the
            # promoted dtype, rounded to the output's) rather than by the layer's bias-dropout-add.
            output = (output + output_bias * per_token_scale.unsqueeze(-1)).to(output.dtype)
            output_bias = None
        return output, output_bias


class ClampedSwiGLUSequentialMLP(SequentialMLP):
    """megatron-core's SequentialMLP whose experts are ClampedSwiGLUMLPs.

    SequentialMLP builds its experts as MLP itself (not from the spec), so they are built as usual
    (same parameters, same initialisation) and then given ClampedSwiGLUMLP's forward by their class:
    ClampedSwiGLUMLP adds no state to MLP.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _gate_alpha(self.config)
        for expert in self.local_experts:
            if type(expert) is not MLP:
                raise TypeError(f"ClampedSwiGLUSequentialMLP: expected MLP experts, got {type(expert).__name__}")
            expert.__class__ = ClampedSwiGLUMLP


class ClampedSwiGLUNotAppliedError(ValueError):
    """A spec or model where the configured clamp would not be applied (or not by clamped_swiglu)."""


class ClampedSwiGLUTEGroupedMLP(TEGroupedMLP):
    """megatron-core's TEGroupedMLP (grouped-GEMM experts) with its activation computed by clamped_swiglu.

    The one hook megatron-core 0.19.2 gives TEGroupedMLP's activation is self.activation_func, which its
    forward calls on fc1's output (bias added) when config.use_te_activation_func is True, multiplying
    by the routing weights itself afterwards (in the activation's dtype). TransformerConfig allows that
    flag only for a gelu, silu or relu gate, so this serves SiLU-gated clamped experts (DeepSeek-V4
    style); it refuses, naming what to use instead, a quick-GELU gate (gpt-oss: use SequentialMLP
    experts, moe_grouped_gemm=False), use_te_activation_func=False, Transformer Engine's op fuser
    (use_transformer_engine_op_fuser) and interleaved GLU weights (moe_mlp_glu_interleave_size).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config
        if config.activation_func in _QUICK_GELUS:
            problem = ("a quick-GELU gate (gpt-oss) reaches no activation hook in TEGroupedMLP (TransformerConfig "
                       "refuses use_te_activation_func for it): build the spec with moe_grouped_gemm=False "
                       "(SequentialMLP experts)")
        elif not config.use_te_activation_func:
            problem = "set use_te_activation_func=True: it is TEGroupedMLP's only activation hook"
        elif self._with_fused_impl:
            problem = "Transformer Engine's op fuser has no activation hook: set use_transformer_engine_op_fuser=False"
        elif config.moe_mlp_glu_interleave_size is not None:
            problem = "interleaved GLU weights bypass the hook: set moe_mlp_glu_interleave_size=None"
        else:
            _gate_alpha(config)
            del self.activation_func  # Transformer Engine's activation module, when the spec built one
            self.activation_func = functools.partial(
                fused_rl_ops.clamped_swiglu,
                limit=config.activation_func_clamp_value,
                alpha=1.0,
                linear_offset=config.glu_linear_offset,
            )
            return
        raise ClampedSwiGLUNotAppliedError(f"ClampedSwiGLUTEGroupedMLP cannot apply clamped_swiglu: {problem}")


def _refuse_grouped_gemm_experts(cls):
    if issubclass(cls, InferenceGroupedMLP):
        why = "whose inference kernels take no activation hook"
    else:
        why = "a TEGroupedMLP subclass with_clamped_swiglu_mlp does not know how to replace"
    raise ClampedSwiGLUNotAppliedError(
        f"with_clamped_swiglu_mlp: the MoE experts are {cls.__name__}, {why}: use TEGroupedMLP "
        "(moe_grouped_gemm=True) or SequentialMLP experts (moe_grouped_gemm=False)"
    )


# megatron-core's expert classes and the classes with_clamped_swiglu_mlp puts in their place.
_CLAMPED_EXPERTS = {SequentialMLP: ClampedSwiGLUSequentialMLP, TEGroupedMLP: ClampedSwiGLUTEGroupedMLP}
# What a spec holds once with_clamped_swiglu_mlp has replaced a module: taken as already replaced.
_ALREADY_CLAMPED = (ClampedSwiGLUMLP, ClampedSwiGLUMLP.as_mlp_submodule, *_CLAMPED_EXPERTS.values())


def with_clamped_swiglu_mlp(spec):
    """A copy of a GPT / hybrid layer or block spec with every dense Megatron MLP a ClampedSwiGLUMLP and
    every SequentialMLP (MoE experts) a ClampedSwiGLUSequentialMLP, and every TEGroupedMLP (grouped-GEMM
    experts) a ClampedSwiGLUTEGroupedMLP, which refuses, when built, configs its hook cannot serve
    (see there); InferenceGroupedMLP is refused with ClampedSwiGLUNotAppliedError. Shared experts keep
    megatron-core's MLP, and check_clamp_not_dropped runs on each when it is built: every MLP of a
    model built from the returned spec applies its configured clamp, or the build raises. A spec
    this function already returned is returned as it is."""
    replaced = []

    def swap(node):
        if isinstance(node, functools.partial):
            if node.func in _ALREADY_CLAMPED:
                replaced.append(node)
                return node
            if node.func == MLP.as_mlp_submodule:
                replaced.append(node)
                return functools.partial(ClampedSwiGLUMLP.as_mlp_submodule, *node.args, **node.keywords)
            if node.func in _CLAMPED_EXPERTS:
                replaced.append(node)
                return functools.partial(_CLAMPED_EXPERTS[node.func], *node.args, **node.keywords)
            if isinstance(node.func, type) and issubclass(node.func, TEGroupedMLP):
                _refuse_grouped_gemm_experts(node.func)
            # e.g. partial(MoELayer, submodules=MoESubmodules(experts=...)): look inside.
            return functools.partial(node.func, *swap(node.args), **{k: swap(v) for k, v in node.keywords.items()})
        if isinstance(node, ModuleSpec):
            if node.module in _ALREADY_CLAMPED:
                replaced.append(node)
                return node
            if node.module is MLP:
                # The form TransformerLayer itself rewraps into MLP.as_mlp_submodule.
                replaced.append(node)
                return functools.partial(ClampedSwiGLUMLP.as_mlp_submodule, submodules=node.submodules, **node.params)
            if node.module in _CLAMPED_EXPERTS:
                replaced.append(node)
                return dataclasses.replace(node, module=_CLAMPED_EXPERTS[node.module])
            if isinstance(node.module, type) and issubclass(node.module, TEGroupedMLP):
                _refuse_grouped_gemm_experts(node.module)
        if isinstance(node, (list, tuple)):
            return type(node)(swap(item) for item in node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            fields = {f.name: swap(getattr(node, f.name)) for f in dataclasses.fields(node) if f.init}
            if isinstance(node, MoESubmodules) and node.shared_experts is not None:
                fields["shared_experts"] = functools.partial(_build_and_check, node.shared_experts)
            return dataclasses.replace(node, **fields)
        return node

    swapped = swap(spec)
    if not replaced:
        raise ValueError(
            "with_clamped_swiglu_mlp: the spec has no dense megatron MLP, SequentialMLP or TEGroupedMLP experts to "
            "replace"
        )
    return swapped


def _build_and_check(build, **kwargs):
    """Builds a module the spec keeps as megatron-core's (shared experts) and checks its clamp."""
    module = build(**kwargs)
    check_clamp_not_dropped(module, prefix=kwargs.get("name") or "")
    return module


def _why_clamp_is_dropped(module):
    """How megatron-core 0.19.2 would run `module` without its config's activation_func_clamp_value
    (one sentence naming the config field to change), or None when the clamp is applied."""
    config = module.config
    gate = config.activation_func
    if isinstance(module, (ClampedSwiGLUMLP, ClampedSwiGLUTEGroupedMLP)):
        return None  # clamped_swiglu applies it, whatever the fusion settings
    if isinstance(module, TEGroupedMLP):
        if isinstance(module, InferenceGroupedMLP) and gate is F.silu:
            return ("in inference mode its grouped kernels (FlashInfer, vLLM) take a SiLU activation type and no "
                    "clamp: serve it with another experts module")
        if module._with_fused_impl and gate is F.silu:
            return ("Transformer Engine's op fuser (ScaledSwiGLU) takes no clamp: set "
                    "use_transformer_engine_op_fuser=False")
    elif isinstance(module, MLP):
        if hasattr(type(module), "_make_fused_impl"):
            return ("Transformer Engine's op-fuser MLP (SwiGLU / GEGLU ops) takes no clamp: use megatron-core's "
                    "MLP (get_gpt_layer_local_spec or use_te_op_fuser=False) with with_clamped_swiglu_mlp")
        if isinstance(module, SharedExpertMLP) and config.moe_shared_expert_overlap:
            return ("the overlapped shared-expert path (linear_fc1_forward_and_act) applies neither the clamp nor "
                    "glu_linear_offset: set moe_shared_expert_overlap=False")
    else:
        return None
    # The activation code MLP.forward and TEGroupedMLP.forward share.
    if config.use_te_activation_func:
        return "Transformer Engine's activation module takes no clamp: set use_te_activation_func=False"
    # TEGroupedMLP takes its unfused (clamping) path for interleaved GLU weights even when fusion is on.
    interleaved_grouped = isinstance(module, TEGroupedMLP) and config.moe_mlp_glu_interleave_size is not None
    if config.bias_activation_fusion and not interleaved_grouped:
        if gate not in _QUICK_GELUS:
            return ("the fused bias_swiglu / bias_geglu kernels take no clamp (only quick_gelu's does): set "
                    "bias_activation_fusion=False, or use with_clamped_swiglu_mlp")
        # Routed experts (TEGroupedMLP, SequentialMLP's MLPs) take the weighted kernel; a dense MLP raises.
        expert = isinstance(module, TEGroupedMLP) or getattr(module.linear_fc1, "is_expert", False)
        if config.add_bias_linear and expert:
            return ("the fused weighted quick-GEGLU kernel clamps fc1's output before adding fc1's bias (the "
                    "unfused path clamps the sum): set bias_activation_fusion=False, or use with_clamped_swiglu_mlp")
    if not config.gated_linear_unit:
        return "only a gated (GLU) MLP clamps: set gated_linear_unit=True, or activation_func_clamp_value=None"
    return None


def check_clamp_not_dropped(model, prefix=""):
    """Raises ClampedSwiGLUNotAppliedError when any MLP or MoE experts module of `model` has a config
    with activation_func_clamp_value set but would run a path of megatron-core 0.19.2 that ignores
    it: the fused bias_swiglu / bias_geglu kernels (bias_activation_fusion with a SiLU or GELU gate),
    the fused weighted quick-GEGLU kernel with an fc1 bias (it clamps before adding the bias),
    Transformer Engine's activation modules (use_te_activation_func) and op-fuser MLP, TEGroupedMLP's
    op-fuser ScaledSwiGLU, InferenceGroupedMLP's inference kernels with a SiLU gate, the
    overlapped shared-expert path (moe_shared_expert_overlap), and non-gated MLPs. The message
    names every such module and the config field to change. ClampedSwiGLUMLP experts and MLPs
    always clamp. prefix: prepended to the module names in the message. Returns the model."""
    problems = []
    for name, module in model.named_modules(prefix=prefix):
        config = getattr(module, "config", None)
        if getattr(config, "activation_func_clamp_value", None) is None:
            continue
        reason = _why_clamp_is_dropped(module)
        if reason is not None:
            problems.append(f"  {name or '<model>'} ({type(module).__name__}): {reason}")
    if problems:
        raise ClampedSwiGLUNotAppliedError(
            "activation_func_clamp_value is set, but these modules would run without the clamp:\n" + "\n".join(problems)
        )
    return model
