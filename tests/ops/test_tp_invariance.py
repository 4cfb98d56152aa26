"""batch_invariant=True across tensor-parallel degrees: chosen_logprob's logprob, entropy and hidden
gradient, and the weight gradient reassembled from the shards, are bitwise the same at TP 1, 2, 4 and
8 (real ranks on gloo), with every logit option and many tokens per position; so are top_logprobs'
ids and logprobs and vocab_divergence's divergence of every kind, with their gradients; a TP 2 run
inside a larger, different batch gives TP 1's bits; close to float64; the configurations it cannot
keep the promise for are refused."""
import pytest
import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops import LogitOptions, reference
from fused_rl_ops.testing.distributed import run_distributed

H, HT, PADDED_V, VOCAB, N = 32, 20, 4096, 4000, 150
# Each case: chosen_logprob's logit options, and the token layout ("one": [N], "many": [N, 3]).
CASES = {
    "plain": (dict(temperature=0.9), "one"),
    "softcap": (dict(softcap=2.0), "one"),
    "top_k": (dict(top_k=20, temperature=1.1), "one"),
    "top_p": (dict(top_p=0.8), "one"),
    "top_k_top_p": (dict(top_k=50, top_p=0.9, softcap=3.0), "one"),
    "many": (dict(temperature=0.7), "many"),
}
OTHERS = 170  # the other tokens of the larger batch
# The other ops' cases: top_logprobs' ids and logprobs, and vocab_divergence of each kind.
OP_CASES = ("top_logprobs", "forward_kl", "reverse_kl", "jsd")


def problem():
    """fp32 weights of a padded vocabulary, hidden rows whose logits spread over several nats, token
    ids on the virtual shards' edges and the vocabulary's end (some ignored), upstream gradients;
    and a pool of other rows for the larger batch."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(PADDED_V, H, generator=g) * (2.0 / H**0.5)
    hidden = torch.randn(N + OTHERS, H, generator=g) * 1.5
    one = torch.randint(0, VOCAB, (N + OTHERS,), generator=g)
    edges = [e for s in range(1, 8) for e in (s * 512 - 1, s * 512)] + [0, VOCAB - 1]
    one[: len(edges)] = torch.tensor(edges)
    one[len(edges)::9] = -100
    many = torch.randint(0, VOCAB, (N + OTHERS, 3), generator=g)
    many[::11, 1] = -100
    many[5] = -100  # a position with every entry ignored
    grads = torch.randn(N + OTHERS, 3, generator=g), torch.randn(N + OTHERS, generator=g)
    teacher = dict(teacher_weight=torch.randn(PADDED_V, HT, generator=g) * (2.0 / HT**0.5),
                   teacher_hidden=torch.randn(N + OTHERS, HT, generator=g) * 1.5)
    return dict(weight=weight, hidden=hidden, one=one, many=many, grad_lp=grads[0], grad_ent=grads[1], **teacher)


def run(p, rows, options, layout, rank=0, world=1):
    """The results of rows of the problem on this rank: logprob, entropy, hidden gradient and this
    rank's weight gradient."""
    local = PADDED_V // world
    hidden = p["hidden"][rows].clone().requires_grad_(True)
    weight = p["weight"][rank * local:(rank + 1) * local].clone().requires_grad_(True)
    tokens = p[layout][rows]
    grad_lp = p["grad_lp"][rows] if layout == "many" else p["grad_lp"][rows, 0]
    lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, tokens, vocab_size=VOCAB, return_entropy=True,
                                          batch_invariant=True, tp_group=dist.group.WORLD if world > 1 else None,
                                          workspace_bytes=1, **options)
    (torch.where(torch.isfinite(lp), lp, 0.0) * grad_lp).sum().add((ent * p["grad_ent"][rows]).sum()).backward()
    return [lp.detach(), ent.detach(), hidden.grad, weight.grad]


def run_op(p, rows, name, rank=0, world=1):
    """top_logprobs' ids and logprobs (k 5, a mask), or vocab_divergence of kind name, of rows of
    the problem on this rank, then the hidden gradient and this rank's weight gradient."""
    local = slice(rank * PADDED_V // world, (rank + 1) * PADDED_V // world)
    hidden = p["hidden"][rows].clone().requires_grad_(True)
    weight = p["weight"][local].clone().requires_grad_(True)
    kw = dict(vocab_size=VOCAB, batch_invariant=True, tp_group=dist.group.WORLD if world > 1 else None,
              temperature=0.9)
    if name == "top_logprobs":
        outputs = fused_rl_ops.top_logprobs(hidden, weight, 5, mask=p["one"][rows] != -100, **kw)
        loss = (outputs[1] * p["grad_lp"][rows, :1]).sum()
    else:
        outputs = [fused_rl_ops.vocab_divergence(hidden, weight, p["teacher_hidden"][rows],
                                                 p["teacher_weight"][local], kind=name, softcap=3.0,
                                                 workspace_bytes=1, **kw)]
        loss = (outputs[0] * p["grad_ent"][rows]).sum()
    loss.backward()
    return [t.detach() for t in outputs] + [hidden.grad, weight.grad]


def bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int64)


def assert_same_bits(got, want, what):
    for k in range(len(got)):
        assert torch.equal(bits(got[k]), bits(want[k])), (what, k, int((bits(got[k]) != bits(want[k])).sum()))


