"""Which rows of the vocabulary a rank's shard of the output layer holds: the VocabShard option group
and its resolution from a call's arguments."""
import dataclasses
from typing import Optional

from .._options import NON_NEGATIVE_INTEGER, check_options, option, options_dataclass


@options_dataclass
class VocabShard:
    """An option group of the vocab-parallel ops (declared for C++ as FRL_VOCAB_SHARD): weight
    [V_local, H] holds the global vocabulary rows vocab_start
    .. vocab_start + V_local - 1, of which the first valid_rows are vocabulary and the rest padding
    (None: all of them)."""
    vocab_start: int = option(NON_NEGATIVE_INTEGER)
    valid_rows: Optional[int] = option(NON_NEGATIVE_INTEGER)

    def __post_init__(self):
        check_options(type(self).__name__, self)


def resolve_shard(op: str, local_vocab: int, rank: int, world: int, vocab_start: Optional[int],
                  vocab_size: Optional[int]) -> tuple[VocabShard, int]:
    """(shard, vocab_size) of a rank's weight of local_vocab rows in a tensor-parallel group of
    world ranks: vocab_start defaults to rank * local_vocab, vocab_size (the real vocabulary, the
    rows past it padding) to every row of every rank. Raises what this rank can see to be wrong;
    the ranks' shards are compared by the agreement check."""
    vocab_start = rank * local_vocab if vocab_start is None else vocab_start
    vocab_size = world * local_vocab if vocab_size is None else vocab_size
    shard = VocabShard(vocab_start, None)  # vocab_start checked before it is read
    if vocab_size < 1:
        raise ValueError(f"{op}: vocab_size must be >= 1, got {vocab_size}")
    if world == 1 and (vocab_start != 0 or vocab_size > local_vocab):
        raise ValueError(f"{op}: without a tensor-parallel group the weight holds the whole vocabulary: "
                         f"vocab_start must be 0 and vocab_size <= {local_vocab} (its rows), got vocab_start "
                         f"{vocab_start} and vocab_size {vocab_size}")
    return dataclasses.replace(shard, valid_rows=min(max(vocab_size - vocab_start, 0), local_vocab)), vocab_size
