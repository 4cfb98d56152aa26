"""The processor and the MTP loss under context parallel and packed sequences (megatron-core 0.18
and 0.19, CPU / gloo, CP 2 x TP 2 with sequence parallel on 4 ranks).

A trainer shifts the labels on the full sequence (each document's own, when packed), then gives
each CP rank its part of tokens, labels, loss mask and position ids as Megatron's
`get_batch_on_this_cp_rank` does: each sequence (each document, when packed as THD rows with
`PackedSeqParams`) cut into 2 x CP chunks, rank r keeping chunks r and 2 x CP - 1 - r. Megatron's
local attention refuses CP and THD on the CPU, so the models here have a core attention in which
each position attends to itself alone (megatron_cpu.with_self_only_attention): every position is
computed on its own, and the results at CP 2 must be those at CP 1 whatever the split.

- The processor at CP 2, its outputs put back in sequence order, matches CP 1 on the same weights
  (logprobs, entropy, values, and every parameter's gradient summed over the CP ranks, as Megatron's
  DDP reduces them), for a batch split by Megatron's own get_batch_on_this_cp_rank; packed rows
  split per document match each sequence scored alone, with no label rolled across a boundary.
- The MTP loss at CP 2, plain and packed: the gradients and the logged MTP loss and counts (0.18:
  the loss) of the attached model are those of megatron-core's own process_mtp_loss (which divides
  each CP rank's loss by that rank's own token count).
"""
import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402

import fused_rl_ops  # noqa: E402
from fused_rl_ops.megatron import attach, rl_output_processor  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import (set_parallel_degrees, tiny_config, tiny_model,  # noqa: E402
                                               with_self_only_attention)
from fused_rl_ops.testing.ppo import allreduce_sequence_parallel_grads, shifted_labels  # noqa: E402
from megatron_helpers import logged_mtp_metrics  # noqa: E402

B, S = 2, 16  # S: a multiple of 2 x CP x TP (zigzag chunks, then sequence parallel)
DOCUMENTS = (8, 4, 12)  # packed lengths, each a multiple of 2 x CP; their sum a multiple of 2 x CP x TP
VOCAB, REAL_VOCAB = 256, 200
COEFF = {"logprobs": 1.0, "entropy": 0.3, "values": 0.5}  # the loss: sum of COEFF-weighted outputs


def build(mtp=False):
    """The position-wise tiny GPT at the current TP / CP degrees (sequence parallel), seed 1: the same
    logical weights at every degree; with a value head and an attached processor unless mtp."""
    config = tiny_config(sequence_parallel=True, mtp_num_layers=1 if mtp else None)
    model = tiny_model("gpt", config, vocab_size=VOCAB, seq_length=S, edit_spec=with_self_only_attention, seed=1)
    if not mtp:
        torch.manual_seed(2)
        attach(model, rl_output_processor(value_head=fused_rl_ops.ValueHead(32, bias=True), vocab_size=REAL_VOCAB))
    return model


def full_batch(lengths, seed):
    """[rows, sum(lengths)] tokens, labels (each document's tokens shifted within it), loss mask (0
    where the label is -100, as a trainer shifts it with the labels) and position ids (restarting
    at each document), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    rows = B if len(lengths) == 1 else 1
    documents = []
    for length in lengths:
        tokens = torch.randint(0, REAL_VOCAB, (rows, length), generator=g)
        labels = shifted_labels(tokens)
        documents.append({"tokens": tokens, "labels": labels,
                          "loss_mask": ((torch.rand(rows, length, generator=g) > 0.3) & (labels != -100)).float(),
                          "position_ids": torch.arange(length).expand(rows, length)})
    return {key: torch.cat([document[key] for document in documents], dim=1) for key in documents[0]}


def zigzag_positions(lengths, cp_size, cp_rank):
    """The positions of a row that CP rank cp_rank holds, in its order: each document of the row
    (lengths) cut into 2 x cp_size chunks, the rank's chunks cp_rank and 2 x cp_size - 1 - cp_rank."""
    positions, start = [], 0
    for length in lengths:
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            positions.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += length
    return torch.cat(positions)


def packed_seq_params(lengths):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def forward_backward(model, batch, packed=None):
    """The processor's outputs and every parameter's gradient (TP-reduced where sequence parallel
    leaves partial sums, then summed over the CP ranks) of sum(COEFF-weighted outputs)."""
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                loss_mask=batch["loss_mask"], packed_seq_params=packed)
    sum(weight * out[name] for name, weight in COEFF.items()).sum().backward()
    allreduce_sequence_parallel_grads(model)
    grads = {}
    for name, param in model.named_parameters():
        grads[name] = param.grad.clone()
        dist.all_reduce(grads[name], group=parallel_state.get_context_parallel_group())
    model.zero_grad()
    return {name: t.detach() for name, t in out.items()}, grads


def in_sequence_order(local, positions):
    """[rows, local positions] outputs of every CP rank, put at their positions of the full rows."""
    group = parallel_state.get_context_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    indices = [torch.empty_like(positions) for _ in pieces]
    dist.all_gather(pieces, local.contiguous(), group=group)
    dist.all_gather(indices, positions, group=group)
    full = local.new_empty(local.shape[0], sum(index.numel() for index in indices))
    for piece, index in zip(pieces, indices):
        full[:, index] = piece
    return full


