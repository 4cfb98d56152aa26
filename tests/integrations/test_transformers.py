"""fused_rl_ops.transformers.causal_lm_logprobs on tiny randomly initialised transformers models,
against each model's own logits (log_softmax and gather of the shifted labels) in float64."""
import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

pytest.importorskip("transformers", reason="transformers is not installed")
import transformers  # noqa: E402
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, PhiConfig, PhiForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from fused_rl_ops.reference import chosen_logprob as chosen_logprob_reference, sampler_filter  # noqa: E402
from fused_rl_ops.testing.distributed import run_distributed  # noqa: E402
from tests.helpers.kernel_calls import KernelCalls, scored  # noqa: E402
from fused_rl_ops.transformers import LOGITS_AFTER_HEAD, causal_lm_logprobs  # noqa: E402

VOCAB = 97
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=16)
# What a class's config needs beyond TINY to be tiny, or to make its step after the head change
# the logits (Cohere's default logit_scale 0.0625 already does).
EXTRA = {
    "MixtralForCausalLM": MOE, "Qwen2MoeForCausalLM": MOE, "Qwen3MoeForCausalLM": MOE,
    "GraniteForCausalLM": dict(logits_scaling=4.0), "GraniteMoeForCausalLM": dict(MOE, logits_scaling=4.0),
    "DeepseekV3ForCausalLM": dict(num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                                  n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
                                  n_group=1, topk_group=1),
    # Softcapped logits have their own test (test_gemma2_softcap).
    "Gemma2ForCausalLM": dict(final_logit_softcapping=None), "Gemma3ForCausalLM": dict(final_logit_softcapping=None),
}
TIGHT = dict(atol=1e-10, rtol=1e-10)  # float64 model, fused path against the model's own logits


def tiny_model(class_name, dtype=torch.float64, **overrides):
    config_class = getattr(transformers, class_name).config_class
    config = config_class(**{**TINY, **EXTRA.get(class_name, {}), **overrides})
    # "eager" experts: the grouped-GEMM path has no float64.
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").to(dtype).eval()
    assert type(model).__name__ == class_name
    return model


