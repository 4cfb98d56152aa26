"""save_sharded / load_sharded: checkpoints that reshard bit for bit, through torch.distributed.checkpoint.

Every entry is stored as its logical global tensor (a stride-2 GLU fc1 as `[W ; V]`, from its
ShardSpec), expert tensors under their global expert index (experts.py), so a checkpoint loads at
any (TP, EP, expert TP) layout whose degrees divide the sharded dims and the expert count, and plain
`dcp.load` of a full tensor reads the real weight. A module's layers are stored under their global
number (stages.py), so it also loads at any pipeline degree. Groups: `tp_group` for dense tensors,
`ep_group`, `expert_tp_group` for experts, `pp_group` (the pipeline stages); those left None come
from megatron-core's parallel_state when it is initialised, else: the world for tp_group where it is
one rank (more ranks need a tp_group), no expert or pipeline parallelism, `expert_tp_group` =
`tp_group`. Data-parallel replicas must hold the same bytes (checked; when megatron-core's DDP has
a parameter all-gather pending, param_gather.py, or reduces experts' gradients over the dense group,
experts.py, the error says so) and are stored once.
`optimizer=` (a torch.optim optimizer over the module's parameters, or one of megatron-core's with
fp32 main copies, distributed over the data-parallel ranks or not) saves and loads its state with
the module, each state tensor stored and resharded as its parameter (optimizer.py; a
DistributedOptimizer's ranges as chunks, chunks.py). A load of the weights alone into parameters
that a megatron-core optimizer keeps fp32 main copies of (`param.main_param`) needs
`main_params_of=` that optimizer, whose main copies it then refreshes from the loaded weights
(megatron-core's reload_model_params): left stale, the next step would write them back over the
load. The planners (planners.py) tell DCP where each rank's chunks lie in the global tensors.

Both check first, collectively (ranks.py); a load checks the checkpoint's metadata (its checksum and
structure, metadata.py) and the checkpoint against the module (names, global shapes, dtypes,
divisibility, expert counts, data files), so such errors leave the module untouched on every rank;
strict=False loads what the two share and returns the rest. Loading then reads straight into the
module's tensors (parameters keep their storage: views into Megatron's DDP buffers stay views),
verifying each item's checksum (integrity.py); `staged=True` reads into temporaries first, so that
a checksum mismatch or an I/O error mid-read also leaves the module unchanged. A save commits
atomically over the checkpoint it replaces (integrity.py). Both are collective over the default
group and need the xxhash package.
"""
import contextlib
import warnings
from typing import NamedTuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ._torch_private import EXTRA_STATE_KEY_SUFFIX
from .chunks import placement
from .experts import (check_expert_counts, check_grouped_glu_not_interleaved, experts_reduced_over_the_dense_group,
                      is_extra_state)
from .integrity import ChecksummedReader, ChecksummedWriter, require_xxhash
from .metadata import check_data_files, read_metadata
from .planners import LoadPlanner, SavePlanner
from .optimizer import (check_optimizer_type, entries_to_save, install_optimizer_state, is_optimizer_item,
                        optimizer_items_to_load, read_optimizer_objects)
from .param_gather import pending_param_gather
from .ranks import Layout, check_ranks_agree, layout_of, local_entries, raised_together
from .sharding import global_shape

__all__ = ["IncompatibleKeys", "load_sharded", "save_sharded"]


def _alias(local: torch.Tensor) -> torch.Tensor:
    """local's storage under a new tensor object that autograd does not track: DCP writes from it
    and reads into it in place, so the parameter keeps its storage (Megatron's DDP holds it as a
    view of a buffer)."""
    return local.detach()


def _dcp_state(entries: dict, make_buffer) -> tuple:
    """(the state dict handed to DCP: each tensor as make_buffer(local), other objects as they are;
    the Placement of each tensor that is not its whole global tensor, for the planners)."""
    state = {name: entry.local if entry.spec is None else make_buffer(entry.local) for name, entry in entries.items()}
    placements = {name: placement(entries[name], state[name]) for name in state if entries[name].spec is not None}
    return state, {name: placed for name, placed in placements.items() if placed is not None}