def assert_close_by_name(actual, expected, what):
    assert actual.keys() == expected.keys() and expected, what
    for name, tensor in expected.items():
        assert_close(actual[name], tensor, rtol=1e-4, atol=1e-5 * tensor.abs().max().item() + 1e-9,
                     msg=lambda message: f"{what} {name}: {message}")


def _processor_at_cp1():
    """CP 1 (TP 2 x DP 2): the outputs and gradients of the plain batch, and of each document alone."""
    model = build()
    plain = forward_backward(model, full_batch((S,), seed=3))
    documents = full_batch(DOCUMENTS, seed=4)
    alone, start = [], 0
    for length in DOCUMENTS:
        alone.append(forward_backward(model, {key: t[:, start:start + length] for key, t in documents.items()}))
        start += length
    packed_outputs = {name: torch.cat([outputs[name] for outputs, _ in alone], dim=1) for name in COEFF}
    packed_grads = {name: sum(grads[name] for _, grads in alone) for name in alone[0][1]}
    return plain, (packed_outputs, packed_grads)


def _processor_at_cp2(plain_at_cp1, packed_at_cp1):
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    model = build()
    batch = full_batch((S,), seed=3)
    local = get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False,
                                      cp_group=parallel_state.get_context_parallel_group())
    positions = zigzag_positions((S,), cp_size, cp_rank)
    for key, tensor in batch.items():  # Megatron's split is the zigzag the packed rows get below
        assert torch.equal(local[key], tensor[:, positions]), key
    outputs, grads = forward_backward(model, {key: local[key] for key in batch})
    for name, expected in plain_at_cp1[0].items():
        assert_close(in_sequence_order(outputs[name], positions), expected, msg=lambda m: f"plain {name}: {m}")
    assert_close_by_name(grads, plain_at_cp1[1], "plain")

    documents = full_batch(DOCUMENTS, seed=4)
    positions = zigzag_positions(DOCUMENTS, cp_size, cp_rank)
    outputs, grads = forward_backward(model, {key: t[:, positions] for key, t in documents.items()},
                                      packed_seq_params(DOCUMENTS))
    for name, expected in packed_at_cp1[0].items():
        assert_close(in_sequence_order(outputs[name], positions), expected, msg=lambda m: f"packed {name}: {m}")
    assert_close_by_name(grads, packed_at_cp1[1], "packed")
    # Each document's last position has no label: logprob and entropy exactly 0 there.
    ends = torch.tensor(DOCUMENTS).cumsum(0) - 1
    assert torch.all(in_sequence_order(outputs["logprobs"], positions)[:, ends] == 0)


def _mtp_at_cp2():
    """Megatron's own MTP loss against the attached processor's, plain and packed, at CP 2: the main
    loss sum(cross entropy) on Megatron's side, -sum(logprobs) on ours (the same, so the gradients
    differ only through the MTP loss)."""
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    plain, documents = full_batch((S,), seed=5), full_batch(DOCUMENTS, seed=6)
    cases = {"plain": ({key: t[:, zigzag_positions((S,), cp_size, cp_rank)] for key, t in plain.items()}, None),
             "packed": ({key: t[:, zigzag_positions(DOCUMENTS, cp_size, cp_rank)] for key, t in documents.items()},
                        packed_seq_params(DOCUMENTS))}
    megatron, fused = build(mtp=True), build(mtp=True)
    attach(fused, rl_output_processor())
    MTPLossLoggingHelper.tracker.clear()
    for what, (batch, packed) in cases.items():
        inputs = (batch["tokens"], batch["position_ids"], None)
        cross_entropy = megatron(*inputs, labels=batch["labels"], loss_mask=batch["loss_mask"], packed_seq_params=packed)
        (cross_entropy * batch["loss_mask"]).sum().backward()
        expected = logged_mtp_metrics()
        out = fused(*inputs, labels=batch["labels"], loss_mask=batch["loss_mask"], packed_seq_params=packed)
        (-out["logprobs"]).sum().backward()
        metrics = logged_mtp_metrics()
        assert_close(metrics["loss_values"], expected["loss_values"], msg=lambda m: f"{what}: {m}")
        for key in metrics.keys() - {"loss_values"}:  # megatron-core >= 0.19's acceptance counts
            assert torch.equal(metrics[key], expected[key]), (what, key)
        for model in (megatron, fused):
            allreduce_sequence_parallel_grads(model)
        assert_close_by_name({n: p.grad for n, p in fused.named_parameters()},
                             {n: p.grad for n, p in megatron.named_parameters()}, what)
        megatron.zero_grad()
        fused.zero_grad()


def _context_parallel(rank, world_size):
    set_parallel_degrees(tp=2)  # CP 1, DP 2: the reference
    at_cp1 = _processor_at_cp1()
    set_parallel_degrees(tp=2, cp=2)
    _processor_at_cp2(*at_cp1)
    _mtp_at_cp2()


def test_processor_and_mtp_loss_under_context_parallel_and_packed_sequences():
    run_distributed(_context_parallel, 4)
