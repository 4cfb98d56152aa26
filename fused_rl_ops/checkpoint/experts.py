"""Expert tensors under their global expert index, for save_sharded / load_sharded.

An EP rank holds n local experts (0..n-1) of each MoE layer, as megatron-core's SequentialMLP
(`<p>experts.local_experts.<i>.<rest>`) or as Transformer Engine GroupedLinear modules
(TEGroupedMLP: `<p>experts.linear_fc1.weight<i>` / `bias<i>`, the same for `linear_fc2`). The
checkpoint stores local expert i of EP rank e as `<p>experts.local_experts.<e * n + i>.<rest>`
(megatron-core's global numbering, SequentialMLP's spelling), so it loads at any EP degree dividing
the expert count and into either layout: per expert both hold the same tensors with the same
tensor-parallel layout.

megatron-core 0.19.2 marks grouped tensors with stride 1, yet a GLU fc1 rank holds `[W_r ; V_r]`
(stride 2): a grouped GLU fc1 (fc1 has twice the rows fc2 has columns) is taken as stride 2, and
any other claim than its place in the MLP gives is a ShardingMetadataError. Interleaved GLU rows
(`moe_mlp_glu_interleave_size`), TE's single grouped weight and FP8 state of grouped experts are
refused. Expert extra states that carry nothing (None, an empty tensor) are left out of a save and
filled only where a checkpoint has them, so either layout loads the other's checkpoint.
"""
import re
from typing import NamedTuple, Optional

import torch

from ._torch_private import EXTRA_STATE_KEY_SUFFIX
from .sharding import ShardingMetadataError, ShardSpec

__all__ = ["ExpertLayout", "check_expert_counts", "check_grouped_glu_not_interleaved", "expert_prefix",
           "experts_reduced_over_the_dense_group", "is_extra_state"]

_SEQUENTIAL_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?local_experts\.)(?P<index>\d+)(?P<rest>\..+)$")
_GROUPED_NAME = re.compile(
    r"^(?P<experts>(?:.*\.)?experts\.)(?P<linear>linear_fc[12])\.(?P<kind>weight|bias)(?P<index>\d+)$")
_SINGLE_GROUPED_NAME = re.compile(r"^(?:.*\.)?experts\.linear_fc[12]\.(?:weight|bias)$")
_GROUPED_EXTRA_STATE = re.compile(rf"^(?:.*\.)?experts\.linear_fc[12]\.{EXTRA_STATE_KEY_SUFFIX}$")

# The tensor-parallel layout each grouped tensor must have: its partition dim, None for replicated.
_GROUPED_DIM = {".linear_fc1.weight": 0, ".linear_fc1.bias": 0, ".linear_fc2.weight": 1, ".linear_fc2.bias": None}


class _ExpertName(NamedTuple):
    prefix: str  # `<p>experts.local_experts.`, whichever the layout
    index: int  # local index in a module's name, global in a stored one
    rest: str  # `.linear_fc1.weight`, ...
    grouped: bool


def _split(name: str) -> Optional[_ExpertName]:
    match = _SEQUENTIAL_NAME.match(name)
    if match:
        return _ExpertName(match["prefix"], int(match["index"]), match["rest"], False)
    match = _GROUPED_NAME.match(name)
    if match:
        return _ExpertName(f"{match['experts']}local_experts.", int(match["index"]),
                           f".{match['linear']}.{match['kind']}", True)
    return None


def is_extra_state(name: str) -> bool:
    """Whether a state dict entry is a module's get_extra_state(): an object, or a tensor made anew
    by each call (Transformer Engine serialises its FP8 state into a uint8 tensor)."""
    return name.endswith(EXTRA_STATE_KEY_SUFFIX)


def expert_prefix(name: str) -> Optional[str]:
    """The experts module (`...local_experts.`) a tensor name belongs to, or None for a dense tensor."""
    parts = _split(name)
    return parts.prefix if parts else None


