"""The value head a trainer attaches, and the processor's argument checks, on megatron-core 0.18 and 0.19
(CPU / gloo with the test-only shims).

`attach(model, rl_output_processor(value_head=ValueHead(H)))` makes the head the model's submodule:
a tiny GPTModel at TP 2 x DP 2 (with and without sequence parallel) inside Megatron's DDP, an Adam
optimizer over `model.parameters()` only and a PPO loss train it for a few steps. Each step its
values and gradient are equal on the TP ranks, every gradient equals (to fp32 rounding) the naive
reference's at the same weights (materialised logits, value head and data-parallel reduction done
by hand, no attach), the replicas stay identical, and at the last step the temperature changes.
Then the head is saved and loaded with the model (at TP 2 and at TP 1) and detach removes it.

A value head belongs to one model: attaching it to a second one (a reference model given the
policy's processor) is refused until detach releases it, and an optimizer that misses it (built
before attach) is reported by a warning after its first step, on a model trained for a few steps.
Megatron's own optimizers (Float16OptimizerWithFloat16Params, DistributedOptimizer) train a bf16
policy's fp32 head, set up as docs/rl_recipe.md does, with no such warning."""
import gc
import math
import re
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402

import fused_rl_ops  # noqa: E402
from fused_rl_ops.checkpoint import load_sharded, save_sharded  # noqa: E402
from fused_rl_ops.megatron import attach, detach, rl_output_processor  # noqa: E402
from fused_rl_ops.reference.megatron import NaiveRLOutputProcessor  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import ddp_train_step, forward_backward, make_rollout, model_inputs  # noqa: E402

B, S = 2, 8  # b != s, so a [b, s] / [s, b] mix-up cannot pass
VOCAB, REAL_VOCAB = 256, 200  # the model's padded vocabulary, the tokenizer's
TEMPERATURES = (0.9, 0.9, 0.6)  # per step: the last step changes the processor's temperature


def value_head_like(seed, hidden_size=32):
    head = fused_rl_ops.ValueHead(hidden_size, bias=True)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
    return head


# --------------------------------------------------------------------------------- in-process checks


