"""save_sharded / load_sharded with megatron-core's own optimizers: bf16 parameters (Float16Module),
fp32 main parameters and Adam state in Float16OptimizerWithFloat16Params, DistributedOptimizer (the
state sharded over the data-parallel ranks in flat buffers) and the ChainedOptimizer that
get_megatron_optimizer builds, on megatron-core 0.18 and 0.19 (CPU / gloo, the shims of
fused_rl_ops.testing.megatron_cpu).

References are the saved layout's state assembled by the tests' own rule (megatron_training_state:
megatron-core's own accessors for each rank's range, then the TP shards joined); comparisons are of
integer views. `pytest -k megatron_optimizer` runs these.
"""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from fused_rl_ops.checkpoint import load_sharded, save_sharded
from tests.helpers.checkpoint import assert_same_megatron_state, megatron_training_state, same_bits
from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron.core import parallel_state  # noqa: E402

from tests.helpers.megatron import MEGATRON_0_18  # noqa: E402

pytestmark = pytest.mark.usefixtures("checkpoint_dependencies")

VOCAB = 256
# What save_sharded is given: the optimizer get_megatron_optimizer builds (a ChainedOptimizer: for a
# model whose experts have their own groups, of one optimizer for the dense parameters and one for
# the experts), or the one optimizer inside it for a dense model; with the data-parallel sharded
# DistributedOptimizer or not.
KINDS = {"distributed": (True, False), "float16": (False, False), "chained": (True, True)}


def set_saved_layout(kind):
    """Where the models of kind train and save (4 ranks): TP 2 x DP 2. The experts have their own
    groups at expert TP 1: on megatron-core 0.19 at EP 1 (the experts' data-parallel degree 4); 0.18
    gives experts their own gradient reduction only at EP > 1 (at EP 1 their copies drift apart and
    save_sharded refuses them: _refuses_experts_reduced_over_the_dense_group), so there at EP 2."""
    from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees

    set_parallel_degrees(tp=2, expert_tp=1, ep=2 if MEGATRON_0_18 and kind == "chained" else 1)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[0, 1],
           moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", add_bias_linear=False)


def build(kind, seed, lr=1e-2):
    """A bf16 tiny GPT (SwiGLU: fc1 and its bias are stride-2 shards; for "chained", its second layer
    MoE, sequence parallel at TP > 1 as MoE training needs) at the current parallel state in
    Float16Module and DDP, and the optimizer of kind: (model, ddp_model, the optimizer to step, the
    optimizer to save and load)."""
    from fused_rl_ops.testing.megatron_cpu import megatron_bf16_training, tiny_config, tiny_model

    distributed, chained = KINDS[kind]
    settings = dict(bf16=True, pipeline_dtype=torch.bfloat16, gated_linear_unit=True, activation_func=F.silu)
    if chained:
        settings.update(MOE, sequence_parallel=parallel_state.get_tensor_model_parallel_world_size() > 1)
    model = tiny_model("gpt", tiny_config(**settings), seed=seed, vocab_size=VOCAB)
    ddp_model, optimizer = megatron_bf16_training(model, distributed_optimizer=distributed, lr=lr, clip_grad=1.0)
    return model, ddp_model, optimizer, optimizer if chained else optimizer.chained_optimizers[0]


def train(ddp_model, optimizer, steps):
    """Megatron's training step on each data-parallel rank's own batch of the given steps."""
    from megatron.core.distributed import finalize_model_grads

    from fused_rl_ops.testing.ppo import model_inputs

    for step in steps:
        seed = 1000 * step + parallel_state.get_data_parallel_rank()
        tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(seed))
        inputs = tokens[:, :-1]
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        ddp_model(inputs, *model_inputs(inputs), labels=tokens[:, 1:]).mean().backward()
        finalize_model_grads([ddp_model])
        assert optimizer.step()[0]


def lr_after_schedule(group):
    return 3e-3 if group["weight_decay"] else 2e-3


