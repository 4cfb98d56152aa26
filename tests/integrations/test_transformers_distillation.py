"""causal_lm_logprobs with k tokens per position and top_logprobs (issue 37 point 3) on a tiny float64
transformers Llama, against its own logits: values, ids, skipped positions and gradients."""
import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers", reason="transformers is not installed")
from tests.integrations.test_transformers import TIGHT, VOCAB, rl_batch, tiny_model  # noqa: E402

from fused_rl_ops.transformers import causal_lm_logprobs  # noqa: E402

K, TOP, TEMPERATURE = 3, 4, 0.7


def test_many_tokens_and_top_logprobs_match_the_model_logits():
    torch.manual_seed(0)
    model = tiny_model("LlamaForCausalLM")
    input_ids, attention_mask, position_ids, labels = rl_batch()
    many = torch.randint(3, VOCAB, (*labels.shape, K))
    many[labels == -100] = -100
    many[0, 5, 1] = -100  # one ignored entry in a scored position
    kwargs = dict(attention_mask=attention_mask, position_ids=position_ids)
    lp, top_ids, top_lp = causal_lm_logprobs(model, input_ids, labels=many, temperature=TEMPERATURE,
                                             top_logprobs=TOP, **kwargs)
    fused = [(p.grad.clone() if p.grad is not None else None) for p in model.parameters()]
    coeff = torch.randn(lp.shape, dtype=torch.float64), torch.randn(top_lp.shape, dtype=torch.float64)
    grads = torch.autograd.grad((coeff[0] * lp).sum() + (coeff[1] * top_lp).sum(), list(model.parameters()),
                                allow_unused=True)
    assert all(g is None for g in fused)

    logp = (model(input_ids, **kwargs).logits[:, :-1] / TEMPERATURE).log_softmax(-1)
    targets = many[:, 1:]
    ignored = targets == -100
    want_lp = torch.where(ignored, 0.0, logp.gather(-1, targets.clamp(min=0)))
    scored = ~ignored.all(-1)
    want_ids = logp.detach().sort(dim=-1, descending=True, stable=True).indices[..., :TOP]
    want_top = torch.where(scored[..., None], logp.gather(-1, want_ids), 0.0)
    assert lp.shape == targets.shape and top_ids.shape == (*targets.shape[:2], TOP)
    assert_close(lp, want_lp, **TIGHT)
    assert torch.equal(top_ids[scored], want_ids[scored]) and top_ids[~scored].eq(-100).all()
    assert_close(top_lp, want_top, **TIGHT)
    want_grads = torch.autograd.grad((coeff[0] * want_lp).sum() + (coeff[1] * want_top).sum(),
                                     list(model.parameters()), allow_unused=True)
    for got, want in zip(grads, want_grads):
        if want is None:
            assert got is None or got.eq(0).all()
        else:
            assert_close(got, want, **TIGHT)
