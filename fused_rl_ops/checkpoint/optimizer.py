"""An optimizer's state in a save_sharded checkpoint, keyed by parameter name.

Optimizers: a torch.optim optimizer over the module's parameters, and megatron-core's own
(FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer and a ChainedOptimizer of
them, as megatron.core.optimizer.get_megatron_optimizer builds it), recognised by class without
importing megatron. Each is seen as slots: for each module parameter it trains, the torch.optim
optimizer that steps it (a Megatron optimizer's `.optimizer`) and the tensor that one steps, its
"main" tensor: the parameter itself, its fp32 main copy (the mixed-precision optimizers, for a
bf16 / fp16 parameter), or, with DistributedOptimizer, this data-parallel rank's range of the
flattened parameter (of either), none on the ranks that hold no range of it.

For the parameter stored as `<p>` (its name in the module; experts under their global index):
- `<p>/optimizer/state/<key>`: each state entry. A tensor of the main tensor's shape (exp_avg,
  exp_avg_sq, momentum_buffer...) is stored with the parameter's own Entry fields (ShardSpec,
  group), so it is stored and resharded as the parameter is; a 0-d tensor (`step`) as a replicated
  tensor and a Python number as an object, both checked equal across the ranks that share it.
- `<p>/optimizer/main_param`: the fp32 main copy, stored as the parameter is (where there is one).
- `<p>/optimizer/param_group`: the torch.optim optimizer's class and the hyperparameters of the
  parameter's group (lr, betas, weight_decay, and megatron-core's own keys).
A DistributedOptimizer's rank holds a range of each tensor: an Entry with its Piece, which the
ranks check tile the parameter (ranks.py) and which is stored as chunks of the global tensor
(chunks.py), so a checkpoint holds one global tensor per state whatever the optimizer, and loads
into any of them at any layout.

A load reads the state into the optimizer's own tensors where they fit (in place; a range through
a temporary), into new ones otherwise (an optimizer before its first step has none), the main
copies into the main tensors themselves, and hands the state to each torch.optim optimizer's own
load_state_dict, which applies torch.optim's rules (e.g. where `step` lives).
"""
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor

from .integrity import read_objects
from .ranks import Entry, Piece
from .sharding import ShardSpec, global_shape

__all__ = ["OptimizerLoad", "check_optimizer_type", "entries_to_save", "install_optimizer_state", "is_optimizer_item",
           "optimizer_items_to_load", "read_optimizer_objects"]

_MARK = "/optimizer/"
_REPLICATED = ShardSpec(None)
_SCALAR_OBJECTS = (bool, int, float, type(None))
_MEGATRON = "megatron.core.optimizer"
_MEGATRON_SUPPORTED = ("ChainedOptimizer", "DistributedOptimizer", "Float16OptimizerWithFloat16Params", "FP32Optimizer")


def is_optimizer_item(stored_name: str) -> bool:
    return _MARK in stored_name


def _state_item(stored: str, key: str) -> str:
    return f"{stored}{_MARK}state/{key}"


def _group_item(stored: str) -> str:
    return f"{stored}{_MARK}param_group"


def _main_item(stored: str) -> str:
    return f"{stored}{_MARK}main_param"


