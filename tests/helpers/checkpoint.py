"""Reference splits, bit-exact comparisons, toy modules and saves killed part-way for the checkpoint tests.

Shards come from the tests' own reference split (Megatron's rule: chunks of N / (stride * tp), rank
r takes chunks r, r + tp, ...), not from the code under test; data is random bit patterns (NaN
payloads, -0.0 and infinities included) compared through integer views. megatron_training_state
assembles what megatron-core's optimizers hold through megatron-core's own accessors.
"""
import contextlib
import itertools
import os
import pickle
import re
import signal
import zlib

import torch
import torch.distributed as dist

from fused_rl_ops.checkpoint import integrity

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_bits(shape, dtype, seed):
    """A tensor of dtype whose bytes are random: every bit pattern, NaN payloads and -0.0 included."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**15, 2**15, (*shape, dtype.itemsize // 2), dtype=torch.int16, generator=generator)
    return words.view(dtype).reshape(shape)


def bits(t):
    return t.detach().contiguous().view(_INT_OF_SIZE[t.element_size()])


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def reference_shard(full, dim, stride, tp, rank):
    pieces = torch.split(full, full.shape[dim] // (stride * tp), dim)
    return torch.cat(pieces[rank::tp], dim)


def reference_unshard(shards, dim, stride):
    """The logical tensor from all ranks' shards: block b of every rank, in rank order, for each b."""
    blocks = [s.chunk(stride, dim) for s in shards]
    return torch.cat([blocks[r][b] for b in range(stride) for r in range(len(shards))], dim)


def assert_same_training_state(module, optimizer, expected_module, expected_optimizer):
    """module's parameters and optimizer's state are bitwise those of expected_module and
    expected_optimizer, name by name, and the param groups (hyperparameters) are equal."""
    expected = dict(expected_module.named_parameters())
    held = dict(module.named_parameters())
    assert held.keys() == expected.keys(), sorted(held.keys() ^ expected.keys())
    for name, param in held.items():
        assert same_bits(param, expected[name]), name
        state, wanted = optimizer.state[param], expected_optimizer.state[expected[name]]
        assert state.keys() == wanted.keys() and all(same_bits(state[k], wanted[k]) for k in wanted), name
    assert optimizer.state_dict()["param_groups"] == expected_optimizer.state_dict()["param_groups"]


def partition_of(param):
    """(dim, stride) from Megatron's own legacy attributes, or None when replicated."""
    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim, getattr(param, "partition_stride", 1)
    return None


def global_layer_name(name, layer_offset):
    """name with its decoder layer index moved by layer_offset (the stage's first global layer)."""
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + layer_offset}.", name)


def perturb(model, tp_rank, seed, layer_offset=0):
    """Random values everywhere (Megatron initialises norms and biases to constants): the same on
    every TP rank for replicated tensors, rank-dependent for shards, and each decoder layer's own
    values by its global index (layer_offset: the pipeline stage's first layer)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            rank_part = tp_rank if partition_of(param) else 0
            name_seed = zlib.crc32(global_layer_name(name, layer_offset).encode())
            generator = torch.Generator().manual_seed(name_seed + 1000 * seed + rank_part)
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))


def gathered(local, split, group):
    """The logical tensor whose shards (split: (dim, stride), None for a replicated tensor) the ranks
    of group hold, local being this rank's; assembled by the test's reference rule."""
    if split is None:
        return local.detach().clone()
    shards = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, local.detach().clone(), group=group)  # pickled: bit for bit
    return reference_unshard(shards, *split)


def gathered_logical(model, group):
    """The logical tensors of a TP-sharded model, assembled by the test's reference rule."""
    return {name: gathered(param, partition_of(param), group) for name, param in model.named_parameters()}


