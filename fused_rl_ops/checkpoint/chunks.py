"""Where the tensor a rank holds lies in the logical global tensor, as DCP chunks.

A TP shard (ShardSpec: dim, stride) holds the rank's part of each of the `stride` equal blocks
of the global tensor along `dim`: one chunk per block. A Piece (elements [start, stop) of the
flattened TP shard: a DistributedOptimizer's range) is cut into boxes, each contiguous in
row-major order (the end of a row, whole rows, the start of a row, dimension by dimension), and
those at the stride blocks; each chunk's elements are a strided view of the Piece's, so nothing is
copied. placement() is the one place that says where a rank's chunks lie; the planners
(planners.py) hand them to DCP.
"""
import math
from typing import NamedTuple, Optional

import torch

from .sharding import global_shape

__all__ = ["Placement", "placement"]


def _at(coords: tuple, dim: int, value: int) -> tuple:
    return coords[:dim] + (value,) + coords[dim + 1:]


def _boxes(shape: tuple, start: int, stop: int) -> list:
    """(offset, size) of the boxes, each contiguous in row-major order, that make up elements
    [start, stop) (start < stop) of a tensor of shape."""
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row

    def in_row(index, begin, end):
        return [((index, *offset), (1, *size)) for offset, size in _boxes(shape[1:], begin, end)]

    if first == last:
        return in_row(first, start - first * row, stop - first * row)
    boxes = []
    if start % row:
        boxes += in_row(first, start % row, row)
        first += 1
    if stop // row > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (stop // row - first, *shape[1:])))
    if stop % row:
        boxes += in_row(stop // row, 0, stop % row)
    return boxes


def _chunks(shape: tuple, spec, tp_size: int, tp_rank: int, boxes: list) -> list:
    """(global offset, offset in the TP shard, size) of each chunk of the given boxes of a TP shard
    of shape: each box cut at the stride blocks (a box that is empty along the sharded dim keeps a
    chunk per block, as a whole empty shard does)."""
    if not spec.sharded:
        return [(offset, offset, size) for offset, size in boxes]
    dim, stride = spec.dim, spec.stride
    block = shape[dim] // stride
    chunks = []
    for offset, size in boxes:
        for b in range(stride):
            low, high = max(offset[dim], b * block), min(offset[dim] + size[dim], (b + 1) * block)
            if low < high or not size[dim]:
                at_global = b * block * tp_size + tp_rank * block + low - b * block
                chunks.append((_at(offset, dim, at_global), _at(offset, dim, low), _at(size, dim, high - low)))
    return chunks


def _piece_chunk(data: torch.Tensor, piece, in_shard: tuple, size: tuple) -> torch.Tensor:
    """The elements of a chunk (at in_shard, of size, in the TP shard) as a view of data, a Piece's
    elements: strided as the TP shard is."""
    strides = torch.empty(piece.shape, device="meta").stride()
    first = sum(offset * stride for offset, stride in zip(in_shard, strides)) - piece.start
    return data.as_strided(size, strides, data.storage_offset() + first)


class Placement(NamedTuple):
    """Where a rank's tensor lies in the logical global tensor: the global tensor's shape, and the
    elements of each chunk (a view of the rank's tensor) by the chunk's global offset, in order."""

    global_shape: tuple
    chunks: dict


def placement(entry, data: torch.Tensor) -> Optional[Placement]:
    """The Placement of a tensor entry (ranks.Entry) whose elements DCP writes from or reads into
    data (the rank's TP shard, or its Piece's flat elements), None where data is the whole global
    tensor."""
    piece, spec = entry.piece, entry.spec
    if piece is not None and piece.shape:
        chunks = _chunks(piece.shape, spec, entry.tp.size, entry.tp.rank, _boxes(piece.shape, piece.start, piece.stop))
        views = {at_global: _piece_chunk(data, piece, in_shard, size) for at_global, in_shard, size in chunks}
    elif spec.sharded:
        chunks = _chunks(entry.shape, spec, entry.tp.size, entry.tp.rank, [((0,) * data.dim(), entry.shape)])
        views = {at_global: data[tuple(slice(o, o + n) for o, n in zip(in_shard, size))]
                 for at_global, in_shard, size in chunks}
    else:
        return None
    return Placement(global_shape(entry.shape, spec, entry.tp.size), views)