def _class_name(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _megatron_class(optimizer) -> Optional[str]:
    """The name of optimizer's class where it is one of megatron-core's optimizers we read."""
    cls = type(optimizer)
    return cls.__name__ if cls.__module__.startswith(_MEGATRON) and cls.__name__ in _MEGATRON_SUPPORTED else None


def _unsupported(optimizer) -> Optional[str]:
    """What in one of megatron-core's mixed-precision or FP32 optimizers keeps state that would not be
    stored, or None."""
    inner, scaler = optimizer.optimizer, getattr(optimizer, "grad_scaler", None)
    ddp_config = getattr(optimizer, "ddp_config", None)  # DistributedOptimizer's
    if optimizer.config.use_precision_aware_optimizer:
        return ("use_precision_aware_optimizer (Transformer Engine's FusedAdam keeps the main parameters and state in "
                "other dtypes, inside itself)")
    if not isinstance(inner, torch.optim.Optimizer) or type(inner).__name__ == "HybridDeviceOptimizer":
        return f"its optimizer {type(inner).__name__} (CPU offloading: the state is split over devices)"
    if scaler is not None and type(scaler).__name__ != "ConstantGradScaler":
        return f"{type(scaler).__name__} (fp16 with dynamic loss scaling: the scaler's state would not be stored)"
    if ddp_config is not None and (ddp_config.use_megatron_fsdp or getattr(ddp_config, "fp8_param_gather", False)
                                   or getattr(ddp_config, "fp4_param_gather", False)):
        return "Megatron FSDP or FP8 / FP4 parameters (the main parameters are not ranges of plain tensors)"
    return None


def check_optimizer_type(optimizer):
    """Raises TypeError unless optimizer is None, a torch.optim.Optimizer or one of megatron-core's
    optimizers in a configuration whose state is all in its main tensors and torch.optim state."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    kind = _megatron_class(optimizer)
    if kind is None:
        megatron = any(c.__name__ == "MegatronOptimizer" for c in type(optimizer).__mro__)
        raise TypeError(
            f"optimizer: expected a torch.optim.Optimizer or one of megatron-core's {', '.join(_MEGATRON_SUPPORTED)}; "
            f"got {_class_name(optimizer) if megatron else type(optimizer).__name__}")
    if kind == "ChainedOptimizer":
        for member in optimizer.chained_optimizers:
            check_optimizer_type(member)
    elif not optimizer.is_stub_optimizer and (reason := _unsupported(optimizer)):
        raise TypeError(f"optimizer: {kind} with {reason} is not supported")


class _Slot(NamedTuple):
    """One module parameter as an optimizer holds it (module docstring)."""

    inner: object  # the torch.optim optimizer that steps main
    group: Optional[int]  # main's param group in inner (None where this rank holds none of param)
    param: torch.Tensor  # the module's parameter
    main: Optional[torch.Tensor]  # what inner steps; None where this rank holds none of it
    piece: Optional[Piece]  # the range of param that main holds (DistributedOptimizer), None for all of it
    main_is_copy: bool  # main is an fp32 copy of a bf16 / fp16 param
    data_parallel_group: object = None  # the group a DistributedOptimizer shards inner's state over


def _slots(optimizer) -> list:
    kind = _megatron_class(optimizer)
    if kind is None:  # a torch.optim optimizer
        return [_Slot(optimizer, g, p, p, None, False) for g, group in enumerate(optimizer.param_groups)
                for p in group["params"]]
    if kind == "ChainedOptimizer":
        return [slot for member in optimizer.chained_optimizers for slot in _slots(member)]
    if optimizer.is_stub_optimizer:  # no parameters on this rank
        return []
    if kind == "FP32Optimizer":
        return _slots(optimizer.optimizer)
    if kind == "Float16OptimizerWithFloat16Params":
        groups = zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups, optimizer.fp32_from_fp32_groups)
        return [slot for g, (float16, mains, fp32) in enumerate(groups) for slot in (
            *(_Slot(optimizer.optimizer, g, p, main, None, True) for p, main in zip(float16, mains)),
            *(_Slot(optimizer.optimizer, g, p, p, None, False) for p in fp32))]
    return _distributed_slots(optimizer)


def _distributed_slots(optimizer) -> list:
    """A DistributedOptimizer's slots: its parameters with a range on this rank (the range its
    data-parallel rank owns in megatron-core's gbuf_ranges), then the other parameters of its
    buffers, with none."""
    slots, group = [], optimizer.data_parallel_group
    groups = zip(optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups, optimizer.model_fp32_groups,
                 optimizer.shard_fp32_groups)
    for g, (float16, float16_mains, fp32, fp32_mains) in enumerate(groups):
        for params, mains, main_is_copy in ((float16, float16_mains, True), (fp32, fp32_mains, False)):
            for param, main in zip(params, mains):
                gbuf, dtype, bucket = optimizer.model_param_gbuf_map[param]
                owned = optimizer.gbuf_ranges[gbuf][dtype][bucket]["param_map"][param]["param"]
                piece = Piece(owned.start, owned.end, tuple(param.shape))
                slots.append(_Slot(optimizer.optimizer, g, param, main, piece, main_is_copy, group))
    with_range = {id(slot.param) for slot in slots}
    for buffer in optimizer.buffers:
        slots += [_Slot(optimizer.optimizer, None, p, None, Piece(0, 0, tuple(p.shape)), False, group)
                  for p in buffer.params if id(p) not in with_range]
    return slots


class _Held(NamedTuple):
    """One slot of the optimizer, with its parameter's stored name and Entry."""

    slot: _Slot
    stored: str
    entry: Entry


def _held_slots(optimizer, state: dict, entries: dict) -> list:
    """The optimizer's slots, each parameter found by identity among the module's state dict values
    (a tensor shared under two names goes by the first)."""
    by_id = {}
    for stored, entry in entries.items():
        by_id.setdefault(id(state[entry.module_name]), (stored, entry))
    held, foreign = [], []
    for slot in _slots(optimizer):
        param = slot.param
        if id(param) not in by_id:
            where = "" if slot.group is None else f"param_groups[{slot.group}]: "
            foreign.append(f"{where}{type(param).__name__} of shape {tuple(param.shape)}")
            continue
        stored, entry = by_id[id(param)]
        if isinstance(param, DTensor):
            raise ValueError(f"{entry.module_name}: optimizer state of DTensor parameters is not supported")
        held.append(_Held(slot, stored, entry))
    if foreign:
        raise ValueError(
            f"optimizer holds parameters that are not in the module (its state_dict(keep_vars=True)): {foreign}")
    return held


def _whole(slot: _Slot) -> Optional[Piece]:
    """The Piece of an object or 0-d tensor of slot: held only by the ranks with a range of a
    DistributedOptimizer's parameter; None (held with the parameter) otherwise."""
    return None if slot.piece is None else Piece(0, 1, ())


def _state_entry(held: _Held, key: str, value) -> Entry:
    slot, entry = held.slot, held.entry
    name = f"{entry.module_name} (optimizer state {key!r})"
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        if value.shape == slot.main.shape:
            return entry._replace(module_name=name, local=value, piece=slot.piece)
        if value.dim() == 0:
            return entry._replace(module_name=name, local=value, spec=_REPLICATED, piece=_whole(slot))
        raise ValueError(
            f"{name}: has shape {tuple(value.shape)}; only state tensors of the shape of the tensor the optimizer "
            f"steps, {tuple(slot.main.shape)} (stored as the parameter is), and scalars can be stored")
    if isinstance(value, _SCALAR_OBJECTS):
        return entry._replace(module_name=name, local=value, spec=None, piece=_whole(slot))
    raise ValueError(f"{name}: is a {type(value).__name__}; expected a tensor or a number")


def _main_entry(held: _Held) -> Entry:
    return held.entry._replace(module_name=f"{held.entry.module_name} (optimizer's fp32 main parameter)",
                               local=held.slot.main, piece=held.slot.piece)


# Keys of a param group that are not hyperparameters: its parameters, and megatron-core's
# is_expert_parallel, which says whether the experts have their own groups at this layout.
_NOT_HYPERPARAMETERS = ("params", "param_names", "is_expert_parallel")


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}


