"""The option groups a call passes to the ops over a vocab-parallel output layer: every such op's
schema takes the logit map, the vocab shard and the tiling first (SHARED_GROUPS), then its own group."""
from typing import NamedTuple

from .._options import op_arguments
from ..logit_options import LogitMap
from .shard import VocabShard
from .tiling import Tiling

SHARED_GROUPS = (LogitMap, VocabShard, Tiling)


class KernelOptions(NamedTuple):
    """A call's option groups, in the schemas' order."""
    logit_map: LogitMap
    shard: VocabShard
    tiling: Tiling
    own: object  # the op's own option group (an options dataclass)

    def arguments(self) -> tuple:
        """The ops' options, after their tensors."""
        return op_arguments(*self)

    def shared_arguments(self) -> tuple:
        """The options of the shared groups alone, for an op with no own group."""
        return op_arguments(self.logit_map, self.shard, self.tiling)
