import math

import pytest
import torch

import fused_rl_ops
from fused_rl_ops import reference
from fused_rl_ops.chosen_logprob import CombinedColumns
from fused_rl_ops.logit_options import LogitMap, LogitOptions

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
             torch.float16: dict(atol=5e-3, rtol=5e-3)}
SMALLEST_WORKSPACE = 1  # forces 128-row chunks


def make_inputs(N, H, V, dtype, device, vocab_size=None, seed=0):
    """Random hidden/weight with logits of order 1-10 and tokens at 0, the last valid id,
    chunk edges, and one ignore_index position."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (3.0 / H**0.5)
    valid = vocab_size or V
    tokens = torch.randint(0, valid, (N,), generator=g)
    for i, t in enumerate([0, valid - 1, 127, 128, 255, -100][:N]):
        tokens[i] = min(t, valid - 1)
    return hidden.to(device, dtype), weight.to(device, dtype), tokens.to(device)


def reference_outputs_and_grads(hidden, weight, tokens, grad_lp, grad_ent, **kw):
    h = hidden.detach().double().cpu().requires_grad_(True)
    w = weight.detach().double().cpu().requires_grad_(True)
    lp, ent = reference.chosen_logprob(h, w, tokens.cpu(), **kw)
    (lp * grad_lp.double().cpu() + ent * grad_ent.double().cpu()).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def run_ours(hidden, weight, tokens, grad_lp, grad_ent, **kw):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens, return_entropy=True, **kw)
    (lp * grad_lp + ent * grad_ent).sum().backward()
    return lp, ent, h.grad, w.grad


def assert_matches_reference(ours, ref, tol):
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach().double().cpu(), b, **tol)


@pytest.mark.parametrize(
    "N,H,V,vocab_size,temperature",
    [(37, 33, 300, None, 1.0), (37, 33, 300, 290, 0.7), (5, 16, 128, None, 1.3), (1, 8, 129, 129, 2.0),
     (64, 24, 1000, 999, 0.9)],
)
def test_matches_float64_reference(device, N, H, V, vocab_size, temperature):
    hidden, weight, tokens = make_inputs(N, H, V, torch.float32, device, vocab_size)
    grad_lp, grad_ent = torch.randn(N, device=device), torch.randn(N, device=device)
    kw = dict(temperature=temperature, vocab_size=vocab_size)
    ours = run_ours(hidden, weight, tokens, grad_lp, grad_ent, workspace_bytes=SMALLEST_WORKSPACE, **kw)
    ref = reference_outputs_and_grads(hidden, weight, tokens, grad_lp, grad_ent, **kw)
    assert ours[0].dtype == torch.float32 and ours[0].shape == (N,)
    assert_matches_reference(ours, ref, TOLERANCE[torch.float32])
    assert ours[0][tokens == -100].eq(0).all()
    if vocab_size is not None and vocab_size < V:
        assert ours[3][vocab_size:].eq(0).all()  # padded rows get no gradient


def test_one_chunk_equals_many_chunks(device):
    hidden, weight, tokens = make_inputs(40, 32, 700, torch.float32, device)
    grads = torch.randn(40, device=device), torch.randn(40, device=device)
    many = run_ours(hidden, weight, tokens, *grads, workspace_bytes=SMALLEST_WORKSPACE)
    one = run_ours(hidden, weight, tokens, *grads, workspace_bytes=2**30)
    for a, b in zip(many, one):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision(device, dtype):
    hidden, weight, tokens = make_inputs(48, 64, 520, dtype, device, vocab_size=515)
    grad_lp, grad_ent = torch.randn(48, device=device), torch.randn(48, device=device)
    kw = dict(temperature=0.8, vocab_size=515)
    ours = run_ours(hidden, weight, tokens, grad_lp, grad_ent, workspace_bytes=SMALLEST_WORKSPACE, **kw)
    ref = reference_outputs_and_grads(hidden, weight, tokens, grad_lp, grad_ent, **kw)
    assert ours[0].dtype == torch.float32 and ours[2].dtype == dtype and ours[3].dtype == dtype
    assert_matches_reference(ours, ref, TOLERANCE[dtype])


def test_leading_shape_int32_tokens_and_non_contiguous(device):
    hidden, weight, tokens = make_inputs(24, 16, 200, torch.float32, device)
    hidden_bsh = hidden.reshape(4, 6, 16).transpose(0, 1)  # [6, 4, 16], not contiguous
    tokens_bs = tokens.reshape(4, 6).transpose(0, 1).to(torch.int32)
    weight_t = weight.T.contiguous().T  # same values, column-major
    assert not hidden_bsh.is_contiguous() and not weight_t.is_contiguous()
    lp = fused_rl_ops.chosen_logprob(hidden_bsh, weight_t, tokens_bs)
    ref, _ = reference.chosen_logprob(hidden_bsh.double().cpu(), weight.double().cpu(), tokens_bs.long().cpu())
    assert lp.shape == (6, 4)
    torch.testing.assert_close(lp.double().cpu(), ref, **TOLERANCE[torch.float32])


def test_skip_ignored_false_passes_no_logprob_gradient_but_keeps_entropy(device):
    hidden, weight, tokens = make_inputs(6, 8, 130, torch.float32, device)
    tokens[:] = -100
    h = hidden.clone().requires_grad_(True)
    lp, ent = fused_rl_ops.chosen_logprob(h, weight, tokens, return_entropy=True, skip_ignored=False)
    assert lp.eq(0).all() and (ent > 0).all()
    lp.sum().backward(retain_graph=True)
    assert h.grad.eq(0).all()
    ent.sum().backward()
    assert h.grad.ne(0).all()


def test_unchecked_out_of_range_ids_give_nan_not_a_wrong_number(device):
    """check_tokens=False: ids below 0, in the padding rows or beyond every row match no row; their
    logprob and gradients are NaN (not -lse), every other token's are the float64 reference's."""
    hidden, weight, tokens = make_inputs(8, 8, 130, torch.float32, device, vocab_size=120)
    bad = torch.tensor([1, 4, 6, 7], device=device)
    tokens[bad] = torch.tensor([-1, 120, 129, 10**6], device=device)
    grad_lp, grad_ent = torch.randn(8, device=device), torch.randn(8, device=device)
    lp, ent, grad_h, grad_w = run_ours(hidden, weight, tokens, grad_lp, grad_ent, vocab_size=120, check_tokens=False)
    good = torch.ones(8, dtype=torch.bool, device=device)
    good[bad] = False
    ref_lp, ref_ent, ref_grad_h, _ = reference_outputs_and_grads(
        hidden, weight, torch.where(good, tokens, -100), grad_lp, grad_ent, vocab_size=120)
    _, bad_ent = reference.chosen_logprob(hidden.double().cpu(), weight.double().cpu(), tokens.cpu().clamp(0, 119),
                                          vocab_size=120)  # the entropy of the bad ids' rows
    tol = TOLERANCE[torch.float32]
    assert lp[~good].isnan().all() and grad_h[~good].isnan().all()
    torch.testing.assert_close(lp[good].double().cpu(), ref_lp[good.cpu()], **tol)
    torch.testing.assert_close(grad_h[good].double().cpu(), ref_grad_h[good.cpu()], **tol)
    torch.testing.assert_close(ent[good].double().cpu(), ref_ent[good.cpu()], **tol)
    torch.testing.assert_close(ent[~good].double().cpu(), bad_ent[~good.cpu()], **tol)
    assert grad_w[:120].isnan().all() and grad_w[120:].eq(0).all()
    with pytest.raises(ValueError, match="token ids must lie in"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens, vocab_size=120)


@pytest.mark.parametrize("temperature,batch_invariant", [(1.0, False), (0.7, True)])
def test_is_max_marks_every_token_tied_for_the_row_maximum(device, temperature, batch_invariant):
    """return_is_max against float64: True exactly where the token's logit equals its row's maximum
    over the valid rows, whichever of several tied tokens it is; False for ignored positions, NaN
    rows and unchecked out-of-range ids. Integer inputs make every logit, so every tie, exact; the
    padding rows would hold each row's maximum if they took part; several 128-row chunks."""
    g = torch.Generator().manual_seed(5)
    N, H, V, valid = 40, 6, 300, 260
    hidden = torch.randint(-2, 3, (N, H), generator=g).double()
    weight = torch.randint(-2, 3, (V, H), generator=g).double()
    weight[valid:] = 3.0 * hidden.abs().max()
    logits = hidden @ weight[:valid].t()
    row_max = logits.max(-1, keepdim=True).values
    tied = logits == row_max
    assert (tied.sum(-1) > 1).sum() > N // 4  # many rows with a tie for the maximum
    last_tied = valid - 1 - tied.flip(-1).int().argmax(-1)  # the highest id among the tied
    tokens = torch.where(torch.arange(N) % 2 == 0, last_tied, torch.randint(0, valid, (N,), generator=g))
    tokens[3], tokens[9] = -100, V + 5  # ignored, out of range
    hidden[13, 2] = float("nan")
    expected = tied.gather(-1, tokens.clamp(0, valid - 1)[:, None]).squeeze(-1)
    expected[[3, 9, 13]] = False
    assert expected.sum() > N // 2
    logprob, is_max = fused_rl_ops.chosen_logprob(
        hidden.float().to(device), weight.float().to(device), tokens.to(device), temperature=temperature,
        vocab_size=valid, check_tokens=False, return_is_max=True, batch_invariant=batch_invariant,
        workspace_bytes=SMALLEST_WORKSPACE)
    assert is_max.dtype == torch.bool and torch.equal(is_max.cpu(), expected)
    assert logprob[13].isnan() and logprob[9].isnan()
    only_entropy = fused_rl_ops.chosen_logprob(hidden.float().to(device), weight.float().to(device),
                                               tokens.clamp(0, valid - 1).to(device), return_entropy=True,
                                               return_is_max=True, vocab_size=valid)
    assert len(only_entropy) == 3 and only_entropy[2].dtype == torch.bool


