"""vocab_divergence on one rank against the float64 reference (materialised logits of both models,
fused_rl_ops.reference.vocab_divergence): every kind, temperature, both softcaps, padded vocab, masks,
a wider teacher, every dtype; the logit map as one object; the teacher's tensors constant; non-finite
values; the ops' contract (opcheck, chunking, bad arguments)."""
import dataclasses

import pytest
import torch

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops._options import op_arguments
from fused_rl_ops._vocab_divergence_function import FORWARD_KL_COLUMN, REVERSE_KL_COLUMN
from fused_rl_ops._vocab_parallel.shard import VocabShard
from fused_rl_ops._vocab_parallel.tiling import Tiling
from fused_rl_ops.logit_options import LogitMap, LogitOptions, TeacherLogitMap
from fused_rl_ops.vocab_divergence import OP_GROUPS, VocabDivergenceOptions
from tests.helpers.kernel_calls import KernelCalls

KINDS = ["forward_kl", "reverse_kl", "jsd"]
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=4e-3, rtol=4e-3), torch.float64: dict(atol=1e-12, rtol=1e-12)}
SMALLEST_WORKSPACE = 1  # 128-row chunks: several chunks and a partial last one
# Settings of the distribution: plain; the lot (temperature, both softcaps, padded rows, beta).
SETTINGS = [dict(), dict(temperature=0.7, softcap=4.0, teacher_softcap=2.5, vocab_size=290, beta=0.3),
            dict(temperature=1.6, teacher_softcap=3.0, vocab_size=257, beta=0.8)]


def make_inputs(shape, H, H_t, V, dtype, device, seed=0):
    """Student and teacher hidden states and weights whose logits are of order 1-5, correlated (the
    teacher's logits are near the student's, as in distillation), and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (2.0 / H**0.5)
    teacher_hidden = torch.cat([hidden, torch.randn(*shape, H_t - H, generator=g, dtype=torch.float64)], -1)
    teacher_weight = torch.cat([weight, torch.randn(V, H_t - H, generator=g, dtype=torch.float64) * (1.0 / H_t**0.5)],
                               -1)
    grad = torch.randn(*shape, generator=g, dtype=torch.float64)
    return [t.to(device, dtype) for t in (hidden, weight, teacher_hidden, teacher_weight)] + [grad.to(device)]


def run(fn, hidden, weight, teacher_hidden, teacher_weight, grad, **kw):
    """fn's divergence and its gradients in hidden and weight for the upstream grad; the teacher's
    tensors require a gradient too, and must get none."""
    h, w = (t.detach().clone().requires_grad_(True) for t in (hidden, weight))
    th, tw = (t.detach().clone().requires_grad_(True) for t in (teacher_hidden, teacher_weight))
    divergence = fn(h, w, th, tw, **kw)
    (divergence * grad.to(divergence.dtype)).sum().backward()
    assert th.grad is None and tw.grad is None
    return divergence.detach(), h.grad, w.grad


def reference_keywords(kw):
    """The op's keywords kw as the reference takes them: the logit maps as objects, the teacher's the
    student's with teacher_softcap."""
    kw = dict(kw)
    student = LogitMap(kw.pop("temperature", 1.0), kw.pop("softcap", None))
    teacher = dataclasses.replace(student, softcap=kw.pop("teacher_softcap", None))
    return dict(kw, logit_map=student, teacher_logit_map=teacher)


def reference_run(hidden, weight, teacher_hidden, teacher_weight, grad, **kw):
    as64 = [t.detach().double().cpu() for t in (hidden, weight, teacher_hidden, teacher_weight, grad)]
    mask = kw.pop("mask", None)
    return run(lambda h, w, th, tw, **kw: reference.vocab_divergence(h, w, th.detach(), tw.detach(), **kw), *as64,
               mask=None if mask is None else mask.cpu(), **reference_keywords(kw))