def layer_offset():
    """The pipeline stage's first layer (of the tiny model's 2)."""
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    return parallel_state.get_pipeline_model_parallel_rank() * 2 // stages


# --- TP 2 x DP 2 -> TP 1 x DP 4, TP 4 and PP 2 x DP 2 (4 processes) ------------------------------

def _reshard(rank, world_size, root):
    from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees

    saved = {}
    for kind in KINDS:
        set_saved_layout(kind)
        model, ddp_model, optimizer, to_save = build(kind, seed=1)
        assert len(optimizer.chained_optimizers) == (2 if kind == "chained" else 1)
        train(ddp_model, optimizer, range(2))
        for group in to_save.param_groups:  # as a schedule moves them
            group["lr"] = lr_after_schedule(group)
        save_sharded(model, f"{root}/{kind}", optimizer=to_save)
        saved[kind] = megatron_training_state(model, optimizer)
        assert {"param", "main_param", "exp_avg", "exp_avg_sq", "step"} == saved[kind]["output_layer.weight"].keys()
        # Plain DCP reads the logical tensors: one entry per parameter, whatever the optimizer.
        items = {"main_param": "optimizer/main_param", **{k: f"optimizer/state/{k}" for k in ("exp_avg", "exp_avg_sq")}}
        plain = {f"{name}/{item}": torch.empty_like(saved[kind][name][key])
                 for name in saved[kind] for key, item in items.items()}
        dcp.load(plain, checkpoint_id=f"{root}/{kind}", no_dist=True)
        for name in saved[kind]:
            assert all(same_bits(plain[f"{name}/{item}"], saved[kind][name][key]) for key, item in items.items()), name

    for degrees in (dict(tp=1), dict(tp=4, expert_tp=1), dict(tp=1, pp=2)):
        set_parallel_degrees(**degrees)
        for kind in KINDS:
            model, _, optimizer, to_load = build(kind, seed=2, lr=0.5)
            before = megatron_training_state(model, optimizer, layer_offset())
            assert not any(same_bits(before[n]["main_param"], saved[kind][n]["main_param"]) for n in before)
            load_sharded(model, f"{root}/{kind}", optimizer=to_load)
            assert_same_megatron_state(megatron_training_state(model, optimizer, layer_offset()), saved[kind])
            assert all(group["lr"] == lr_after_schedule(group) for group in to_load.param_groups), (kind, degrees)
    # The format does not depend on the optimizer: a DistributedOptimizer's checkpoint loads into
    # Float16OptimizerWithFloat16Params, and the other way round (here through temporaries).
    for kind, other in (("distributed", "float16"), ("float16", "distributed")):
        model, _, optimizer, to_load = build(other, seed=2, lr=0.5)
        load_sharded(model, f"{root}/{kind}", optimizer=to_load, staged=True)
        assert_same_megatron_state(megatron_training_state(model, optimizer, layer_offset()), saved[kind])
    _refusals(root)
    _refuses_experts_reduced_over_the_dense_group(root)


def _refuses_experts_reduced_over_the_dense_group(root):
    """At TP 2, expert TP 1, EP 1, megatron-core 0.18 reduces the experts' gradients over the dense
    data-parallel group (allreduce=True): a training step leaves their copies on the two TP ranks
    apart, and save_sharded refuses them, saying why. (0.19 reduces them over the expert groups:
    there 0.18's marking and a drifted copy are planted.)"""
    from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees

    set_parallel_degrees(tp=2, expert_tp=1)
    model, ddp_model, optimizer, _ = build("chained", seed=1)
    experts = [param for name, param in model.named_parameters() if ".experts." in name]
    assert experts and all(param.allreduce is MEGATRON_0_18 for param in experts)
    if MEGATRON_0_18:
        train(ddp_model, optimizer, range(1))
    else:
        for param in experts:
            param.allreduce = True
        with torch.no_grad():
            experts[0].add_(parallel_state.get_tensor_model_parallel_rank())
    with pytest.raises(ValueError, match=r"experts\.local_experts\.\d\..*: ranks \d and \d both hold .* different bytes; "
                                         r"a checkpoint keeps one copy: the experts' gradients are reduced over the "
                                         r"dense data-parallel group .* megatron-core 0.18"):
        save_sharded(model, f"{root}/experts_reduced_over_the_dense_group", optimizer=optimizer)


