"""Multi-token prediction with an attached processor (fused_rl_ops.megatron.mtp), on megatron-core
0.18 and 0.19, CPU / gloo, against megatron-core's own MTP path with the same weights and settings:
its labels= loss (or, with labels from input_ids, its logits), its gradients, and what
MTPLossLoggingHelper logs (0.18: the loss alone). Each spawned run groups several checks (imports and
builds dominate)."""
import contextlib
import inspect
import types

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed
from tests.helpers.kernel_calls import KernelCalls

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import gpt_model  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402
from megatron.core.transformer import multi_token_prediction  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper  # noqa: E402

from fused_rl_ops.megatron import attach, detach, rl_output_processor  # noqa: E402
from fused_rl_ops.megatron.mtp import FusedMTPLoss  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import model_inputs  # noqa: E402
from tests.helpers.megatron import (MEGATRON_0_18, MTP_LOGGED, assert_close_by_name, logged_mtp_metrics,  # noqa: E402
                              same_on_all_ranks, take_grads)

if MEGATRON_0_18:
    from megatron.core.models.gpt.fine_grained_callables import PostProcessNode
else:
    from megatron.core.models.common.utils import PostProcessNode

B, S = 2, 8
VOCAB = 256
MEGATRON_PROCESS_MTP_LOSS = multi_token_prediction.process_mtp_loss


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


def mtp_scored_rows(mask, depths, labels_from_input_ids):
    """The positions each MTP depth scores: loss_mask rolled once per depth (and once more for labels
    from the input ids, which 0.18 does not derive: no MTP loss there)."""
    if labels_from_input_ids and MEGATRON_0_18:
        return []
    shift = int(labels_from_input_ids)
    return [int(mask[:, depth + shift:].sum()) for depth in range(1, depths + 1)]


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
    loss -mean(logprobs): the output layer never runs, the ops compute the positions with
    loss_mask 1 only (each MTP depth's, then the main head's), gradients and logged metrics match,
    and detach brings Megatron's path back."""
    model = mtp_model(depths, tied=tied, **settings)
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    inputs = (tokens, *model_inputs(tokens))
    labels = None if labels_from_input_ids else labels_accepted_by_megatron(model, tokens, depths)
    loss_mask = (same_on_all_ranks(B, S, seed=2) > -0.7).float() if masked else None
    mask = torch.ones(B, S) if loss_mask is None else loss_mask
    chosen = tokens if labels is None else labels
    MTPLossLoggingHelper.tracker.clear()

    scored_mtp_rows = mtp_scored_rows(mask, depths, labels is None)
    with output_layer_outputs(model) as calls:
        if labels is None:  # Megatron returns logits; its MTP labels come from the input ids
            logits = model(*inputs, loss_mask=loss_mask).transpose(0, 1)
            cross_entropy = vocab_parallel_cross_entropy(logits.contiguous(), chosen.t().contiguous()).t()
        else:
            cross_entropy = model(*inputs, labels=labels, loss_mask=loss_mask)
    assert len(calls) == 1 + len(scored_mtp_rows)  # Megatron materialises logits for every MTP depth
    (cross_entropy * mask).mean().backward()
    megatron_grads, megatron_metrics = take_grads(model), logged_mtp_metrics()

    attach(model, rl_output_processor())
    assert gpt_model.process_mtp_loss is not MEGATRON_PROCESS_MTP_LOSS
    context = {"tokens": chosen} if labels is None else None
    with output_layer_outputs(model) as calls, KernelCalls() as kernel_calls:
        outputs = model(*inputs, labels=labels, loss_mask=loss_mask, output_processor_context=context)
        (-outputs["logprobs"].mean()).backward()
    assert calls == []
    assert_close(outputs["logprobs"], -(cross_entropy * mask).detach())
    assert_close_by_name(take_grads(model), megatron_grads)
    metrics = logged_mtp_metrics()
    # The MTP depths' positions with loss_mask 1 (Megatron >= 0.19 counts them: total_values), then the main head's.
    scored_rows = scored_mtp_rows + [int(mask.sum())]
    for op in ("chosen_logprob_stats", "chosen_logprob_backward"):  # every position, the scored ones computed
        assert {len(tokens) for tokens in kernel_calls.tokens(op)} == {S * B}, op
        rows = [tokens.tolist() for tokens in kernel_calls.computed_tokens(op)]
        assert sorted(map(len, rows)) == sorted(scored_rows) and all(-100 not in r for r in rows), op
    if scored_mtp_rows:
        assert_close(metrics["loss_values"], megatron_metrics["loss_values"])
    if not MEGATRON_0_18:
        assert metrics["total_values"].long().tolist() == scored_mtp_rows
        assert torch.equal(metrics["total_values"], megatron_metrics["total_values"])
        assert torch.equal(metrics["correct_values"], megatron_metrics["correct_values"])
        if labels is not None and not masked:
            assert (metrics["correct_values"] >= 2).all()  # the acceptance counts are exercised

    model.eval()  # not training: Megatron logs nothing; neither does the fused path
    with torch.no_grad():
        model(*inputs, labels=labels, loss_mask=loss_mask, output_processor_context=context)
    assert MTP_LOGGED["loss_values"] not in MTPLossLoggingHelper.tracker
    model.train()

    detach(model)
    assert gpt_model.process_mtp_loss is MEGATRON_PROCESS_MTP_LOSS
    with output_layer_outputs(model) as calls:
        model(*inputs, labels=chosen, loss_mask=loss_mask)
    assert len(calls) == 1 + depths
    logged_mtp_metrics()


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
    logged_mtp_metrics()


