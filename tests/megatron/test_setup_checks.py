"""Set-up mistakes a trainer can make with the Megatron integration, each refused or reported where it
happens instead of training silently wrong (megatron-core 0.18 and 0.19, CPU / gloo):

- a value head whose parameters differ between the TP ranks (built after a per-rank seed): attach
  refuses it on every rank, naming the fix, and the fix it names works;
- attach before Float16Module (which then makes the value head bf16): a warning at the first forward;
- a weights-only load_sharded into a bf16 model whose Megatron optimizer keeps fp32 main copies
  (Float16OptimizerWithFloat16Params, DistributedOptimizer at DP 2): refused, the model untouched;
  with main_params_of=optimizer the main copies take the loaded weights, so the next step continues
  from them;
- attach of a model that is not a Megatron language model: refused, naming causal_lm_logprobs;
- bad labels or context tokens (an id out of range, a float tensor, another device): reported by the
  caller's name and index in its [b, s] layout, through the processor and the MTP loss;
- the PPO loss of fused_rl_ops.testing.ppo with tokens top_p dropped (logprob -inf): finite, and the
  float64 loss of the other tokens.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

import fused_rl_ops  # noqa: E402
from fused_rl_ops.checkpoint import load_sharded, save_sharded  # noqa: E402
from fused_rl_ops.megatron import attach, detach, rl_output_processor  # noqa: E402
from tests.helpers.checkpoint import megatron_training_state, same_bits  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import (megatron_bf16_training, set_parallel_degrees,  # noqa: E402
                                               tiny_config, tiny_model)
from fused_rl_ops.testing.ppo import ENTROPY_COEFF, VALUE_COEFF, CLIP, model_inputs, ppo_loss, shifted_labels  # noqa: E402

B, S = 2, 8
VOCAB = 256
LR = 1e-3


# ------------------------------------------------------------------------------- in one process


@pytest.mark.parametrize("model", [torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Embedding(8, 4))],
                         ids=["linear", "sequential"])
def test_attach_refuses_a_model_that_is_not_megatrons(model):
    with pytest.raises(TypeError, match=r"expected a megatron-core GPTModel or HybridModel .*got torch\.nn\.modules"
                                        r".*Hugging Face model use fused_rl_ops\.transformers\.causal_lm_logprobs"):
        attach(model, rl_output_processor())
    assert not hasattr(model, "value_head") and not model._forward_pre_hooks


def test_load_sharded_main_params_of_is_checked(tmp_path, checkpoint_dependencies):
    module = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"main_params_of must be a megatron-core optimizer \(.*\), got SGD"):
        load_sharded(module, str(tmp_path), main_params_of=torch.optim.SGD(module.parameters(), lr=0.1))


def test_ppo_loss_leaves_out_the_tokens_top_p_dropped():
    """-inf logprobs (now, or in the old logprobs) take no part: the loss and its gradient are finite
    and are the float64 loss of the other tokens."""
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(B, S, generator=g) * 3).requires_grad_(True)
    rollout = {"old_logprobs": -torch.rand(B, S, generator=g) * 3, "advantages": torch.randn(B, S, generator=g),
               "returns": torch.randn(B, S, generator=g), "mask": (torch.rand(B, S, generator=g) > 0.2).float()}
    entropy, values = torch.rand(B, S, generator=g), torch.randn(B, S, generator=g)
    dropped_now, dropped_before = torch.zeros(B, S, dtype=torch.bool), torch.zeros(B, S, dtype=torch.bool)
    dropped_now[0, 2] = dropped_now[1, 5] = dropped_before[1, 5] = dropped_before[0, 6] = True
    rollout["mask"][dropped_now | dropped_before] = 1.0
    rollout["old_logprobs"][dropped_before] = float("-inf")
    outputs = {"logprobs": torch.where(dropped_now, float("-inf"), logprobs), "entropy": entropy, "values": values}
    loss = ppo_loss(outputs, rollout)
    loss.backward()
    kept = (rollout["mask"] > 0) & ~dropped_now & ~dropped_before
    reference_logprobs = logprobs.detach().double().requires_grad_(True)
    ratio = torch.exp(reference_logprobs[kept] - rollout["old_logprobs"].double()[kept])
    advantages = rollout["advantages"].double()[kept]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    per_token = (-surrogate - ENTROPY_COEFF * entropy.double()[kept]
                 + VALUE_COEFF * (values.double() - rollout["returns"].double())[kept] ** 2)
    per_token.mean().backward()
    assert_close(loss.double(), per_token.mean(), rtol=1e-6, atol=1e-7)
    assert_close(logprobs.grad.double(), reference_logprobs.grad, rtol=1e-5, atol=1e-7)  # 0 where dropped


# ----------------------------------------------------------------------- TP 2, then TP 1 x DP 2


def bf16_config():
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return tiny_config(bf16=True, params_dtype=torch.bfloat16, sequence_parallel=tp > 1)


def _value_head_differing_over_tp():
    """Made after a per-rank seed, the head is refused on both ranks and the model left as it was;
    broadcast from the TP group's first rank as the error says, it attaches."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    model = tiny_model("gpt", tiny_config(sequence_parallel=True), vocab_size=VOCAB, seed=1)
    torch.manual_seed(100 + dist.get_rank())  # a per-rank seed, as RL frameworks seed
    head = fused_rl_ops.ValueHead(32, bias=True)
    for value_head in (head, head.weight):  # a module, and a weight parameter
        # The bias starts at zero on every rank: only the weight is named.
        with pytest.raises(ValueError, match=r"value head's parameters differ between the tensor-parallel ranks "
                                             r"\(value_head\.weight\);.*torch\.distributed\.broadcast"):
            attach(model, rl_output_processor(value_head=value_head))
        assert not hasattr(model, "value_head") and not model._forward_pre_hooks
    for param in head.parameters():  # the fix the error names
        torch.distributed.broadcast(param.data, src=torch.distributed.get_global_rank(tp_group, 0), group=tp_group)
    attach(model, rl_output_processor(value_head=head))
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(2))
    values = model(tokens, *model_inputs(tokens), labels=shifted_labels(tokens))["values"].detach()
    pieces = [torch.empty_like(values) for _ in range(2)]
    dist.all_gather(pieces, values, group=tp_group)
    assert torch.equal(pieces[0], pieces[1])
    detach(model)


