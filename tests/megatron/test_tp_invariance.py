"""rl_output_processor(batch_invariant=True) called as Megatron's output layer calls it, on real
ranks on gloo: its logprobs, entropy, values and top logprobs and the gradient of its hidden states
are bitwise the same at TP 1, 2 and 4, with sequence parallel off and on (the hidden states then split along s
over the ranks, their gradient reassembled)."""
import types

import pytest
import torch
import torch.distributed as dist

from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the GPU machine has none)")
from fused_rl_ops.megatron import rl_output_processor  # noqa: E402

S, B, H, PADDED_V, VOCAB = 16, 3, 24, 1024, 1000
OPTIONS = {"temperature": dict(temperature=0.8), "top_k": dict(top_k=30, softcap=4.0)}
OUTPUTS = ("logprobs", "entropy", "values", "top_ids", "top_logprobs")


def problem():
    g = torch.Generator().manual_seed(3)
    return dict(hidden=torch.randn(S, B, H, generator=g), weight=torch.randn(PADDED_V, H, generator=g) * 0.4,
                value=torch.randn(H, generator=g), tokens=torch.randint(0, VOCAB, (B, S), generator=g),
                loss_mask=(torch.rand(B, S, generator=g) > 0.2).float(), coeff=torch.randn(3, B, S, generator=g))


def processor_results(rank, world, sequence_parallel, options, tp_group):
    """The processor's outputs and its hidden states' gradient (this rank's [s/tp] slice with
    sequence parallel)."""
    p = problem()
    local = PADDED_V // world
    output_layer = types.SimpleNamespace(weight=p["weight"][rank * local:(rank + 1) * local],
                                         tp_group=tp_group, sequence_parallel=sequence_parallel)
    rows = S // world if sequence_parallel else S
    hidden = p["hidden"][rank * rows:(rank + 1) * rows] if sequence_parallel else p["hidden"]
    hidden = hidden.clone().requires_grad_(True)
    processor = rl_output_processor(batch_invariant=True, vocab_size=VOCAB, value_head=p["value"], top_logprobs=3,
                                    **options)
    outputs = processor(hidden_states=hidden, output_layer=output_layer, labels=p["tokens"], loss_mask=p["loss_mask"])
    logprobs = torch.where(torch.isfinite(outputs["logprobs"]), outputs["logprobs"], 0.0)
    loss = p["coeff"][0] * logprobs + p["coeff"][1] * outputs["entropy"] + p["coeff"][2] * outputs["values"]
    (loss.sum() + 0.5 * outputs["top_logprobs"].sum()).backward()
    return {**{k: v.detach() for k, v in outputs.items()}, "hidden gradient": hidden.grad}


def ranks_body(rank, world, path):
    results = {(sp, name): processor_results(rank, world, sp, options, dist.group.WORLD)
               for sp in (False, True) for name, options in OPTIONS.items()}
    torch.save(results, f"{path}/rank{rank}.pt")


def bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int64)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world: {(sequence_parallel, option case): outputs}}, the sequence-parallel gradient slices
    reassembled along s; world 1 without a group."""
    by_world = {}
    for world in (2, 4):
        path = tmp_path_factory.mktemp(f"tp{world}")
        run_distributed(ranks_body, world, str(path))
        ranks = [torch.load(path / f"rank{r}.pt") for r in range(world)]
        for key, first in ranks[0].items():
            if key[0]:
                first["hidden gradient"] = torch.cat([r[key]["hidden gradient"] for r in ranks])
            for r in ranks[1:]:  # the outputs alike on every rank
                for name in OUTPUTS:
                    assert torch.equal(bits(r[key][name]), bits(first[name])), (world, key, name)
        by_world[world] = ranks[0]
    by_world[1] = {name: processor_results(0, 1, False, options, None) for name, options in OPTIONS.items()}
    return by_world


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_processor_same_bits_at_tp_1_2_4(results, sequence_parallel, name):
    want = results[1][name]
    assert torch.isneginf(want["logprobs"]).any() == (name == "top_k")
    for world in (2, 4):
        got = results[world][(sequence_parallel, name)]
        for what in (*OUTPUTS, "hidden gradient"):
            differing = int((bits(got[what]) != bits(want[what])).sum())
            assert differing == 0, (world, what, differing)