def rl_batch(batch=3, seq=9, left_padding=True):
    """input_ids, attention_mask (row 1 right-padded, row 2 left-padded unless not left_padding),
    position_ids, and labels with -100 on each row's prompt (3 tokens) and padding, as an RL
    trainer scores completions."""
    input_ids = torch.randint(3, VOCAB, (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, -3:] = 0
    if left_padding:
        attention_mask[2, :2] = 0
    input_ids[attention_mask == 0] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    for row in range(batch):
        first = int(attention_mask[row].argmax())
        labels[row, first:first + 3] = -100
    return input_ids, attention_mask, position_ids, labels


def reference(model, input_ids, labels, temperature, top_k=None, top_p=None, **forward_kwargs):
    """(logprob, entropy) [b, s - 1] from the model's own logits: log_softmax(logits[:, :-1] / T)
    at labels[:, 1:] (with top_k / top_p, the tokens vLLM's sampler drops at -inf first), both 0
    where the label is -100."""
    logits = model(input_ids=input_ids, use_cache=False, **forward_kwargs).logits[:, :-1]
    logp = torch.log_softmax(sampler_filter(logits.double() / temperature, top_k, top_p), dim=-1)
    target = labels[:, 1:]
    chosen = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    plogp = logp.exp() * torch.where(logp.isneginf(), 0.0, logp)  # dropped tokens add nothing
    return torch.where(target == -100, 0.0, chosen), torch.where(target == -100, 0.0, -plogp.sum(-1))


def values_and_grads(model, compute, grad_logprob, grad_entropy):
    """compute()'s (logprob, entropy) and every parameter's gradient of sum(g_lp * lp + g_ent * ent)."""
    model.zero_grad(set_to_none=True)
    logprob, entropy = compute()
    # A token the sampler's filter drops has logprob -inf by design: it takes no part in the loss.
    ((torch.where(logprob.isneginf(), 0.0, logprob) * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    return logprob.detach(), entropy.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_against_model(model, temperature=0.7, tolerance=TIGHT, reference_model=None, filter_=None, **batch_kwargs):
    """causal_lm_logprobs on model against reference() on reference_model (default model itself,
    a float64 copy otherwise): logprob, entropy and the gradient of every parameter; filter_: the
    sampler's top_k / top_p, for both."""
    filter_ = filter_ or {}
    reference_model = model if reference_model is None else reference_model
    input_ids, attention_mask, position_ids, labels = rl_batch(**batch_kwargs)
    kwargs = dict(attention_mask=attention_mask, position_ids=position_ids)
    grad_logprob = torch.randn(labels[:, 1:].shape, dtype=torch.float64)
    grad_entropy = torch.randn(labels[:, 1:].shape, dtype=torch.float64)
    expected = values_and_grads(reference_model, lambda: reference(reference_model, input_ids, labels, temperature,
                                                                   **filter_, **kwargs), grad_logprob, grad_entropy)
    got = values_and_grads(model, lambda: causal_lm_logprobs(model, input_ids, labels=labels, temperature=temperature,
                                                             return_entropy=True, **filter_, **kwargs),
                           grad_logprob, grad_entropy)
    assert got[0].shape == (input_ids.shape[0], input_ids.shape[1] - 1)
    assert bool((got[0][labels[:, 1:] == -100] == 0).all())
    assert_close(got[0].double(), expected[0], **tolerance)
    assert_close(got[1].double(), expected[1], **tolerance)
    assert expected[2].keys() == got[2].keys()
    for name, grad in expected[2].items():
        assert (grad is None) == (got[2][name] is None), name
        if grad is not None:
            assert_close(got[2][name].double(), grad.double(), **tolerance, msg=lambda m: f"{name}: {m}")
    return got


@pytest.mark.parametrize("class_name", sorted(LOGITS_AFTER_HEAD))
def test_every_verified_class_matches_its_logits(class_name):
    model = tiny_model(class_name)
    # Gemma 2's eager attention (its only one) makes a left-padded row NaN in float64 (not in float32).
    logprob, entropy, grads = check_against_model(model, left_padding=class_name != "Gemma2ForCausalLM")
    assert torch.isfinite(logprob).all() and torch.isfinite(entropy).all()
    # The gradient reaches the decoder's layers through the hidden states.
    assert grads[next(n for n, _ in model.named_parameters() if "layers.0." in n)] is not None


@pytest.mark.parametrize("build", [
    lambda: LlamaForCausalLM(LlamaConfig(**TINY)),
    lambda: Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **TINY)),
], ids=["llama_untied", "qwen2_tied"])
def test_float32_model_against_float64_logits(build):
    model = build().eval()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == isinstance(model, Qwen2ForCausalLM)
    reference_model = type(model)(model.config).double().eval()
    reference_model.load_state_dict(model.state_dict())
    logprob, entropy, _ = check_against_model(model, temperature=1.3, tolerance=dict(atol=2e-5, rtol=1e-4),
                                              reference_model=reference_model)
    assert logprob.dtype == torch.float32 and entropy.dtype == torch.float32


def test_bfloat16_model_gives_the_float64_softmax_of_its_own_hidden_states():
    """A bfloat16 model: float32 logprobs and entropy equal, to float32 rounding, to the float64
    log_softmax of the model's own final hidden states times its head (exact logits of the
    bfloat16 decoder's output; its own bfloat16 logits are rounded to bfloat16 on top)."""
    model = tiny_model("LlamaForCausalLM", dtype=torch.bfloat16)
    input_ids, attention_mask, _, labels = rl_batch()
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    expected = chosen_logprob_reference(hidden[:, :-1].double(), model.lm_head.weight.double(), labels[:, 1:],
                                        temperature=0.8)
    got = causal_lm_logprobs(model, input_ids, attention_mask=attention_mask, labels=labels, temperature=0.8,
                             return_entropy=True)
    for fused, exact in zip(got, expected):
        assert fused.dtype == torch.float32
        assert_close(fused.double(), exact, atol=2e-6, rtol=0)


@pytest.mark.parametrize("poisoned", ["model.embed_tokens.weight", "lm_head.weight"])
def test_nan_weights_give_what_the_model_logits_give(poisoned):
    """A NaN in an embedding row (one sequence's tokens after it) or in one head row (every token)
    gives NaN exactly where the model's own logits do; -100 positions stay 0 as there."""
    model = tiny_model("LlamaForCausalLM")
    input_ids, attention_mask, _, labels = rl_batch()
    with torch.no_grad():
        model.get_parameter(poisoned)[int(input_ids[0, 4])] = float("nan")
        expected = reference(model, input_ids, labels, 1.0, attention_mask=attention_mask)
        got = causal_lm_logprobs(model, input_ids, attention_mask=attention_mask, labels=labels, return_entropy=True)
    assert expected[0].isnan().any() and not expected[0].isnan().all()
    for fused, from_logits in zip(got, expected):
        assert_close(fused, from_logits, **TIGHT, equal_nan=True)


def test_gemma2_softcap():
    config = Gemma2Config(final_logit_softcapping=30.0, tie_word_embeddings=False, **TINY)
    model = Gemma2ForCausalLM(config).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(300.0)  # logits up to 4 softcaps: see test_sampler_filter
    input_ids = rl_batch(left_padding=False)[0]
    uncapped = model.lm_head(model.model(input_ids).last_hidden_state)
    capped = model(input_ids).logits
    assert (uncapped - capped).abs().max() > 1.0
    check_against_model(model, left_padding=False)


@pytest.mark.parametrize("filter_", [dict(top_k=10), dict(top_p=0.6), dict(top_k=40, top_p=0.8)],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_sampler_filter(filter_):
    """top_k / top_p passed through: against the model's own logits with vLLM's masking, with the
    softcap of Gemma 2 and the logit scale of Granite; the filter drops some of the sampled
    tokens (logprob -inf, no logprob gradient)."""
    for class_name in ("LlamaForCausalLM", "GraniteForCausalLM"):
        got = check_against_model(tiny_model(class_name), filter_=filter_)
        assert got[0].isneginf().any(), class_name
    model = Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=30.0, tie_word_embeddings=False, **TINY))
    # Logits up to 4 softcaps: the cap bends most of them, while the float64 reference's softcap
    # derivative, 1 - tanh^2 in torch's autograd, keeps its precision (deeper in saturation it
    # cancels to a relative error of 1e-6, which depends on the CPU's tanh; the kernels' does not).
    with torch.no_grad():
        model.lm_head.weight.mul_(300.0)
    check_against_model(model.double().eval(), filter_=filter_, left_padding=False)