def _errors_name_the_callers_tensors():
    """A bad id, a float tensor or a misplaced device is reported by the caller's name and, for an id,
    its [b, s(, k)] index in the caller's tensor, not the processor's transposed [s, b] ids: through
    the processor (labels, or the context's tokens [b, s, k]) and the MTP loss, at TP 2 with
    sequence parallel, on both ranks; a bad id under loss_mask 0 is not scored, so not refused."""
    tokens = torch.randint(0, 200, (B, S), generator=torch.Generator().manual_seed(6))
    inputs = (tokens, *model_inputs(tokens))
    bad_labels = shifted_labels(tokens)
    bad_labels[1, 3] = 4242
    many = torch.randint(0, 200, (B, S, 3), generator=torch.Generator().manual_seed(7))
    many[0, 2, 1], many[1, 5, 0] = 999, -1
    ids = r"token ids must lie in \[0, 200\) or equal ignore_index \(-100\); found \[{}\], the first at {}$"
    model = tiny_model("gpt", tiny_config(sequence_parallel=True), vocab_size=VOCAB, seed=1)
    attach(model, rl_output_processor(vocab_size=200))
    with pytest.raises(ValueError, match="RLOutputProcessor: " + ids.format("4242", r"labels\[1, 3\]")):
        model(*inputs, labels=bad_labels)
    with pytest.raises(ValueError, match=ids.format("999, -1", r"output_processor_context\['tokens'\]\[0, 2, 1\]")):
        model(*inputs, output_processor_context={"tokens": many})
    with pytest.raises(TypeError, match=r"RLOutputProcessor: labels must be int64 or int32, got torch.float32"):
        model(*inputs, labels=bad_labels.float())
    with pytest.raises(ValueError, match=r"loss_mask must be on the hidden states' device cpu, got meta"):
        model(*inputs, labels=bad_labels, loss_mask=torch.ones(B, S, device="meta"))
    loss_mask = torch.ones(B, S)
    loss_mask[1, 3] = 0
    assert model(*inputs, labels=bad_labels, loss_mask=loss_mask)["logprobs"][1, 3] == 0
    mtp_model = tiny_model("gpt", tiny_config(sequence_parallel=True, mtp_num_layers=1), vocab_size=VOCAB, seed=1)
    attach(mtp_model, rl_output_processor())
    with pytest.raises(ValueError, match=r"FusedMTPLoss: token ids .* \[0, 256\).*the first at labels\[1, 3\]"):
        mtp_model(*inputs, labels=bad_labels)


