"""Expert-parallel names for save_sharded / load_sharded: local expert indices to global ones.

megatron-core's SequentialMLP holds an EP rank's experts as `...experts.local_experts.<i>.<rest>`
with i in 0..n-1 (n experts per EP rank); its own sharded state dict puts local expert i of EP rank
e at global index `e * n + i`. The checkpoint stores expert tensors under that global index, in the
same spelling (`...local_experts.<e * n + i>.<rest>`), so at EP 1 stored and module names coincide
and a checkpoint saved at one EP degree loads at any EP degree dividing the expert count.
"""
import re
from typing import NamedTuple, Optional

__all__ = ["ExpertLayout", "check_expert_counts", "expert_prefix"]

_EXPERT_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?local_experts\.)(?P<index>\d+)(?P<rest>\..+)$")


def _split(name: str):
    match = _EXPERT_NAME.match(name)
    return (match["prefix"], int(match["index"]), match["rest"]) if match else None


def expert_prefix(name: str) -> Optional[str]:
    """The experts module (`...local_experts.`) a tensor name belongs to, or None for a dense tensor."""
    parts = _split(name)
    return parts[0] if parts else None


def _indices_by_prefix(names) -> dict:
    indices = {}
    for name in names:
        parts = _split(name)
        if parts:
            indices.setdefault(parts[0], set()).add(parts[1])
    return indices


class ExpertLayout(NamedTuple):
    """This rank's place among the expert-parallel ranks, and its experts per experts module."""

    ep_size: int
    ep_rank: int
    local_counts: dict  # experts prefix -> experts on this rank

    @classmethod
    def of(cls, names, ep_size: int, ep_rank: int) -> "ExpertLayout":
        """Reads the local expert counts from a module's tensor names; each experts module must
        number its local experts 0..n-1."""
        counts = {}
        for prefix, indices in sorted(_indices_by_prefix(names).items()):
            if indices != set(range(len(indices))):
                raise ValueError(f"{prefix}: local expert indices {sorted(indices)} are not 0..{len(indices) - 1}")
            counts[prefix] = len(indices)
        return cls(ep_size, ep_rank, counts)

    def stored_name(self, name: str) -> str:
        """name with its local expert index replaced by the global one (dense names unchanged)."""
        parts = _split(name)
        if not parts:
            return name
        prefix, index, rest = parts
        return f"{prefix}{self.ep_rank * self.local_counts[prefix] + index}{rest}"

    def holds(self, stored_name: str) -> bool:
        """Whether a stored name is a dense tensor or one of this rank's experts."""
        parts = _split(stored_name)
        if not parts:
            return True
        prefix, index, _ = parts
        count = self.local_counts.get(prefix, 0)
        return self.ep_rank * count <= index < (self.ep_rank + 1) * count


def check_expert_counts(stored_names, layout: ExpertLayout, path: str):
    """Raises unless each experts module in the checkpoint numbers its experts 0..G-1 and the module
    holds G / ep_size of them per EP rank (a module's experts missing from the checkpoint included)."""
    stored = _indices_by_prefix(stored_names)
    for prefix in sorted(stored.keys() | layout.local_counts.keys()):
        indices = stored.get(prefix, set())
        count = len(indices)
        expected = layout.ep_size * layout.local_counts.get(prefix, 0)
        if indices != set(range(count)):
            raise ValueError(
                f"checkpoint {path!r}: experts under {prefix} are numbered {sorted(indices)}, not 0..{count - 1}: "
                f"missing {sorted(set(range(max(indices) + 1)) - indices)}")
        if count % layout.ep_size:
            raise ValueError(
                f"checkpoint {path!r}: its {count} experts under {prefix} cannot be split over expert-parallel "
                f"degree {layout.ep_size}")
        if count != expected:
            raise ValueError(
                f"checkpoint {path!r} holds {count} experts under {prefix}, the module {expected} "
                f"({layout.local_counts.get(prefix, 0)} per rank x expert-parallel degree {layout.ep_size})")
