"""The option groups a call passes to the ops over a vocab-parallel output layer: every such op's
schema takes the logit map, the vocab shard and the tiling (SHARED_GROUPS), then its own group; an
op that reads a second model's logits (vocab_divergence) takes that model's map, a TeacherLogitMap,
right after the first's."""
from typing import NamedTuple, Optional

from .._options import op_arguments
from ..logit_options import LogitMap, TeacherLogitMap
from .shard import VocabShard
from .tiling import Tiling

SHARED_GROUPS = (LogitMap, VocabShard, Tiling)


class KernelOptions(NamedTuple):
    """A call's option groups."""
    logit_map: LogitMap
    shard: VocabShard
    tiling: Tiling
    own: object  # the op's own option group (an options dataclass)
    teacher_logit_map: Optional[TeacherLogitMap] = None

    def arguments(self) -> tuple:
        """The ops' options, after their tensors, in the schema's order."""
        maps = (self.logit_map,) if self.teacher_logit_map is None else (self.logit_map, self.teacher_logit_map)
        return op_arguments(*maps, self.shard, self.tiling, self.own)

    def shared_arguments(self) -> tuple:
        """The options of the shared groups alone, for an op with no own group."""
        return op_arguments(self.logit_map, self.shard, self.tiling)