def _check_schedule_plan_post_process_node():
    """The schedule plan's post-process node calls _postprocess on the concatenated hidden states
    of the main model and the MTP layers (MTP layers are plan nodes there, and need MoE layers,
    which do not run on the CPU; so the node is called on what the MTP block returns): the MTP loss
    is the fused one there too, with the forward path's outputs, logged metrics and gradients."""
    model = mtp_model(2)
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(4))
    position_ids, attention_mask = model_inputs(tokens)
    attach(model, rl_output_processor())
    concatenated = []
    handle = model.mtp.register_forward_hook(lambda module, args, output: concatenated.append(output))
    outputs = model(tokens, position_ids, attention_mask, labels=tokens)
    (-outputs["logprobs"].mean()).backward()
    forward_grads, forward_metrics = take_grads(model), logged_mtp_metrics()
    model(tokens, position_ids, attention_mask, labels=tokens)
    handle.remove()
    logged_mtp_metrics()
    state = types.SimpleNamespace(
        input_ids=tokens, position_ids=position_ids, labels=tokens, decoder_input=None, rotary_pos_emb=None,
        rotary_pos_cos=None, rotary_pos_sin=None, loss_mask=None, attention_mask=attention_mask,
        packed_seq_params=None, sequence_len_offset=None, runtime_gather_output=None, extra_block_kwargs=None,
        output_processor=rl_output_processor(), output_processor_context=None,
    )
    with output_layer_outputs(model) as calls:
        node_outputs = PostProcessNode(model, state, None, None).forward_impl(concatenated[1])
    assert calls == []
    assert_close(node_outputs["logprobs"], outputs["logprobs"].detach(), rtol=0, atol=0)
    (-node_outputs["logprobs"].mean()).backward()
    assert_close_by_name(take_grads(model), forward_grads)
    metrics = logged_mtp_metrics()
    for key, expected in forward_metrics.items():
        assert torch.equal(metrics[key], expected), key
    detach(model)


def _check_refuses_a_loss_it_cannot_replace():
    """A model whose compute_language_model_loss is not Megatron's cross entropy is refused, and left
    as it was; so is a HybridModel with MTP configured (no output_processor hook in 0.19.2)."""
    model = mtp_model(1)
    model.__class__ = type("SmoothedLossGPT", (type(model),), {
        "compute_language_model_loss": lambda self, labels, logits: 0.9 * super(type(self), self)
        .compute_language_model_loss(labels, logits)})
    with pytest.raises(ValueError, match="cannot take it over"):
        attach(model, rl_output_processor())
    assert gpt_model.process_mtp_loss is MEGATRON_PROCESS_MTP_LOSS
    with pytest.raises(RuntimeError, match="no output processor is attached"):
        detach(model)
    with pytest.raises(ValueError, match="multi-token prediction calls the output layer"):
        attach(tiny_model("hybrid", tiny_config(mtp_num_layers=1)), rl_output_processor())


