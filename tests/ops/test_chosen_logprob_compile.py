"""chosen_logprob and the Megatron processor under torch.compile(fullgraph=True) with their default
arguments (check_tokens=True): the compiled PPO loss matches eager and a float64 reference, an
out-of-range token id gives NaN instead of the eager error, changing shapes and temperatures give
the right numbers; and the argument errors a trainer meets (temperature, hidden size, meta tensors)."""
import pytest
import torch
from torch.testing import assert_close

import fused_rl_ops
from fused_rl_ops.testing.distributed import run_distributed

VOCAB, HIDDEN = 300, 16
TEMPERATURE = 0.7
CLIP, ENTROPY_COEFF = 0.2, 0.01


def make_batch(batch, seq, dtype, seed=0):
    """hidden [b, s, H], weight [V, H], shifted labels with -100 (the last position and a prompt
    part), old logprobs and advantages."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, HIDDEN, generator=generator).to(dtype)
    weight = (0.5 * torch.randn(VOCAB, HIDDEN, generator=generator)).to(dtype)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels[:, -1] = -100
    labels[:, : seq // 4] = -100
    old_logprobs = -6.0 + torch.randn(batch, seq, generator=generator)
    advantages = torch.randn(batch, seq, generator=generator)
    return hidden, weight, labels, old_logprobs, advantages


def ppo_loss(logprob, entropy, labels, old_logprobs, advantages):
    """Clipped surrogate of new vs old logprobs minus an entropy bonus, over the labelled positions."""
    mask = (labels != -100).to(logprob.dtype)
    ratio = torch.exp(logprob - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    return ((-surrogate - ENTROPY_COEFF * entropy) * mask).sum() / mask.sum()


def fused_step(hidden, weight, labels, old_logprobs, advantages):
    logprob, entropy = fused_rl_ops.chosen_logprob(hidden, weight, labels, temperature=TEMPERATURE,
                                                   return_entropy=True)
    return ppo_loss(logprob, entropy, labels, old_logprobs, advantages), logprob, entropy


def reference_step(hidden, weight, labels, old_logprobs, advantages):
    """float64 log_softmax over the whole vocabulary; ignored positions get logprob 0 and entropy 0
    (the loss masks them: no gradient either)."""
    log_probs = torch.log_softmax(hidden.double() @ weight.double().t() / TEMPERATURE, dim=-1)
    entropy = torch.where(labels == -100, 0.0, -(log_probs.exp() * log_probs).sum(-1))
    chosen = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logprob = torch.where(labels == -100, 0.0, chosen)
    return ppo_loss(logprob, entropy, labels, old_logprobs.double(), advantages.double()), logprob, entropy


def run_with_grads(step, batch):
    hidden, weight = (t.clone().requires_grad_(True) for t in batch[:2])
    loss, logprob, entropy = step(hidden, weight, *batch[2:])
    loss.backward()
    return [loss, logprob, entropy, hidden.grad, weight.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ppo_loss_compiles_with_defaults_and_matches_eager(dtype):
    batch = make_batch(2, 12, dtype)
    compiled = run_with_grads(torch.compile(fused_step, fullgraph=True), batch)
    eager = run_with_grads(fused_step, batch)
    reference = run_with_grads(reference_step, batch)
    names = ["loss", "logprob", "entropy", "hidden grad", "weight grad"]
    for name, got, want, exact in zip(names, compiled, eager, reference):
        assert got.dtype == want.dtype, name
        assert_close(got, want, msg=name)  # fp32 rounding (bf16 for the bf16 input gradients)
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        assert_close(got.double(), exact.double(), **tolerance, msg=name)
    assert (compiled[1][batch[2] == -100] == 0).all()


@pytest.mark.parametrize("zero_out_wgrad", [False, True])
def test_main_grad_accumulation_compiles(zero_out_wgrad):
    """Megatron's gradient-accumulation fusion under fullgraph: over two micro-batches the compiled
    step adds the weight gradient into main_grad as eager does (and as float64 gives), sets
    grad_added_to_main_grad and hands the weight the placeholder DDP's hook drops."""
    batches = [make_batch(2, 12, torch.float32, seed=seed) for seed in (0, 1)]
    weight = batches[0][1]  # one weight, two micro-batches
    batches = [(hidden, weight, *rest) for hidden, _, *rest in batches]

    def step(h, w, main_grad, labels, old_logprobs, advantages):
        logprob, entropy = fused_rl_ops.chosen_logprob(h, w, labels, temperature=TEMPERATURE, return_entropy=True,
                                                       main_grad=main_grad)
        return ppo_loss(logprob, entropy, labels, old_logprobs, advantages)

    main_grads = []
    for fn in (torch.compile(step, fullgraph=True), step):
        w = torch.nn.Parameter(weight.clone())
        w.main_grad, w.grad_added_to_main_grad, w.zero_out_wgrad = torch.zeros_like(weight), False, zero_out_wgrad
        for hidden, _, labels, old_logprobs, advantages in batches:
            fn(hidden, w, w.main_grad, labels, old_logprobs, advantages).backward()
            assert w.grad_added_to_main_grad and w.grad.shape == w.shape
            if zero_out_wgrad:
                assert not w.grad.any()
            w.grad = None  # what DDP's hook does with the placeholder
        main_grads.append(w.main_grad)
    want = sum(run_with_grads(reference_step, batch)[4] for batch in batches)
    assert main_grads[0].abs().sum() > 0
    assert_close(main_grads[0], main_grads[1])
    assert_close(main_grads[0], want, rtol=1e-5, atol=1e-5)  # float64 math, rounded to the weight's fp32