def entries_to_save(optimizer, state: dict, entries: dict) -> dict:
    """stored name -> Entry of every optimizer item (module docstring), given the module's entries."""
    items = {}
    for held in _held_slots(optimizer, state, entries):
        slot, entry = held.slot, held.entry
        if slot.main is None:
            continue
        hyperparameters = _hyperparameters(slot.inner.param_groups[slot.group])
        group = {"optimizer": _class_name(slot.inner), "hyperparameters": hyperparameters}
        items[_group_item(held.stored)] = entry._replace(
            module_name=f"{entry.module_name} (optimizer param group)", local=group, spec=None, piece=_whole(slot))
        for key, value in slot.inner.state.get(slot.main, {}).items():
            items[_state_item(held.stored, key)] = _state_entry(held, key, value)
        if slot.main_is_copy:
            items[_main_item(held.stored)] = _main_entry(held)
    return items


class OptimizerLoad(NamedTuple):
    """What a load of the optimizer's items reads, from the checkpoint's metadata: its slots (_Held),
    the state keys stored for each (by stored name), and the Entries of its tensor items to read."""

    held: list
    keys: dict
    tensors: dict


def _check_main_copies(held: _Held, stored: dict, path: str):
    """Raises where the checkpoint has an fp32 main copy of the parameter and the optimizer has none,
    or the other way round."""
    slot, name = held.slot, held.entry.module_name
    has_main = _main_item(held.stored) in stored
    if slot.main_is_copy and not has_main:
        raise ValueError(
            f"{name}: checkpoint {path!r} holds no fp32 main parameter for it, which the optimizer keeps for its "
            f"{slot.param.dtype} parameter (saved with an optimizer that steps the parameter itself?)")
    if has_main and not slot.main_is_copy:
        raise ValueError(
            f"{name}: checkpoint {path!r} holds an fp32 main parameter for it, which the optimizer does not keep (it "
            f"steps the {slot.param.dtype} parameter itself): loading would drop the main parameter")