def _models_against_megatron(rank, world_size):
    set_parallel_degrees(tp=world_size)
    _check_against_megatron(1)
    _check_against_megatron(2, tied=True, masked=True, calculate_per_token_loss=True, mtp_loss_scaling_factor=0.3)
    _check_against_megatron(2, masked=True, labels_from_input_ids=True)
    if not MEGATRON_0_18:  # 0.19's option
        _check_against_megatron(2, tied=True, mtp_detach_heads=True)
    _check_routing_is_per_model()
    _check_ties_count_as_accepted()
    _check_schedule_plan_post_process_node()
    _check_refuses_a_loss_it_cannot_replace()


@pytest.mark.parametrize("tp", [1, 2])
def test_mtp_models_match_megatron(tp):
    """TP 1, and TP 2 with sequence parallel."""
    run_distributed(_models_against_megatron, tp)


# ------------------------------------------------------- process_mtp_loss's replacement on its own


def mtp_loss_call(model, hidden_states, labels, loss_mask, **overrides):
    """process_mtp_loss's keywords as GPTModel._postprocess passes them (0.18: no tp_group, input_ids)."""
    call = dict(hidden_states=hidden_states, labels=labels, loss_mask=loss_mask, output_layer=model.output_layer,
                output_weight=None, runtime_gather_output=None, is_training=True,
                compute_language_model_loss=model.compute_language_model_loss, config=model.config, cp_group=None,
                tp_group=model.output_layer.tp_group, packed_seq_params=None, scale_logits_fn=None, input_ids=None)
    taken = inspect.signature(MEGATRON_PROCESS_MTP_LOSS).parameters
    return {name: value for name, value in {**call, **overrides}.items() if name in taken}


def run_both(model, hidden_states, labels, loss_mask, **overrides):
    """Megatron's process_mtp_loss and FusedMTPLoss on the same inputs, each followed by backward of
    the returned main hidden states' sum: for each, (returned, hidden grad, output weight grad, metrics)."""
    results = []
    for process_mtp_loss in (MEGATRON_PROCESS_MTP_LOSS, FusedMTPLoss()):
        hidden = hidden_states.detach().clone().requires_grad_(True)
        returned = process_mtp_loss(**mtp_loss_call(model, hidden, labels, loss_mask, **overrides))
        returned.sum().backward()
        results.append((returned.detach(), hidden.grad, model.output_layer.weight.grad.clone(), logged_mtp_metrics()))
        model.zero_grad()
    return results


def assert_same_results(megatron, fused):
    for name, expected, actual in zip(("returned", "hidden grad", "weight grad"), megatron, fused):
        assert_close(actual, expected, rtol=1e-4, atol=1e-6, msg=lambda message: f"{name}: {message}")
    assert_close(fused[3]["loss_values"], megatron[3]["loss_values"], rtol=1e-5, atol=1e-6)
    for key in fused[3].keys() - {"loss_values"}:
        assert torch.equal(fused[3][key], megatron[3][key]), key