def ranks_body(rank, world, path):
    p = problem()
    scored = torch.arange(N)
    # The larger batch: other rows before, between and after the scored ones, in another order.
    g = torch.Generator().manual_seed(world)
    larger = torch.cat([torch.arange(N, N + 60), scored, torch.arange(N + 60, N + OTHERS)])
    larger = larger[torch.randperm(larger.numel(), generator=g)]
    results = {}
    for name, (options, layout) in CASES.items():
        results[name] = run(p, scored, options, layout, rank, world)
        if world == 2 and name in ("plain", "top_k", "top_p", "many"):
            got = run(p, larger, options, layout, rank, world)
            where = torch.argsort(larger)[:N]
            results[name + " in a larger batch"] = [got[0][where], got[1][where], got[2][where]]
    for name in OP_CASES:
        results[name] = run_op(p, scored, name, rank, world)
        if world == 2:
            got = run_op(p, larger, name, rank, world)
            results[name + " in a larger batch"] = [t[torch.argsort(larger)[:N]] for t in got[:-1]]
    torch.save(results, f"{path}/rank{rank}.pt")
    refused_configurations(rank, world, p)


def refused_configurations(rank, world, p):
    """A TP degree that does not hold whole virtual shards, and shards out of rank order."""
    def call(weight, group, **kw):
        fused_rl_ops.chosen_logprob(p["hidden"][:4], weight, p["one"][:4], tp_group=group, batch_invariant=True, **kw)

    if world == 4 and rank < 3:  # three ranks holding 4095 rows
        three = dist.new_group([0, 1, 2])
        with pytest.raises(ValueError, match="does not hold whole ones"):
            call(p["weight"][:1365], three)
    elif world == 4:
        dist.new_group([0, 1, 2])  # every rank calls new_group
    if world == 2:  # the shards swapped: rank 0 holds the upper half
        local = PADDED_V // 2
        with pytest.raises(ValueError, match="rank r of tp_group to hold the rows from r"):
            call(p["weight"][:local], dist.group.WORLD, vocab_start=(1 - rank) * local)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's results at TP 1 and at TP 2, 4 and 8 (the weight gradient reassembled)."""
    p = problem()
    by_world = {1: {name: run(p, torch.arange(N), options, layout) for name, (options, layout) in CASES.items()}}
    by_world[1].update({name: run_op(p, torch.arange(N), name) for name in OP_CASES})
    for world in (2, 4, 8):
        path = tmp_path_factory.mktemp(f"tp{world}")
        run_distributed(ranks_body, world, str(path))
        ranks = [torch.load(path / f"rank{r}.pt") for r in range(world)]
        for r in ranks[1:]:  # every rank holds the same per-token results
            for name in r:
                assert_same_bits(r[name][:-1], ranks[0][name][:-1], (world, name, "rank"))
        by_world[world] = {name: res if "larger" in name else res[:-1] + [torch.cat([r[name][-1] for r in ranks])]
                           for name, res in ranks[0].items()}
    return by_world


@pytest.mark.parametrize("name", list(CASES) + list(OP_CASES))
def test_same_bits_at_every_degree(results, name):
    for world in (2, 4, 8):
        assert_same_bits(results[world][name], results[1][name], (world, name))


@pytest.mark.parametrize("name", ["plain", "top_k", "top_p", "many", *OP_CASES])
def test_tp2_inside_a_larger_batch_gives_tp1_alone(results, name):
    assert_same_bits(results[2][name + " in a larger batch"], results[1][name][:-1], name)


@pytest.mark.parametrize("name", ["plain", "softcap", "top_k_top_p", "many"])
def test_close_to_float64(results, name):
    p = problem()
    options, layout = CASES[name]
    hidden = p["hidden"][:N].double().requires_grad_(True)
    weight = p["weight"].double().requires_grad_(True)
    tokens, grad_lp = p[layout][:N], p["grad_lp"][:N] if layout == "many" else p["grad_lp"][:N, 0]
    # Many tokens: each entry scored under its position's row (the entropy read from the first entry's).
    lp, ent = reference.chosen_logprob(hidden[:, None].expand(N, 3, H) if layout == "many" else hidden, weight,
                                       tokens, vocab_size=VOCAB, **options)
    ent = ent[:, 0] if layout == "many" else ent
    (torch.where(torch.isfinite(lp), lp, 0.0) * grad_lp).sum().add((ent * p["grad_ent"][:N]).sum()).backward()
    for ours, ref in zip(results[1][name], (lp, ent, hidden.grad, weight.grad)):
        torch.testing.assert_close(ours.double(), ref.detach(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["top_logprobs", "jsd"])
def test_other_ops_close_to_float64(results, name):
    p = problem()
    hidden = p["hidden"][:N].double().requires_grad_(True)
    weight = p["weight"].double().requires_grad_(True)
    student = LogitOptions(temperature=0.9, softcap=None if name == "top_logprobs" else 3.0).logit_map
    if name == "top_logprobs":
        ids = results[1][name][0]
        logp = torch.log_softmax(reference.apply_logit_map(hidden @ weight[:VOCAB].T, student), -1)
        scored = (p["one"][:N] != -100)[:, None]
        want = [torch.where(scored, logp.gather(1, ids.clamp(min=0)), 0.0)]
        # The ids: the 5 largest in descending order.
        assert torch.equal(ids[scored[:, 0]], logp[scored[:, 0]].topk(5).indices)
        loss = (want[0] * p["grad_lp"][:N, :1]).sum()
    else:
        want = [reference.vocab_divergence(hidden, weight, p["teacher_hidden"][:N].double(),
                                           p["teacher_weight"].double(), kind=name, logit_map=student,
                                           teacher_logit_map=LogitOptions(temperature=0.9).logit_map,
                                           vocab_size=VOCAB)]
        loss = (want[0] * p["grad_ent"][:N]).sum()
    loss.backward()
    got = results[1][name]
    for ours, ref in zip(got[-3:], want + [hidden.grad, weight.grad]):
        torch.testing.assert_close(ours.double(), ref.detach(), atol=2e-5, rtol=2e-5)