@contextlib.contextmanager
def _quiet_if_one_process():
    """DCP warns at each save and load without torch.distributed that it assumes one process: that
    is the use documented here (one rank needs no process group), so, then, that warning alone is
    silenced."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


def _state_of(module_or_state_dict) -> dict:
    if isinstance(module_or_state_dict, torch.nn.Module):
        return module_or_state_dict.state_dict(keep_vars=True)  # keep_vars: Parameters keep their attributes
    return dict(module_or_state_dict)


def save_sharded(module_or_state_dict: Union[torch.nn.Module, dict], path: str, *, tp_group=None, ep_group=None,
                 expert_tp_group=None, pp_group=None, optimizer=None) -> None:
    """Saves each entry as its logical global tensor with DCP, and optimizer's state with them (see
    the module docstring). A state dict must be state_dict(keep_vars=True) to go with an optimizer; a
    plain state dict at pipeline degree > 1 is refused: its layer names do not say which layers they are."""
    require_xxhash()
    check_optimizer_type(optimizer)
    module = module_or_state_dict if isinstance(module_or_state_dict, torch.nn.Module) else None
    if module is not None:
        check_grouped_glu_not_interleaved(module)
    state = _state_of(module_or_state_dict)
    with raised_together():
        layout = layout_of(state, (tp_group, ep_group, expert_tp_group, pp_group), module)
        entries = local_entries(state, layout)
        if optimizer is not None:
            entries.update(entries_to_save(optimizer, state, entries))
    why_bytes_differ = pending_param_gather(module, optimizer) or experts_reduced_over_the_dense_group(
        state, layout.tp.size, layout.expert_tp.size)
    check_ranks_agree(entries, layout, with_checksums=True, why_bytes_differ=why_bytes_differ)
    entries = {name: entry for name, entry in entries.items() if not entry.optional}
    state, placements = _dcp_state(entries, _alias)
    with _quiet_if_one_process():
        dcp.save(state, storage_writer=ChecksummedWriter(path), planner=SavePlanner(placements))


class IncompatibleKeys(NamedTuple):
    """What a load left out, as nn.Module.load_state_dict reports it: the module's entries the
    checkpoint lacks (this rank's, by their names in the module), and the checkpoint's entries that
    no rank's module holds (by their stored names)."""

    missing_keys: list
    unexpected_keys: list


def _unmatched(entries: dict, layout: Layout, metadata: Metadata, path: str, held_anywhere: set) -> tuple:
    """(the stored names of entries the checkpoint lacks, the checkpoint's names no rank holds:
    held_anywhere), once the optional entries it lacks are removed from entries and its experts are
    found to fit the module's."""
    stored = metadata.state_dict_metadata
    check_expert_counts([n for n in stored.keys() if layout.stage.holds(n)], layout.experts, path)
    for name in [n for n, entry in entries.items() if entry.optional and n not in stored]:
        del entries[name]
    # Optimizer items are checked by optimizer_items_to_load, and ignored by a load without optimizer=.
    unexpected = sorted(n for n in stored.keys() - held_anywhere if not is_optimizer_item(n))
    return sorted(entries.keys() - stored.keys()), unexpected


def _check_fits(entries: dict, metadata: Metadata):
    """Raises where an entry of the checkpoint does not fit the module's: an object for a tensor or
    the other way round, another dtype, a global shape other than the module's at its TP degree."""
    stored = metadata.state_dict_metadata
    for name, entry in entries.items():
        module_name, local, spec, tp = entry[:4]
        md = stored[name]
        if (spec is None) != isinstance(md, BytesStorageMetadata):
            kinds = ("an object", "a tensor") if spec is None else ("a tensor", "an object")
            raise ValueError(f"{module_name}: the module holds {kinds[0]}, the checkpoint {kinds[1]} (as {name})")
        if spec is None:
            continue
        if md.properties.dtype != local.dtype:
            raise ValueError(f"{module_name}: the checkpoint holds {md.properties.dtype}, the module {local.dtype}")
        if is_extra_state(module_name):
            continue  # a serialised state (Transformer Engine's): its length is the checkpoint's
        saved_shape = tuple(md.size)
        if spec.sharded and len(saved_shape) == len(entry.shape) and saved_shape[spec.dim] % (spec.stride * tp.size):
            raise ValueError(
                f"{module_name}: cannot be split across tensor-parallel degree {tp.size}: dim {spec.dim} has "
                f"{saved_shape[spec.dim]} entries in the checkpoint, not a multiple of {tp.size} ranks x "
                f"stride {spec.stride}")
        expected = global_shape(entry.shape, spec, tp.size)
        if saved_shape != expected:
            raise ValueError(
                f"{module_name}: the checkpoint holds global shape {saved_shape} (as {name}), the module expects "
                f"{expected} (local {entry.shape} at tensor-parallel degree {tp.size})")


def _failures(exc: dcp.CheckpointException) -> str:
    return "; ".join(f"rank {rank}: {error!r}" for rank, (error, _) in sorted(exc.failures.items()))


def _read(entries: dict, metadata: Metadata, path: str, staged: bool) -> dict:
    """stored name -> what DCP read for it: straight into the entries' tensors, or staged into
    temporaries; an extra state's tensor at its stored length."""
    loaded, placements = _dcp_state(entries, torch.empty_like if staged else _alias)
    for name, entry in entries.items():
        if entry.spec is not None and is_extra_state(entry.module_name):
            # get_extra_state() made a new tensor: read into one of the stored size, then hand it over.
            loaded[name] = entry.local.new_empty(metadata.state_dict_metadata[name].size)
            placements.pop(name, None)
    try:
        with _quiet_if_one_process():
            dcp.load(loaded, storage_reader=ChecksummedReader(path, metadata), planner=LoadPlanner(placements))
    except dcp.CheckpointException as exc:
        if staged:
            raise RuntimeError(
                f"reading checkpoint {path!r} failed; the module was left unchanged: {_failures(exc)}") from exc
        raise RuntimeError(
            f"reading checkpoint {path!r} failed part-way; the module may be partially loaded (pass staged=True "
            f"to read into temporaries first and leave it unchanged on such a failure): {_failures(exc)}") from exc
    return loaded


def _install(module: torch.nn.Module, entries: dict, loaded: dict, staged: bool):
    """Hands extra states to their modules and, staged, copies the temporaries into the entries' tensors."""
    with torch.no_grad():
        for name, entry in entries.items():
            if is_extra_state(entry.module_name):
                owner = entry.module_name[: -len(EXTRA_STATE_KEY_SUFFIX)].rstrip(".")
                module.get_submodule(owner).set_extra_state(loaded[name])
            elif staged:
                entry.local.copy_(loaded[name])


def load_sharded(module: torch.nn.Module, path: str, *, tp_group=None, ep_group=None, expert_tp_group=None,
                 pp_group=None, staged: bool = False, optimizer=None, strict: bool = True,
                 main_params_of=None) -> IncompatibleKeys:
    """Loads a save_sharded checkpoint into module at its (TP, EP, PP) layout, in place or staged, and
    into optimizer its state and hyperparameters (module docstring); every data-parallel replica reads
    its own copy. strict=False loads the entries the module and the checkpoint share, leaving the
    module's others as they are; the entries either lacks are returned (strict=True raises naming
    them). An optimizer= needs state for all its parameters either way. main_params_of: without
    optimizer=, the megatron-core optimizer whose fp32 main copies of the parameters take the loaded
    weights (required where it keeps such copies)."""
    require_xxhash()
    check_optimizer_type(optimizer)
    _check_main_params_of(main_params_of, optimizer)
    check_grouped_glu_not_interleaved(module)
    state = module.state_dict(keep_vars=True)
    with raised_together():
        layout = layout_of(state, (tp_group, ep_group, expert_tp_group, pp_group), module)
        entries = local_entries(state, layout)
    held_anywhere = check_ranks_agree(entries, layout, with_checksums=False)
    with raised_together():
        metadata = read_metadata(path)
        if optimizer is not None:
            optimizer_load = optimizer_items_to_load(optimizer, state, entries, metadata, path)
            entries.update(optimizer_load.tensors)
        missing, unexpected = _unmatched(entries, layout, metadata, path, held_anywhere)
        if strict and (missing or unexpected):
            described = [entries[n].module_name + ("" if n == entries[n].module_name else f" (stored as {n})")
                         for n in missing]
            raise ValueError(f"checkpoint {path!r} does not match the module: missing {sorted(described)}, unexpected "
                             f"{unexpected} (strict=False loads what matches)")
        missing = sorted(entries.pop(n).module_name for n in missing)
        _check_fits(entries, metadata)
        if optimizer is None and main_params_of is None:
            _refuse_stale_main_params(entries)
        check_data_files(metadata, path)
        if optimizer is not None:
            optimizer_objects = read_optimizer_objects(optimizer_load, metadata, path)
    loaded = _read(entries, metadata, path, staged)
    _install(module, entries, loaded, staged)
    if optimizer is not None:
        install_optimizer_state(optimizer_load, optimizer_objects)
    if main_params_of is not None:
        main_params_of.reload_model_params()
    return IncompatibleKeys(missing, unexpected)


def _check_main_params_of(main_params_of, optimizer):
    if main_params_of is None:
        return
    if optimizer is not None:
        raise ValueError("load_sharded: give optimizer= (a checkpoint with its state, main copies included) or "
                         "main_params_of= (a checkpoint of weights alone), not both")
    if not callable(getattr(main_params_of, "reload_model_params", None)):
        raise TypeError(f"load_sharded: main_params_of must be a megatron-core optimizer (it keeps fp32 main copies "
                        f"of the parameters), got {type(main_params_of).__name__}")


def _refuse_stale_main_params(entries: dict):
    """A ValueError where the load would overwrite parameters that a megatron-core optimizer keeps fp32
    main copies of (its Float16OptimizerWithFloat16Params and DistributedOptimizer set param.main_param
    on each bf16 / fp16 parameter they train, on every data-parallel rank)."""
    kept = sorted(entry.module_name for entry in entries.values() if hasattr(entry.local, "main_param"))
    if kept:
        raise ValueError(
            f"load_sharded: a megatron-core optimizer keeps fp32 main copies of {kept[0]}"
            f"{f' and {len(kept) - 1} more parameters' if len(kept) > 1 else ''} (param.main_param); a load of the "
            "weights alone would leave them as they were, and the next optimizer step would write them back over "
            "the loaded weights. Pass main_params_of=optimizer (the load then copies the loaded weights into its "
            "main copies), or optimizer=optimizer for a checkpoint saved with the optimizer's state, or load "
            "before building the optimizer")