def one_rank_call(**overrides):
    """A processor call's keywords without a TP group: hidden [S, B, 16], a 32-row weight."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(S, B, 16, generator=g), torch.randn(32, 16, generator=g)
    output_layer = types.SimpleNamespace(weight=weight, tp_group=None, sequence_parallel=False)
    call = dict(hidden_states=hidden, output_layer=output_layer, labels=torch.randint(0, 32, (B, S), generator=g))
    return {**call, **overrides}


def test_shape_mistakes_name_the_argument_and_the_expected_shape():
    processor = rl_output_processor()
    tokens = one_rank_call()["labels"]
    expected = r" = \[2, 8\] for hidden states \[8, 2, 16\].*got "
    positions, tokens_shapes = r"must be \[b, s\]", r"must be \[b, s\] or \[b, s, k\]"  # the context's: k per position
    for keywords, name, form, got in (
        (dict(loss_mask=torch.ones(S, B)), "loss_mask", positions, r"\[8, 2\]"),  # [s, b]: a broadcasting error before
        (dict(loss_mask=torch.ones(B * S)), "loss_mask", positions, r"\[16\]"),
        (dict(labels=tokens.t().contiguous()), "labels", positions, r"\[8, 2\]"),
        (dict(labels=tokens[:, :-1]), "labels", positions, r"\[2, 7\]"),
        (dict(labels=None, context={"tokens": tokens[None]}), r"output_processor_context\['tokens'\]", tokens_shapes,
         r"\[1, 2, 8\]"),
    ):
        with pytest.raises(ValueError, match=f"{name} {form}{expected}{got}"):
            processor(**one_rank_call(**keywords))
    with pytest.raises(TypeError, match=r"loss_mask must be a \[b, s\] tensor, got list"):
        processor(**one_rank_call(loss_mask=[[1.0] * S] * B))


def test_temperature_is_checked_when_given_and_when_changed():
    for bad in (None, 0, -1.0, math.inf, math.nan, True, "0.7"):
        with pytest.raises(ValueError, match=f"temperature must be a positive finite number, got {bad!r}"):
            rl_output_processor(temperature=bad)
    processor = rl_output_processor(temperature=0.9)
    with pytest.raises(ValueError, match="got None"):
        processor.temperature = None
    assert processor.temperature == 0.9  # a refused value leaves the old one
    processor.temperature = 0.5
    call = one_rank_call()
    outputs = processor(**call)
    # float64 at the new temperature
    logits = call["hidden_states"].double() @ call["output_layer"].weight.double().t() / 0.5
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, call["labels"].t().unsqueeze(-1)).squeeze(-1).t()
    assert_close(outputs["logprobs"], chosen.float())
    assert_close(outputs["entropy"], -(log_probs.exp() * log_probs).sum(-1).t().float())


# ------------------------------------------------------- TP 2 x DP 2: training, checkpoint, detach


def all_gathered(tensor, group):
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def assert_equal_over(group, tensors):
    """Every tensor of the dict is bitwise the same on all ranks of group."""
    for name, tensor in tensors.items():
        first, *others = all_gathered(tensor.detach(), group)
        assert all(torch.equal(first, other) for other in others), name


def reference_grads(naive, naive_head, language_model, rollout, temperature):
    """Every gradient of the PPO loss at language_model's current weights, the naive way: naive
    (untouched by attach) gets those weights and the reference processor per call, its gradients are
    reduced by hand (sequence-parallel norms summed over TP by forward_backward, then everything
    averaged over the data-parallel ranks). Returns the outputs and the gradients by name."""
    weights = language_model.state_dict()
    naive_head.load_state_dict({k.removeprefix("value_head."): v for k, v in weights.items() if k.startswith("value_head.")})
    naive.load_state_dict({k: v for k, v in weights.items() if not k.startswith("value_head.")})
    naive.zero_grad()
    naive_head.zero_grad()
    processor = NaiveRLOutputProcessor(value_head=naive_head, vocab_size=REAL_VOCAB, temperature=temperature)
    outputs, _ = forward_backward(naive, rollout, output_processor=processor)
    grads = {name: p.grad for name, p in naive.named_parameters()}
    grads.update({f"value_head.{name}": p.grad for name, p in naive_head.named_parameters()})
    dp_group = parallel_state.get_data_parallel_group()
    for grad in grads.values():
        dist.all_reduce(grad, group=dp_group)
        grad /= dist.get_world_size(dp_group)
    return outputs, grads


def _check_training(sequence_parallel):
    config = tiny_config(sequence_parallel=sequence_parallel)
    model = tiny_model("gpt", config, vocab_size=VOCAB, seed=1)
    names_before = [name for name, _ in model.named_parameters()]
    head = value_head_like(seed=2)
    processor = rl_output_processor(value_head=head, vocab_size=REAL_VOCAB, temperature=TEMPERATURES[0])
    attach(model, processor)
    assert model.value_head is head
    assert [name for name, _ in model.named_parameters()] == names_before + ["value_head.weight", "value_head.bias"]
    assert {"value_head.weight", "value_head.bias"} <= model.state_dict().keys()
    assert all(p.tensor_model_parallel is False and p.sequence_parallel is False for p in head.parameters())

    ddp_model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=1e-2)  # the head comes with the model
    naive, naive_head = tiny_model("gpt", config, vocab_size=VOCAB), value_head_like(seed=3)
    tp_group, dp_group = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_data_parallel_group()
    initial_head = {name: p.detach().clone() for name, p in head.named_parameters()}
    for step, temperature in enumerate(TEMPERATURES):
        # The data differs between the replicas (as data parallelism has it), not between TP ranks.
        seed = 100 * step + parallel_state.get_data_parallel_rank()
        tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))
        rollout = make_rollout(tokens, torch.full((B, S), -math.log(REAL_VOCAB)), seed=seed)
        naive_outputs, expected_grads = reference_grads(naive, naive_head, model, rollout, temperature)
        processor.temperature = temperature
        outputs, _ = ddp_train_step(ddp_model, optimizer, rollout)

        for name in outputs:
            assert_close(outputs[name], naive_outputs[name], msg=lambda message: f"step {step} {name}: {message}")
        grads = {name: p.main_grad for name, p in model.named_parameters()}
        assert grads.keys() == expected_grads.keys()
        for name, expected in expected_grads.items():
            assert_close(grads[name], expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item(),
                         msg=lambda message: f"step {step} {name}: {message}")
        assert grads["value_head.weight"].abs().sum() > 0
        assert_equal_over(tp_group, {"values": outputs["values"], "value_head.weight grad": grads["value_head.weight"],
                                     "value_head.bias grad": grads["value_head.bias"]})
        assert_equal_over(dp_group, dict(model.named_parameters()))  # the replicas stay identical
    for name, initial in initial_head.items():
        assert (head.get_parameter(name) - initial).abs().min() > 1e-4, name  # Adam moved every entry
    return model, head


def _check_checkpoint_and_detach(model, head, path):
    """The head is saved with the model and loads into another model's attached head, at TP 2 and
    at TP 1 (a replicated parameter: the same values at every degree). detach removes it."""
    tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected_values = model(tokens, *model_inputs(tokens), labels=tokens)["values"]
    save_sharded(model, path, tp_group=parallel_state.get_tensor_model_parallel_group())
    for tp in (2, 1):
        set_parallel_degrees(tp=tp)
        config = tiny_config(sequence_parallel=model.config.sequence_parallel and tp > 1)
        other, other_head = tiny_model("gpt", config, vocab_size=VOCAB, seed=5), value_head_like(seed=6)
        attach(other, rl_output_processor(value_head=other_head, vocab_size=REAL_VOCAB))
        assert not torch.equal(other_head.weight, head.weight)
        load_sharded(other, path, tp_group=parallel_state.get_tensor_model_parallel_group())
        for name, param in head.named_parameters():
            assert torch.equal(other_head.get_parameter(name), param), name
        with torch.no_grad():
            values = other(tokens, *model_inputs(tokens), labels=tokens)["values"]
        assert_close(values, expected_values, rtol=1e-5, atol=1e-5)

    names_attached = [name for name, _ in other.named_parameters()]
    detach(other)
    assert [name for name, _ in other.named_parameters()] == names_attached[:-2]
    assert not hasattr(other, "value_head") and "value_head.weight" not in other.state_dict()
    assert other(tokens, *model_inputs(tokens)).shape == (B, S, VOCAB)  # logits again (TP 1)


def _check_attach_refuses_a_wrapped_model_and_a_plain_tensor():
    config = tiny_config()
    wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(), tiny_model("gpt", config))
    for model in (wrapped, wrapped.module):
        with pytest.raises(RuntimeError, match="attach the processor before wrapping the model"):
            attach(model, rl_output_processor(value_head=value_head_like(seed=1)))
        assert not hasattr(wrapped.module, "value_head")
    attach(wrapped, rl_output_processor())  # no value head: nothing for DDP to miss
    detach(wrapped)
    with pytest.raises(TypeError, match="value_head is a plain tensor"):
        attach(tiny_model("gpt", config), rl_output_processor(value_head=torch.randn(config.hidden_size)))


def _tp2_dp2(rank, world_size, path):
    set_parallel_degrees(tp=2)
    _check_attach_refuses_a_wrapped_model_and_a_plain_tensor()
    _check_training(sequence_parallel=False)
    model, head = _check_training(sequence_parallel=True)
    _check_checkpoint_and_detach(model, head, path)


def test_value_head_trains_with_the_model_at_tp2_dp2_and_is_checkpointed(tmp_path, checkpoint_dependencies):
    run_distributed(_tp2_dp2, 4, str(tmp_path / "checkpoint"))


# ------------------------------------------- one model per value head, and an optimizer that trains it


def ppo_steps(step, steps):
    """steps PPO steps through step(rollout); returns the messages of the value-head warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(steps):
            tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))
            step(make_rollout(tokens, torch.full((B, S), -math.log(REAL_VOCAB)), seed=seed))
    return [str(warning.message) for warning in caught if "value head" in str(warning.message)]


