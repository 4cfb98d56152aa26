"""Test-only shims that let a tiny megatron-core GPTModel run on the CPU under gloo (NOTES section 2).

Use in a process whose default group is initialised (tests/dist_utils.run_distributed):

    install_cpu_shims()
    set_tensor_parallel_degree(2)
    model = build_tiny_gpt(seed=1)
    logits = full_vocab_logits(model, tokens)  # [batch, seq, vocab]

Not part of the package: the shims replace megatron-core functions process-wide.
"""
import contextlib

import torch
import torch.nn.functional as F


def install_cpu_shims():
    """Megatron allocates its global memory buffer and forks its RNG tracker on CUDA; on the CPU
    the buffer becomes a plain CPU tensor and the fork does nothing."""
    from megatron.core import utils
    from megatron.core.tensor_parallel import random

    def cpu_buffer(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype)

    def no_fork(self, name=None):
        return contextlib.nullcontext()

    utils.GlobalMemoryBuffer.get_tensor = cpu_buffer
    random.CudaRNGStatesTracker.fork = no_fork


def set_tensor_parallel_degree(tp: int):
    """(Re)initialises megatron-core's parallel state with TP degree tp over the default group
    (the remaining ranks are data-parallel replicas)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def full_vocab_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """model's logits [batch, seq, vocab] for tokens [batch, seq], gathered over the TP ranks here
    (Megatron's own gather allocates on CUDA). The causal mask is passed explicitly for the same
    reason."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    seq_len = tokens.shape[1]
    positions = torch.arange(seq_len).expand_as(tokens)
    masked = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1).view(1, 1, seq_len, seq_len)
    local = model(tokens, positions, masked)  # [batch, seq, vocab / tp]
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def build_tiny_gpt(seed: int, *, hidden_size=32, num_layers=2, vocab_size=128, max_sequence_length=16,
                   num_attention_heads=4, ffn_hidden_size=64):
    """A GPTModel at the current TP degree: gated SiLU MLP (fc1 has partition stride 2), biases,
    learned absolute positions, untied output layer; no fusions, no dropout. Megatron builds every
    weight as a full master tensor from the CPU RNG and keeps this rank's shard, so a given seed
    means the same logical weights at every degree."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length,
                    position_embedding_type="learned_absolute")