def test_out_of_range_id_under_compile_gives_nan():
    """Eager (default) raises; compiled, the id gets a NaN logprob and NaN gradients (its hidden
    row, and every weight row, which sums over tokens), as with check_tokens=False, the rest exact."""
    hidden, weight, labels, _, _ = make_batch(2, 12, torch.float32)
    labels[0, 5], labels[1, 7] = VOCAB, -3
    bad = torch.zeros_like(labels, dtype=torch.bool)
    bad[0, 5] = bad[1, 7] = True
    coeff = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))

    def step(h, w, labels):
        return fused_rl_ops.chosen_logprob(h, w, labels, temperature=TEMPERATURE)

    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {VOCAB}\).*found \[{VOCAB}, -3\]"):
        step(hidden, weight, labels)
    results = []
    for fn in (torch.compile(step, fullgraph=True, backend="aot_eager"),
               lambda h, w, t: fused_rl_ops.chosen_logprob(h, w, t, temperature=TEMPERATURE, check_tokens=False)):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logprob = fn(h, w, labels)
        (logprob * coeff).sum().backward()
        results.append((logprob, h.grad, w.grad))
    (logprob, grad_hidden, grad_weight), unchecked = results
    assert torch.equal(logprob.isnan(), bad) and torch.equal(grad_hidden.isnan().all(-1), bad)
    assert not grad_hidden[~bad].isnan().any() and grad_weight.isnan().all()
    for got, want in zip(results[0], unchecked):
        assert_close(got, want, equal_nan=True)
    # the valid positions are what the float64 reference gives with the bad ids ignored
    _, want, _ = reference_step(hidden, weight, labels.masked_fill(bad, -100), labels.double(), labels.double())
    assert_close(logprob[~bad].double(), want[~bad], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [True, None])
def test_changing_token_counts_and_temperature(dynamic):
    """dynamic=True reuses one graph over token counts; dynamic=None recompiles then generalises.
    Each call's numbers, not the compilations, are checked."""
    def step(h, w, labels, temperature):
        logprob, entropy = fused_rl_ops.chosen_logprob(h, w, labels, temperature=temperature, return_entropy=True)
        return (logprob * 1.5).sum() + entropy.mean(), logprob, entropy

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for seed, (batch, seq, temperature) in enumerate([(2, 8, 0.7), (3, 5, 0.7), (1, 13, 1.3), (4, 9, 0.5)]):
        hidden, weight, labels, _, _ = make_batch(batch, seq, torch.float32, seed=seed)
        results = []
        for fn in (compiled, step):
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            out = fn(h, w, labels, temperature)
            out[0].backward()
            results.append([*out, h.grad, w.grad])
        for got, want in zip(*results):
            assert got.shape == want.shape
            assert_close(got, want)


