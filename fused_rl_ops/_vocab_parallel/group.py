"""The communication of a vocab-parallel op within its tensor-parallel group: TensorParallelGroup."""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


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
