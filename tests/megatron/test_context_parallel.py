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
  DDP reduces them), for a batch split as Megatron's own get_batch_on_this_cp_rank splits it; packed rows
  split per document match each sequence scored alone, with no label rolled across a boundary.
- The split (fused_rl_ops.megatron.context_parallel): plain rows split as get_batch_on_this_cp_rank
  splits them at CP 2 and 4; packed rows against a reference from the definition (Transformer
  Engine's per-document split is absent here); labels shifted within each document as megatron-core's
  roll_tensor rolls them; the processor's batches above are split by it.
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
from fused_rl_ops.megatron import (attach, context_parallel_positions, rl_output_processor, shift_labels,  # noqa: E402
                                   split_for_context_parallel)
from fused_rl_ops.testing.megatron_cpu import (set_parallel_degrees, tiny_config, tiny_model,  # noqa: E402
                                               with_self_only_attention)
from fused_rl_ops.testing.ppo import allreduce_sequence_parallel_grads, shifted_labels  # noqa: E402
from tests.helpers.megatron import logged_mtp_metrics  # noqa: E402

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


def cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_seq_params(lengths):
    offsets = cu_seqlens(lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


# ------------------------------------------------------------- the split helpers, in one process


def positions_by_owner(lengths, cp_size, cp_rank):
    """The reference from the definition, position by position: a position at offset p of a document
    of length L lies in chunk p // (L / (2 x CP)); chunk c belongs to rank c, or 2 x CP - 1 - c past
    the middle. A rank keeps the positions of its chunks, in row order."""
    owner = []
    for length in lengths:
        chunk = length // (2 * cp_size)
        owner += [min(p // chunk, 2 * cp_size - 1 - p // chunk) for p in range(length)]
    return torch.tensor([p for p, rank in enumerate(owner) if rank == cp_rank], dtype=torch.int64)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("lengths", [(16,), (8, 16, 0, 24), (32, 8)], ids=["one", "packed", "packed2"])
def test_context_parallel_positions_are_megatrons_zigzag(cp_size, lengths):
    """Each rank's positions from the definition, for plain and packed rows (documents whose length is
    a multiple of 2 x CP, one of them empty); together the ranks hold each position once, as many each."""
    offsets = cu_seqlens(lengths) if len(lengths) > 1 else None
    held = [context_parallel_positions(sum(lengths), cp_size, rank, offsets) for rank in range(cp_size)]
    for rank, positions in enumerate(held):
        assert torch.equal(positions, positions_by_owner(lengths, cp_size, rank)), rank
    assert torch.equal(torch.cat(held).sort().values, torch.arange(sum(lengths)))
    assert len({positions.numel() for positions in held}) == 1
    tokens = torch.arange(2 * sum(lengths)).reshape(2, -1)
    batch = {"tokens": tokens, "labels": shift_labels(tokens, offsets), "loss_mask": None}
    local = split_for_context_parallel(batch, cp_size, cp_size - 1, offsets)
    assert torch.equal(local["tokens"], tokens[:, held[-1]]) and local["loss_mask"] is None
    assert torch.equal(local["labels"], batch["labels"][:, held[-1]])


def test_shift_labels_is_megatrons_roll_within_each_document():
    """shift_labels against megatron-core's roll_tensor (packed: rolled within each document), which
    puts 0 where shift_labels puts ignore_index: at each document's last position."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    tokens = torch.randint(1, REAL_VOCAB, (1, sum(DOCUMENTS)), generator=torch.Generator().manual_seed(1))
    ends = torch.tensor(DOCUMENTS).cumsum(0) - 1
    for offsets, packed, last in ((None, None, [sum(DOCUMENTS) - 1]),
                                  (cu_seqlens(DOCUMENTS), packed_seq_params(DOCUMENTS), ends)):
        labels = shift_labels(tokens, offsets)
        rolled, _ = roll_tensor(tokens, shifts=-1, dims=-1, packed_seq_params=packed)
        at_end = torch.zeros_like(tokens, dtype=torch.bool)
        at_end[:, last] = True
        assert torch.equal(labels, torch.where(at_end, -100, rolled)) and rolled[at_end].eq(0).all()
    assert torch.equal(shift_labels(tokens, cu_seqlens(DOCUMENTS), ignore_index=-1)[:, ends], torch.full((1, 3), -1))


def test_context_parallel_split_refuses_what_it_cannot_split():
    batch = {"tokens": torch.zeros(2, 24, dtype=torch.long), "loss_mask": torch.ones(2, 24)}
    with pytest.raises(ValueError, match=r"document 1 \(positions 8\.\.18\) has length 10, not a multiple of "
                                         r"2 x cp_size = 4.*pad it"):
        split_for_context_parallel(batch, 2, 0, torch.tensor([0, 8, 18, 24]))
    with pytest.raises(ValueError, match=r"the row has length 24, not a multiple of 2 x cp_size = 16"):
        split_for_context_parallel(batch, 8, 0)
    with pytest.raises(ValueError, match=r"cu_seqlens must be .* from 0 to the row's length 24"):
        split_for_context_parallel(batch, 2, 0, torch.tensor([0, 8, 20]))
    with pytest.raises(ValueError, match=r"cp_rank must lie in \[0, cp_size\).*cp_size=2, cp_rank=2"):
        split_for_context_parallel(batch, 2, 2)
    with pytest.raises(ValueError, match=r"batch must hold \[b, s, \.\.\.\] tensors of one sequence length"):
        split_for_context_parallel({**batch, "labels": torch.zeros(2, 16)}, 2, 0)


# ------------------------------------------------------------------------------ CP 2 x TP 2


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
    local = split_for_context_parallel(batch, cp_size, cp_rank)
    # Megatron's own split of plain rows, at CP 2 (the CP group) and at CP 4 (the world's 4 ranks).
    for group in (parallel_state.get_context_parallel_group(), dist.group.WORLD):
        megatron_local = get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False, cp_group=group)
        ours = split_for_context_parallel(batch, dist.get_world_size(group), dist.get_rank(group))
        assert all(torch.equal(ours[key], megatron_local[key]) for key in batch), dist.get_world_size(group)
    positions = context_parallel_positions(S, cp_size, cp_rank)
    outputs, grads = forward_backward(model, local)
    for name, expected in plain_at_cp1[0].items():
        assert_close(in_sequence_order(outputs[name], positions), expected, msg=lambda m: f"plain {name}: {m}")
    assert_close_by_name(grads, plain_at_cp1[1], "plain")

    documents = full_batch(DOCUMENTS, seed=4)
    positions = context_parallel_positions(sum(DOCUMENTS), cp_size, cp_rank, cu_seqlens(DOCUMENTS))
    outputs, grads = forward_backward(model, split_for_context_parallel(documents, cp_size, cp_rank,
                                                                        cu_seqlens(DOCUMENTS)),
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
    cases = {"plain": (split_for_context_parallel(plain, cp_size, cp_rank), None),
             "packed": (split_for_context_parallel(documents, cp_size, cp_rank, cu_seqlens(DOCUMENTS)),
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
