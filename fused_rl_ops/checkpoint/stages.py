"""Pipeline stages: layers stored under their global number, for save_sharded / load_sharded.

A pipeline stage numbers its layers locally (`decoder.layers.0` is global layer 2 on the second
stage of a 4-layer, 2-stage megatron-core model). Each element of a numbered layer list
(`<p>layers.<i>`) that carries megatron-core's `layer_number` (1-based, global: TransformerLayer,
HybridStack's layers, MTP layers) is stored as `<p>layers.<layer_number - 1>`, so a checkpoint
loads at any pipeline degree. Modules outside the layer lists (embedding on the first stage,
output layer and final norm on the last) keep their names. With tied embeddings a last stage
without the embedding holds its own copy of the word embeddings as `output_layer.weight` (megatron-
core keeps the copies equal); it is stored once, under the embedding's name. At pipeline degree > 1
a layer without `layer_number`, or a plain state dict (whose names say nothing of the stage), cannot
be placed and is refused.
"""
import re
from typing import NamedTuple, Optional

import torch

__all__ = ["StageLayout"]

# The outermost numbered layer a name lies in: `decoder.layers.3.mlp.experts.local_experts.1.x` is in
# `decoder.layers.3` (the lazy prefix stops at the first `layers.<i>.`).
_LAYER_NAME = re.compile(r"^(?P<layers>(?:.*?\.)?layers)\.(?P<index>\d+)(?P<rest>\..+)$")
_LAYER_MODULE = re.compile(r"^(?:.*\.)?layers\.\d+$")


def _layer_numbers(module: torch.nn.Module) -> dict:
    """`<p>layers.<i>` -> global layer index, for each numbered layer of module with an int
    layer_number; raises where two layers of one list claim the same global number."""
    numbers = {}
    for name, sub in module.named_modules():
        number = getattr(sub, "layer_number", None)
        if _LAYER_MODULE.match(name) and isinstance(number, int):
            numbers[name] = number - 1
    by_list = {}
    for name, index in sorted(numbers.items()):
        other = by_list.setdefault((name.rpartition(".")[0], index), name)
        if other != name:
            raise ValueError(f"{other} and {name}: both say they are global layer {index} (layer_number {index + 1})")
    return numbers


def _tied_output_weights(module: torch.nn.Module) -> dict:
    """{a last stage's output weight: the word embeddings it is a copy of}, for each megatron-core
    LanguageModule with tied embeddings whose stage does not hold the embedding."""
    tied = {}
    for name, sub in module.named_modules():
        output_weight = getattr(getattr(sub, "output_layer", None), "weight", None)
        if (getattr(sub, "share_embeddings_and_output_weights", False) and getattr(sub, "post_process", False)
                and not hasattr(sub, "embedding") and isinstance(output_weight, torch.nn.Parameter)):
            prefix = f"{name}." if name else ""
            tied[f"{prefix}output_layer.weight"] = f"{prefix}embedding.word_embeddings.weight"
    return tied


class StageLayout(NamedTuple):
    """This rank's pipeline stage: the degree, the global index of each of its numbered layers
    (None for a plain state dict), their stored names and its tied output weights."""

    pp_size: int
    layers: Optional[dict] = None  # `<p>layers.<local>` -> global index
    stored_layers: frozenset = frozenset()  # `<p>layers.<global>` of each
    tied: dict = {}

    @classmethod
    def of(cls, module: Optional[torch.nn.Module], pp_size: int) -> "StageLayout":
        """The stage of module (None: a plain state dict) at pipeline degree pp_size."""
        if module is None:
            return cls(pp_size)
        layers = _layer_numbers(module)
        stored = frozenset(f"{layer.rpartition('.')[0]}.{index}" for layer, index in layers.items())
        return cls(pp_size, layers, stored, _tied_output_weights(module))

    def stored_name(self, name: str) -> str:
        """name with its layer's local index replaced by the global one (a tied output weight: the
        embedding's name); raises where it lies in a numbered layer whose global number is unknown at
        pipeline degree > 1."""
        if name in self.tied:
            return self.tied[name]
        match = _LAYER_NAME.match(name)
        if not match:
            return name
        layer = f"{match['layers']}.{match['index']}"
        if self.layers is None or layer not in self.layers:
            if self.pp_size == 1:
                return name
            if self.layers is None:
                raise ValueError(
                    f"{name}: a plain state dict cannot be placed at pipeline-parallel degree {self.pp_size}: its "
                    "layer names are local to the stage; pass the model (whose layers carry megatron-core's "
                    "layer_number) instead")
            raise ValueError(
                f"{name}: its layer {layer} has no layer_number, so its global layer is unknown at "
                f"pipeline-parallel degree {self.pp_size} (megatron-core's layers carry it)")
        return f"{match['layers']}.{self.layers[layer]}{match['rest']}"

    def holds(self, stored_name: str) -> bool:
        """Whether a stored name is this stage's: outside the numbered layers, or in one of its layers
        (at pipeline degree 1 every name is)."""
        match = _LAYER_NAME.match(stored_name)
        return not match or self.pp_size == 1 or f"{match['layers']}.{int(match['index'])}" in self.stored_layers