def test_defaults_and_no_grad():
    """labels default to input_ids, temperature to 1, one tensor unless return_entropy; under
    torch.no_grad the values are the same and carry no graph."""
    model = tiny_model("LlamaForCausalLM")
    input_ids = rl_batch()[0]
    expected = reference(model, input_ids, input_ids, 1.0)[0]
    logprob = causal_lm_logprobs(model, input_ids)
    assert isinstance(logprob, torch.Tensor) and logprob.requires_grad
    assert_close(logprob, expected, **TIGHT)
    with torch.no_grad():
        logprob, entropy = causal_lm_logprobs(model, input_ids, return_entropy=True)
    assert logprob.grad_fn is None and entropy.grad_fn is None
    assert_close(logprob, expected, **TIGHT)


def fused_and_calls(model, input_ids, labels, **kwargs):
    """causal_lm_logprobs' (logprob, entropy) and the token ids its kernels got, forward and backward."""
    with KernelCalls() as calls:
        logprob, entropy = causal_lm_logprobs(model, input_ids, labels=labels, return_entropy=True, **kwargs)
        (logprob.sum() + entropy.sum()).backward()
    return logprob.detach(), entropy.detach(), calls


def assert_kernels_computed(calls, want):
    """The ops got every position and computed the rows of want (the scored ids)."""
    for op in ("chosen_logprob_stats", "chosen_logprob_backward"):
        [tokens], [computed] = calls.tokens(op), calls.computed_tokens(op)
        assert len(tokens) > len(want) and torch.equal(computed, want), op