def _megatron_optimizer_pieces(model, optimizer) -> dict:
    """name -> (start, stop, {"main_param": ..., state key: ...}) for each parameter of model that
    optimizer (one of megatron-core's) steps elements [start, stop) of here: a DistributedOptimizer's
    range (its _get_model_param_range_map), else the whole parameter. The main parameter is the fp32
    copy megatron-core hands the parameter as param.main_param, or where the parameter is fp32, the
    stepped tensor at the range's address (the parameter itself, or a DistributedOptimizer's view of
    its range); the state is its torch.optim state. (Not megatron-core's
    _get_main_param_and_optimizer_states: in 0.19.2 it picks another parameter's main copy in a param
    group that mixes fp32 and bf16 parameters, such as a bf16 model's fp32 value head.)"""
    pieces = {}
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        ranges = getattr(member, "model_param_group_index_map", None)  # a DistributedOptimizer's
        stepped = [p for group in member.optimizer.param_groups for p in group["params"]]
        for name, param in model.named_parameters():
            if ranges is not None and param not in ranges:
                continue
            start, stop = 0, param.numel()
            if ranges is not None:
                owned = member._get_model_param_range_map(param)["param"]
                start, stop = owned.start, owned.end
            main = getattr(param, "main_param", None)
            if main is None:
                address = param.view(-1)[start:stop].data_ptr()
                main = next((p for p in stepped if p.data_ptr() == address and p.numel() == stop - start), None)
            if main is None or not any(main is p for p in stepped):
                continue  # another optimizer of the chain steps it
            state = {key: value for key, value in member.optimizer.state.get(main, {}).items()
                     if isinstance(value, torch.Tensor)}
            pieces[name] = (start, stop, {"main_param": main, **state})
    return pieces


def megatron_training_state(model, optimizer, layer_offset=0) -> dict:
    """global layer name -> {"param": ..., "main_param": ..., state key: ...}: the logical tensors of
    model's parameters and of what one of megatron-core's optimizers keeps for each (its fp32 main
    parameter, or the parameter itself where it steps that; exp_avg, exp_avg_sq, step), assembled
    by the tests' own rule: the ranges the data-parallel ranks step (_megatron_optimizer_pieces)
    put in order, checked to tile each TP shard (replicas: bit for bit the same), then the TP
    shards joined by reference_unshard. layer_offset: the pipeline stage's first layer; experts under
    their global index, from every expert-parallel rank. Collective over the model's (expert)
    data-parallel, tensor-parallel and expert-parallel groups."""
    from megatron.core import parallel_state

    mine = {name: (start, stop, {key: value.detach().clone() for key, value in tensors.items()})
            for name, (start, stop, tensors) in _megatron_optimizer_pieces(model, optimizer).items()}
    state = {}
    for expert in (False, True):  # dense parameters, then experts, over their own groups
        if expert:
            dp_group = parallel_state.get_expert_data_parallel_group()
            tp_group = parallel_state.get_expert_tensor_parallel_group()
        else:
            dp_group = parallel_state.get_data_parallel_group()
            tp_group = parallel_state.get_tensor_model_parallel_group()
        params = {name: p for name, p in model.named_parameters() if (".experts." in name) == expert}
        everyone = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(everyone, {n: piece for n, piece in mine.items() if n in params}, group=dp_group)
        part = {}
        for name, param in params.items():
            whole = {"param": param, **_assembled([pieces[name] for pieces in everyone if name in pieces], param, name)}
            part[global_layer_name(name, layer_offset)] = {
                key: value if value.dim() == 0 else gathered(value, partition_of(param), tp_group)
                for key, value in whole.items()}
        state.update(_experts_of_every_ep_rank(part, model.config.num_moe_experts) if expert and part else part)
    return state


def _experts_of_every_ep_rank(experts: dict, num_experts: int) -> dict:
    """experts (by their local index) under their global index, this expert-parallel rank's first
    plus the local one, with every other expert-parallel rank's."""
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    first = dist.get_rank(group) * num_experts // dist.get_world_size(group)
    mine = {re.sub(r"\.local_experts\.(\d+)\.", lambda m: f".local_experts.{int(m[1]) + first}.", name): value
            for name, value in experts.items()}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {name: value for part in everyone for name, value in part.items()}