def _indices_by_prefix(names) -> dict:
    indices = {}
    for name in names:
        parts = _split(name)
        if parts:
            indices.setdefault(parts.prefix, set()).add(parts.index)
    return indices


def _grouped_glu(prefix: str, state: dict) -> bool:
    """Whether the grouped experts under prefix are a GLU: fc1 has twice the rows fc2 has columns
    (a plain MLP: as many)."""
    experts = prefix[: -len("local_experts.")]
    fc1, fc2 = state.get(f"{experts}linear_fc1.weight0"), state.get(f"{experts}linear_fc2.weight0")
    if fc1 is None or fc2 is None or fc1.dim() != 2 or fc2.dim() != 2 or fc1.shape[0] not in (fc2.shape[1],
                                                                                               2 * fc2.shape[1]):
        shapes = [tuple(t.shape) if t is not None else None for t in (fc1, fc2)]
        raise ValueError(f"{experts}linear_fc1.weight0 / linear_fc2.weight0: grouped experts need both, fc1 "
                         f"[F or 2F, H] and fc2 [H, F]; found shapes {shapes}")
    return fc1.shape[0] == 2 * fc2.shape[1]


class ExpertLayout(NamedTuple):
    """This rank's place among the expert-parallel ranks, and its experts per experts module."""

    ep_size: int
    ep_rank: int
    local_counts: dict  # experts prefix -> experts on this rank
    grouped_glu: dict  # experts prefix held as TE GroupedLinear weights -> whether they are a GLU

    @classmethod
    def of(cls, state: dict, ep_size: int, ep_rank: int) -> "ExpertLayout":
        """Reads the local expert counts from a module's state (names, and shapes of grouped experts);
        each experts module must number its local experts 0..n-1 in one layout."""
        single = sorted(n for n in state if _SINGLE_GROUPED_NAME.match(n))
        if single:
            raise ValueError(
                f"{single[0]}: one grouped tensor for all local experts (Transformer Engine's single grouped "
                "weight, moe_single_grouped_weight) is not supported; keep one weight<i> per expert")
        counts, grouped_glu, layouts = {}, {}, {}
        for name in state:
            parts = _split(name)
            if parts:
                layouts.setdefault(parts.prefix, {}).setdefault(parts.grouped, name)
        for prefix, indices in sorted(_indices_by_prefix(state).items()):
            if len(layouts[prefix]) > 1:
                raise ValueError(f"{prefix}: holds experts in both layouts: {layouts[prefix][False]} (SequentialMLP) "
                                 f"and {layouts[prefix][True]} (TE GroupedLinear)")
            if indices != set(range(len(indices))):
                raise ValueError(f"{prefix}: local expert indices {sorted(indices)} are not 0..{len(indices) - 1}")
            counts[prefix] = len(indices)
            if True in layouts[prefix]:
                grouped_glu[prefix] = _grouped_glu(prefix, state)
        return cls(ep_size, ep_rank, counts, grouped_glu)

    def stored_name(self, name: str) -> str:
        """name with its local expert index replaced by the global one, in SequentialMLP's spelling
        (dense names unchanged)."""
        parts = _split(name)
        if not parts:
            return name
        return f"{parts.prefix}{self.ep_rank * self.local_counts[parts.prefix] + parts.index}{parts.rest}"

    def holds(self, stored_name: str) -> bool:
        """Whether a stored name is a dense tensor or one of this rank's experts."""
        parts = _split(stored_name)
        if not parts:
            return True
        count = self.local_counts.get(parts.prefix, 0)
        return self.ep_rank * count <= parts.index < (self.ep_rank + 1) * count

    @staticmethod
    def carries_nothing(name: str, value) -> bool:
        """Whether name is an experts module's extra state that carries nothing (None: megatron-core's
        own linears; an empty tensor: Transformer Engine's without FP8 state), which a save leaves out
        and a load fills only from a checkpoint that has it. A grouped module's FP8 state (one entry
        for all the rank's local experts) is refused."""
        grouped = _GROUPED_EXTRA_STATE.match(name)
        if not grouped and not (is_extra_state(name) and _SEQUENTIAL_NAME.match(name)):
            return False
        if value is None or (isinstance(value, torch.Tensor) and value.numel() == 0):
            return True
        if grouped:
            raise ValueError(
                f"{name}: Transformer Engine FP8 state of grouped experts (one entry for all local experts of the "
                "rank) is not supported: it cannot be stored per expert")
        return False

    def sharding(self, name: str, spec: ShardSpec) -> ShardSpec:
        """The tensor-parallel layout of name as stored: spec (read from its metadata), except for
        grouped experts, checked against the layout their place in the MLP gives (module docstring)."""
        parts = _split(name)
        if not parts or not parts.grouped:
            return spec
        dim = _GROUPED_DIM[parts.rest]
        glu_fc1 = self.grouped_glu[parts.prefix] and parts.rest.startswith(".linear_fc1.")
        strides = (1, 2) if glu_fc1 else (1,)
        if spec.dim != dim or (spec.sharded and spec.stride not in strides):
            wanted = "replicated" if dim is None else f"sharded on dim {dim} with stride {' or '.join(map(str, strides))}"
            raise ShardingMetadataError(
                f"{name}: a grouped expert's {parts.rest[1:]} must be {wanted} over the expert tensor-parallel group, "
                f"its metadata says {spec}")
        return ShardSpec(dim, 2, spec.dialects) if glu_fc1 else spec


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
            held_as = " (as TE grouped weight<i>)" if prefix in layout.grouped_glu else ""
            raise ValueError(
                f"checkpoint {path!r} holds {count} experts under {prefix}, the module {expected}{held_as} "
                f"({layout.local_counts.get(prefix, 0)} per rank x expert-parallel degree {layout.ep_size})")