def optimizer_items_to_load(optimizer, state: dict, entries: dict, metadata, path: str) -> OptimizerLoad:
    """The optimizer's items to read, after checking that the checkpoint holds state for exactly
    the optimizer's parameters among the module's (entries), main copies where it keeps them."""
    stored = metadata.state_dict_metadata
    held = _held_slots(optimizer, state, entries)
    missing = sorted(h.entry.module_name for h in held if _group_item(h.stored) not in stored)
    if missing:
        raise ValueError(f"checkpoint {path!r} holds no optimizer state for {missing} (saved without optimizer=?)")
    mine = {n.split(_MARK)[0] for n in stored if is_optimizer_item(n)} & entries.keys()  # of this rank's parameters
    foreign = sorted(mine - {h.stored for h in held})
    if foreign:
        raise ValueError(f"checkpoint {path!r} holds optimizer state for {foreign}, which the optimizer does not hold")
    keys, tensors = {}, {}
    for h in held:
        if h.slot.main is None:
            continue
        _check_main_copies(h, stored, path)
        prefix = _state_item(h.stored, "")
        keys[h.stored] = [n[len(prefix):] for n in stored if n.startswith(prefix)]
        current = h.slot.inner.state.get(h.slot.main, {})
        for key in keys[h.stored]:
            md = stored[_state_item(h.stored, key)]
            if not isinstance(md, BytesStorageMetadata):
                tensors[_state_item(h.stored, key)] = _target(h, key, md, current.get(key), path)
        if h.slot.main_is_copy:
            tensors[_main_item(h.stored)] = _main_entry(h)
    return OptimizerLoad(held, keys, tensors)


def _target(held: _Held, key: str, md, current, path: str) -> Entry:
    """The Entry to read state `key` of held into: its current tensor where it fits, else a new one."""
    slot, entry = held.slot, held.entry
    param_shape = global_shape(entry.shape, entry.spec, entry.tp.size)
    if tuple(md.size) == param_shape:
        shape, device = slot.main.shape, slot.main.device
    elif len(md.size) == 0:
        shape, device = (), current.device if isinstance(current, torch.Tensor) else "cpu"
    else:
        raise ValueError(
            f"{entry.module_name}: checkpoint {path!r} holds optimizer state {key!r} of shape {tuple(md.size)}, "
            f"neither the parameter's global shape {param_shape} nor a scalar")
    fits = (isinstance(current, torch.Tensor) and not isinstance(current, DTensor) and current.shape == shape
            and current.dtype == md.properties.dtype)
    local = current if fits else torch.empty(shape, dtype=md.properties.dtype, device=device)
    return _state_entry(held, key, local)