def test_zero_tokens(device):
    hidden, weight, _ = make_inputs(1, 8, 130, torch.float32, device)
    h = hidden[:0].clone().requires_grad_(True)
    lp, ent = fused_rl_ops.chosen_logprob(h, weight, torch.empty(0, dtype=torch.long, device=device), return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == (0,) and ent.shape == (0,) and h.grad.shape == (0, 8)


def test_deterministic(device):
    hidden, weight, tokens = make_inputs(50, 40, 600, torch.float32, device)
    grads = torch.randn(50, device=device), torch.randn(50, device=device)
    first = run_ours(hidden, weight, tokens, *grads, workspace_bytes=SMALLEST_WORKSPACE)
    second = run_ours(hidden, weight, tokens, *grads, workspace_bytes=SMALLEST_WORKSPACE)
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_gradcheck_float64():
    hidden, weight, tokens = make_inputs(4, 5, 133, torch.float64, "cpu", vocab_size=131)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def fn(h, w):
        return fused_rl_ops.chosen_logprob(h, w, tokens, temperature=0.9, vocab_size=131, return_entropy=True,
                                           workspace_bytes=SMALLEST_WORKSPACE)

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def per_token_inputs(stats):
    """The backward's per-token inputs for the stats of one shard: row max, log-sum, log-sum minus
    entropy, and upstream gradients."""
    row = CombinedColumns(*torch.ops.fused_rl_ops.chosen_logprob_combine(stats[None]).unbind(1))
    device = stats.device
    return [row.row_max.contiguous(), row.log_sum.contiguous(), (row.log_sum - row.entropy).contiguous(),
            torch.randn(len(stats), device=device), torch.randn(len(stats), device=device)]


def test_opcheck(device):
    hidden, weight, tokens = make_inputs(9, 12, 200, torch.float32, device)
    ops = torch.ops.fused_rl_ops
    torch.library.opcheck(ops.chosen_logprob_stats, (hidden, weight, tokens, 0.9, None, 100, None, 128))
    # Blocks of 4, passes of 8.
    torch.library.opcheck(ops.chosen_logprob_stats, (hidden, weight, tokens, 0.9, None, 100, None, 128, 4, 8))
    torch.library.opcheck(ops.chosen_logprob_stats, (hidden, weight, tokens, 0.9, None, 100, 150, 128))
    # Rows left out inside the op (the tokens at 0 and the last valid id).
    torch.library.opcheck(ops.chosen_logprob_stats, (hidden, weight, tokens, 0.9, None, 0, None, 128),
                          dict(ignore_index=int(tokens[0]), top_width=3))
    stats = ops.chosen_logprob_stats(hidden, weight, tokens, 0.9, None, 0, None, 128)
    torch.library.opcheck(ops.chosen_logprob_combine, (torch.stack([stats, stats]),))
    per_token = per_token_inputs(stats)
    options = (0.9, None, 0, 150, 128)
    torch.library.opcheck(ops.chosen_logprob_backward, (hidden, weight, tokens, *per_token, None, *options))
    torch.library.opcheck(ops.chosen_logprob_backward, (hidden, weight, tokens, *per_token, None, *options, 4, 8))
    torch.library.opcheck(ops.chosen_logprob_backward, (hidden, weight, tokens, *per_token, None, *options),
                          dict(grad_chunks=2))  # a gradient buffer of two chunks
    torch.library.opcheck(ops.chosen_logprob_backward, (hidden, weight, tokens, *per_token, None, *options),
                          dict(ignore_index=int(tokens[0])))
    main_grad = torch.randn(weight.shape, device=device)
    torch.library.opcheck(ops.chosen_logprob_backward, (hidden, weight, tokens, *per_token, main_grad, *options, 4,
                                                        8))


def test_valid_rows_are_the_first_rows_of_weight(device):
    """The ops take the whole weight and valid_rows (padding after them): the same as the valid rows
    alone, and the backward's padded rows get zero gradient."""
    hidden, weight, tokens = make_inputs(9, 12, 200, torch.float32, device, vocab_size=150)
    ops = torch.ops.fused_rl_ops
    stats = ops.chosen_logprob_stats(hidden, weight, tokens, 0.9, None, 0, 150, 128)
    assert torch.equal(stats, ops.chosen_logprob_stats(hidden, weight[:150], tokens, 0.9, None, 0, None, 128))
    per_token = per_token_inputs(stats)
    grad_h, grad_w = ops.chosen_logprob_backward(hidden, weight, tokens, *per_token, None, 0.9, None, 0, 150, 128)
    grad_h_valid, grad_w_valid = ops.chosen_logprob_backward(hidden, weight[:150], tokens, *per_token, None, 0.9, None,
                                                             0, None, 128)
    assert torch.equal(grad_h, grad_h_valid) and torch.equal(grad_w[:150], grad_w_valid)
    assert grad_w[150:].eq(0).all()
    with pytest.raises(ValueError, match="valid_rows must be None or at most weight's rows 200, got 201"):
        ops.chosen_logprob_stats(hidden, weight, tokens, 0.9, None, 0, 201, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_chunks,row_block,pass_rows", [(2, 0, 0), (3, 16, 32), (3, 16, 16), (100, 0, 0)])
def test_gradient_gemms_over_several_chunks(device, dtype, grad_chunks, row_block, pass_rows):
    """grad_chunks > 1 (CUDA's default for bf16/fp16): the gradient GEMMs take groups of 128-row
    chunks from a buffer of their logit gradients (the last group partial, then one group of all the
    rows, then several passes of row blocks with a padded last block, the buffer holding every pass's
    rows for one weight-gradient GEMM per group (passes of 32 rows: 48 rows of 3 chunks are no more
    than a pass and the [group, 24] accumulator) or one pass's, summed over passes (passes of 16)):
    the float64 reference's gradients, and with main_grad what adding the returned weight gradient
    gives (bitwise on the CPU; on CUDA the GEMMs add into it, in fp32)."""
    N, H, V, valid = 37, 24, 700, 690
    hidden, weight, tokens = make_inputs(N, H, V, dtype, device, vocab_size=valid)
    ops = torch.ops.fused_rl_ops
    options = (0.8, None, 0, valid, 128, row_block, pass_rows)
    stats = ops.chosen_logprob_stats(hidden, weight, tokens, *options)
    row = CombinedColumns(*ops.chosen_logprob_combine(stats[None]).unbind(1))
    grad_lp = torch.where(tokens == -100, 0.0, torch.randn(N, device=device))  # as chosen_logprob passes them
    grad_ent = torch.randn(N, device=device)
    per_token = [row.row_max.contiguous(), row.log_sum.contiguous(), (row.log_sum - row.entropy).contiguous(),
                 grad_lp, grad_ent]
    kw = dict(grad_chunks=grad_chunks)
    grad_h, grad_w = ops.chosen_logprob_backward(hidden, weight, tokens, *per_token, None, *options, **kw)
    _, _, want_h, want_w = reference_outputs_and_grads(hidden, weight, tokens, grad_lp, grad_ent, temperature=0.8,
                                                       vocab_size=valid, skip_ignored=False)  # the ops: every row
    torch.testing.assert_close(grad_h.double().cpu(), want_h, **TOLERANCE[dtype])
    torch.testing.assert_close(grad_w.double().cpu(), want_w, **TOLERANCE[dtype])
    assert grad_w[valid:].eq(0).all()
    main_grad = torch.randn(V, H, device=device)
    start = main_grad.clone()
    grad_h_again, _ = ops.chosen_logprob_backward(hidden, weight, tokens, *per_token, main_grad, *options, **kw)
    assert torch.equal(grad_h_again, grad_h)
    if device == "cpu":
        assert torch.equal(main_grad, start + grad_w.float())
    else:
        torch.testing.assert_close((main_grad - start).double().cpu(), want_w, **TOLERANCE[dtype])


def test_ops_called_directly_refuse_what_the_kernels_cannot_read(device):
    """The ops check the shapes, dtypes and devices their kernels rely on (the options:
    tests/tooling/test_op_contract.py), with chosen_logprob's words."""
    hidden, weight, tokens = make_inputs(9, 12, 200, torch.float32, device)
    ops = torch.ops.fused_rl_ops
    for args, error, message in [
            ((hidden, weight, tokens[:8]), ValueError, r"tokens must be \[N\] or \[N, k\] with k >= 1"),
            ((hidden, weight, tokens[:, None, None]), ValueError, r"tokens must be \[N\] or \[N, k\] with k >= 1"),
            ((hidden, weight, tokens[:, None][:, :0]), ValueError, r"tokens must be \[N\] or \[N, k\] with k >= 1"),
            ((hidden, weight, tokens.int()), TypeError, "tokens must be int64"),
            ((hidden, weight[:, :11], tokens), ValueError, r"expected hidden \[N, H\] with H >= 1 and weight \[V, H"),
            ((hidden[:, :0], weight[:, :0], tokens), ValueError, r"expected hidden \[N, H\] with H >= 1"),
            ((hidden.int(), weight.int(), tokens), TypeError, "hidden must be float32, bfloat16 or float16"),
            ((hidden, weight.double(), tokens), TypeError, "weight must have hidden's dtype"),
            ((hidden, weight.to("meta"), tokens), ValueError, "all tensors must be on one device")]:
        with pytest.raises(error, match=message):
            ops.chosen_logprob_stats(*args, 1.0, None, 0, None, 128)
    stats = ops.chosen_logprob_stats(hidden, weight, tokens, 1.0, None, 0, None, 128)
    with pytest.raises(ValueError, match="partials must be \\[ranks, N, 3 \\+ k\\]"):
        ops.chosen_logprob_combine(stats)
    with pytest.raises(TypeError, match="partials must be float32"):
        ops.chosen_logprob_combine(stats[None].bfloat16())
    per_token = per_token_inputs(stats)
    for bad in (torch.randn(8, device=device), torch.randn(9, device=device).bfloat16()):
        with pytest.raises(ValueError, match="must be \\[N\\], grad_logprob tokens' shape, in the accumulation dtype"):
            ops.chosen_logprob_backward(hidden, weight, tokens, *per_token[:4], bad, None, 1.0, None, 0, None, 128)
    for main_grad in (torch.zeros(200, 11, device=device), torch.zeros(200, 12, device=device, dtype=torch.float64)):
        with pytest.raises(ValueError, match="main_grad must be a float32 \\(or weight-dtype\\) tensor"):
            ops.chosen_logprob_backward(hidden, weight, tokens, *per_token, main_grad, 1.0, None, 0, None, 128)


@pytest.mark.parametrize("op", ["chosen_logprob_stats", "chosen_logprob_backward"])
@pytest.mark.parametrize("temperature, softcap", [(0.0, None), (-1.0, None), (math.nan, None), (math.inf, None),
                                                  (1.0, 0.0), (1.0, -1.0), (1.0, math.nan), (1.0, math.inf)])
def test_ops_called_directly_refuse_a_bad_temperature_or_softcap(device, op, temperature, softcap):
    """As chosen_logprob does: a softcap of -1 is not "no cap", and a temperature of 0 does not run."""
    hidden, weight, tokens = make_inputs(9, 12, 200, torch.float32, device)
    stats = torch.ops.fused_rl_ops.chosen_logprob_stats(hidden, weight, tokens, 1.0, None, 0, None, 128)
    tensors = (hidden, weight, tokens) + ((*per_token_inputs(stats), None) if op == "chosen_logprob_backward" else ())
    name, value = ("temperature", temperature) if softcap is None else ("softcap", softcap)
    optional = "None or " if name == "softcap" else ""
    with pytest.raises(ValueError, match=f"chosen_logprob: {name} must be {optional}a positive finite number, got"):
        getattr(torch.ops.fused_rl_ops, op)(*tensors, temperature, softcap, 0, None, 128)
    with pytest.raises(ValueError, match=f"LogitOptions: {name} must be {optional}a positive finite number, got"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens, temperature=temperature, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_weight_gradient_added_into_main_grad(device, dtype, batch_invariant):
    """With main_grad the weight gradient goes into it; the weight gets no gradient, or Megatron's
    placeholder when it carries grad_added_to_main_grad. On the CPU bitwise what adding the returned
    gradient would give (Megatron's unfused path); on CUDA the GEMMs add their fp32 sums into it
    (Megatron's gradient_accumulation_fusion), with no rounding to bf16 on the way."""
    hidden, weight, tokens = make_inputs(20, 16, 300, dtype, device, vocab_size=290)
    grads = torch.randn(20, device=device), torch.randn(20, device=device)
    kw = dict(vocab_size=290, workspace_bytes=SMALLEST_WORKSPACE, batch_invariant=batch_invariant)
    _, _, unfused_grad_h, unfused_grad_w = run_ours(hidden, weight, tokens, *grads, **kw)

    def into_main_grad(start, megatron_ddp):
        main_grad = start.clone()
        h = hidden.clone().requires_grad_(True)
        w = torch.nn.Parameter(weight.clone())
        if megatron_ddp:
            w.grad_added_to_main_grad = False
        lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens, return_entropy=True, main_grad=main_grad, **kw)
        (lp * grads[0] + ent * grads[1]).sum().backward()
        assert torch.equal(h.grad, unfused_grad_h)
        if megatron_ddp:
            assert w.grad_added_to_main_grad and w.grad.shape == w.shape
        else:
            assert w.grad is None
        return main_grad

    start = torch.randn(weight.shape, device=device)
    for megatron_ddp in (False, True):
        main_grad = into_main_grad(start, megatron_ddp)
        if device == "cpu":
            assert torch.equal(main_grad, start + unfused_grad_w.float())
            continue
        # CUDA: the fp32 weight gradient (main_grad from zero) added to start once, in fp32.
        fused = into_main_grad(torch.zeros_like(start), megatron_ddp)
        torch.testing.assert_close(main_grad, start + fused, rtol=2**-23, atol=0)
        # Within fp32 GEMM rounding of the returned gradient before its own rounding to weight's dtype.
        ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
        assert ((fused - unfused_grad_w.float()).abs() <= ulp * fused.abs() + 1e-6).all()
        if dtype == torch.bfloat16:  # more bits than bf16 holds: not rounded on the way
            assert (fused != fused.bfloat16().float()).float().mean() > 0.5


def test_torch_compile(device):
    hidden, weight, tokens = make_inputs(16, 16, 300, torch.float32, device)

    def loss(h, w):
        lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens, temperature=0.8, return_entropy=True, check_tokens=False)
        return (lp * 2.0).sum() + ent.mean()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out_c, out_e = compiled(h1, w1), loss(h2, w2)
    out_c.backward()
    out_e.backward()
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


def _fwd_bwd(path, N, H, V):
    hidden = torch.randn(N, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.1).requires_grad_(True)
    tokens = torch.randint(0, V, (N,))
    if path == "fused":
        lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, tokens, return_entropy=True, workspace_bytes=4 * 2**20)
    else:
        lp, ent = reference.chosen_logprob(hidden, weight, tokens)
    (lp.sum() + ent.sum()).backward()


