"""Multi-token prediction with an attached processor (fused_rl_ops.megatron.mtp), on megatron-core
0.19.2, CPU / gloo, against megatron-core's own MTP path with the same weights and settings: its
labels= loss (or, with labels from input_ids, its logits), its gradients, and what
MTPLossLoggingHelper logs. Each spawned run groups several checks (imports and builds dominate)."""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import gpt_model  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402
from megatron.core.transformer import multi_token_prediction  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper  # noqa: E402

from fused_rl_ops.megatron import attach, detach, rl_output_processor  # noqa: E402
from fused_rl_ops.megatron.mtp import FusedMTPLoss  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import model_inputs  # noqa: E402

B, S = 2, 8
VOCAB = 256
MEGATRON_PROCESS_MTP_LOSS = multi_token_prediction.process_mtp_loss


def same_on_all_ranks(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def mtp_model(depths, *, tied=False, seed=0, **settings):
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = tiny_config(mtp_num_layers=depths, sequence_parallel=tp > 1, **settings)
    return tiny_model("gpt", config, tied_embeddings=tied, seed=seed, vocab_size=VOCAB)


@contextlib.contextmanager
def output_layer_outputs(model):
    """The [s, b, V/tp] logits of every output-layer call, in call order (the MTP depths first)."""
    outputs = []
    handle = model.output_layer.register_forward_hook(lambda module, args, output: outputs.append(output[0].detach()))
    try:
        yield outputs
    finally:
        handle.remove()


def logged_metrics():
    """MTPLossLoggingHelper's per-depth loss, correct and total since the last call; empties its
    tracker (whose tensors keep the size of the first model's mtp_num_layers)."""
    tracker = MTPLossLoggingHelper.tracker
    metrics = {key: tracker[key].clone() for key in ("loss_values", "correct_values", "total_values")}
    tracker.clear()
    return metrics


def take_grads(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def assert_close_by_name(actual, expected):
    assert actual.keys() == expected.keys() and expected
    for name, tensor in expected.items():
        assert_close(actual[name], tensor, rtol=1e-4, atol=1e-5 * tensor.abs().max().item() + 1e-9,
                     msg=lambda message: f"{name}: {message}")


def gather_vocab(local):
    """[..., V/tp] shards of the tensor-parallel group, concatenated along the vocab."""
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def labels_accepted_by_megatron(model, tokens, depths):
    """Labels that Megatron's argmax accepts at about half the positions of each depth: depth d's
    logits at position i are scored against label i + d (MTP hidden states depend on the input
    ids, not on the labels, so the labels can be built from this forward's predictions)."""
    with torch.no_grad(), output_layer_outputs(model) as logits:
        model(tokens, *model_inputs(tokens), labels=tokens)
    predictions = [gather_vocab(depth_logits).argmax(-1).t() for depth_logits in logits[:depths]]  # [b, s]
    labels = tokens.clone()
    for j in range(1, S):
        depth = 1 + j % depths
        if j - depth >= 0:
            labels[:, j] = predictions[depth - 1][:, j - depth]
    return labels


# ----------------------------------------------------------------- the model against Megatron's own


def _check_against_megatron(depths, *, tied=False, masked=False, labels_from_input_ids=False, **settings):
    """One step through Megatron's own path, then through the attached processor with the main
    loss -mean(logprobs): the output layer never runs, gradients and logged metrics match, and
    detach brings Megatron's path back."""
    model = mtp_model(depths, tied=tied, **settings)
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    inputs = (tokens, *model_inputs(tokens))
    labels = None if labels_from_input_ids else labels_accepted_by_megatron(model, tokens, depths)
    loss_mask = (same_on_all_ranks(B, S, seed=2) > -0.7).float() if masked else None
    mask = torch.ones(B, S) if loss_mask is None else loss_mask
    chosen = tokens if labels is None else labels
    MTPLossLoggingHelper.tracker.clear()

    with output_layer_outputs(model) as calls:
        if labels is None:  # Megatron returns logits; its MTP labels come from the input ids
            logits = model(*inputs, loss_mask=loss_mask).transpose(0, 1)
            cross_entropy = vocab_parallel_cross_entropy(logits.contiguous(), chosen.t().contiguous()).t()
        else:
            cross_entropy = model(*inputs, labels=labels, loss_mask=loss_mask)
    assert len(calls) == 1 + depths  # Megatron materialises logits for every MTP depth
    (cross_entropy * mask).mean().backward()
    megatron_grads, megatron_metrics = take_grads(model), logged_metrics()

    attach(model, rl_output_processor())
    assert gpt_model.process_mtp_loss is not MEGATRON_PROCESS_MTP_LOSS
    context = {"tokens": chosen} if labels is None else None
    with output_layer_outputs(model) as calls:
        outputs = model(*inputs, labels=labels, loss_mask=loss_mask, output_processor_context=context)
    assert calls == []
    assert_close(outputs["logprobs"], -(cross_entropy * mask).detach())
    (-outputs["logprobs"].mean()).backward()
    assert_close_by_name(take_grads(model), megatron_grads)
    metrics = logged_metrics()
    assert_close(metrics["loss_values"], megatron_metrics["loss_values"])
    assert torch.equal(metrics["total_values"], megatron_metrics["total_values"])
    assert torch.equal(metrics["correct_values"], megatron_metrics["correct_values"])
    if labels is not None and not masked:
        assert (metrics["correct_values"] >= 2).all()  # the acceptance counts are exercised

    model.eval()  # not training: Megatron logs nothing; neither does the fused path
    with torch.no_grad():
        model(*inputs, labels=labels, loss_mask=loss_mask, output_processor_context=context)
    assert "total_values" not in MTPLossLoggingHelper.tracker
    model.train()

    detach(model)
    assert gpt_model.process_mtp_loss is MEGATRON_PROCESS_MTP_LOSS
    with output_layer_outputs(model) as calls:
        model(*inputs, labels=chosen, loss_mask=loss_mask)
    assert len(calls) == 1 + depths
    logged_metrics()


def _check_routing_is_per_model():
    """Two attached models and one that is not: only the attached ones skip their output layers;
    megatron-core's process_mtp_loss comes back when the last of them detaches."""
    first, second, plain = (mtp_model(1, seed=seed) for seed in (0, 1, 2))
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    attach(first, rl_output_processor())
    attach(second, rl_output_processor())
    for model, expected_calls in ((first, 0), (second, 0), (plain, 2)):
        with output_layer_outputs(model) as calls:
            model(tokens, *model_inputs(tokens), labels=tokens)
        assert len(calls) == expected_calls
    detach(first)
    assert gpt_model.process_mtp_loss is not MEGATRON_PROCESS_MTP_LOSS
    with output_layer_outputs(second) as calls:
        second(tokens, *model_inputs(tokens), labels=tokens)
    assert calls == []
    detach(second)
    assert gpt_model.process_mtp_loss is MEGATRON_PROCESS_MTP_LOSS
    logged_metrics()


def _models_against_megatron(rank, world_size):
    set_parallel_degrees(tp=world_size)
    _check_against_megatron(1)
    _check_against_megatron(2, tied=True, masked=True, calculate_per_token_loss=True, mtp_loss_scaling_factor=0.3)
    _check_against_megatron(2, masked=True, labels_from_input_ids=True)
    _check_against_megatron(2, tied=True, mtp_detach_heads=True)
    _check_routing_is_per_model()


@pytest.mark.parametrize("tp", [1, 2])
def test_mtp_models_match_megatron(tp):
    """TP 1, and TP 2 with sequence parallel."""
    run_distributed(_models_against_megatron, tp)
