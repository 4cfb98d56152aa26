"""save_sharded / load_sharded with optimizer=: torch.optim state stored and resharded with its parameters.

Toy models are TP (and EP) shards of logical tensors with Megatron's sharding attributes (LAYOUT:
column- and row-parallel weights, a stride-2 GLU fc1, replicated norms), trained on gloo with a loss
whose gradient is elementwise (-3 sin(3p) + noise, the noise a shard of one logical tensor), so
each rank's gradient is the shard of the logical one, as under TP. References are the saved
layout's state gathered over its TP group and split with the tests' own reference_shard; all
comparisons are of integer views.
"""
import copy
import subprocess
import sys
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist

from fused_rl_ops.checkpoint import ShardingMetadataError, load_sharded, save_sharded
from tests.helpers.checkpoint import (LAYOUT, add_parameter, assert_same_training_state, flip_bits, gathered,
                                             legacy, reference_shard, same_bits, stored_items, tp_group_of_size)
from fused_rl_ops.testing.distributed import run_distributed

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")

NO_DECAY = {"row.bias", "norm.weight", "column.bias", "fc1.bias"}


def _shard(full, split, tp, rank):
    return reference_shard(full, *split, tp, rank) if split else full


def toy(layout, tp, rank, seed):
    """A module holding TP rank `rank`'s shards of random logical tensors laid out as `layout`."""
    module = torch.nn.Module()
    generator = torch.Generator().manual_seed(seed)
    for name, shape, dtype, attributes, split in layout:
        full = torch.randn(shape, generator=generator).to(dtype)
        add_parameter(module, name, _shard(full, split, tp, rank).clone(), attributes)
    return module.requires_grad_(True)


def adam(module, lr=1e-2, reverse_groups=False):
    """AdamW with the usual two groups: no weight decay for biases and norms."""
    named = dict(module.named_parameters())
    groups = [{"params": [p for n, p in named.items() if n not in NO_DECAY], "weight_decay": 0.1},
              {"params": [p for n, p in named.items() if n in NO_DECAY], "weight_decay": 0.0, "lr": lr / 3}]
    return torch.optim.AdamW(groups[::-1] if reverse_groups else groups, lr=lr, betas=(0.8, 0.99))


def train(module, optimizer, layout, tp, rank, steps, first_step=0, name_of=lambda name: name):
    """steps optimizer steps; the noise of logical tensor name_of(name) depends on the step only."""
    params = dict(module.named_parameters())
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad()
        loss = 0.0
        for name, shape, dtype, _, split in layout:
            generator = torch.Generator().manual_seed(zlib.crc32(f"{name_of(name)} {step}".encode()))
            noise = _shard(torch.randn(shape, generator=generator).to(dtype), split, tp, rank)
            p = params[name]
            loss = loss + (torch.cos(3 * p) + noise * p).float().sum()
        loss.backward()
        optimizer.step()


def logical_state(module, optimizer, layout, group, name_of=lambda name: name):
    """logical name -> (parameter, {state key: value}), gathered over group."""
    params = dict(module.named_parameters())
    result = {}
    for name, _, _, _, split in layout:
        state = optimizer.state[params[name]]
        result[name_of(name)] = (gathered(params[name], split, group), {
            key: value.clone() if value.dim() == 0 else gathered(value, split, group) for key, value in state.items()})
    return result


def assert_holds(module, optimizer, layout, tp, rank, reference, name_of=lambda name: name):
    """module and optimizer hold rank's shards at TP degree tp of reference (logical_state's)."""
    params = dict(module.named_parameters())
    for name, _, _, _, split in layout:
        param, state = reference[name_of(name)]
        assert same_bits(params[name], _shard(param, split, tp, rank)), name
        held = optimizer.state[params[name]]
        assert held.keys() == state.keys(), (name, held.keys())
        for key, value in state.items():
            expected = value if value.dim() == 0 else _shard(value, split, tp, rank)
            assert same_bits(held[key], expected), (name, key)


def hyperparameters_by_name(optimizer, module):
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: {k: v for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups for p in group["params"]}


def snapshot(module, optimizer):
    return copy.deepcopy((module.state_dict(), optimizer.state_dict()))


def assert_unchanged(module, optimizer, before):
    params, state = before
    assert all(same_bits(t, params[n]) for n, t in module.state_dict().items())
    now = optimizer.state_dict()
    assert now["param_groups"] == state["param_groups"] and now["state"].keys() == state["state"].keys()
    for index, held in state["state"].items():
        assert all(same_bits(now["state"][index][k], v) for k, v in held.items())


# --- TP 2 -> TP 1 and TP 4, and the same layout (4 processes) ------------------------------------