def _float16_module_after_attach():
    """Float16Module built after attach converts the head: the first forward warns, once; built
    before attach (the documented order), the head stays fp32 and nothing warns."""
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    inputs = (tokens, *model_inputs(tokens))
    for wrap_first in (False, True):
        model = tiny_model("gpt", bf16_config(), vocab_size=VOCAB, seed=1)
        torch.manual_seed(4)
        processor = rl_output_processor(value_head=fused_rl_ops.ValueHead(32))
        if wrap_first:
            model = Float16Module(model.config, model)
        attach(model, processor)
        if not wrap_first:
            model = Float16Module(model.config, model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(*inputs, labels=shifted_labels(tokens))
            model(*inputs, labels=shifted_labels(tokens))
        messages = [str(w.message) for w in caught if "changed dtype after attach" in str(w.message)]
        head_dtype = processor.value_head.weight.dtype
        if wrap_first:
            assert messages == [] and head_dtype == torch.float32
        else:
            assert head_dtype == torch.bfloat16 and len(messages) == 1
            assert "value_head.weight (torch.float32 at attach, now torch.bfloat16)" in messages[0]
            assert "wrap the model in Float16Module first, then attach" in messages[0]


def train_step(ddp_model, optimizer, seed):
    tokens = torch.randint(0, 200, (B, S), generator=torch.Generator().manual_seed(seed))
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    logprobs = ddp_model(tokens, *model_inputs(tokens), labels=shifted_labels(tokens))["logprobs"]
    (-logprobs.mean()).backward()
    finalize_model_grads([ddp_model])
    optimizer.step()


def bf16_params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.dtype == torch.bfloat16}


def _weights_only_load(path):
    """A supervised checkpoint (weights alone) loaded into a trained bf16 policy, with each of
    Megatron's mixed-precision optimizers: refused without main_params_of; with it, every main copy
    is its loaded weight, and a step moves the weights by Adam's step size only."""
    supervised = tiny_model("gpt", bf16_config(), vocab_size=VOCAB, seed=2)
    save_sharded(Float16Module(supervised.config, supervised).module, path)  # all bf16, as the policy's
    for distributed_optimizer in (True, False):
        model = tiny_model("gpt", bf16_config(), vocab_size=VOCAB, seed=1)
        ddp_model, optimizer = megatron_bf16_training(model, distributed_optimizer=distributed_optimizer, lr=LR,
                                                      processor=rl_output_processor())
        train_step(ddp_model, optimizer, seed=5)
        trained = bf16_params(model)
        with pytest.raises(ValueError, match=r"keeps fp32 main copies of .* and \d+ more parameters .*next optimizer "
                                             r"step would write them back.*main_params_of=optimizer"):
            load_sharded(model, path)
        assert all(same_bits(p, trained[n]) for n, p in bf16_params(model).items())  # untouched
        with pytest.raises(ValueError, match="not both"):
            load_sharded(model, path, optimizer=optimizer, main_params_of=optimizer)

        load_sharded(model, path, main_params_of=optimizer)
        loaded = bf16_params(model)
        assert not any(same_bits(loaded[n], trained[n]) for n in loaded if loaded[n].dim() > 1)  # norms start at 1
        state = megatron_training_state(model, optimizer)
        for name in loaded:
            assert same_bits(state[name]["main_param"], state[name]["param"].float()), name
        train_step(ddp_model, optimizer, seed=6)
        for name, param in bf16_params(model).items():
            # Adam moves each element by about LR (weight decay included): the loaded weights, continued.
            assert (param.float() - loaded[name].float()).abs().max() < 5 * LR + 1e-2 * loaded[name].float().abs().max(), name


def _setup_checks(rank, world_size, path):
    set_parallel_degrees(tp=2)
    _value_head_differing_over_tp()
    _errors_name_the_callers_tensors()
    _float16_module_after_attach()
    set_parallel_degrees(tp=1)  # DP 2: the DistributedOptimizer shards the main copies
    _weights_only_load(path)


def test_setup_mistakes_are_refused_or_reported(tmp_path, checkpoint_dependencies):
    run_distributed(_setup_checks, 2, str(tmp_path / "supervised"))