def test_prompt_and_padding_positions_are_not_computed():
    """-100 labels (the prompts) and padding, marked by attention_mask alone (the padding's labels
    left as its ids): position t is skipped when labels[:, t + 1] is -100 or attention_mask[:, t + 1]
    is 0; logprob and entropy 0 there, the model's own numbers elsewhere."""
    model = tiny_model("LlamaForCausalLM")
    input_ids, attention_mask, position_ids, labels = rl_batch()
    unmarked_padding = torch.where(attention_mask == 0, input_ids, labels)
    logprob, entropy, calls = fused_and_calls(
        model, input_ids, unmarked_padding, attention_mask=attention_mask, position_ids=position_ids)
    assert_kernels_computed(calls, scored(labels[:, 1:]))
    expected = reference(model, input_ids, labels, 1.0, attention_mask=attention_mask, position_ids=position_ids)
    assert_close(logprob, expected[0], **TIGHT)
    assert_close(entropy, expected[1], **TIGHT)
    assert (labels[:, 1:] == -100).sum() > labels.numel() // 3


def test_packed_sequences():
    """Several sequences in one row (position_ids restarting, -100 where a sequence starts, so that
    no position scores the next sequence's first token), as a packing trainer passes them: the
    model's own numbers, the boundaries skipped."""
    model = tiny_model("LlamaForCausalLM")
    lengths = (4, 6, 5)
    input_ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.masked_fill(position_ids == 0, -100)
    logprob, entropy, calls = fused_and_calls(model, input_ids, labels, position_ids=position_ids)
    assert_kernels_computed(calls, scored(labels[:, 1:]))
    assert len(scored(labels[:, 1:])) == sum(lengths) - 3
    expected = reference(model, input_ids, labels, 1.0, position_ids=position_ids)
    assert_close(logprob, expected[0], **TIGHT)
    assert_close(entropy, expected[1], **TIGHT)


class OpOutputShapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns (the fused op's own buffers are not ops)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("class_name, tied", [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True)])
def test_lm_head_never_runs_and_no_vocab_sized_tensor(class_name, tied):
    model = tiny_model(class_name, tie_word_embeddings=tied)
    calls = []
    model.lm_head.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    model.lm_head.register_forward_hook(lambda module, args, out: calls.append("forward"))
    input_ids, attention_mask, _, labels = rl_batch()

    def vocab_sized_shapes(compute):
        with OpOutputShapes() as mode:
            logprob, entropy = compute()
            (logprob.sum() + entropy.sum()).backward()
        # Only the head's weight and its gradient, [vocab, hidden], may have a vocab-sized dim.
        return [s for s in mode.shapes if VOCAB in s and s != (VOCAB, TINY["hidden_size"])]

    fused = vocab_sized_shapes(lambda: causal_lm_logprobs(model, input_ids, attention_mask=attention_mask,
                                                          labels=labels, return_entropy=True))
    assert calls == [] and fused == []
    # The same checks see the model's own path.
    assert vocab_sized_shapes(lambda: reference(model, input_ids, labels, 1.0, attention_mask=attention_mask))
    assert calls == ["pre", "forward"]


def grpo_loss(logprob, old_logprob, advantages, completion_mask, clip=0.2):
    """A GRPO-style clipped surrogate over the completion tokens, as a trainer writes it."""
    ratio = torch.exp(logprob - old_logprob)
    per_token = -torch.minimum(ratio * advantages[:, None], ratio.clamp(1 - clip, 1 + clip) * advantages[:, None])
    return (per_token * completion_mask).sum() / completion_mask.sum()


def test_grpo_training_steps_match_the_model_logits_path():
    """Three AdamW steps on a GRPO loss from causal_lm_logprobs give the parameters that the same
    steps from the model's own logits give."""
    input_ids, attention_mask, _, labels = rl_batch(batch=4)
    advantages = torch.randn(4, dtype=torch.float64)
    completion_mask = (labels[:, 1:] != -100).double()
    models = {}
    for path in ("fused", "logits"):
        torch.manual_seed(1)
        model = tiny_model("Qwen2ForCausalLM", tie_word_embeddings=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with torch.no_grad():
            old_logprob = causal_lm_logprobs(model, input_ids, attention_mask=attention_mask, labels=labels)
        for _ in range(3):
            if path == "fused":
                logprob = causal_lm_logprobs(model, input_ids, attention_mask=attention_mask, labels=labels,
                                             temperature=0.9)
            else:
                logprob = reference(model, input_ids, labels, 0.9, attention_mask=attention_mask)[0]
            optimizer.zero_grad()
            grpo_loss(logprob, old_logprob, advantages, completion_mask).backward()
            optimizer.step()
        models[path] = model
    fused, logits = models["fused"].state_dict(), models["logits"].state_dict()
    start = tiny_model("Qwen2ForCausalLM", tie_word_embeddings=True).state_dict()
    for name, value in logits.items():
        assert_close(fused[name], value, atol=1e-9, rtol=1e-9, msg=lambda m: f"{name}: {m}")
    assert any(not torch.equal(value, start[name]) for name, value in logits.items())


class LlamaWithOwnForward(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


class ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def llama_with_head(head_type=torch.nn.Linear, rows=VOCAB, bias=False):
    model = tiny_model("LlamaForCausalLM")
    model.lm_head = head_type(TINY["hidden_size"], rows, bias=bias, dtype=torch.float64)
    return model


@pytest.mark.parametrize("build, match", [
    (lambda: PhiForCausalLM(PhiConfig(**TINY)),
     r"verified class .*got PhiForCausalLM, whose forward is transformers.models.phi.modeling_phi.PhiForCausalLM"),
    (lambda: LlamaWithOwnForward(LlamaConfig(**TINY)), r"forward is (tests\.integrations\.)?test_transformers.LlamaWithOwnForward"),
    (lambda: tiny_model("LlamaForCausalLM").model, r"got LlamaModel, whose forward is .*LlamaModel.forward"),
    (lambda: llama_with_head(bias=True), r"plain torch.nn.Linear without bias, got Linear with a bias"),
    (lambda: llama_with_head(ScaledLinear), r"LM head must be a plain torch.nn.Linear without bias, got ScaledLinear"),
    (lambda: llama_with_head(rows=VOCAB + 3), r"LM head has 100 rows but config.vocab_size is 97"),
    (lambda: tiny_model("CohereForCausalLM", logit_scale=-0.5),
     r"model.logit_scale must be a positive finite number, got -0.5"),
    (lambda: tiny_model("GraniteForCausalLM", logits_scaling=0.0), r"config.logits_scaling must be a positive finite"),
], ids=["unverified_class", "own_forward", "base_model", "head_bias", "head_subclass", "head_rows", "logit_scale",
        "logits_scaling"])
def test_refuses_models_whose_logits_it_cannot_reproduce(build, match):
    model = build()
    with pytest.raises(ValueError, match=match):
        causal_lm_logprobs(model, rl_batch()[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), r"temperature must be a positive finite number, got 0.0"),
    (dict(temperature=-1.0), r"temperature must be a positive finite number"),
    (dict(temperature=float("inf")), r"temperature must be a positive finite number"),
    (dict(temperature=float("nan")), r"temperature must be a positive finite number"),
    (dict(temperature=True), r"temperature must be a positive finite number, got True"),
    (dict(labels=torch.zeros(3, 8, dtype=torch.long)), r"labels must have input_ids' shape \(3, 9\) \(unshifted\)"),
    (dict(input_ids=torch.zeros(3, 1, dtype=torch.long)), r"input_ids must be a \[batch, seq\] tensor with seq >= 2"),
    (dict(input_ids=torch.zeros(9, dtype=torch.long)), r"input_ids must be a \[batch, seq\] tensor"),
    (dict(labels=torch.full((3, 9), VOCAB)), r"token ids must lie in \[0, 97\)"),
])
def test_refuses_bad_arguments(kwargs, match):
    model = tiny_model("LlamaForCausalLM")
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("input_ids", rl_batch()[0])
    with pytest.raises(ValueError, match=match):
        causal_lm_logprobs(model, input_ids, **kwargs)



def fsdp2_refusal_checks(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    with pytest.raises(ValueError, match=r"LM head's weight is a DTensor \(sharded by FSDP2"):
        causal_lm_logprobs(model, rl_batch()[0])


def test_refuses_an_fsdp2_sharded_head():
    """Under FSDP2 the head's weight stays sharded outside the model's own forward: a clear error."""
    run_distributed(fsdp2_refusal_checks, 2)