def _extra_peak_in_this_process(path):
    from benchmarks.peak_memory import peak_rss_growth

    torch.set_num_threads(1)
    _fwd_bwd(path, 64, 64, 256)  # thread pools and BLAS buffers
    return peak_rss_growth(lambda: _fwd_bwd(path, 1024, 64, 32768))


def extra_peak_bytes(path):
    from benchmarks.peak_memory import in_fresh_process

    return in_fresh_process(_extra_peak_in_this_process, path)


def test_peak_memory_does_not_hold_tokens_by_vocab():
    """Peak RSS growth of forward + backward (inputs and gradients included: 16.5 MiB): the naive
    path holds [N, V] logits (128 MiB here), ours stays near its 4 MiB workspace."""
    logits_bytes = 4 * 1024 * 32768
    assert extra_peak_bytes("naive") > logits_bytes
    assert extra_peak_bytes("fused") < 32 * 2**20


def test_bad_inputs(device):
    hidden, weight, tokens = make_inputs(4, 8, 130, torch.float32, device)
    with pytest.raises(TypeError, match="weight must have hidden's dtype"):
        fused_rl_ops.chosen_logprob(hidden, weight.to(torch.float16), tokens)
    with pytest.raises(TypeError, match="tokens must be int64 or int32"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens.float())
    with pytest.raises(TypeError, match="hidden must be float32, bfloat16 or float16"):
        fused_rl_ops.chosen_logprob(hidden.to(torch.int32), weight.to(torch.int32), tokens)
    with pytest.raises(ValueError, match=r"weight \[V_local, H\]"):
        fused_rl_ops.chosen_logprob(hidden, weight[:, :7], tokens)
    with pytest.raises(ValueError, match="tokens must have hidden's leading shape"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens[:3])
    with pytest.raises(ValueError, match="temperature must be a positive"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens, temperature=0.0)
    with pytest.raises(ValueError, match=r"either as keywords \(temperature, softcap, top_k, top_p\) or as "
                                         r"logit_options, not both"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens, top_k=5, logit_options=LogitOptions(top_k=5))
    with pytest.raises(TypeError, match="logit_options must be a LogitOptions, got LogitMap"):
        fused_rl_ops.chosen_logprob(hidden, weight, tokens, logit_options=LogitMap(1.0, None))
    bad = tokens.clone()
    bad[1] = 130
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 130\).*\[130\]"):
        fused_rl_ops.chosen_logprob(hidden, weight, bad)
    bad[1] = 125
    with pytest.raises(ValueError, match=r"\[0, 120\)"):
        fused_rl_ops.chosen_logprob(hidden, weight, bad, vocab_size=120)
    bad[1] = -1
    with pytest.raises(ValueError, match="token ids must lie"):
        fused_rl_ops.chosen_logprob(hidden, weight, bad)
    with pytest.raises(ValueError, match="one device"):
        fused_rl_ops.chosen_logprob(hidden, weight.to("meta"), tokens)