def _tp_reshard(rank, world_size, root):
    groups = {tp: tp_group_of_size(tp) for tp in (1, 2, 4)}
    source = toy(LAYOUT, 2, dist.get_rank(groups[2]), seed=1)
    optimizer = adam(source)
    train(source, optimizer, LAYOUT, 2, dist.get_rank(groups[2]), steps=3)
    optimizer.param_groups[0]["lr"] = 3e-3  # a schedule moved it
    save_sharded(source, f"{root}/tp2", tp_group=groups[2], optimizer=optimizer)
    reference = logical_state(source, optimizer, LAYOUT, groups[2])
    hyperparameters = hyperparameters_by_name(optimizer, source)

    for tp in (1, 4):
        tp_rank = dist.get_rank(groups[tp])
        for staged in (False, True):
            # A fresh optimizer (no state yet), its groups in another order and other hyperparameters.
            target = toy(LAYOUT, tp, tp_rank, seed=2)
            fresh = adam(target, lr=0.5, reverse_groups=True)
            params = dict(target.named_parameters())
            assert not any(same_bits(params[n], _shard(reference[n][0], s, tp, tp_rank)) for n, _, _, _, s in LAYOUT)
            assert hyperparameters_by_name(fresh, target) != hyperparameters
            load_sharded(target, f"{root}/tp2", tp_group=groups[tp], optimizer=fresh, staged=staged)
            assert_holds(target, fresh, LAYOUT, tp, tp_rank, reference)
            assert hyperparameters_by_name(fresh, target) == hyperparameters

    # An optimizer that has state already: loaded in place into its own tensors (without staged).
    target = toy(LAYOUT, 4, rank, seed=3)
    trained = adam(target, lr=0.5)
    train(target, trained, LAYOUT, 4, rank, steps=1, first_step=50)
    def storage():
        return {(id(p), key): t.data_ptr() for p, state in trained.state.items() for key, t in state.items()}

    before = storage()
    load_sharded(target, f"{root}/tp2", tp_group=groups[4], optimizer=trained)
    assert_holds(target, trained, LAYOUT, 4, rank, reference)
    assert storage() == before

    # The module alone from a checkpoint with optimizer state.
    alone = toy(LAYOUT, 1, 0, seed=4)
    load_sharded(alone, f"{root}/tp2", tp_group=groups[1])
    params = dict(alone.named_parameters())
    assert all(same_bits(params[n], reference[n][0]) for n, *_ in LAYOUT)


def test_optimizer_state_reshards_from_tp2_to_tp1_and_tp4(tmp_path):
    run_distributed(_tp_reshard, 4, str(tmp_path))


# --- experts: EP 2 x expert TP 2 -> EP 1, into TE-grouped experts (4 processes) -----------------

EXPERTS = 4
PREFIX = "decoder.layers.0.mlp.experts"
# per expert: name, logical shape, dtype, SequentialMLP's attributes, TE GroupedLinear's, split
EXPERT_TENSORS = [
    ("linear_fc1.weight", (16, 6), torch.float32, legacy(0, 2), legacy(0), (0, 2)),  # GLU [W ; V]
    ("linear_fc2.weight", (6, 8), torch.float32, legacy(1), legacy(1), (1, 1)),
]
ROUTER = ("decoder.layers.0.mlp.router.weight", (4, 6), torch.float32, {}, None)


def moe_layout(num_local, grouped):
    """The toy layout of one rank's MoE layer: the router and num_local experts."""
    layout = [ROUTER]
    for i in range(num_local):
        for name, shape, dtype, sequential, grouped_attributes, split in EXPERT_TENSORS:
            linear, kind = name.split(".")
            local_name = f"{PREFIX}.{linear}.{kind}{i}" if grouped else f"{PREFIX}.local_experts.{i}.{name}"
            layout.append((local_name, shape, dtype, grouped_attributes if grouped else sequential, split))
    return layout


def global_expert_name(ep_rank, num_local):
    """local parameter name -> the logical tensor it holds (experts by global index)."""
    def name_of(name):
        for i in range(num_local):
            for tensor, *_ in EXPERT_TENSORS:
                linear, kind = tensor.split(".")
                if name in (f"{PREFIX}.{linear}.{kind}{i}", f"{PREFIX}.local_experts.{i}.{tensor}"):
                    return f"expert {ep_rank * num_local + i} {tensor}"
        return name
    return name_of


