"""batch_invariant=True on the Megatron processor's other losses, called as Megatron calls them, on
real ranks on gloo: the student's rl_output_processor(divergence=...) with the teacher's outputs from
teacher_output_processor() in its context (every divergence kind; the student's logit options, the
teacher's softcap), and the MTP loss (FusedMTPLoss.for_processor, as route_mtp_loss builds it, two
depths): their outputs (logprobs, entropy, divergence; the logged MTP loss and acceptance) and the
student's hidden gradient are bitwise the same at TP 1, 2 and 4, with sequence parallel off and on
(both models' hidden states then split along s, the student's gradient reassembled); and close to
float64. The output layers are stand-ins holding this rank's vocab rows, as in
test_tp_invariance.py: real models at different degrees would feed different hidden states."""
import dataclasses
import types

import pytest
import torch
from torch.testing import assert_close

from fused_rl_ops import LogitOptions, reference
from fused_rl_ops.testing.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the GPU machine has none)")
from megatron.core import parallel_state  # noqa: E402

from fused_rl_ops.megatron import rl_output_processor, teacher_output_processor  # noqa: E402
from fused_rl_ops.megatron.mtp import FusedMTPLoss  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config  # noqa: E402
from tests.helpers.megatron import logged_mtp_metrics  # noqa: E402

S, B, H, HT, PADDED_V, VOCAB, DEPTHS = 16, 3, 24, 20, 1024, 1000, 2
# Each case: the student's processor keywords (the divergence, its logit options) and the teacher's softcap.
CASES = {
    "forward_kl": (dict(divergence="forward_kl", temperature=0.8), None),
    "reverse_kl": (dict(divergence="reverse_kl", softcap=4.0), 3.0),
    "jsd": (dict(divergence="jsd", beta=0.3, top_k=30, temperature=1.1), 5.0),
}
DISTILLATION_OUTPUTS = ("logprobs", "entropy", "divergence")


def problem():
    g = torch.Generator().manual_seed(4)
    return dict(hidden=torch.randn(S, B, H, generator=g), weight=torch.randn(PADDED_V, H, generator=g) * 0.4,
                teacher_hidden=torch.randn(S, B, HT, generator=g),
                teacher_weight=torch.randn(PADDED_V, HT, generator=g) * 0.5,
                mtp_hidden=torch.randn((1 + DEPTHS) * S, B, H, generator=g),  # the main head's, then each depth's
                tokens=torch.randint(0, VOCAB, (B, S), generator=g),
                loss_mask=(torch.rand(B, S, generator=g) > 0.2).float(), coeff=torch.randn(3, B, S, generator=g))


def output_layer(weight, rank, world, sequence_parallel):
    """A stand-in for Megatron's output layer on this rank: its vocab rows of weight, the TP group."""
    local = PADDED_V // world
    return types.SimpleNamespace(weight=weight[rank * local:(rank + 1) * local], sequence_parallel=sequence_parallel,
                                 tp_group=parallel_state.get_tensor_model_parallel_group())


def positions(states, rank, world, sequence_parallel, pieces=1):
    """This rank's [s(/tp), b, ...] part of each of the pieces stacked along s in states."""
    if not sequence_parallel:
        return states
    return torch.cat([piece.chunk(world)[rank] for piece in states.chunk(pieces)])


def distillation_results(p, rank, world, sequence_parallel, name):
    """The student processor's outputs and its hidden states' gradient (this rank's [s/tp] slice
    with sequence parallel)."""
    options, teacher_softcap = CASES[name]
    with torch.no_grad():
        teacher = teacher_output_processor(softcap=teacher_softcap)(
            hidden_states=positions(p["teacher_hidden"], rank, world, sequence_parallel),
            output_layer=output_layer(p["teacher_weight"], rank, world, sequence_parallel))
    hidden = positions(p["hidden"], rank, world, sequence_parallel).clone().requires_grad_(True)
    processor = rl_output_processor(batch_invariant=True, vocab_size=VOCAB, **options)
    outputs = processor(hidden_states=hidden, output_layer=output_layer(p["weight"], rank, world, sequence_parallel),
                        labels=p["tokens"], loss_mask=p["loss_mask"], context={"teacher": teacher})
    distillation_loss(p, *(outputs[k] for k in DISTILLATION_OUTPUTS)).backward()
    return {**{k: v.detach() for k, v in outputs.items()}, "hidden gradient": hidden.grad}


def distillation_loss(p, logprobs, entropy, divergence):
    logprobs = torch.where(torch.isfinite(logprobs), logprobs, 0.0)  # top_k drops some chosen tokens
    return (p["coeff"][0] * logprobs + p["coeff"][1] * entropy + p["coeff"][2] * divergence).sum()


def mtp_results(p, rank, world, sequence_parallel):
    """What the MTP loss logs, and the gradient of the [(1 + DEPTHS) s(/tp), b, h] hidden states it
    takes (the main head's, then each depth's)."""
    mtp_loss = FusedMTPLoss.for_processor(rl_output_processor(batch_invariant=True))
    hidden = positions(p["mtp_hidden"], rank, world, sequence_parallel, 1 + DEPTHS).clone().requires_grad_(True)
    returned = mtp_loss(hidden_states=hidden, labels=p["tokens"], loss_mask=p["loss_mask"],
                        output_layer=output_layer(p["weight"], rank, world, sequence_parallel), output_weight=None,
                        runtime_gather_output=None, is_training=True, compute_language_model_loss=None,
                        config=tiny_config(mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=0.3))
    returned.sum().backward()
    return {**logged_mtp_metrics(), "hidden gradient": hidden.grad}