def _processor_compiled(rank, world_size, sequence_parallel):
    """The attached processor's call under fullgraph (Megatron's own layers, ahead of it in the
    model forward, do not trace with fullgraph: megatron-core warns from inside its linear layers),
    at TP 2 with the model's output layer: outputs and gradients match eager; an out-of-range id
    gives NaN on every rank, with no group check and no hang."""
    from fused_rl_ops.megatron import rl_output_processor
    from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model

    set_parallel_degrees(tp=world_size)
    model = tiny_model("gpt", tiny_config(sequence_parallel=sequence_parallel), vocab_size=256)
    batch, seq = 2, 8
    local_seq = seq // world_size if sequence_parallel else seq
    generator = torch.Generator().manual_seed(0)
    hidden_all = torch.randn(seq, batch, 32, generator=generator)
    labels = torch.randint(0, 256, (batch, seq), generator=generator)
    labels[:, -1] = -100
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, :2] = 0
    coeffs = torch.randn(3, batch, seq, generator=generator)
    value_head = fused_rl_ops.ValueHead(32)
    processor = rl_output_processor(temperature=0.9, value_head=value_head)

    def step(hidden_states, labels):
        out = processor(hidden_states=hidden_states, output_layer=model.output_layer, labels=labels,
                        loss_mask=loss_mask)
        return out, sum((c * out[name]).sum() for c, name in zip(coeffs, ("logprobs", "entropy", "values")))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    mine = hidden_all[rank * local_seq: (rank + 1) * local_seq] if sequence_parallel else hidden_all
    results = []
    for fn in (compiled, step):
        hidden_states = mine.clone().requires_grad_(True)
        model.zero_grad()
        value_head.zero_grad()
        out, loss = fn(hidden_states, labels)
        loss.backward()
        results.append([out["logprobs"], out["entropy"], out["values"], hidden_states.grad,
                        model.output_layer.weight.grad.clone(), value_head.weight.grad.clone()])
    for got, want in zip(*results):
        assert_close(got, want)
    assert (results[0][0][labels == -100] == 0).all() and (results[0][0][:, :2] == 0).all()

    labels[1, 4] = 256
    out, loss = compiled(mine.clone(), labels)
    expected_nan = torch.zeros(batch, seq, dtype=torch.bool)
    expected_nan[1, 4] = True
    assert torch.equal(out["logprobs"].isnan(), expected_nan) and loss.isnan()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sequence_parallel"])
def test_megatron_processor_compiles_with_defaults(sequence_parallel):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    run_distributed(_processor_compiled, 2, sequence_parallel)


@pytest.mark.parametrize("temperature", [None, torch.tensor(1.0), "1.0", True, 0.0, float("nan"), float("inf")])
def test_temperature_must_be_a_positive_finite_number(temperature):
    hidden, weight, labels, _, _ = make_batch(1, 4, torch.float32)
    match = r"temperature must be a positive finite number, got "
    with pytest.raises(ValueError, match=match):
        fused_rl_ops.chosen_logprob(hidden, weight, labels, temperature=temperature)
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from fused_rl_ops.megatron import rl_output_processor

    with pytest.raises(ValueError, match="LogitOptions: " + match):
        rl_output_processor(temperature=temperature)


def test_hidden_size_zero_is_refused():
    with pytest.raises(ValueError, match=r"hidden's last dimension \(the hidden size H\) must be at least 1, "
                                         r"got hidden of shape \(2, 3, 0\)"):
        fused_rl_ops.chosen_logprob(torch.randn(2, 3, 0), torch.randn(VOCAB, 0), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_tensors_give_shapes(dtype):
    """Meta tensors go through the fake kernels (what torch.compile traces with): shapes and dtypes
    of the outputs and gradients, as real tensors would give them."""
    hidden = torch.empty(3, 5, HIDDEN, dtype=dtype, device="meta", requires_grad=True)
    weight = torch.empty(VOCAB, HIDDEN, dtype=dtype, device="meta", requires_grad=True)
    labels = torch.empty(3, 5, dtype=torch.long, device="meta")
    logprob, entropy = fused_rl_ops.chosen_logprob(hidden, weight, labels, return_entropy=True)
    assert logprob.device.type == "meta" and logprob.shape == entropy.shape == (3, 5)
    assert logprob.dtype == entropy.dtype == torch.float32
    (logprob.sum() + entropy.sum()).backward()
    assert (hidden.grad.shape, hidden.grad.dtype) == (hidden.shape, dtype)
    assert (weight.grad.shape, weight.grad.dtype) == (weight.shape, dtype)
    with pytest.raises(ValueError, match=r"all tensors must be on one device, got hidden on meta, weight on cpu"):
        fused_rl_ops.chosen_logprob(hidden, torch.randn(VOCAB, HIDDEN, dtype=dtype), labels)


def test_non_tensor_input_is_named():
    with pytest.raises(TypeError, match="chosen_logprob: hidden must be a tensor, got list"):
        fused_rl_ops.chosen_logprob([[1.0]], torch.randn(VOCAB, 1), torch.zeros(1, dtype=torch.long))
