"""What the Megatron integration tests (tests/megatron/) share: a batch identical on every
rank, the cases of a processor's checks at TP 2, a processor that records the hidden states it
gets, the hidden states a model feeds its output layer, parameter gradients by name and their
comparison, Megatron's own logprobs and gradients, and the float64 logprobs and entropy from hidden
states and the full output weight."""
import contextlib

import torch
import torch.distributed as dist
from megatron.core import package_info
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from torch.testing import assert_close

from fused_rl_ops.megatron import attach, rl_output_processor
from fused_rl_ops.reference.megatron import NaiveRLOutputProcessor
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model
from fused_rl_ops.testing.ppo import allreduce_sequence_parallel_grads, model_inputs

# megatron-core 0.18 (verl's) lacks what 0.19 added: MTP labels from the input ids, mtp_detach_heads,
# MTP acceptance counts, expert gradients reduced over the expert groups whenever expert TP != TP.
MEGATRON_0_18 = package_info.__version__.startswith("0.18.")
# MTPLossLoggingHelper's tracker keys of what it logs per MTP depth (0.18: the loss alone).
MTP_LOGGED = {"loss_values": "values"} if MEGATRON_0_18 else {key: key for key in ("loss_values", "correct_values",
                                                                                   "total_values")}
B, S = 2, 8  # b != s, so a [b, s] / [s, b] mix-up cannot pass
VOCAB = 256  # the model's (padded) vocabulary
REAL_VOCAB = 200  # the tokenizer's, for the padded-vocab checks


def make_batch(vocab=VOCAB, seed=0):
    """Tokens, position ids and a causal mask, identical on every rank."""
    tokens = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))
    return (tokens, *model_inputs(tokens))


def tp2_processor_cases(seed):
    """Sets TP 2, then yields (tokens [b, s] below REAL_VOCAB, coefficients [2, b, s], the tiny
    model's config) without and with sequence parallel: the same tensors on every rank and in both."""
    set_parallel_degrees(tp=2)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=g)
    coeff = torch.randn(2, B, S, generator=g)
    for sequence_parallel in (False, True):
        yield tokens, coeff, tiny_config(sequence_parallel=sequence_parallel, init_method_std=0.3)


def same_on_all_ranks(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class RecordingProcessor:
    """Wraps a processor and keeps the hidden states of every call; shows attach its value head."""

    def __init__(self, processor):
        self.processor = processor
        self.value_head = getattr(processor, "value_head", None)
        self.hidden_states = []

    def __call__(self, **kwargs):
        self.hidden_states.append(kwargs["hidden_states"].detach().clone())
        return self.processor(**kwargs)


@contextlib.contextmanager
def output_layer_inputs(model):
    """Collects the hidden states the model feeds its output layer."""
    inputs = []
    handle = model.output_layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
    try:
        yield inputs
    finally:
        handle.remove()


def grads_by_name(model):
    return {name: param.grad for name, param in model.named_parameters() if param.grad is not None}


def take_grads(model):
    """The model's parameter gradients by name; clears them."""
    grads = {name: grad.clone() for name, grad in grads_by_name(model).items()}
    model.zero_grad()
    return grads


def assert_close_by_name(actual, expected):
    """Dicts of named tensors (gradients, parameters) agree to fp32 rounding, relative to each tensor's scale."""
    assert actual.keys() == expected.keys() and expected
    for name, tensor in expected.items():
        assert_close(actual[name], tensor, rtol=1e-4, atol=1e-5 * tensor.abs().max().item() + 1e-9,
                     msg=lambda message: f"{name}: {message}")


def megatron_own(model, batch, coeff):
    """Megatron's own logprobs (-its cross entropy, from labels), the hidden states its output layer
    received, and the gradients of sum(coeff * logprobs)."""
    tokens, position_ids, attention_mask = batch
    with output_layer_inputs(model) as inputs:
        logprobs = -model(tokens, position_ids, attention_mask, labels=tokens)
    (coeff * logprobs).sum().backward()
    [hidden_states] = inputs
    return logprobs.detach(), hidden_states, take_grads(model)


def full_vocab_weight(weight_shard):
    """The output weight of all TP ranks (the default group's), concatenated along the vocab."""
    if not dist.is_initialized():
        return weight_shard.detach()
    shards = [torch.empty_like(weight_shard) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, weight_shard.detach().contiguous())
    return torch.cat(shards)


def float64_reference(hidden_states, weight, tokens, temperature=1.0, vocab_size=None):
    """Logprobs and entropy [b, s] in float64 from [s, b, h] hidden states and the full weight."""
    logits = hidden_states.double() @ weight[:vocab_size].double().t() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, tokens.t().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen.t(), entropy.t()


def logged_mtp_metrics():
    """MTPLossLoggingHelper's per-depth loss, correct and total (0.18: the loss alone) since the last
    call, those logged; empties its tracker (whose tensors keep the size of the first model's
    mtp_num_layers)."""
    tracker = MTPLossLoggingHelper.tracker
    metrics = {key: tracker[tracked].clone() for key, tracked in MTP_LOGGED.items() if tracked in tracker}
    tracker.clear()
    return metrics


def outputs_and_grads(model, tokens, coeff, **forward_kwargs):
    """The attached processor's outputs for [b, s] tokens (their own labels; forward_kwargs go to
    the model's forward) and every parameter's gradient of sum(coeff[0] * logprobs + coeff[1] *
    entropy), the gradients then zeroed. A -inf logprob (a token the sampler's filter drops) takes
    no part in the sum."""
    outputs = model(tokens, *model_inputs(tokens), labels=tokens, **forward_kwargs)
    logprobs = outputs["logprobs"]
    (coeff[0] * torch.where(logprobs.isneginf(), 0.0, logprobs) + coeff[1] * outputs["entropy"]).sum().backward()
    allreduce_sequence_parallel_grads(model)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return {name: t.detach() for name, t in outputs.items()}, grads


def assert_matches_naive_processor(config, options, tokens, coeff, what=""):
    """A tiny Megatron GPTModel of config with rl_output_processor(**options) attached, against its
    copy with the naive reference processor (fused_rl_ops.reference.megatron): the same outputs and
    every parameter's gradient (outputs_and_grads). Returns the fused model and its outputs."""
    fused, naive = tiny_model("gpt", config), tiny_model("gpt", config)
    naive.load_state_dict(fused.state_dict())
    attach(fused, rl_output_processor(**options))
    attach(naive, NaiveRLOutputProcessor(**options))
    (fused_outputs, fused_grads), (naive_outputs, naive_grads) = [outputs_and_grads(m, tokens, coeff)
                                                                  for m in (fused, naive)]
    assert list(fused_outputs) == list(naive_outputs), what
    for name in fused_outputs:
        assert_close(fused_outputs[name], naive_outputs[name], msg=lambda m: f"{what} {name}: {m}")
    assert fused_grads.keys() == naive_grads.keys() and "output_layer.weight" in fused_grads, what
    for name, grad in naive_grads.items():
        assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item() + 1e-9,
                     msg=lambda m: f"{what} {name}: {m}")
    return fused, fused_outputs