def _check_ties_count_as_accepted():
    """Integer hidden states and weights make every logit exact, and ties frequent (one planted
    across the TP shards). Each label is the highest id tied for its row's maximum: the fused path
    accepts every one, Megatron's argmax (the lowest tied id) only those of rows with one maximum
    (0.19; 0.18 counts none); loss and gradients agree."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    model = mtp_model(1)
    g = torch.Generator().manual_seed(6)
    weight = torch.randint(-2, 3, (VOCAB, 32), generator=g).float()
    weight[VOCAB // 2 + 5] = weight[3]
    local_rows = VOCAB // tp
    with torch.no_grad():
        model.output_layer.weight.copy_(weight[rank * local_rows:(rank + 1) * local_rows])
    hidden = torch.randint(-2, 3, (2 * S, B, 32), generator=g).float()  # the main, then depth 1's
    logits = hidden[S:].double() @ weight.double().t()  # [s, b, V]
    tied = logits == logits.max(-1, keepdim=True).values
    highest_tied = (VOCAB - 1 - tied.flip(-1).int().argmax(-1)).t()  # [b, s]
    labels = torch.zeros(B, S, dtype=torch.long)
    labels[:, 1:] = highest_tied[:, :-1]  # depth 1 scores position i against label i + 1
    local = slice(rank * S // tp, (rank + 1) * S // tp)  # sequence parallel: this rank's positions
    hidden_local = torch.cat([hidden[:S][local], hidden[S:][local]])
    megatron, fused = run_both(model, hidden_local, labels, None)
    valid = S - 1
    unique = (tied.sum(-1)[:valid] == 1).sum()
    if not MEGATRON_0_18:  # 0.18 logs no acceptance counts
        assert fused[3]["total_values"].item() == B * valid
        assert fused[3]["correct_values"].item() == B * valid
        assert megatron[3]["correct_values"].item() == unique < B * valid
        megatron[3]["correct_values"] = fused[3]["correct_values"]
    assert_same_results(megatron, fused)


def _rolling_cases(rank, world_size):
    """Context parallel over the two ranks and packed sequences: the fused path takes Megatron's
    own rolling (roll_tensor), with given labels and with labels from the input ids."""
    set_parallel_degrees(tp=1)
    cp_group = dist.new_group([0, 1])
    model = mtp_model(2)
    g = torch.Generator().manual_seed(10 + rank)  # each rank holds its own part of the sequence
    T = 8  # this rank's tokens, one packed row
    hidden = torch.randn(3 * T, 1, 32, generator=g)
    labels = torch.randint(0, VOCAB, (1, T), generator=g)
    loss_mask = (torch.rand(1, T, generator=g) > 0.2).float()
    packs = {None: PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 8], dtype=torch.int32)),
             cp_group: PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4, 16], dtype=torch.int32))}
    totals = {}
    for group in (None, cp_group):
        for packed in (None, packs[group]):
            for given_labels in (labels,) if MEGATRON_0_18 else (labels, None):  # 0.18: no labels, no MTP loss
                megatron, fused = run_both(model, hidden, given_labels, loss_mask, cp_group=group,
                                           packed_seq_params=packed, input_ids=labels)
                assert_same_results(megatron, fused)
                # The positions scored (0.18: the loss, which they change too).
                totals[group, packed is None, given_labels is None] = fused[3].get("total_values",
                                                                                   fused[3]["loss_values"])
    for group in (None, cp_group):
        assert not torch.equal(totals[group, True, False], totals[group, False, False])  # packing rolls differently


def test_rolling_with_context_parallel_and_packed_sequences():
    run_distributed(_rolling_cases, 2)


def run_schedule(model, batches, loss_func):
    """Megatron's pipeline schedule, one microbatch per (tokens, labels); loss_func(output)."""
    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, *model_inputs(tokens), labels=labels)
        return output, lambda output: (loss_func(output), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                                num_microbatches=len(batches), seq_length=S, micro_batch_size=B)


@contextlib.contextmanager
def tensors_stay_on_the_cpu():
    """Tensor.cuda() returns the tensor: GPTModel's constructor moves the last stage's copy of the
    embedding (which the MTP layers use) to CUDA for the all-reduce that gives it the first stage's values."""
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


def _pipeline_parallel(rank, world_size):
    """2 pipeline stages under get_forward_backward_func, the MTP layers on the last: every
    parameter's gradient on both stages, and the logged metrics, are those of Megatron's own path."""
    set_parallel_degrees(tp=1, pp=2)
    with tensors_stay_on_the_cpu():
        model = mtp_model(1, pipeline_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g))
               for _ in range(2)]
    last_stage = parallel_state.is_pipeline_last_stage()
    run_schedule(model, batches, lambda cross_entropy: cross_entropy.mean())
    megatron_grads = take_grads(model)
    megatron_metrics = logged_mtp_metrics() if last_stage else None
    attach(model, rl_output_processor())
    with output_layer_outputs(model) if last_stage else contextlib.nullcontext([]) as calls:
        run_schedule(model, batches, lambda outputs: -outputs["logprobs"].mean())
    assert calls == []
    assert_close_by_name(take_grads(model), megatron_grads)
    if last_stage:
        metrics = logged_mtp_metrics()
        assert_close(metrics["loss_values"], megatron_metrics["loss_values"])
        if not MEGATRON_0_18:
            assert torch.equal(metrics["total_values"], megatron_metrics["total_values"])
    detach(model)


def test_pipeline_parallel_two_stages():
    run_distributed(_pipeline_parallel, 2)
