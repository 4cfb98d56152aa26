"""How a rank computes its vocab shard: VocabPieces.

By default the shard is one piece: the ops run once over the rank's rows, their partials are merged
over the ranks in rank order and the hidden gradient is all-reduced. With batch_invariant=True the
padded vocabulary is split into VIRTUAL_SHARDS fixed virtual shards (fewer where the padded
vocabulary has fewer factors of two), the same at every tensor-parallel degree dividing their
count: a rank runs the ops once per virtual shard it holds, so every chunk and GEMM has the same
shape at every degree; the partials are merged in the global order of the virtual shards and the
hidden gradients summed in a fixed binary tree over them (the ranks exchanging whole subtrees), so a
token's results are bitwise the same at every such degree (docs/determinism.md)."""
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .group import TensorParallelGroup
from .kernel_options import KernelOptions

VIRTUAL_SHARDS = 8  # the most virtual shards: TP degrees 1, 2, 4 and 8 agree bit for bit


def virtual_shard_count(padded_vocab: int) -> int:
    """The virtual shards of a padded vocabulary: the largest power of two dividing it, at most
    VIRTUAL_SHARDS (it depends on the padded vocabulary alone, not on the TP degree)."""
    count = 1
    while count < VIRTUAL_SHARDS and padded_vocab % (2 * count) == 0:
        count *= 2
    return count


def check_virtual_shards(op: str, local_rows: int, rank: int, world: int, vocab_start: int) -> None:
    """Raises where batch_invariant=True cannot split world ranks' shards of local_rows rows into
    whole virtual shards held in rank order."""
    padded = local_rows * world
    count = virtual_shard_count(padded)
    if count % world:
        raise ValueError(f"{op}: batch_invariant=True splits the padded vocabulary ({padded} rows) into {count} "
                         f"virtual shards (the largest power of two dividing it, at most {VIRTUAL_SHARDS}); "
                         f"a tensor-parallel group of {world} ranks does not hold whole ones: use a TP degree "
                         f"dividing {count}, or pad the vocabulary to a multiple of {VIRTUAL_SHARDS * world}")
    if vocab_start != rank * local_rows:
        raise ValueError(f"{op}: batch_invariant=True needs rank r of tp_group to hold the rows from "
                         f"r * V_local; rank {rank} has vocab_start {vocab_start}, not {rank * local_rows}")


@dataclass(frozen=True)
class VocabPieces:
    """The pieces a rank computes its shard in (module docstring): count pieces of rows rows each;
    tree: the hidden gradients are summed in the virtual shards' fixed tree."""
    tp: TensorParallelGroup
    rows: int
    count: int
    tree: bool

    @classmethod
    def of(cls, tp: TensorParallelGroup, local_rows: int, batch_invariant: bool) -> "VocabPieces":
        if not batch_invariant:
            return cls(tp, local_rows, 1, False)
        world = dist.get_world_size(tp.group) if tp.distributed else 1
        count = virtual_shard_count(local_rows * world) // world
        return cls(tp, local_rows // count, count, True)

    def each(self, kernel_options: KernelOptions, *row_tensors: Optional[torch.Tensor]) -> Iterator[tuple]:
        """(kernel_options, *row_tensors) of each piece, in vocabulary order: the piece's shard and
        rows of each of row_tensors ([V_local, ...] each: weights, main_grad; None stays None)."""
        if self.count == 1:
            yield kernel_options, *row_tensors
            return
        shard = kernel_options.shard
        valid = self.rows * self.count if shard.valid_rows is None else shard.valid_rows
        for k in range(self.count):
            start = k * self.rows
            piece_shard = dataclasses.replace(shard, vocab_start=shard.vocab_start + start,
                                              valid_rows=min(max(valid - start, 0), self.rows))
            yield (kernel_options._replace(shard=piece_shard),
                   *(None if t is None else t.narrow(0, start, self.rows) for t in row_tensors))

    def weight_grad_buffer(self, weight: torch.Tensor, main_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Where the backward ops add the pieces' weight gradients: main_grad; without it, in the
        fixed pieces, a zeroed buffer of weight's shape, so that the shard's gradient is not put
        together from the pieces' (a second [V_local, H] at once: extra memory growing with V), one
        way at every degree; None: the one piece's op returns it."""
        if main_grad is None and self.tree:
            return torch.zeros_like(weight)
        return main_grad

    @staticmethod
    def weight_grad(buffer: Optional[torch.Tensor], returned: list) -> torch.Tensor:
        """The shard's weight gradient (no main_grad): the buffer of weight_grad_buffer, or the one
        piece's returned gradient."""
        return returned[0] if buffer is None else buffer

    def gather(self, stacked: torch.Tensor) -> torch.Tensor:
        """The pieces' [count, ...] of every rank, [ranks * count, ...] in vocabulary order."""
        return self.tp.gather(stacked).flatten(0, 1)

    def sum(self, parts: Iterator[torch.Tensor], reduce: bool = True) -> torch.Tensor:
        """The pieces' parts (fp32 hidden gradients or sums, in vocabulary order, each the op's own
        buffer: summed in place) summed, and over the ranks where reduce: by default in order and
        all-reduced; in the fixed tree otherwise (reduce False: this rank's subtree)."""
        if not self.tree:
            total = _sum_in_order(parts)
            if reduce:
                self.tp.all_reduce(total)  # fp32: the sum is taken before rounding
            return total
        total = _sum_in_tree(parts)
        return _butterfly_sum(total, self.tp.group) if reduce and self.tp.distributed else total


def _sum_in_order(parts):
    total = None
    for g in parts:
        total = g if total is None else total.add_(g)
    return total


def _sum_in_tree(parts):
    """A power-of-two count of tensors summed in the binary tree ((g0 + g1) + (g2 + g3)) + ..., at
    most log2(count) + 1 held at once."""
    done = []  # (height, subtree sum), heights decreasing
    for g in parts:
        height = 0
        while done and done[-1][0] == height:
            g = done.pop()[1].add_(g)
            height += 1
        done.append((height, g))
    assert len(done) == 1, "the pieces are a power of two"
    return done[0][1]


def _butterfly_sum(total: torch.Tensor, group) -> torch.Tensor:
    """The ranks' subtree sums summed up the tree, in place, on every rank: in round k rank r adds
    the sum of its partner r ^ 2^k, the sibling subtree; fp addition commutes, so both partners get
    the same bits."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(total)
    step = 1
    while step < world:
        peer = dist.get_global_rank(group, rank ^ step)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, total, peer, group),
                                           dist.P2POp(dist.irecv, received, peer, group)])
        for request in requests:
            request.wait()
        total.add_(received)
        step *= 2
    return total