def _refusals(root):
    """A checkpoint with fp32 main parameters does not load into an optimizer without them, nor the
    other way round; ranks whose DistributedOptimizer ranges leave a hole refuse to save."""
    model, _, _, float16 = build("float16", seed=1)
    adamw = torch.optim.AdamW(model.parameters())  # steps the bf16 parameters themselves
    save_sharded(model, f"{root}/adamw", optimizer=adamw)
    with pytest.raises(ValueError, match=r"holds no fp32 main parameter for it, which the optimizer keeps for its "
                                         r"torch.bfloat16 parameter"):
        load_sharded(model, f"{root}/adamw", optimizer=float16)
    with pytest.raises(ValueError, match=r"holds an fp32 main parameter for it, which the optimizer does not keep"):
        load_sharded(model, f"{root}/float16", optimizer=adamw)

    model, _, _, distributed = build("distributed", seed=1)
    if dist.get_rank() == 0:  # a planted defect: rank 0's first range starts one element late
        param = distributed.model_float16_groups[0][0]
        gbuf, dtype, bucket = distributed.model_param_gbuf_map[param]
        ranges = distributed.gbuf_ranges[gbuf][dtype][bucket]["param_map"][param]
        ranges["param"] = type(ranges["param"])(ranges["param"].start + 1, ranges["param"].end)
    with pytest.raises(ValueError, match=r"/optimizer/main_param: the ranks' pieces .* do not tile"):
        save_sharded(model, f"{root}/with_a_hole", optimizer=distributed)


def test_megatron_optimizer_state_reshards_bit_for_bit(tmp_path):
    """Saved at TP 2 x DP 2 from a DistributedOptimizer, a Float16OptimizerWithFloat16Params and
    get_megatron_optimizer's ChainedOptimizer, loaded at TP 1 x DP 4, TP 4 and PP 2 x DP 2 into a
    fresh model and optimizer of the same kind: the bf16 parameters, the fp32 main parameters and
    every Adam state are the saved ones bit for bit, the hyperparameters too. Experts whose
    gradients are reduced over the dense group where they should not be are refused."""
    run_distributed(_reshard, 4, str(tmp_path))


# --- resume at the same layout (4 processes, TP 2 x DP 2) ------------------------------------------

def _resume(rank, world_size, root):
    for kind in KINDS:
        set_saved_layout(kind)
        straight_model, straight_ddp, straight_optimizer, _ = build(kind, seed=1)
        train(straight_ddp, straight_optimizer, range(5))

        model, ddp_model, optimizer, to_save = build(kind, seed=1)
        train(ddp_model, optimizer, range(2))
        save_sharded(model, f"{root}/{kind}", optimizer=to_save)
        resumed, resumed_ddp, resumed_optimizer, to_load = build(kind, seed=3, lr=0.5)
        load_sharded(resumed, f"{root}/{kind}", optimizer=to_load)
        train(resumed_ddp, resumed_optimizer, range(2, 5))
        assert_same_megatron_state(megatron_training_state(resumed, resumed_optimizer),
                                   megatron_training_state(straight_model, straight_optimizer))


def test_megatron_optimizer_resumes_bit_for_bit(tmp_path):
    """Two steps, a save, a fresh model and optimizer loading it, three more steps: the bf16
    parameters, fp32 main parameters and Adam state equal those of five uninterrupted steps bit for
    bit, for each kind of Megatron optimizer."""
    run_distributed(_resume, 4, str(tmp_path))