@pytest.mark.per_device
@pytest.mark.skipif(not (torch.cuda.is_available() and fused_rl_ops.has_cuda_kernels()), reason="needs a GPU")
def test_cuda_peak_memory_within_workspace_at_large_vocab():
    N, H, V, workspace = 4096, 1024, 131072, 64 * 2**20
    hidden, weight, tokens = make_inputs(N, H, V, torch.bfloat16, "cuda")
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    grads = (torch.empty_like(hidden), torch.empty_like(weight))  # the gradients' own memory
    del grads
    # A small call first: cuBLAS's workspace, made at a stream's first GEMM of a kind, is not the op's.
    fused_rl_ops.chosen_logprob(hidden[:8].detach().requires_grad_(True), weight[:8].detach().requires_grad_(True),
                                tokens[:8].clamp(max=7), vocab_size=8).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() + 2 * N * H + 2 * V * H
    lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, tokens, return_entropy=True, workspace_bytes=workspace)
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # What the ops hold at the backward's peak, in its chunk loop: the buffers the workspace bounds,
    # the fp32 hidden-gradient accumulator of the scored rows (4 bytes per element) and the copy of
    # hidden's scored rows that leaving out the ignored one makes (make_inputs has one -100 token; 2
    # bytes per element, the forward's copy freed by then); the per-token state (the ops' index,
    # masks and gathered per-token inputs, the Function's saved rows, logprob and entropy: a few
    # dozen [N] tensors of at most 8 bytes) within 1 MiB. The logits alone would be 2 GiB.
    scored = int((tokens != -100).sum())
    assert extra <= workspace + 4 * scored * H + 2 * scored * H + 2**20, extra


