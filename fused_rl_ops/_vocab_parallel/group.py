"""The communication of a vocab-parallel op within its tensor-parallel group: TensorParallelGroup,
and the per-token partials the ranks exchange (StatsColumns, CombinedColumns)."""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .._library import ops


class StatsColumns(NamedTuple):
    """The columns of chosen_logprob_stats' [N, 3 + k] output (k tokens per position): a vocab
    shard's partials of each position's row (the C++ stats_column): the max m
    of its logits, s = sum exp(z - m), t = sum exp(z - m) (z - m), and the k chosen logits (0 when
    another shard holds the token). With top_width the row's top follows them
    (sampler_filter.TOP_HEADER + top_width columns)."""
    max: torch.Tensor
    sum: torch.Tensor
    ent: torch.Tensor
    chosen: torch.Tensor


class CombinedColumns(NamedTuple):
    """The columns of chosen_logprob_combine's [N, 3 + k] output: the shards' partials merged
    (combined_column): the row max, the log-sum relative to it (lse = row_max + log_sum), the
    entropy [N] each, and the chosen logits [N, k]."""
    row_max: torch.Tensor
    log_sum: torch.Tensor
    entropy: torch.Tensor
    chosen: torch.Tensor


# The first chosen-logit column of both (stats_column::chosen).
CHOSEN = 3


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks holding the shards of one output layer (group None: one rank, the whole of it)."""
    group: Optional[dist.ProcessGroup]

    @property
    def distributed(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' t stacked, [ranks, ...] ([1, ...] on one rank)."""
        if not self.distributed:
            return t.unsqueeze(0)
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, t.contiguous(), group=self.group)
        return torch.stack(gathered)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sums t over the ranks, in place."""
        if self.distributed:
            dist.all_reduce(t, group=self.group)

    def combine(self, stats: torch.Tensor) -> CombinedColumns:
        """The ranks' partials of chosen_logprob_stats ([N, 3 + k] each) merged. lse = row_max +
        log_sum, kept apart: z - row_max is exact near the top of the row."""
        merged = ops.chosen_logprob_combine(self.gather(stats))
        return CombinedColumns(*merged[:, :CHOSEN].unbind(1), merged[:, CHOSEN:])