def _experts_ep2_to_ep1(rank, world_size, root):
    expert_tp = tp_group_of_size(2)
    ep_groups = [dist.new_group([i, i + 2]) for i in range(2)]
    tp_rank, ep_rank = rank % 2, rank // 2
    name_of = global_expert_name(ep_rank, EXPERTS // 2)
    layout = moe_layout(EXPERTS // 2, grouped=False)
    source = torch.nn.Module()
    for name, shape, dtype, attributes, split in layout:  # each rank's own experts, all from seed 1
        generator = torch.Generator().manual_seed(zlib.crc32(name_of(name).encode()))
        add_parameter(source, name, _shard(torch.randn(shape, generator=generator), split, 2, tp_rank), attributes)
    source.requires_grad_(True)
    optimizer = torch.optim.Adam(source.parameters(), lr=1e-2)
    train(source, optimizer, layout, 2, tp_rank, steps=3, name_of=name_of)
    groups = dict(tp_group=expert_tp, expert_tp_group=expert_tp)
    save_sharded(source, f"{root}/ep2", ep_group=ep_groups[rank % 2], optimizer=optimizer, **groups)
    # Gathered over the expert TP group, then over the EP group: every expert, by global index.
    shared = [None, None]
    dist.all_gather_object(shared, logical_state(source, optimizer, layout, expert_tp, name_of), group=ep_groups[rank % 2])
    reference = {name: value for part in shared for name, value in part.items()}

    layout = moe_layout(EXPERTS, grouped=True)
    target = toy(layout, 2, tp_rank, seed=2)
    fresh = torch.optim.Adam(target.parameters(), lr=0.5)
    load_sharded(target, f"{root}/ep2", optimizer=fresh, **groups)
    assert_holds(target, fresh, layout, 2, tp_rank, reference, global_expert_name(0, EXPERTS))
    assert fresh.param_groups[0]["lr"] == 1e-2


def test_expert_optimizer_state_reshards_from_ep2_to_ep1_grouped(tmp_path):
    run_distributed(_experts_ep2_to_ep1, 4, str(tmp_path))


# --- resume at the same layout, and refusals that involve both ranks (2 processes, TP 2) --------

def sgd(module, lr=0.05):
    return torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=0.01)


def _resume_and_refusals(rank, world_size, root):
    group = dist.group.WORLD
    for make in (adam, sgd):
        straight = toy(LAYOUT, 2, rank, seed=1)
        straight_optimizer = make(straight)
        train(straight, straight_optimizer, LAYOUT, 2, rank, steps=5)

        first = toy(LAYOUT, 2, rank, seed=1)
        first_optimizer = make(first)
        save_sharded(first, f"{root}/{make.__name__}", tp_group=group, optimizer=first_optimizer)  # overwritten next
        train(first, first_optimizer, LAYOUT, 2, rank, steps=2)
        resumed = toy(LAYOUT, 2, rank, seed=9)
        resumed_optimizer = make(resumed, lr=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # overwriting a checkpoint and loading with optimizer= warn nothing
            save_sharded(first, f"{root}/{make.__name__}", tp_group=group, optimizer=first_optimizer)
            load_sharded(resumed, f"{root}/{make.__name__}", tp_group=group, optimizer=resumed_optimizer)
        train(resumed, resumed_optimizer, LAYOUT, 2, rank, steps=3, first_step=2)
        assert_same_training_state(resumed, resumed_optimizer, straight, straight_optimizer)

    # A scalar shared by the TP ranks must agree: one rank's step differs, every rank refuses.
    momentum = first_optimizer.state[first.column.weight]["momentum_buffer"]  # SGD keeps no step: add one
    first_optimizer.state[first.column.weight]["step"] = torch.tensor(float(3 + rank))
    with pytest.raises(ShardingMetadataError, match=r"column\.weight/optimizer/state/step: claims to be replicated"):
        save_sharded(first, f"{root}/disagree", tp_group=group, optimizer=first_optimizer)
    del first_optimizer.state[first.column.weight]["step"]
    assert momentum is first_optimizer.state[first.column.weight]["momentum_buffer"]

    # Rank 1's optimizer holds a tensor that is not in the module: both ranks raise, and neither
    # the module nor the optimizer changes on either.
    target = toy(LAYOUT, 2, rank, seed=5)
    optimizer = adam(target)
    train(target, optimizer, LAYOUT, 2, rank, steps=1)
    if rank == 1:
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    before = snapshot(target, optimizer)
    with pytest.raises(ValueError, match=r"optimizer holds parameters that are not in the module.*shape \(3,\)"):
        load_sharded(target, f"{root}/adam", tp_group=group, optimizer=optimizer)
    assert_unchanged(target, optimizer, before)


def test_training_resumes_bit_for_bit_and_ranks_refuse_together(tmp_path):
    run_distributed(_resume_and_refusals, 2, str(tmp_path))


# --- a tiny megatron-core GPTModel at TP 2 with Adam (2 processes) -------------------------------

def _gpt_resume(rank, world_size, root):
    from megatron.core import parallel_state

    from fused_rl_ops.megatron import attach, rl_output_processor
    from fused_rl_ops.testing.megatron_cpu import build_tiny_gpt, set_parallel_degrees
    from fused_rl_ops.testing.ppo import model_inputs

    set_parallel_degrees(tp=2)
    tp_group = parallel_state.get_tensor_model_parallel_group()

    def build(seed):
        model = build_tiny_gpt(seed)
        attach(model, rl_output_processor())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def train_gpt(model, optimizer, first_step, steps):
        for step in range(first_step, first_step + steps):
            tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(step))
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            outputs = model(inputs, *model_inputs(inputs), labels=labels)
            optimizer.zero_grad()
            (-outputs["logprobs"].mean() - 0.01 * outputs["entropy"].mean()).backward()
            optimizer.step()

    straight, straight_optimizer = build(seed=1)
    train_gpt(straight, straight_optimizer, 0, 4)
    first, first_optimizer = build(seed=1)
    train_gpt(first, first_optimizer, 0, 2)
    save_sharded(first, root, tp_group=tp_group, optimizer=first_optimizer)
    resumed, resumed_optimizer = build(seed=2)
    load_sharded(resumed, root, tp_group=tp_group, optimizer=resumed_optimizer)
    train_gpt(resumed, resumed_optimizer, 2, 2)
    assert_same_training_state(resumed, resumed_optimizer, straight, straight_optimizer)
    assert not same_bits(straight.output_layer.weight, first.output_layer.weight)  # training moved it


def test_gpt_model_resumes_bit_for_bit_at_tp2(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    run_distributed(_gpt_resume, 2, str(tmp_path))


# --- refusals in one process ---------------------------------------------------------------------

def trained_toy(make=adam, seed=1):
    module = toy(LAYOUT, 1, 0, seed)
    optimizer = make(module)
    train(module, optimizer, LAYOUT, 1, 0, steps=2)
    return module, optimizer


def test_unsupported_megatron_optimizers_are_refused_by_class_and_configuration():
    """Megatron's optimizers are recognised by class (the checkpoint package does not import megatron);
    those whose state would not all be stored are refused before anything is written."""
    optimizer_module = pytest.importorskip("megatron.core.optimizer", reason="megatron-core is not installed")
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    module, adamw = trained_toy()

    def wrapper(cls, **settings):  # the class and these attributes are all the checks read
        optimizer = object.__new__(cls)
        defaults = dict(is_stub_optimizer=False, optimizer=adamw, grad_scaler=None,
                        config=optimizer_module.OptimizerConfig(bf16=True))
        optimizer.__dict__.update({**defaults, **settings})
        return optimizer

    float16 = optimizer_module.Float16OptimizerWithFloat16Params
    dynamic = object.__new__(DynamicGradScaler)
    precision_aware = optimizer_module.OptimizerConfig(bf16=True)
    precision_aware.use_precision_aware_optimizer = True  # its checks want Transformer Engine when built so
    cases = [
        (wrapper(LayerWiseDistributedOptimizer), r"expected a torch.optim.Optimizer or one of megatron-core's "
                                                 r"ChainedOptimizer, .*; got megatron\.core\.optimizer\.layer_wise"),
        (wrapper(float16, grad_scaler=dynamic), "Float16OptimizerWithFloat16Params with DynamicGradScaler .*dynamic "
                                                "loss scaling.* is not supported"),
        (wrapper(optimizer_module.DistributedOptimizer, config=precision_aware), "DistributedOptimizer with "
                                                                                 "use_precision_aware_optimizer"),
        (optimizer_module.ChainedOptimizer([wrapper(float16), wrapper(float16, optimizer=object())]),
         "Float16OptimizerWithFloat16Params with its optimizer object"),
        ({}, "expected a torch.optim.Optimizer or one of megatron-core's .*got dict"),
    ]
    for optimizer, message in cases:
        with pytest.raises(TypeError, match=f"optimizer: {message}"):
            save_sharded(module, "/nonexistent", optimizer=optimizer)
        with pytest.raises(TypeError, match=f"optimizer: {message}"):
            load_sharded(module, "/nonexistent", optimizer=optimizer)
    # The check needs no megatron import: the checkpoint package does not load it.
    code = "import sys, fused_rl_ops.checkpoint; assert not [m for m in sys.modules if m.startswith('megatron')]"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_state_that_cannot_be_placed_is_refused(tmp_path):
    module, optimizer = trained_toy()
    stranger = torch.nn.Parameter(torch.zeros(2, 2))
    optimizer.add_param_group({"params": [stranger]})
    with pytest.raises(ValueError, match=r"not in the module.*param_groups\[2\]: Parameter of shape \(2, 2\)"):
        save_sharded(module, str(tmp_path / "a"), optimizer=optimizer)
    optimizer.param_groups.pop()

    optimizer.state[module.row.weight]["low_rank"] = torch.zeros(6, 2)
    with pytest.raises(ValueError, match=r"row\.weight \(optimizer state 'low_rank'\): has shape \(6, 2\); only "
                                         r"state tensors of the shape of the tensor the optimizer steps, \(6, 16\)"):
        save_sharded(module, str(tmp_path / "b"), optimizer=optimizer)
    optimizer.state[module.row.weight]["low_rank"] = [1.0]
    with pytest.raises(ValueError, match=r"'low_rank'\): is a list; expected a tensor or a number"):
        save_sharded(module, str(tmp_path / "b"), optimizer=optimizer)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_loads_that_do_not_fit_leave_module_and_optimizer_unchanged(tmp_path):
    module, optimizer = trained_toy()
    save_sharded(module, str(tmp_path / "adam"), optimizer=optimizer)
    save_sharded(module, str(tmp_path / "module_only"))
    sgd_module, sgd_optimizer = trained_toy(sgd)
    save_sharded(sgd_module, str(tmp_path / "sgd"), optimizer=sgd_optimizer)

    target, target_optimizer = trained_toy(seed=2)
    before = snapshot(target, target_optimizer)
    single_group = torch.optim.AdamW(target.parameters())
    fewer = torch.optim.AdamW([target.row.weight])
    cases = [
        (target_optimizer, "module_only", ValueError, r"holds no optimizer state for \[.*'column\.weight'.*saved "
                                                      r"without optimizer=\?"),
        (target_optimizer, "sgd", ValueError, r"holds the state of torch\.optim\.sgd\.SGD, the optimizer is "
                                              r"torch\.optim\.adamw\.AdamW"),
        (single_group, "adam", ValueError, r"param_groups\[0\] holds column\.weight and column\.bias, whose "
                                           r"hyperparameters in checkpoint .* differ"),
        (fewer, "adam", ValueError, r"holds optimizer state for \['column\.bias', .*which the optimizer does not"),
    ]
    for staged in (False, True):
        for load_optimizer, name, error, message in cases:
            with pytest.raises(error, match=message):
                load_sharded(target, str(tmp_path / name), optimizer=load_optimizer, staged=staged)
            assert_unchanged(target, target_optimizer, before)

    # Damage: one flipped bit in a stored exp_avg fails the staged load with nothing changed; in a
    # param group (read and checked before anything is written) also the direct one.
    items = {name: (file, start, end) for file, start, end, name in stored_items(tmp_path / "adam")}
    file, start, end = items["fc1.weight/optimizer/state/exp_avg"]
    flip_bits(tmp_path / "adam" / file, end - 3, 0x10)
    with pytest.raises(RuntimeError, match=r"left unchanged.*fc1\.weight/optimizer/state/exp_avg: its bytes .* do "
                                           "not match the checksum"):
        load_sharded(target, str(tmp_path / "adam"), optimizer=target_optimizer, staged=True)
    assert_unchanged(target, target_optimizer, before)
    flip_bits(tmp_path / "adam" / file, end - 3, 0x10)
    file, start, end = items["norm.weight/optimizer/param_group"]
    flip_bits(tmp_path / "adam" / file, (start + end) // 2, 0x01)
    with pytest.raises(ValueError, match=r"norm\.weight/optimizer/param_group: its bytes .* do not match"):
        load_sharded(target, str(tmp_path / "adam"), optimizer=target_optimizer)
    assert_unchanged(target, target_optimizer, before)


def test_number_state_is_kept_and_handed_to_the_optimizer(tmp_path):
    """A step kept as a Python number (as older torch.optim did) is stored as an object and handed to
    load_state_dict, which turns it into Adam's step tensor of the same value."""
    module, optimizer = trained_toy()
    for state in optimizer.state.values():
        state["step"] = float(state["step"]) + 0.5
    save_sharded(module, str(tmp_path), optimizer=optimizer)
    target = toy(LAYOUT, 1, 0, seed=2)
    fresh = adam(target)
    load_sharded(target, str(tmp_path), optimizer=fresh)
    assert [float(fresh.state[p]["step"]) for p in target.parameters()] == [2.5] * len(LAYOUT)