@pytest.mark.parametrize("V", [1, 3, 300])
def test_one_hot_softmax_passes_no_gradient(device, V):
    """Logits of order 1e7 make the softmax one-hot: float64 gives the chosen token probability 1
    and every logit gradient 0. The backward recomputes the forward's shifted logits z / T - max,
    which must come out bit for bit as in the forward (no FMA contraction of z * (1/T) - max, whose
    result would be the product's rounding error: an error of order 1 in a probability of 1)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 8, generator=g, dtype=torch.float64) * 3000
    weight = torch.randn(V, 8, generator=g, dtype=torch.float64) * 3000
    logits = hidden @ weight.T
    tokens = logits.argmax(-1)  # the one token with probability 1
    tokens[:5] = -100
    grad_lp, grad_ent = torch.randn(40, generator=g), torch.randn(40, generator=g)
    lp, ent, grad_h, grad_w = run_ours(hidden.float().to(device), weight.float().to(device), tokens.to(device),
                                       grad_lp.to(device), grad_ent.to(device), temperature=1.7)
    want_lp, want_ent, want_h, want_w = reference_outputs_and_grads(hidden, weight, tokens, grad_lp, grad_ent,
                                                                    temperature=1.7)
    assert torch.equal(want_h, torch.zeros_like(want_h)) and torch.equal(want_w, torch.zeros_like(want_w))
    assert torch.equal(lp.cpu().double(), want_lp) and torch.equal(ent.cpu().double(), want_ent)
    assert torch.equal(grad_h.cpu(), torch.zeros_like(grad_h.cpu()))
    assert torch.equal(grad_w.cpu(), torch.zeros_like(grad_w.cpu()))