def optimizer_steps(model, optimizers):
    """A step function: forward-backward through model, then each optimizer steps."""
    def step(rollout):
        for optimizer in optimizers:
            optimizer.zero_grad()
        forward_backward(model, rollout)
        for optimizer in optimizers:
            optimizer.step()
    return step


def clones(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def assert_every_entry_moved(module, before):
    for name, initial in before.items():
        assert torch.all(module.get_parameter(name) != initial), f"{name} did not train"


def _check_one_model_per_value_head():
    """The mistake of a policy and a reference attached to one processor with a value head is refused
    (the reference's requires_grad_(False) would freeze the policy's critic); the reference given its
    own processor, the policy's critic trains. detach releases the head."""
    config = tiny_config()
    policy, reference = [tiny_model("gpt", config, vocab_size=VOCAB, seed=1) for _ in range(2)]
    head = value_head_like(seed=2)
    processor = rl_output_processor(value_head=head, vocab_size=REAL_VOCAB)
    attach(policy, processor)
    refusal = ("this value head is already attached to another model; give the reference model its own "
               "rl_output_processor without value_head")
    for shared in (processor, rl_output_processor(value_head=head.weight)):  # the module, or its bare weight
        with pytest.raises(ValueError, match=refusal):
            attach(reference, shared)
        assert not hasattr(reference, "value_head")
    attach(reference, rl_output_processor(return_entropy=False, vocab_size=REAL_VOCAB))  # the refusal's advice
    reference.requires_grad_(False)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    initial = clones(head)
    assert ppo_steps(optimizer_steps(policy, [optimizer]), steps=3) == []
    assert_every_entry_moved(head, initial)

    other = tiny_model("gpt", config, vocab_size=VOCAB, seed=3)
    with pytest.raises(ValueError, match=refusal):
        attach(other, processor)
    detach(policy)
    attach(other, processor)
    assert other.value_head is head and not hasattr(policy, "value_head")
    with pytest.raises(ValueError, match=refusal):
        attach(policy, processor)
    del other  # dropped without detach: the head is free again
    gc.collect()
    attach(policy, processor)
    assert policy.value_head is head


def _check_an_optimizer_trains_the_value_head():
    """An optimizer built before attach does not hold the head: one warning, at the forward after the
    first step (under Megatron's DDP, as a trainer runs it). No warning when the head trains: by the
    optimizer built after attach, or by an optimizer of its own beside the trunk's; nor for a frozen
    head, nor after an optimizer that stepped before attach (supervised training) and no more."""
    config = tiny_config()
    untrained = r"value head's parameters \(value_head\.weight, value_head\.bias\) are in no optimizer"

    model, head = tiny_model("gpt", config, vocab_size=VOCAB, seed=1), value_head_like(seed=2)
    early_optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    attach(model, rl_output_processor(value_head=head, vocab_size=REAL_VOCAB))
    ddp_model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    initial = clones(head)
    [message] = ppo_steps(lambda rollout: ddp_train_step(ddp_model, early_optimizer, rollout), steps=3)
    assert re.search(untrained, message) and "optimizer.add_param_group" in message
    assert all(torch.equal(head.get_parameter(name), p) for name, p in initial.items())  # what it reports

    model, head = tiny_model("gpt", config, vocab_size=VOCAB, seed=1), value_head_like(seed=2)
    trunk_optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    attach(model, rl_output_processor(value_head=head, vocab_size=REAL_VOCAB))
    head_optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    initial = clones(head)
    assert ppo_steps(optimizer_steps(model, [trunk_optimizer, head_optimizer]), steps=3) == []
    assert_every_entry_moved(head, initial)

    model, head = tiny_model("gpt", config, vocab_size=VOCAB, seed=1), value_head_like(seed=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    attach(model, rl_output_processor(value_head=head.requires_grad_(False), vocab_size=REAL_VOCAB))
    assert ppo_steps(optimizer_steps(model, [optimizer]), steps=2) == []

    model = tiny_model("gpt", config, vocab_size=VOCAB, seed=1)
    supervised_optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    model(tokens, *model_inputs(tokens), labels=tokens).mean().backward()  # Megatron's cross entropy
    supervised_optimizer.step()
    attach(model, rl_output_processor(value_head=value_head_like(seed=2), vocab_size=REAL_VOCAB))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert ppo_steps(optimizer_steps(model, [optimizer]), steps=2) == []


def _ownership_and_training(rank, world_size):
    set_parallel_degrees(tp=1)
    _check_one_model_per_value_head()
    _check_an_optimizer_trains_the_value_head()


def test_a_value_head_has_one_model_and_an_optimizer_that_trains_it():
    run_distributed(_ownership_and_training, 1)


def _megatron_optimizers_train_the_value_head(rank, world_size):
    """A bf16 policy set up as docs/rl_recipe.md does (attach inside Float16Module, before DDP; the
    head fp32), trained by the optimizer get_megatron_optimizer builds, at DP 2: every element of the
    head's parameters changes at every step, and no warning says the head is untrained."""
    from megatron.core.distributed import finalize_model_grads

    from fused_rl_ops.testing.megatron_cpu import megatron_bf16_training

    set_parallel_degrees(tp=1)
    config = tiny_config(bf16=True, params_dtype=torch.bfloat16)
    for distributed, kind in ((False, "Float16OptimizerWithFloat16Params"), (True, "DistributedOptimizer")):
        model, head = tiny_model("gpt", config, vocab_size=VOCAB, seed=1), value_head_like(seed=2)
        processor = rl_output_processor(value_head=head, vocab_size=REAL_VOCAB)
        ddp_model, optimizer = megatron_bf16_training(model, distributed_optimizer=distributed, lr=1e-2,
                                                      processor=processor)
        assert [type(member).__name__ for member in optimizer.chained_optimizers] == [kind]
        assert model.value_head is head and {p.dtype for p in head.parameters()} == {torch.float32}

        def step(rollout):
            before = clones(head)
            ddp_model.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(ddp_model, rollout)
            finalize_model_grads([ddp_model])
            assert optimizer.step()[0]
            assert_every_entry_moved(head, before)

        assert ppo_steps(step, steps=3) == []


def test_megatron_optimizers_train_the_value_head_without_a_warning():
    run_distributed(_megatron_optimizers_train_the_value_head, 2)
