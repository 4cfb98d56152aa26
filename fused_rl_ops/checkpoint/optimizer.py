"""A torch.optim optimizer's state in a save_sharded checkpoint, keyed by parameter name.

For the parameter stored as `<p>` (its name in the module; experts under their global index):
- `<p>/optimizer/state/<key>`: each state entry. A tensor of the parameter's shape (exp_avg,
  exp_avg_sq, momentum_buffer...) is stored with the parameter's own Entry fields (ShardSpec, group),
  so it is stored and resharded as the parameter is; a 0-d tensor (`step`) as a replicated tensor
  and a Python number as an object, both checked equal across the ranks that share it.
- `<p>/optimizer/param_group`: the optimizer's class and the hyperparameters of the parameter's
  group (lr, betas, weight_decay...).

A load reads the state into the optimizer's own tensors where they fit (in place), into new ones
otherwise (an optimizer before its first step has none), and hands it over through the optimizer's
own load_state_dict, which applies torch.optim's rules (e.g. where `step` lives). Megatron's own
optimizers (DistributedOptimizer and the others) are refused: their state is not per parameter.
"""
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor

from .integrity import ChecksummedReader
from .ranks import Entry
from .sharding import ShardSpec, global_shape

__all__ = ["OptimizerLoad", "check_optimizer_type", "entries_to_save", "install_optimizer_state", "is_optimizer_item",
           "optimizer_items_to_load", "read_optimizer_objects"]

_MARK = "/optimizer/"
_REPLICATED = ShardSpec(None)
_SCALAR_OBJECTS = (bool, int, float, type(None))


def is_optimizer_item(stored_name: str) -> bool:
    return _MARK in stored_name


def _state_item(stored: str, key: str) -> str:
    return f"{stored}{_MARK}state/{key}"


def _group_item(stored: str) -> str:
    return f"{stored}{_MARK}param_group"


