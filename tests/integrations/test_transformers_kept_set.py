"""causal_lm_logprobs(kept_ids=...) on a tiny Llama: the sampled tokens' logprobs renormalised over
the rollout sampler's kept sets, against the model's own logits in float64
(fused_rl_ops.reference.kept_set), values and every parameter's gradient; bad kept sets refused."""
import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers", reason="transformers is not installed")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from fused_rl_ops.reference.kept_set import kept_set_log_softmax  # noqa: E402
from fused_rl_ops.transformers import causal_lm_logprobs  # noqa: E402

VOCAB, K = 97, 8


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                         pad_token_id=0)
    return LlamaForCausalLM(config).double().eval()


def rollout(batch=3, seq=9):
    """input_ids, attention_mask (row 1 right-padded), labels (-100 on the prompt and padding) and
    kept_ids [batch, seq, K] unshifted like labels: each label in its set but one, -100 padding in one set."""
    g = torch.Generator().manual_seed(1)
    kept_ids = torch.stack([torch.randperm(VOCAB - 3, generator=g)[:K] + 3 for _ in range(batch * seq)])
    kept_ids = kept_ids.reshape(batch, seq, K)
    input_ids = kept_ids.gather(-1, torch.randint(0, K // 2, (batch, seq, 1), generator=g))[..., 0]
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, -3:] = 0
    input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :3] = -100
    kept_ids[0, 5, K // 2:] = -100
    input_ids[2, 6] = labels[2, 6] = next(v for v in range(3, VOCAB) if v not in kept_ids[2, 6])  # outside its set
    return input_ids, attention_mask, labels, kept_ids


def values_and_grads(model, compute, grad_logprob, grad_entropy):
    model.zero_grad(set_to_none=True)
    logprob, entropy = compute()
    ((torch.where(logprob.isneginf(), 0.0, logprob) * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    return logprob.detach(), entropy.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_kept_set_matches_the_model_logits():
    model = tiny_llama()
    input_ids, attention_mask, labels, kept_ids = rollout()
    g = torch.Generator().manual_seed(2)
    grad_logprob, grad_entropy = (torch.randn(3, 8, generator=g, dtype=torch.float64) for _ in range(2))

    def naive():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        target = labels[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
        logprob, entropy, _ = kept_set_log_softmax(logits / 0.7, target, kept_ids[:, 1:])
        return logprob, entropy

    expected = values_and_grads(model, naive, grad_logprob, grad_entropy)
    got = values_and_grads(model, lambda: causal_lm_logprobs(model, input_ids, attention_mask=attention_mask,
                                                             labels=labels, temperature=0.7, return_entropy=True,
                                                             kept_ids=kept_ids), grad_logprob, grad_entropy)
    assert got[0][2, 5] == -torch.inf and got[0].isneginf().sum() == 1 and got[0][:, :2].eq(0).all()
    for ours, want in zip(got[:2], expected[:2]):
        assert_close(ours, want, atol=1e-10, rtol=1e-10)
    for name, grad in expected[2].items():
        assert_close(got[2][name], grad, atol=1e-10, rtol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kwargs,match", [
    (dict(kept_ids=torch.zeros(3, 8, 4, dtype=torch.long)), r"kept_ids must be \[batch, seq, k\] with input_ids' "
                                                             r"shape \(3, 9\) \(unshifted\), got \(3, 8, 4\)"),
    (dict(kept_ids=torch.zeros(3, 9, dtype=torch.long)), r"kept_ids must be \[batch, seq, k\]"),
    (dict(kept_ids=torch.full((3, 9, 2), VOCAB)), r"found \[97, 97, 97, 97, 97\], the first at kept_ids\["),
    (dict(kept_ids=torch.zeros(3, 9, 2, dtype=torch.long), top_k=5), "give kept_ids or top_k / top_p, not both"),
])
def test_refuses_bad_kept_sets(kwargs, match):
    input_ids = rollout()[0]
    with pytest.raises(ValueError, match=match):
        causal_lm_logprobs(tiny_llama(), input_ids, **kwargs)