def ranks_body(rank, world, path):
    set_parallel_degrees(tp=world)
    p = problem()
    results = {}
    for sequence_parallel in (False, True) if world > 1 else (False,):
        results[sequence_parallel, "mtp"] = mtp_results(p, rank, world, sequence_parallel)
        for name in CASES:
            results[sequence_parallel, name] = distillation_results(p, rank, world, sequence_parallel, name)
    torch.save(results, f"{path}/rank{rank}.pt")


def bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int64)


def assert_same_bits(got, want, what):
    differing = int((bits(got) != bits(want)).sum())
    assert differing == 0, (what, differing)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world: {(sequence_parallel, case): results}}, the sequence-parallel gradient slices reassembled
    along s (each piece of the MTP's hidden states apart); the other results alike on every rank."""
    by_world = {}
    for world in (1, 2, 4):
        path = tmp_path_factory.mktemp(f"tp{world}")
        run_distributed(ranks_body, world, str(path))
        ranks = [torch.load(path / f"rank{r}.pt") for r in range(world)]
        for key, first in ranks[0].items():
            if key[0]:
                pieces = 1 + DEPTHS if key[1] == "mtp" else 1
                slices = [r[key]["hidden gradient"].chunk(pieces) for r in ranks]
                first["hidden gradient"] = torch.cat([torch.cat([s[k] for s in slices]) for k in range(pieces)])
            for r in ranks[1:]:
                for name in first.keys() - {"hidden gradient"}:
                    assert_same_bits(r[key][name], first[name], (world, key, name, "rank"))
        by_world[world] = ranks[0]
    return by_world


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("name", [*CASES, "mtp"])
def test_same_bits_at_tp_1_2_4(results, sequence_parallel, name):
    want = results[1][False, name]
    for world in (2, 4):
        got = results[world][sequence_parallel, name]
        assert got.keys() == want.keys()
        for what in want:
            assert_same_bits(got[what], want[what], (world, what))


@pytest.mark.parametrize("name", list(CASES))
def test_distillation_close_to_float64(results, name):
    p = problem()
    options, teacher_softcap = CASES[name]
    kind, beta = options["divergence"], options.get("beta", 0.5)
    logit_options = {k: v for k, v in options.items() if k not in ("divergence", "beta")}
    student_map = LogitOptions(**logit_options).logit_map
    hidden = p["hidden"].double().requires_grad_(True)
    rows = hidden.reshape(S * B, H)  # [s, b] order, as the processor's tokens [b, s] transposed
    tokens = p["tokens"].masked_fill(p["loss_mask"] == 0, -100).t().reshape(-1)
    logprobs, entropy = reference.chosen_logprob(rows, p["weight"].double(), tokens, vocab_size=VOCAB,
                                                 **logit_options)
    divergence = reference.vocab_divergence(
        rows, p["weight"].double(), p["teacher_hidden"].double().reshape(S * B, HT), p["teacher_weight"].double(),
        kind=kind, beta=beta, logit_map=student_map, vocab_size=VOCAB, mask=tokens != -100,
        teacher_logit_map=dataclasses.replace(student_map, softcap=teacher_softcap))
    want = {k: v.reshape(S, B).t() for k, v in zip(DISTILLATION_OUTPUTS, (logprobs, entropy, divergence))}
    distillation_loss(p, *want.values()).backward()
    got = results[1][False, name]
    assert got["divergence"][p["loss_mask"] == 0].eq(0).all() and got["divergence"][p["loss_mask"] == 1].gt(0).all()
    for what, expected in [*want.items(), ("hidden gradient", hidden.grad)]:
        assert_close(got[what].double(), expected.detach(), atol=2e-5, rtol=2e-5, msg=lambda m: f"{what}: {m}")


def test_mtp_close_to_float64(results):
    """Each depth d scores its hidden states at position i against the label at i + d (Megatron's
    roll: the last d positions unscored), loss -logprob averaged over its scored positions and scaled
    by mtp_loss_scaling_factor / depths; the main head's gradient is the upstream one."""
    p = problem()
    hidden = p["mtp_hidden"].double().requires_grad_(True)
    main, *depth_states = hidden.chunk(1 + DEPTHS)
    losses = []
    for depth, states in enumerate(depth_states, start=1):
        shift = lambda t: torch.cat([t[:, depth:], torch.zeros_like(t[:, :depth])], 1)  # noqa: E731
        mask = shift(p["loss_mask"])
        tokens = shift(p["tokens"]).masked_fill(mask == 0, -100).t().reshape(-1)
        logprobs, _ = reference.chosen_logprob(states.reshape(S * B, H), p["weight"].double(), tokens)
        losses.append(-logprobs.sum() / mask.sum())
    (0.3 / DEPTHS * sum(losses) + main.sum()).backward()
    got = results[1][False, "mtp"]
    assert_close(got["loss_values"].double(), torch.stack(losses).detach(), atol=1e-5, rtol=1e-5)
    assert_close(got["hidden gradient"].double(), hidden.grad, atol=2e-5, rtol=2e-5)
