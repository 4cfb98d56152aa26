"""The pieces of a tiny PPO step that examples/ppo_step.py runs and the Megatron tests check: a
rollout as a sampler and critic would hand it over, scored as a trainer scores it (position t on
token t + 1: shifted_labels, score), a clipped PPO loss with an entropy bonus and a
value loss, one forward-backward through a model with an attached output processor, and a training
step of a model inside Megatron's DistributedDataParallel with a torch optimizer."""
import torch
import torch.distributed as dist

CLIP = 0.2
ENTROPY_COEFF = 0.01
VALUE_COEFF = 0.5


def ppo_loss(outputs, rollout):
    """Clipped surrogate, minus an entropy bonus, plus a value loss; averaged over rollout["mask"]
    without the tokens the sampler's filter (top_k / top_p) drops: their logprob is -inf, and
    exp(-inf - -inf) would make the loss NaN."""
    logprobs, old_logprobs = outputs["logprobs"], rollout["old_logprobs"]
    mask = rollout["mask"] * ~(torch.isneginf(logprobs) | torch.isneginf(old_logprobs))
    ratio = torch.exp(torch.where(mask > 0, logprobs - old_logprobs, 0.0))
    advantages = rollout["advantages"]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    value_error = (outputs["values"] - rollout["returns"]) ** 2
    per_token = -surrogate - ENTROPY_COEFF * outputs["entropy"] + VALUE_COEFF * value_error
    return (per_token * mask).sum() / mask.sum()


def shifted_labels(tokens, ignore_index=-100):
    """The labels a trainer scores sampled tokens with: the output at position t predicts token
    t + 1, so label t is token t + 1, and each sequence's last position (nothing follows) is
    ignore_index."""
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = ignore_index
    return labels


def make_rollout(tokens, old_logprobs, seed):
    """What a sampler and a critic would hand the trainer; identical on every rank. Each position is
    scored on the token that follows it (shifted_labels(tokens)); the response part of each sequence
    is in the mask, except its last position, which has no label."""
    generator = torch.Generator().manual_seed(seed)
    batch, seq = tokens.shape
    labels = shifted_labels(tokens)
    mask = torch.zeros(batch, seq)
    mask[:, seq // 4 :] = 1.0  # the response part of each sequence
    mask[labels == -100] = 0.0
    return {
        "tokens": tokens,
        "labels": labels,
        "old_logprobs": old_logprobs + 0.1 * torch.randn(batch, seq, generator=generator),
        "advantages": torch.randn(batch, seq, generator=generator),
        "returns": torch.randn(batch, seq, generator=generator),
        "mask": mask,
    }


def score(model, tokens):
    """The attached processor's outputs for [b, s] tokens as a trainer scores a rollout: each
    position on the token that follows it (shifted_labels)."""
    return model(tokens, *model_inputs(tokens), labels=shifted_labels(tokens))


def model_inputs(tokens):
    """Position ids and a causal attention mask for [b, s] tokens."""
    batch, seq = tokens.shape
    position_ids = torch.arange(seq).expand(batch, seq)
    attention_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).expand(batch, 1, seq, seq)
    return position_ids, attention_mask


def allreduce_sequence_parallel_grads(model):
    """With sequence parallel, replicated parameters (norms) hold per-rank partial gradients
    (Megatron's finalize_model_grads sums them; this is that step without its DDP wrapper)."""
    if not model.config.sequence_parallel:
        return
    from megatron.core import parallel_state

    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


def forward_backward(model, rollout, **forward_kwargs):
    """The attached processor's outputs and the PPO loss, after backward; forward_kwargs go to the
    model's forward (e.g. output_processor= for a model without an attached one)."""
    position_ids, attention_mask = model_inputs(rollout["tokens"])
    outputs = model(rollout["tokens"], position_ids, attention_mask, labels=rollout["labels"], **forward_kwargs)
    loss = ppo_loss(outputs, rollout)
    loss.backward()
    allreduce_sequence_parallel_grads(model)
    return outputs, loss


def ddp_train_step(ddp_model, optimizer, rollout):
    """One PPO step of a model inside Megatron's DistributedDataParallel, with a torch optimizer over
    its parameters: forward-backward, Megatron's finalize_model_grads (the data-parallel reduction
    of every gradient, the TP all-reduce of sequence-parallel norms' partial ones), then each
    main_grad handed to the optimizer as param.grad (as Megatron's own optimizer does) and a step.
    Returns the processor's outputs and the loss."""
    from megatron.core.distributed import finalize_model_grads

    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    outputs, loss = forward_backward(ddp_model, rollout)
    finalize_model_grads([ddp_model])
    for param in ddp_model.parameters():
        param.grad = param.main_grad
    optimizer.step()
    return outputs, loss