def read_optimizer_objects(load: OptimizerLoad, metadata, path: str) -> dict:
    """This rank's object items (read and verified against their checksums), once checked: the
    torch.optim optimizer's class, and one set of hyperparameters for each of its param groups."""
    stored = metadata.state_dict_metadata
    held = [h for h in load.held if h.slot.main is not None]
    names = [_group_item(h.stored) for h in held]
    names += [_state_item(h.stored, k) for h in held for k in load.keys[h.stored]
              if isinstance(stored[_state_item(h.stored, k)], BytesStorageMetadata)]
    try:
        objects = read_objects(path, metadata, names)
    except Exception as exc:  # damage (a checksum mismatch, an unreadable pickle) or an I/O error
        raise ValueError(f"reading the optimizer's objects from checkpoint {path!r} failed: {exc}") from exc
    groups = {}
    for h in held:
        saved, inner = objects[_group_item(h.stored)], h.slot.inner
        if saved["optimizer"] != _class_name(inner):
            raise ValueError(f"{h.entry.module_name}: checkpoint {path!r} holds the state of {saved['optimizer']}, "
                             f"the optimizer is {_class_name(inner)}")
        first = groups.setdefault((id(inner), h.slot.group), (h.entry.module_name, saved["hyperparameters"]))
        if first[1] != saved["hyperparameters"]:
            raise ValueError(
                f"optimizer param_groups[{h.slot.group}] holds {first[0]} and {h.entry.module_name}, whose "
                f"hyperparameters in checkpoint {path!r} differ: {first[1]} and {saved['hyperparameters']}")
    return objects


def _hyperparameters_of_groups(held: list, objects: dict) -> dict:
    """group index in inner -> the hyperparameters read for it. A DistributedOptimizer's rank may
    step no range of a group's parameters, so those of its data-parallel group exchange theirs."""
    mine = {h.slot.group: objects[_group_item(h.stored)]["hyperparameters"] for h in held if h.slot.main is not None}
    data_parallel_group = held[0].slot.data_parallel_group
    if data_parallel_group is None or not dist.is_initialized():
        return mine
    everyone = [None] * dist.get_world_size(data_parallel_group)
    dist.all_gather_object(everyone, mine, group=data_parallel_group)
    return {g: hyperparameters for theirs in everyone for g, hyperparameters in theirs.items()}


def install_optimizer_state(load: OptimizerLoad, objects: dict):
    """Hands the read state (load.tensors, read into by now) and hyperparameters to each torch.optim
    optimizer (its load_state_dict), by position; the main copies were read in place. Collective
    over the data-parallel groups of DistributedOptimizers."""
    by_inner = {}
    for h in load.held:
        by_inner.setdefault(id(h.slot.inner), (h.slot.inner, []))[1].append(h)
    for inner, held in by_inner.values():
        position = {id(p): i for i, p in enumerate(p for group in inner.param_groups for p in group["params"])}
        param_groups = [{**group, "params": [position[id(p)] for p in group["params"]]} for group in inner.param_groups]
        for g, hyperparameters in _hyperparameters_of_groups(held, objects).items():
            param_groups[g].update(hyperparameters)
        state = {}
        for h in held:
            names = [_state_item(h.stored, key) for key in load.keys.get(h.stored, ())]
            if names:
                state[position[id(h.slot.main)]] = {key: load.tensors[n].local if n in load.tensors else objects[n]
                                                    for key, n in zip(load.keys[h.stored], names)}
        inner.load_state_dict({"state": state, "param_groups": param_groups})
