"""fused_rl_ops.checkpoint.chunks: where a rank's tensor (a TP shard, or a Piece of one: a range of
its flattened elements, as megatron-core's DistributedOptimizer steps) lies in the global tensor.

Property test (hypothesis): random shapes, sharded dims, strides, TP degrees and ranges. The
global tensor holds each element's own index; the rank's shard comes from the tests' own reference
split, its piece from flat slicing. Every chunk must show, in what is handed to DCP (a view of the
shard's or the piece's own elements), exactly the global tensor's elements at the chunk's global
place, and the chunks must cover the piece's elements once each.
"""
import math

import pytest
import torch

from fused_rl_ops.checkpoint.chunks import placement
from fused_rl_ops.checkpoint.ranks import Entry, Group, Piece
from fused_rl_ops.checkpoint.sharding import ShardSpec
from tests.helpers.checkpoint import reference_shard

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def placements(draw):
    """(global shape, ShardSpec, tp, tp rank, (start, stop) or None for the whole shard)."""
    ndim = draw(st.integers(1, 3))
    spec = ShardSpec(draw(st.one_of(st.none(), st.integers(0, ndim - 1))), draw(st.integers(1, 2)))
    tp = draw(st.integers(1, 3)) if spec.sharded else 1
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    if spec.sharded:
        shape[spec.dim] *= spec.stride * tp
    local = math.prod(shape) // tp
    piece = draw(st.one_of(st.none(), st.tuples(st.integers(0, local - 1), st.integers(1, local)).filter(
        lambda r: r[0] < r[1])))
    return tuple(shape), spec, tp, draw(st.integers(0, tp - 1)), piece


@settings(max_examples=300)
@given(placements())
def test_chunks_hold_the_global_elements_of_a_shard_or_a_piece(case):
    shape, spec, tp, tp_rank, piece = case
    everything = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    shard = reference_shard(everything, spec.dim, spec.stride, tp, tp_rank) if spec.sharded else everything
    if piece is None:
        entry, wanted = Entry("w", shard, spec, Group(tp, tp_rank, tuple(range(tp)))), shard.reshape(-1)
    else:
        wanted = shard.reshape(-1)[piece[0]:piece[1]].clone()
        entry = Entry("w", wanted, spec, Group(tp, tp_rank, tuple(range(tp))), piece=Piece(*piece, tuple(shard.shape)))
    placed = placement(entry, entry.local)
    if piece is None and not spec.sharded:
        assert placed is None  # a plain tensor: DCP's own handling
        return
    assert tuple(placed.global_shape) == shape
    seen = []
    for at_global, in_handed in placed.chunks.items():
        in_global = everything[tuple(slice(o, o + n) for o, n in zip(at_global, in_handed.shape))]
        assert in_handed.untyped_storage().data_ptr() == entry.local.untyped_storage().data_ptr()  # nothing copied
        assert torch.equal(in_global, in_handed), (at_global, tuple(in_handed.shape))
        seen.append(in_global.reshape(-1))
    assert torch.equal(torch.cat(seen).sort().values, wanted.sort().values)