def _class_name(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def check_optimizer_type(optimizer):
    """Raises TypeError unless optimizer is None or a torch.optim.Optimizer; Megatron's optimizers
    are recognised by class, without importing megatron."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    megatron = [c.__name__ for c in type(optimizer).__mro__ if c.__module__.startswith("megatron.core.optimizer")]
    if "MegatronOptimizer" in megatron:
        raise TypeError(
            f"optimizer: {type(optimizer).__name__} is one of Megatron's optimizers ({_class_name(optimizer)}, a "
            "MegatronOptimizer): its state belongs to fp32 main copies of the parameters (with DistributedOptimizer, "
            "sharded over the data-parallel ranks in flat buffers), not to the module's parameters, so it cannot be "
            "stored by parameter name. Save it with megatron.core.dist_checkpointing (its sharded_state_dict), or "
            "train with a torch.optim optimizer over model.parameters() (use_distributed_optimizer=False; "
            "FP32Optimizer's .optimizer is one) and pass that")
    raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")


class _Held(NamedTuple):
    """One parameter of the optimizer: its group, the tensor itself, and its stored name and Entry."""

    group: int
    param: torch.Tensor
    stored: str
    entry: Entry


def _held_parameters(optimizer, state: dict, entries: dict) -> list:
    """The optimizer's parameters in its order, each found by identity among the module's state dict
    values (a tensor shared under two names goes by the first)."""
    by_id = {}
    for stored, entry in entries.items():
        by_id.setdefault(id(state[entry.module_name]), (stored, entry))
    held, foreign = [], []
    for group_index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in by_id:
                foreign.append(f"param_groups[{group_index}]: {type(param).__name__} of shape {tuple(param.shape)}")
                continue
            stored, entry = by_id[id(param)]
            if isinstance(param, DTensor):
                raise ValueError(f"{entry.module_name}: optimizer state of DTensor parameters is not supported")
            held.append(_Held(group_index, param, stored, entry))
    if foreign:
        raise ValueError(
            f"optimizer holds parameters that are not in the module (its state_dict(keep_vars=True)): {foreign}")
    return held


def _state_entry(held: _Held, key: str, value) -> Entry:
    name = f"{held.entry.module_name} (optimizer state {key!r})"
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        if value.shape == held.entry.local.shape:
            return held.entry._replace(module_name=name, local=value)
        if value.dim() == 0:
            return held.entry._replace(module_name=name, local=value, spec=_REPLICATED)
        raise ValueError(
            f"{name}: has shape {tuple(value.shape)}; only state tensors of the parameter's shape "
            f"{tuple(held.entry.local.shape)} (stored as the parameter is) and scalars can be stored")
    if isinstance(value, _SCALAR_OBJECTS):
        return held.entry._replace(module_name=name, local=value, spec=None)
    raise ValueError(f"{name}: is a {type(value).__name__}; expected a tensor or a number")


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def entries_to_save(optimizer, state: dict, entries: dict) -> dict:
    """stored name -> Entry of every optimizer item (module docstring), given the module's entries."""
    items = {}
    for held in _held_parameters(optimizer, state, entries):
        group = {"optimizer": _class_name(optimizer),
                 "hyperparameters": _hyperparameters(optimizer.param_groups[held.group])}
        items[_group_item(held.stored)] = held.entry._replace(
            module_name=f"{held.entry.module_name} (optimizer param group)", local=group, spec=None)
        for key, value in optimizer.state.get(held.param, {}).items():
            items[_state_item(held.stored, key)] = _state_entry(held, key, value)
    return items


class OptimizerLoad(NamedTuple):
    """What a load of the optimizer's items reads, from the checkpoint's metadata: its parameters
    (_Held, in its order), the state keys stored for each (by stored name), and the Entries of its
    tensor items to read."""

    held: list
    keys: dict
    tensors: dict


def optimizer_items_to_load(optimizer, state: dict, entries: dict, layout, metadata, path: str) -> OptimizerLoad:
    """The optimizer's items to read, after checking that the checkpoint holds state for exactly
    the optimizer's parameters (of this rank's experts and stage)."""
    stored = metadata.state_dict_metadata
    held = _held_parameters(optimizer, state, entries)
    names = {h.stored for h in held}
    missing = sorted(h.entry.module_name for h in held if _group_item(h.stored) not in stored)
    if missing:
        raise ValueError(f"checkpoint {path!r} holds no optimizer state for {missing} (saved without optimizer=?)")
    mine = {n.split(_MARK)[0] for n in stored if is_optimizer_item(n) and layout.experts.holds(n) and layout.stage.holds(n)}
    foreign = sorted(mine - names)
    if foreign:
        raise ValueError(f"checkpoint {path!r} holds optimizer state for {foreign}, which the optimizer does not hold")
    keys, tensors = {}, {}
    for h in held:
        prefix = _state_item(h.stored, "")
        keys[h.stored] = [n[len(prefix):] for n in stored if n.startswith(prefix)]
        current = optimizer.state.get(h.param, {})
        for key in keys[h.stored]:
            md = stored[_state_item(h.stored, key)]
            if not isinstance(md, BytesStorageMetadata):
                tensors[_state_item(h.stored, key)] = _target(h, key, md, current.get(key), path)
    return OptimizerLoad(held, keys, tensors)


def _target(held: _Held, key: str, md, current, path: str) -> Entry:
    """The Entry to read state `key` of held into: its current tensor where it fits, else a new one."""
    entry = held.entry
    param_shape = global_shape(entry.local.shape, entry.spec, entry.tp.size)
    if tuple(md.size) == param_shape:
        shape, device = entry.local.shape, held.param.device
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


def read_optimizer_objects(optimizer, load: OptimizerLoad, metadata, path: str) -> dict:
    """This rank's object items (read and verified against their checksums), once checked: the
    optimizer's class, and one set of hyperparameters for each of its param groups."""
    stored = metadata.state_dict_metadata
    names = [_group_item(h.stored) for h in load.held]
    names += [_state_item(h.stored, k) for h in load.held for k in load.keys[h.stored]
              if isinstance(stored[_state_item(h.stored, k)], BytesStorageMetadata)]
    objects = dict.fromkeys(names)
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        dcp.load(objects, storage_reader=ChecksummedReader(path, metadata), planner=planner, no_dist=True)
    except dcp.CheckpointException as exc:
        raise ValueError(f"reading the optimizer's objects from checkpoint {path!r} failed: {exc}") from exc
    groups = {}
    for h in load.held:
        saved = objects[_group_item(h.stored)]
        if saved["optimizer"] != _class_name(optimizer):
            raise ValueError(f"{h.entry.module_name}: checkpoint {path!r} holds the state of {saved['optimizer']}, "
                             f"the optimizer is {_class_name(optimizer)}")
        first = groups.setdefault(h.group, (h.entry.module_name, saved["hyperparameters"]))
        if first[1] != saved["hyperparameters"]:
            raise ValueError(
                f"optimizer param_groups[{h.group}] holds {first[0]} and {h.entry.module_name}, whose hyperparameters "
                f"in checkpoint {path!r} differ: {first[1]} and {saved['hyperparameters']}")
    return objects


def install_optimizer_state(optimizer, load: OptimizerLoad, objects: dict):
    """Hands the read state (load.tensors, read into by now) and hyperparameters to the optimizer
    (its load_state_dict), by position."""
    state = {}
    param_groups = [{**_hyperparameters(group), "params": []} for group in optimizer.param_groups]
    for index, h in enumerate(load.held):
        group = param_groups[h.group]
        group.update(objects[_group_item(h.stored)]["hyperparameters"])
        group["params"].append(index)
        names = [_state_item(h.stored, key) for key in load.keys[h.stored]]
        if names:
            state[index] = {key: load.tensors[n].local if n in load.tensors else objects[n]
                            for key, n in zip(load.keys[h.stored], names)}
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