def check_grouped_glu_not_interleaved(module):
    """Raises for grouped experts (megatron-core TEGroupedMLP) whose GLU fc1 rows are interleaved
    (config.moe_mlp_glu_interleave_size): the checkpoint's logical `[W ; V]` would not be their layout."""
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        size = getattr(config, "moe_mlp_glu_interleave_size", None)
        if size is not None and getattr(config, "gated_linear_unit", False) and hasattr(
                getattr(sub, "linear_fc1", None), "weight0"):
            raise ValueError(
                f"{name or '<model>'}: grouped experts with interleaved GLU rows (moe_mlp_glu_interleave_size="
                f"{size}) are not supported: their fc1 is not the [W ; V] the checkpoint stores")


def experts_reduced_over_the_dense_group(state: dict, tp_size: int, expert_tp_size: int) -> Optional[str]:
    """Why expert copies can hold different bytes at a save, or None: megatron-core marks state's
    experts for the dense data-parallel gradient reduction (`allreduce` True) while their TP degree
    is not the dense one, so their copies on ranks outside that group are never reduced together and
    drift apart in training. megatron-core 0.18 marks experts so at expert-parallel degree 1 (0.19
    reduces them over the expert data-parallel group)."""
    if tp_size == expert_tp_size or not any(
            expert_prefix(name) and getattr(tensor, "allreduce", None) is True for name, tensor in state.items()):
        return None
    return (f"the experts' gradients are reduced over the dense data-parallel group (allreduce=True) while their "
            f"tensor-parallel degree ({expert_tp_size}) is not the dense one ({tp_size}), so their copies on the "
            "tensor-parallel ranks are never reduced together and drift apart in training, as megatron-core 0.18 "
            "trains experts at expert-parallel degree 1; use megatron-core >= 0.19, expert_tensor_parallel_size = "
            "tensor_model_parallel_size, or expert_model_parallel_size > 1")