def assert_same_megatron_state(state, expected):
    """state (megatron_training_state's; a pipeline stage's names) is bitwise expected's, every tensor."""
    assert state and state.keys() <= expected.keys()
    for name, tensors in state.items():
        assert tensors.keys() == expected[name].keys(), (name, tensors.keys())
        for key, value in tensors.items():
            assert same_bits(value, expected[name][key]), (name, key)


def _assembled(held: list, param, name) -> dict:
    """key -> the TP shard of param's main parameter and state from the ranges the ranks hold."""
    keys = held[0][2].keys()
    assert all(tensors.keys() == keys for _, _, tensors in held), name
    whole = {}
    for key in keys:
        if held[0][2][key].dim() == 0:  # step: the same on every rank
            assert all(same_bits(tensors[key], held[0][2][key]) for _, _, tensors in held), (name, key)
            whole[key] = held[0][2][key]
            continue
        by_range = {}  # (start, stop) -> the elements; ranks holding the same range hold the same bits
        for start, stop, tensors in held:
            assert same_bits(by_range.setdefault((start, stop), tensors[key]), tensors[key]), (name, key)
        ranges = sorted(by_range)
        assert [start for start, _ in ranges] == [0] + [stop for _, stop in ranges[:-1]], (name, key, ranges)
        assert ranges[-1][1] == param.numel(), (name, key, ranges)
        whole[key] = torch.cat([by_range[r].reshape(-1) for r in ranges]).view(param.shape)
    return whole


def legacy(dim, stride=1):
    return {"tensor_model_parallel": True, "partition_dim": dim, "partition_stride": stride}


def submodule(module, path):
    """module's submodule at path ("a.b"), created (as plain Modules) where missing."""
    for part in path.split("."):
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    return module


def add_parameter(module, name, tensor, attributes):
    """Registers tensor as parameter name ("a.b.weight") of module, creating the submodules on the way."""
    path, _, leaf = name.rpartition(".")
    module = submodule(module, path) if path else module
    param = torch.nn.Parameter(tensor, requires_grad=False)
    for key, value in attributes.items():
        setattr(param, key, value)
    module.register_parameter(leaf, param)


# --- a toy module covering every kind of tensor ---------------------------------------------------

# name, logical shape, dtype, sharding attributes, (dim, stride) for the reference split or None
LAYOUT = [
    ("column.weight", (16, 6), torch.float32, legacy(0), (0, 1)),
    ("column.bias", (16,), torch.float32, legacy(0), (0, 1)),
    ("fc1.weight", (32, 6), torch.bfloat16, legacy(0, 2), (0, 2)),  # GLU [W ; V]
    ("fc1.bias", (32,), torch.bfloat16, legacy(0, 2), (0, 2)),
    ("row.weight", (6, 16), torch.float32, {"_tensor_parallel_mode": "row"}, (1, 1)),
    ("row.bias", (6,), torch.float32, {"_tensor_parallel_mode": "replicated"}, None),
    ("strided_row.weight", (6, 16), torch.float16, legacy(1, 2), (1, 2)),
    ("norm.weight", (6,), torch.float32, {}, None),
    # vocab 13 padded to 16 rows; the padded rows hold data too (megatron-core 0.16 dialect)
    ("embedding.weight", (16, 6), torch.bfloat16, {"_mcore_tp": True, "_tp_partition_dim": 0}, (0, 1)),
    # gated-delta-net style: only tensor_model_parallel and partition_dim
    ("gdn.conv.weight", (8, 1, 4), torch.float32, {"tensor_model_parallel": True, "partition_dim": 0}, (0, 1)),
]


def logical_state(seed):
    state = {name: random_bits(shape, dtype, seed * 1000 + i) for i, (name, shape, dtype, _, _) in enumerate(LAYOUT)}
    state["norm.running"] = random_bits((6,), torch.float64, seed * 1000 + 999)
    return state


