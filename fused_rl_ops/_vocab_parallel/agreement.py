"""The agreement check of a tensor-parallel group: every rank raises the same error when one rank
rejected its arguments or the ranks disagree on what they must share (their fields) or hold vocab
shards that do not tile the vocabulary. One all-gather of a few int64 per rank (a host
synchronisation on CUDA); a second, only when some rank failed, to share the messages. Without it a
failing rank would leave the others waiting in the op's first collective."""
import dataclasses
import math
import operator
import struct
import typing
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist


class Codec(NamedTuple):
    """How a field's value travels as one int64, and is shown again when the ranks disagree."""
    encode: Callable[[object], int]
    decode: Callable[[int], object]
    shown: bool = True  # False: the message says the values differ, not what they are


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INTEGER = Codec(int, int)
DTYPE = Codec(_DTYPES.index, _DTYPES.__getitem__)


def token_fingerprint(tokens: Optional[torch.Tensor]) -> int:
    """A cheap fingerprint of the ids and their order (distinct weights per position); -1 for None."""
    if tokens is None:
        return -1
    flat = tokens.reshape(-1).long()
    return int((flat * (torch.arange(flat.numel(), device=flat.device) % 8191 + 1)).sum())


# Ids or a mask (or None), compared by fingerprint: computed only when the ranks are compared.
FINGERPRINT = Codec(token_fingerprint, int, shown=False)


def option_codec(kind: type) -> Codec:
    """An option's value (kind float or int, or None) as the bits of float(value), None as those of
    NaN, which no option takes."""
    return Codec(lambda v: _float_bits(math.nan if v is None else float(v)),
                 lambda bits: None if math.isnan(_bits_float(bits)) else kind(_bits_float(bits)))


class Field(NamedTuple):
    """A value the ranks compare: its name in the errors, how it travels, where a record holds it."""
    name: str
    codec: Codec
    value_of: Callable[[object], object]


def agreed(name: str, codec: Codec):
    """A field of an agreed_dataclass: name is how the errors call it."""
    return dataclasses.field(metadata={"name": name, "codec": codec})


def agreed_options():
    """A field of an agreed_dataclass holding an options object (its annotation: an options
    dataclass): its options marked agreed are compared, each by its own name."""
    return dataclasses.field(metadata={"options": True})


def agreed_dataclass(cls):
    """cls (AgreedCall or a subclass) as a frozen, keyword-only dataclass of what the ranks of a
    tensor-parallel group must pass alike besides their shards, with FIELDS: the Field of each value
    compared, in order (a base class's first)."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if "options" in f.metadata:
            fields += [Field(o.name, option_codec(o.kind), operator.attrgetter(f"{f.name}.{o.name}"))
                       for o in hints[f.name].OPTIONS if o.agreed]
        else:
            fields.append(Field(f.metadata["name"], f.metadata["codec"], operator.attrgetter(f.name)))
    cls.FIELDS = tuple(fields)
    return cls


@agreed_dataclass
class AgreedCall:
    """What the ranks of every vocab-parallel op compare; an op's subclass adds its own."""
    token_count: int = agreed("token count", INTEGER)
    hidden_size: int = agreed("hidden size", INTEGER)
    dtype: torch.dtype = agreed("dtype", DTYPE)
    vocab_size: int = agreed("vocab_size", INTEGER)


def check_agreement(op: str, tp_group, declaration: type, error: Optional[Exception], shard: Optional[tuple],
                    agreed_values) -> None:
    """Raises on every rank of tp_group, with the same message, when any rank rejected its arguments
    (error; shard and agreed_values are then None) or the ranks disagree on a field of declaration
    (an AgreedCall subclass; agreed_values: this rank's record of it), or hold shards (vocab_start,
    V_local) that do not tile [0, total rows), or a vocab_size beyond the total rows."""
    fields = declaration.FIELDS
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(tp_group)) else "cpu"
    mine = [int(error is not None)] + ([0] * (2 + len(fields)) if error is not None else
                                       [*shard, *(f.codec.encode(f.value_of(agreed_values)) for f in fields)])
    gathered = [torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=device), group=tp_group)
    rows = torch.stack(gathered).tolist()
    if any(row[0] for row in rows):
        messages = [None] * len(rows)
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=tp_group)
        if error is not None:
            raise error
        failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
        raise ValueError(f"{op}: other ranks of tp_group rejected their arguments ({failed})")
    for k, field in enumerate(fields):
        encoded = [row[3 + k] for row in rows]
        if len(set(encoded)) > 1:
            shown = f"per rank: {[field.codec.decode(v) for v in encoded]}" if field.codec.shown else "differ"
            raise ValueError(f"{op}: the ranks of tp_group disagree on the {field.name} ({shown})")
    _check_shards_tile(op, [(row[1], row[2]) for row in rows], agreed_values.vocab_size)


def _check_shards_tile(op: str, shards: list, vocab_size: int) -> None:
    total = 0
    for start, rows_here in sorted(shards):
        if start != total:
            listed = [(start, start + rows) for start, rows in shards]
            raise ValueError(f"{op}: the ranks' vocab shards [vocab_start, vocab_start + V_local) must "
                             f"tile [0, total rows) without gaps or overlaps; got {listed} by rank")
        total += rows_here
    if vocab_size > total:
        raise ValueError(f"{op}: vocab_size {vocab_size} is beyond the {total} rows the ranks hold")
