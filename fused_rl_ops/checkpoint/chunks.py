"""Where the tensor a rank holds lies in the logical global tensor, as DCP chunks.

A TP shard (ShardSpec: dim, stride) holds the rank's part of each of the `stride` equal blocks
of the global tensor along `dim`: one chunk per block. A Piece (elements [start, stop) of the
flattened TP shard: a DistributedOptimizer's range) is cut into boxes, each contiguous in
row-major order (the end of a row, whole rows, the start of a row, dimension by dimension), and
those at the stride blocks; it travels in a slab, the rows of the TP shard it touches, so that
every box is a slice of one tensor. dcp_tensor is the one place that sets DCP's
CheckpointableTensor fields.
"""
import math

import torch

from .sharding import global_shape

__all__ = ["dcp_tensor", "piece_of"]


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


def _slab_rows(piece) -> tuple:
    """(first row, rows, elements per row) of the TP shard that a Piece of a tensor with dims touches."""
    row = math.prod(piece.shape[1:])
    first = piece.start // row
    return first, -(-piece.stop // row) - first, row


def piece_of(buffer: torch.Tensor, entry) -> torch.Tensor:
    """The elements of entry's Piece in buffer, its dcp_tensor (buffer itself where the entry is
    a whole TP shard or a 0-d tensor)."""
    if entry.piece is None or not entry.piece.shape:
        return buffer
    first, _, row = _slab_rows(entry.piece)
    return buffer.view(-1)[entry.piece.start - first * row:entry.piece.stop - first * row]


def dcp_tensor(entry, make_buffer) -> torch.Tensor:
    """The tensor handed to DCP for a tensor entry (ranks.Entry): make_buffer(entry.local) for a
    whole TP shard, a new slab holding the elements of a Piece (filled with entry.local); marked
    with where its chunks lie in the global tensor where that is not the tensor's own shape."""
    piece, spec = entry.piece, entry.spec
    if piece is not None and piece.shape:
        first, rows, _ = _slab_rows(piece)
        buffer = entry.local.new_empty((rows, *piece.shape[1:]))
        piece_of(buffer, entry).copy_(entry.local)
        boxes = _boxes(piece.shape, piece.start, piece.stop)
    elif spec.sharded:
        buffer = make_buffer(entry.local)
        boxes, first = [((0,) * buffer.dim(), tuple(buffer.shape))], 0
    else:
        return make_buffer(entry.local)
    chunks = _chunks(entry.shape, spec, entry.tp.size, entry.tp.rank, boxes)
    buffer.global_shape = global_shape(entry.shape, spec, entry.tp.size)
    buffer.global_offsets = tuple(at_global for at_global, _, _ in chunks)
    buffer.local_offsets = tuple(_at(in_shard, 0, in_shard[0] - first) for _, in_shard, _ in chunks)
    buffer.local_sizes = tuple(size for _, _, size in chunks)
    return buffer