class Toy(torch.nn.Module):
    """Parameters are this TP rank's shards of the logical tensors, annotated as in LAYOUT; a
    replicated buffer and an extra state ride along."""

    def __init__(self, logical, tp, tp_rank, step):
        super().__init__()
        for name, _, _, attributes, split in LAYOUT:
            local = reference_shard(logical[name], *split, tp, tp_rank) if split else logical[name]
            add_parameter(self, name, local.clone(), attributes)
        self.norm.register_buffer("running", logical["norm.running"].clone())
        self.step = step

    def get_extra_state(self):
        return {"step": self.step}

    def set_extra_state(self, state):
        self.step = state["step"]


def tensors_of(module):
    """module's tensors, without extra states (GroupedLinearStandIn's is a tensor)."""
    return {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def assert_all_differ(module, expected):
    wanted = tensors_of(expected)
    for name, t in tensors_of(module).items():
        assert not same_bits(t, wanted[name]), f"{name} already equals the expected value"


def assert_all_same(module, expected):
    wanted = tensors_of(expected)
    for name, t in tensors_of(module).items():
        assert same_bits(t, wanted[name]), f"{name} differs"


def storage_of(module):
    """Where each tensor's data lives: loading must write into it, not swap it."""
    return {name: (t.untyped_storage().data_ptr(), t.storage_offset()) for name, t in tensors_of(module).items()}


def tp_group_of_size(tp):
    """This rank's group among consecutive groups of tp ranks (every rank creates every group)."""
    mine = None
    for start in range(0, dist.get_world_size(), tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= dist.get_rank() < start + tp:
            mine = group
    return mine


def annotated(shape, attributes, device="meta"):
    t = torch.empty(shape, device=device)
    for key, value in attributes.items():
        setattr(t, key, value)
    return t


def stored_items(path):
    """(data file, first byte, end, entry name) of every item in a checkpoint, read from DCP's own
    .metadata (DCP's per-item storage info)."""
    with open(f"{path}/.metadata", "rb") as f:
        metadata = pickle.load(f)
    return sorted((info.relative_path, info.offset, info.offset + info.length, index.fqn)
                  for index, info in metadata.storage_data.items())


def data_file(path, rank):
    """The name of the data file rank wrote into the checkpoint at path (`__<rank>_...`), from its
    .metadata."""
    (name,) = {file for file, *_ in stored_items(path) if file.startswith(f"__{rank}_")}
    return name


def flip_bits(path, position, mask):
    """XORs the byte at position of the file at path with mask."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ mask]))


class SerialisedState(torch.nn.Module):
    """A module whose extra state is a uint8 tensor made anew by each get_extra_state() call, of a
    length that follows the state (as Transformer Engine serialises its FP8 state)."""

    def __init__(self, state):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3))
        self.state = state

    def get_extra_state(self):
        return torch.frombuffer(bytearray(pickle.dumps(self.state)), dtype=torch.uint8)

    def set_extra_state(self, tensor):
        self.state = pickle.loads(tensor.numpy().tobytes())


def die_after_file_operation(k):
    """Makes this process SIGKILL itself right after its k-th file operation of a save: making the
    directory, creating a file, finishing it (written, synced, closed), the commit's rename, the
    directory's sync, each removal (integrity._CommittingFileSystem's operations, through which
    every file operation of a save goes)."""
    done = itertools.count(1)

    def after_operation():
        if next(done) == k:
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(operation):
        def run(self, *args):
            operation(self, *args)
            after_operation()
        return run

    file_system = integrity._CommittingFileSystem
    create_stream = file_system.create_stream

    @contextlib.contextmanager
    def counted_create_stream(self, path, mode):
        with create_stream(self, path, mode) as stream:
            after_operation()
            yield stream
        after_operation()

    file_system.create_stream = counted_create_stream
    for name in ("mkdir", "replace", "sync_directory", "rm_file"):
        setattr(file_system, name, counted(getattr(file_system, name)))
