"""Test-only helpers that run megatron-core 0.18 and 0.19 on CPU / gloo, and tiny models to test with.

In a process whose default group is initialised (fused_rl_ops.testing.distributed.run_distributed):

    set_parallel_degrees(tp=2)         # installs the CPU shims, (re)initialises parallel_state
    model = tiny_model("gpt", tiny_config(sequence_parallel=True), clamped_swiglu_mlp=True)
    logits = full_vocab_logits(build_tiny_gpt(seed=1), tokens)  # [batch, seq, vocab]

The shims (install_cpu_shims says what each replaces) make megatron-core's CUDA-only calls in the
forward, schedule-plan, pipeline-parallel, HybridModel, DDP gradient-reduction and optimizer
(Float16OptimizerWithFloat16Params, DistributedOptimizer) paths run on the CPU, and let torch's
LayerNorm (the fallback without Apex) run with sequence parallel. They patch megatron-core
process-wide, so only tests and examples import them. megatron_bf16_training wraps a model and
builds megatron-core's optimizer as a bf16 run does.
"""
import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_installed = False


class _NoopEvent:
    """Stands in for torch.cuda.Event: the schedule plan records and waits on it between nodes."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass


class _NoopStream:
    """Stands in for torch.cuda.current_stream(): Megatron's DDP makes it wait on CUDA-graph events
    before reducing gradients (there are none on the CPU)."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


def _is_cuda(device):
    return isinstance(device, int) or torch.device(device).type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Turns device=<cuda> arguments into the CPU (pipeline p2p buffers are allocated on the current
    CUDA device; the mixed-precision optimizers make their scalars with device='cuda'), and makes
    tensor.type() name the CUDA tensor type (megatron-core's optimizer wrappers and gradient
    clipping accept only parameters whose type string is torch.cuda.FloatTensor, HalfTensor or
    BFloat16Tensor; nothing else in megatron-core or torch's eager paths reads that string)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if kwargs.get("device") is not None and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def install_cpu_shims():
    """Makes megatron-core's forward, schedule-plan, pipeline, HybridModel, DDP gradient-reduction
    and mixed-precision optimizer paths run on the CPU. Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    from megatron.core import utils
    from megatron.core.models.common import model_chunk_schedule_plan
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # The global memory buffer is a CUDA tensor, and the RNG tracker forks the CUDA RNG.
    def cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype)

    utils.GlobalMemoryBuffer.get_tensor = cpu_get_tensor
    random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()

    # Schedule plan: no CUDA events or streams on the CPU.
    torch.cuda.Event = _NoopEvent
    for module in (pp_utils, model_chunk_schedule_plan):
        module.get_comp_stream = lambda: None
        module.get_comm_stream = lambda: None
    plan_cls = model_chunk_schedule_plan.TransformerModelChunkSchedulePlan
    plan_cls.record_current_stream = lambda self: None
    plan_cls.wait_current_stream = lambda self: None
    torch.Tensor.record_stream = lambda self, stream: None

    # DDP's gradient reduction (finish_grad_sync) asks for the current stream.
    torch.cuda.current_stream = lambda device=None: _NoopStream()

    # Pipeline parallel: p2p buffers and the current device; the optimizers' scalars and the type
    # strings their wrappers check. The mode stays on for the process.
    torch.cuda.current_device = lambda: "cpu"
    _CudaToCpuMode().__enter__()

    # HybridModel: its final norm is hard-wired to Transformer Engine's.
    hybrid_block.TENorm = WrappedTorchNorm

    # Sequence parallel: torch's norm refuses it only because it does not mark its parameters
    # as sequence-parallel (their gradients are per-rank partial sums), as Apex's norm does.
    build_torch_norm = WrappedTorchNorm.__new__

    def sequence_parallel_torch_norm(cls, config, hidden_size, *args, **kwargs):
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = build_torch_norm(cls, config_without_sp, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = sequence_parallel_torch_norm


def set_parallel_degrees(tp: int, pp: int = 1, ep: int = 1, expert_tp=None, cp: int = 1):
    """Installs the shims and (re)initialises megatron-core's parallel state over the default group
    with TP degree tp, pp pipeline stages, cp context-parallel ranks, and for MoE layers ep
    expert-parallel ranks and expert TP degree expert_tp (default: tp) (the remaining ranks are
    data-parallel replicas)."""
    from megatron.core import parallel_state

    install_cpu_shims()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
    )


def tiny_config(**overrides):
    """A 2-layer, hidden-32 TransformerConfig at the current TP / PP / CP / EP / expert-TP degrees, no
    fusions, no dropout."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    settings = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        batch_p2p_comm=False,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def megatron_bf16_training(model, *, distributed_optimizer: bool, lr: float = 1e-3, processor=None,
                           ddp_settings=None, **optimizer_settings):
    """model (built from a config with bf16=True) set up as a bf16 Megatron run sets it up: inside
    Float16Module (bf16 parameters) and Megatron's DistributedDataParallel (gradients reduced in
    fp32), trained by the optimizer megatron.core.optimizer.get_megatron_optimizer builds (a
    ChainedOptimizer of Adam with fp32 main parameters: a DistributedOptimizer, its state sharded
    over the data-parallel ranks, or Float16OptimizerWithFloat16Params; optimizer_settings go to its
    OptimizerConfig). processor: attached in between, as docs/rl_recipe.md does (a value head stays
    fp32). ddp_settings: more DistributedDataParallelConfig fields (overlap_param_gather...). Returns (ddp_model, optimizer); save_sharded / load_sharded take model itself and the
    optimizer. Needs the shims (set_parallel_degrees installs them)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from fused_rl_ops.megatron import attach

    bf16_model = Float16Module(model.config, model)
    if processor is not None:
        attach(bf16_model, processor)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               grad_reduce_in_fp32=True, **(ddp_settings or {}))
    ddp_model = DistributedDataParallel(model.config, ddp_config, bf16_model)
    config = OptimizerConfig(optimizer="adam", lr=lr, bf16=True, use_distributed_optimizer=distributed_optimizer,
                             **optimizer_settings)
    return ddp_model, get_megatron_optimizer(config, [ddp_model])


class SelfOnlyAttention(torch.nn.Module):
    """A core attention in which each position attends to itself alone: its output is its value.
    A model built with it (with_self_only_attention) computes every position on its own, so it runs
    at context parallel and on packed sequences on the CPU, where Megatron's local attention refuses
    both, and gives each position the same result however the sequence is split or packed."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, query, key, value, *args, **kwargs):
        return value.reshape(*value.shape[:-2], -1)  # [s, b, heads, d] -> [s, b, h]; THD [t, heads, d] -> [t, h]