def assert_matches(ours, ref, tol):
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double().cpu(), b, **tol)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("settings", SETTINGS, ids=["plain", "softcaps_padded", "teacher_softcap"])
def test_matches_float64_reference(device, kind, settings):
    """fp32 inputs [3, 13, H], a wider teacher, several chunks, a mask leaving a third out."""
    inputs = make_inputs((3, 13), 24, 40, 300, torch.float32, device)
    mask = torch.rand(3, 13, generator=torch.Generator().manual_seed(1)) > 0.33
    kw = dict(kind=kind, mask=mask.to(device), **settings)
    ours = run(fused_rl_ops.vocab_divergence, *inputs, workspace_bytes=SMALLEST_WORKSPACE, **kw)
    ref = reference_run(*inputs, **kw)
    assert_matches(ours, ref, TOLERANCE[torch.float32])
    assert ours[0].dtype == torch.float32 and ours[0].shape == (3, 13)
    assert ours[0][~mask].eq(0).all() and ours[1][~mask].eq(0).all()
    assert ref[0][mask].gt(1e-3).all()  # the reference's values are not trivially 0
    if settings.get("vocab_size"):
        assert ours[2][settings["vocab_size"]:].eq(0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_float64(kind):
    """float64 inputs on the CPU match the reference to rounding, and pass gradcheck."""
    inputs = make_inputs((6,), 8, 11, 200, torch.float64, "cpu")
    kw = dict(kind=kind, temperature=0.8, softcap=3.0, teacher_softcap=5.0, vocab_size=190, beta=0.4)
    ours = run(fused_rl_ops.vocab_divergence, *inputs, workspace_bytes=SMALLEST_WORKSPACE, **kw)
    assert_matches(ours, reference_run(*inputs, **kw), TOLERANCE[torch.float64])
    # gradcheck perturbs every input element one by one: a smaller case (5 of 40 rows padding).
    hidden, weight, teacher_hidden, teacher_weight, _ = make_inputs((3,), 4, 6, 40, torch.float64, "cpu")
    kw["vocab_size"] = 35
    torch.autograd.gradcheck(
        lambda h, w: fused_rl_ops.vocab_divergence(h, w, teacher_hidden, teacher_weight, **kw),
        (hidden.requires_grad_(True), weight.requires_grad_(True)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_reduced_precision(device, dtype, kind):
    """bf16 / fp16 inputs (the student's and the teacher's dtypes differing too): the reference
    computes from the same rounded inputs in float64."""
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((37,), 32, 48, 300, dtype, device)
    teacher_hidden, teacher_weight = teacher_hidden.float(), teacher_weight.float()
    kw = dict(kind=kind, temperature=0.9, softcap=6.0, vocab_size=299)
    ours = run(fused_rl_ops.vocab_divergence, hidden, weight, teacher_hidden, teacher_weight, grad,
               workspace_bytes=SMALLEST_WORKSPACE, **kw)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == dtype and ours[2].dtype == dtype
    assert_matches(ours, reference_run(hidden, weight, teacher_hidden, teacher_weight, grad, **kw), TOLERANCE[dtype])


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_model_gives_zero_and_no_gradient(device, kind):
    hidden, weight, _, _, grad = make_inputs((20,), 16, 16, 300, torch.float32, device)
    divergence, grad_hidden, grad_weight = run(fused_rl_ops.vocab_divergence, hidden, weight, hidden, weight, grad,
                                               kind=kind, workspace_bytes=SMALLEST_WORKSPACE)
    for t in (divergence, grad_hidden, grad_weight):
        torch.testing.assert_close(t, torch.zeros_like(t), atol=1e-6, rtol=0)


def test_masked_rows_are_not_computed(device):
    """NaN hidden states at masked positions (both models) reach nothing: the ops leave those rows
    out (they get no row of theirs); mask all False gives zeros."""
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((40,), 16, 20, 300, torch.float32, device)
    mask = torch.arange(40, device=device) % 4 == 1
    hidden[~mask], teacher_hidden[~mask] = float("nan"), float("nan")
    with KernelCalls() as calls:
        ours = run(fused_rl_ops.vocab_divergence, hidden, weight, teacher_hidden, teacher_weight, grad,
                   kind="jsd", mask=mask, workspace_bytes=SMALLEST_WORKSPACE)
    assert {c.op for c in calls.calls} == {"vocab_divergence_stats", "vocab_divergence_combine",
                                          "vocab_divergence_mixture", "vocab_divergence_backward"}
    assert all(t.isfinite().all() for t in ours) and ours[0][~mask].eq(0).all() and ours[1][~mask].eq(0).all()
    ref = reference_run(*(t[mask] if t.dim() == 2 and t.shape[0] == 40 else t for t in
                          (hidden, weight, teacher_hidden, teacher_weight)), grad[mask], kind="jsd")
    assert_matches((ours[0][mask], ours[1][mask], ours[2]), ref, TOLERANCE[torch.float32])
    nothing = run(fused_rl_ops.vocab_divergence, hidden, weight, teacher_hidden, teacher_weight, grad,
                  kind="forward_kl", mask=torch.zeros_like(mask))
    assert all(t.eq(0).all() for t in nothing)


@pytest.mark.parametrize("kind", KINDS)
def test_nan_in_either_model_gives_nan_at_that_position_only(device, kind):
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((10,), 16, 20, 300, torch.float32, device)
    hidden[2, 3] = float("nan")
    teacher_hidden[5, 0] = float("nan")
    divergence, grad_hidden, _ = run(fused_rl_ops.vocab_divergence, hidden, weight, teacher_hidden, teacher_weight,
                                     grad, kind=kind, workspace_bytes=SMALLEST_WORKSPACE)
    nan_rows = torch.zeros(10, dtype=torch.bool, device=device)
    nan_rows[[2, 5]] = True
    ref = reference_run(hidden, weight, teacher_hidden, teacher_weight, grad, kind=kind)
    assert torch.equal(divergence.isnan().cpu(), ref[0].isnan()) and torch.equal(divergence.isnan(), nan_rows)
    assert grad_hidden[nan_rows].isnan().all() and grad_hidden[~nan_rows].isfinite().all()


def test_minus_inf_teacher_logits_carry_no_mass(device):
    """A teacher logit of -inf (a token it rules out) is probability 0: forward_kl and jsd stay
    finite, reverse_kl (the student's mass there) is +inf, as float64 gives."""
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((6,), 8, 8, 150, torch.float32, device)
    teacher_hidden[:, 0], teacher_weight[7, 0] = 1.0, float("-inf")
    for kind in KINDS:
        ours = fused_rl_ops.vocab_divergence(hidden, weight, teacher_hidden, teacher_weight, kind=kind)
        ref = reference.vocab_divergence(*(t.double().cpu() for t in (hidden, weight, teacher_hidden, teacher_weight)),
                                         kind=kind)
        torch.testing.assert_close(ours.double().cpu(), ref, atol=2e-5, rtol=2e-5)
        assert ours.isfinite().all() == (kind != "reverse_kl")


def test_chunking_and_batch_invariance_change_nothing_but_rounding(device):
    inputs = make_inputs((70,), 16, 24, 1000, torch.float32, device)
    kw = dict(kind="jsd", temperature=0.9, softcap=5.0)
    wide = run(fused_rl_ops.vocab_divergence, *inputs, **kw)
    for extra in (dict(workspace_bytes=SMALLEST_WORKSPACE), dict(batch_invariant=True)):
        assert_matches(run(fused_rl_ops.vocab_divergence, *inputs, **kw, **extra), [t.double().cpu() for t in wide],
                       dict(atol=1e-6, rtol=1e-6))
    # batch_invariant: a row's results do not depend on the other rows.
    hidden, weight, teacher_hidden, teacher_weight, grad = inputs
    alone = run(fused_rl_ops.vocab_divergence, hidden[:3], weight, teacher_hidden[:3], teacher_weight, grad[:3],
                batch_invariant=True, **kw)
    together = run(fused_rl_ops.vocab_divergence, *inputs, batch_invariant=True, **kw)
    assert torch.equal(alone[0], together[0][:3]) and torch.equal(alone[1], together[1][:3])


def test_logit_map_object_gives_the_keywords_results(device):
    """logit_map=LogitMap(...) is temperature and softcap as one object (the teacher's cap apart):
    bitwise the keywords' divergence and gradients."""
    inputs = make_inputs((3, 7), 8, 12, 200, torch.float32, device)
    kw = dict(kind="jsd", teacher_softcap=2.5, vocab_size=190, workspace_bytes=SMALLEST_WORKSPACE)
    by_keywords = run(fused_rl_ops.vocab_divergence, *inputs, temperature=0.8, softcap=3.0, **kw)
    by_object = run(fused_rl_ops.vocab_divergence, *inputs, logit_map=LogitMap(0.8, 3.0), **kw)
    assert all(torch.equal(a, b) for a, b in zip(by_keywords, by_object))


def test_weight_gradient_added_into_main_grad(device):
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((9,), 8, 8, 200, torch.float32, device)
    expected = run(fused_rl_ops.vocab_divergence, hidden, weight, teacher_hidden, teacher_weight, grad, kind="jsd")[2]
    main_grad = torch.ones_like(weight)
    w = weight.clone().requires_grad_(True)
    out = fused_rl_ops.vocab_divergence(hidden, w, teacher_hidden, teacher_weight, kind="jsd", main_grad=main_grad)
    (out * grad).sum().backward()
    assert w.grad is None
    torch.testing.assert_close(main_grad, expected + 1)


def test_opcheck(device):
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((9,), 12, 16, 200, torch.float32, device)
    ops = torch.ops.fused_rl_ops
    # The student's map, the teacher's, the shard and the tiling.
    options, own = (0.9, 3.0, 0.9, 2.0, 100, 150, 128), dict(beta=0.3)
    stats = ops.vocab_divergence_stats(hidden, weight, teacher_hidden, teacher_weight, None, *options, **own)
    torch.library.opcheck(ops.vocab_divergence_combine, (torch.stack([stats, stats]),))
    rows, term = ops.vocab_divergence_combine(stats[None]), torch.randn(9, device=device)
    # Rows left out inside the ops (mask False).
    for mask in (None, torch.arange(9, device=device) % 3 != 0):
        tensors = (hidden, weight, teacher_hidden, teacher_weight, mask)
        torch.library.opcheck(ops.vocab_divergence_stats, (*tensors, *options), own)
        torch.library.opcheck(ops.vocab_divergence_stats, (*tensors, *options, 4, 8), own)  # blocks of 4, passes of 8
        torch.library.opcheck(ops.vocab_divergence_mixture, (*tensors, rows, *options), own)
        for kind, main_grad in ((0, None), (1, torch.randn(weight.shape, device=device)), (2, None)):
            arguments = (*tensors, rows, term, grad.float(), main_grad, *options)
            torch.library.opcheck(ops.vocab_divergence_backward, arguments, dict(own, kind=kind))
        torch.library.opcheck(ops.vocab_divergence_backward, (*arguments, 4, 8), dict(own, kind=2))


def call_with(**changes):
    hidden, weight, teacher_hidden, teacher_weight, _ = make_inputs((2, 5), 8, 12, 64, torch.float32, "cpu")
    kw = dict(hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight,
              kind="forward_kl")
    kw.update(changes)
    return fused_rl_ops.vocab_divergence(kw.pop("hidden"), kw.pop("weight"), kw.pop("teacher_hidden"),
                                         kw.pop("teacher_weight"), **kw)


def test_the_teachers_map_is_a_group_of_its_own(device):
    """The ops take the teacher's map as an option group of its own, from its Python object through
    the schema: a teacher temperature and cap of its own (the public function shares the student's
    temperature) give the reference's divergences with those maps."""
    hidden, weight, teacher_hidden, teacher_weight, _ = make_inputs((9,), 12, 16, 200, torch.float32, device)
    student, teacher = LogitMap(0.8, 3.0), LogitMap(1.7, 2.0)
    groups = (student, TeacherLogitMap.of(teacher), VocabShard(0, None), Tiling(64), VocabDivergenceOptions())
    assert tuple(map(type, groups)) == OP_GROUPS
    options = op_arguments(*groups)
    tensors = (hidden, weight, teacher_hidden, teacher_weight)
    rows = torch.ops.fused_rl_ops.vocab_divergence_combine(
        torch.ops.fused_rl_ops.vocab_divergence_stats(*tensors, None, *options)[None])
    as64 = [t.double().cpu() for t in tensors]
    for kind, column in (("forward_kl", FORWARD_KL_COLUMN), ("reverse_kl", REVERSE_KL_COLUMN)):
        expected = reference.vocab_divergence(*as64, kind=kind, logit_map=student, teacher_logit_map=teacher)
        torch.testing.assert_close(rows[:, column].double().cpu(), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("changes,error,pattern", [
    (dict(kind="kl"), ValueError, r"kind must be one of 'forward_kl', 'reverse_kl', 'jsd', got 'kl'"),
    (dict(kind="jsd", beta=1.0), ValueError, r"beta must be a number in \(0, 1\), got 1.0"),
    (dict(kind="jsd", beta=0.0), ValueError, r"beta must be a number in \(0, 1\)"),
    (dict(kind="jsd", beta=float("nan")), ValueError, r"beta must be a number in \(0, 1\), got nan"),
    (dict(temperature=0.0), ValueError, "temperature must be a positive finite number, got 0.0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a positive finite number, got nan"),
    (dict(teacher_softcap=-1.0), ValueError, "teacher_softcap must be None or a positive finite number"),
    (dict(temperature=0.5, logit_map=LogitMap(0.5, None)), ValueError,
     r"give the logit options either as keywords \(temperature, softcap\) or as logit_map, not both"),
    (dict(logit_map=LogitOptions()), TypeError, "logit_map must be a LogitMap, got LogitOptions"),
    (dict(teacher_hidden=torch.randn(2, 4, 12)), ValueError, "teacher_hidden must have hidden's leading shape"),
    (dict(teacher_weight=torch.randn(63, 12)), ValueError, r"teacher_weight must be \[V_local, H_t\] = \[64, 12\]"),
    (dict(weight=torch.randn(64, 9)), ValueError, r"expected hidden \[..., H\] and weight \[V_local, H\]"),
    (dict(weight=torch.randn(64, 8, dtype=torch.float64)), TypeError, "weight must have hidden's dtype"),
    (dict(teacher_weight=torch.randn(64, 12).bfloat16()), TypeError,
     "teacher_weight must have teacher_hidden's dtype"),
    (dict(hidden=torch.randn(2, 5, 8).int()), TypeError, "hidden must be float32, bfloat16 or float16"),
    (dict(mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, r"mask must be a bool tensor of hidden's leading"),
    (dict(mask=torch.ones(2, 5)), ValueError, r"mask must be a bool tensor"),
    (dict(vocab_size=65), ValueError, "vocab_size <= 64"),
])
def test_bad_arguments_raise_clear_errors(changes, error, pattern):
    with pytest.raises(error, match=pattern):
        call_with(**changes)


def test_ops_called_directly_refuse_mismatched_tensors():
    hidden, weight, teacher_hidden, teacher_weight, _ = make_inputs((5,), 8, 12, 64, torch.float32, "cpu")
    ops, options = torch.ops.fused_rl_ops, (1.0, None, 1.0, None, 0, None, 128)
    with pytest.raises(ValueError, match=r"expected teacher_hidden \[N, H_t\]"):
        ops.vocab_divergence_stats(hidden, weight, teacher_hidden[:4], teacher_weight, None, *options)
    with pytest.raises(ValueError, match=r"mask must be None or \[N\] bool"):
        ops.vocab_divergence_stats(hidden, weight, teacher_hidden, teacher_weight, torch.ones(5), *options)
    with pytest.raises(TypeError, match="float64 inputs must be float64 for both models"):
        ops.vocab_divergence_stats(hidden.double(), weight.double(), teacher_hidden, teacher_weight, None, *options)
    with pytest.raises(ValueError, match=r"kind must be 0 \(forward_kl\), 1 \(reverse_kl\) or 2 \(jsd\), got 3"):
        ops.vocab_divergence_stats(hidden, weight, teacher_hidden, teacher_weight, None, *options, kind=3)


def test_torch_compile_fullgraph():
    """The fake kernels carry it through a fullgraph trace; the masked rows are left out inside the
    ops there too (their NaN hidden states reach nothing)."""
    hidden, weight, teacher_hidden, teacher_weight, grad = make_inputs((9,), 8, 12, 200, torch.float32, "cpu")
    mask = torch.arange(9) % 3 != 0
    hidden[~mask] = float("nan")
    call = dict(kind="jsd", mask=mask, softcap=3.0)
    compiled = torch.compile(fused_rl_ops.vocab_divergence, fullgraph=True)
    ours = run(lambda *tensors, **kw: compiled(*tensors, **kw), hidden, weight, teacher_hidden, teacher_weight, grad,
               **call)
    eager = run(fused_rl_ops.vocab_divergence, hidden, weight, teacher_hidden, teacher_weight, grad, **call)
    assert all(torch.equal(a, b) for a, b in zip(ours, eager)) and ours[2].isfinite().all()
