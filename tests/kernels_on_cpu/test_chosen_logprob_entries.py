"""chosen_logprob's CUDA row kernels on the CPU (tests/helpers/kernels_on_cpu.py) for several tokens
per position (stats_rows' chosen logits, grad_rows through entry_grads, combine), against float64."""
import math

import pytest
import torch

from tests.helpers.kernels_on_cpu import (FP32_EPS, Buf, assert_passes, assert_within, combined_stats64,  # noqa: F401
                                    drivers, logit_grads64, logit_map_scalars, lse_entropy64, pytestmark,
                                    row_stats64, run_case, running_stats, stats_tolerance)

K_TOKENS = 3


def entry_tokens(N, C, col0):
    """[N, 3] ids: random ones inside the chunk, then the chunk's first and last column, ids just
    outside it, an ignore_index, and a row naming one id twice."""
    tokens = torch.randint(col0, col0 + C, (N, K_TOKENS))
    tokens[0] = torch.tensor([col0, col0 + C - 1, col0 - 1])
    tokens[1] = torch.tensor([col0 + C, -100, col0 + 1])
    tokens[2, 2] = tokens[2, 0]
    return tokens


@pytest.mark.parametrize("N,C,passes", [(21, 45, "several"), (21, 45, "one"), (13, 7, "several")])
def test_stats_rows_many_tokens(drivers, tmp_path, N, C, passes):
    col0, temperature = 100, 0.7
    inv_temp = float(torch.tensor(1 / temperature, dtype=torch.float32))
    logits = torch.randn(N, C) * 3
    tokens = entry_tokens(N, C, col0)
    earlier = torch.randn(N, 30, dtype=torch.float64) * 3
    has_earlier = torch.arange(N) < N // 2
    stats = torch.cat([running_stats(earlier, has_earlier)[:, :3], torch.full((N, K_TOKENS), 0.5)], 1)
    out, [launch] = run_case(drivers, "chosen_logprob", "stats_rows",
                             {"logits": Buf(logits), "tokens": Buf(tokens), "stats": Buf(stats)},
                             {"N": N, "C": C, "col0": col0, "k": K_TOKENS, **logit_map_scalars(temperature)},
                             passes=passes, tmp_dir=tmp_path)
    assert_passes(launch, N, passes, rows_per_block=launch.block[0] // 32)
    got = out["stats"].double()
    z = (logits * inv_temp).double()
    seen = torch.where(has_earlier[:, None], torch.cat([earlier, z], 1),
                       torch.cat([torch.full_like(earlier, -math.inf), z], 1))
    lse, ent = lse_entropy64(seen)
    tol = stats_tolerance(C / 32 + 9, float(seen[seen.isfinite()].abs().max()))
    assert_within(got[:, 0] + got[:, 1].log(), lse, tol, "lse")
    assert_within(got[:, 1].log() - got[:, 2] / got[:, 1], ent, tol, "entropy")
    # Each entry's chosen logit: the kernel's fp32 z exactly where its token is in the chunk, else untouched.
    inside = (tokens >= col0) & (tokens < col0 + C)
    expected = stats[:, 3:].clone()
    rows = torch.arange(N)[:, None].expand(N, K_TOKENS)
    expected[inside] = (logits * inv_temp)[rows[inside], tokens[inside] - col0]
    assert torch.equal(out["stats"][:, 3:], expected)


def run_entry_grads(drivers, tmp_path, logits, tokens, per_row, gl, col0, temperature, passes, softcap=None,
                    grads=None):
    """grad_rows with k tokens per position, in place or into grads (the gradient GEMMs' buffer)."""
    N, C = logits.shape
    row_max, log_sum, lme, ge = per_row
    buffers = {"logits": Buf(logits.clone()), "tokens": Buf(tokens), "row_max": Buf(row_max.float()),
               "log_sum": Buf(log_sum.float()), "log_sum_minus_entropy": Buf(lme.float()), "gl": Buf(gl),
               "ge": Buf(ge), "entry_grads": Buf(torch.full((N * (1 + tokens.shape[1]),), math.nan))}
    scalars = {"N": N, "C": C, "col0": col0, "k": tokens.shape[1], **logit_map_scalars(temperature, softcap),
               "in_place": int(grads is None)}
    if grads is not None:
        buffers["grads"] = Buf(grads)
        scalars.update(dtype={torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[grads.dtype],
                       grads_stride=grads.shape[1], grads_col=0)
    out, launches = run_case(drivers, "chosen_logprob", "grad_rows", buffers, scalars, passes=passes,
                             block_order_seed=N, tmp_dir=tmp_path)
    assert [launch.kernel for launch in launches] == [
        "chosen_logprob_gather_entry_grads_kernel", "chosen_logprob_grad_rows_kernel",
        "chosen_logprob_scatter_entry_grads_kernel"]
    return out["logits" if grads is None else "grads"]


@pytest.mark.parametrize("N,C,passes", [(20, 45, "several"), (20, 64, "one"), (300, 8, "several")])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_grad_rows_many_tokens(drivers, tmp_path, N, C, passes, softcap):
    """The row's probability term with the entries' summed gradient G, each chosen column adding its
    entries' own (a duplicate twice); written once in each gradient dtype, the chosen columns too
    (bitwise the in-place fp32 gradients rounded once)."""
    col0, temperature = 64, 1.3
    inv_temp = float(torch.tensor(1 / temperature, dtype=torch.float32))
    logits = torch.randn(N, C) * 3
    tokens = entry_tokens(N, C, col0)
    z = (logits * inv_temp).double()
    row_max, log_sum, ent = combined_stats64(torch.cat([z, torch.randn(N, 50, dtype=torch.float64)], 1))
    gl, ge = torch.randn(N, K_TOKENS), torch.randn(N)
    per_row = (row_max, log_sum, log_sum - ent, ge)
    in_place = run_entry_grads(drivers, tmp_path / "in_place", logits, tokens, per_row, gl, col0, temperature, passes,
                               softcap)
    if softcap is None:
        G = gl.double().sum(1).float()
        outside = torch.full((N,), col0 - 1)
        d, scale = logit_grads64(z, outside, row_max, log_sum, log_sum - ent, G, ge, col0)
        inside = (tokens >= col0) & (tokens < col0 + C)
        rows = torch.arange(N)[:, None].expand(N, K_TOKENS)
        d.index_put_((rows[inside], tokens[inside] - col0), gl[inside].double(), accumulate=True)
        tol = 8 * FP32_EPS * (scale + gl.abs().sum(1, keepdim=True).double()) * inv_temp + 1e-30
        assert_within(in_place, d * inv_temp, tol, "logit gradients")
    for dtype in (torch.bfloat16, torch.float16):
        grads = torch.full((N, C), math.nan).to(dtype)
        got = run_entry_grads(drivers, tmp_path / str(dtype), logits, tokens, per_row, gl, col0, temperature, passes,
                              softcap, grads=grads)
        assert torch.equal(got.view(torch.uint8), in_place.to(dtype).view(torch.uint8)), f"{dtype}: not bitwise"


@pytest.mark.parametrize("passes", ["several", "one"])
def test_combine_many_tokens(drivers, tmp_path, passes):
    """The partials of three ranks with three chosen logits each: m, s, t merged, the chosen summed."""
    ranks, N, C = 3, 300, 20
    z = torch.randn(ranks, N, C, dtype=torch.float64) * 4
    partials = torch.zeros(ranks, N, 3 + K_TOKENS, dtype=torch.float64)
    for k in range(ranks):
        partials[k, :, 0], partials[k, :, 1], partials[k, :, 2] = row_stats64(z[k])
    owner = torch.randint(0, ranks, (N, K_TOKENS))
    for j in range(K_TOKENS):
        partials[owner[:, j], torch.arange(N), 3 + j] = torch.randn(N, dtype=torch.float64)
    partials = partials.float()
    out, _ = run_case(drivers, "chosen_logprob", "combine",
                      {"partials": Buf(partials), "out": Buf(torch.full((N, 3 + K_TOKENS), math.nan))},
                      {"N": N, "ranks": ranks, "k": K_TOKENS}, passes=passes, tmp_dir=tmp_path)
    got = out["out"]
    assert torch.equal(got[:, 3:], partials[..., 3:].sum(0))
    lse, ent = lse_entropy64(torch.cat(list(z), 1))
    tol = stats_tolerance(ranks + 4, float(z.abs().max())) + 1e-5
    assert_within(got[:, 0].double() + got[:, 1].double(), lse, tol, "lse")
    assert_within(got[:, 2], ent, tol, "entropy")
    # The CPU kernel (combine_row on the host) agrees.
    assert_within(got, torch.ops.fused_rl_ops.chosen_logprob_combine(partials), 1e-6, "against the CPU op")