def with_self_only_attention(layer_spec):
    """A copy of a GPT layer spec (get_gpt_layer_local_spec()) with SelfOnlyAttention as its core attention."""
    spec = copy.deepcopy(layer_spec)
    spec.submodules.self_attention.submodules.core_attention = SelfOnlyAttention
    return spec


def local_hybrid_stack_spec():
    """A HybridStack spec ("*" attention, "-" MLP layers) from Megatron's local, non-TE modules."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    gpt_layer = get_gpt_layer_local_spec().submodules
    attention = TransformerLayerSubmodules(
        input_layernorm=gpt_layer.input_layernorm,
        self_attention=gpt_layer.self_attention,
        self_attn_bda=gpt_layer.self_attn_bda,
    )
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt_layer.pre_mlp_layernorm, mlp=gpt_layer.mlp, mlp_bda=gpt_layer.mlp_bda
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        ),
    )


def tiny_model(kind="gpt", config=None, *, seed=0, vocab_size=256, tied_embeddings=False,
               clamped_swiglu_mlp=False, seq_length=16, edit_spec=None):
    """A GPTModel ("gpt") or a HybridModel ("hybrid": attention and MLP layers alternating) from
    Megatron's local (non-TE) modules with learned absolute positions, for this pipeline stage, at
    config's (default tiny_config()) TP degree and sequence-parallel setting. A GPT config with
    num_moe_experts gets megatron-core's local block spec (MoE layers as config.moe_layer_freq
    says, SequentialMLP experts); one with mtp_num_layers gets its local MTP block spec.
    clamped_swiglu_mlp: its MLPs are fused_rl_ops.megatron.ClampedSwiGLUMLP.
    edit_spec: a function of the spec giving the spec to build instead (after clamped_swiglu_mlp).
    Megatron builds every weight as a full master tensor from the CPU RNG and keeps this rank's
    shard, so a given seed means the same logical weights at every degree."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from fused_rl_ops.megatron import with_clamped_swiglu_mlp

    config = config or tiny_config()
    if kind != "gpt":
        spec = local_hybrid_stack_spec()
    elif config.num_moe_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec()
    if clamped_swiglu_mlp:
        spec = with_clamped_swiglu_mlp(spec)
    if edit_spec:
        spec = edit_spec(spec)
    common = dict(
        config=config,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=tied_embeddings,
        position_embedding_type="learned_absolute",  # HybridModel's RoPE moves a buffer to CUDA
    )
    torch.manual_seed(seed)
    if kind == "gpt":
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
        return GPTModel(transformer_layer_spec=spec, mtp_block_spec=mtp_spec, **common)
    if kind == "hybrid":
        return HybridModel(hybrid_stack_spec=spec, hybrid_layer_pattern="*-" * (config.num_layers // 2), **common)
    raise ValueError(f"tiny_model: kind is 'gpt' or 'hybrid', got {kind!r}")


def build_tiny_gpt(seed: int, *, hidden_size=32, num_layers=2, vocab_size=128, max_sequence_length=16,
                   num_attention_heads=4, ffn_hidden_size=64):
    """A GPTModel at the current TP degree: gated SiLU MLP (fc1 has partition stride 2), biases,
    untied output layer (tiny_model with these settings)."""
    config = tiny_config(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True,
    )
    return tiny_model("gpt", config, seed=seed, vocab_size=vocab_size, seq_length=max_sequence_length)


def full_vocab_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """model's logits [batch, seq, vocab] for tokens [batch, seq], gathered over the TP ranks here
    (Megatron's own gather allocates on CUDA). The causal mask is passed explicitly for the same
    reason."""
    from megatron.core import parallel_state

    seq_len = tokens.shape[1]
    positions = torch.arange(seq_len).expand_as(tokens)
    masked = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1).view(1, 1, seq_len, seq_len)
    local = model(tokens, positions, masked)  # [batch, seq, vocab / tp]
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)
