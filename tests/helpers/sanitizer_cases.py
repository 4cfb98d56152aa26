"""Calls of every CUDA kernel of an op, forward and backward, for compute-sanitizer
(scripts/sanitizer_cases.py runs each op's, as the op table lists them; scripts/gpu_check.sh runs
that under memcheck, racecheck and synccheck), small enough to take seconds there and big enough
that every kernel loops: odd sizes, several chunks of the vocabulary, several grid-stride passes
and a contiguous view starting one element into its storage, so both the vectorised and the scalar
paths run. Each takes the device ("cuda"; "cpu" in gpu_check.sh's rehearsal) and returns once its
calls are queued."""

import torch

import fused_rl_ops


def clamped_swiglu(device):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for interleaved in (False, True):
            for F in (8, 7):
                storage = torch.randn(5 * 2 * F + 1, device=device, dtype=dtype) * 8
                for offset in (0, 1):
                    x = storage[offset : offset + 5 * 2 * F].view(5, 2 * F).detach().requires_grad_(True)
                    fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved).sum().backward()
                    scale = torch.rand(5, device=device, requires_grad=True)
                    fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved, scale=scale).sum().backward()
            # The weighted backward's row sum across several warps of one row, and rows past the grid.
            x = torch.randn(3000, 2 * 1000, device=device, dtype=dtype, requires_grad=True)
            scale = torch.rand(3000, 1, device=device, requires_grad=True)
            fused_rl_ops.clamped_swiglu(x, 7.0, interleaved=interleaved, scale=scale).sum().backward()


# The vocab-parallel ops' shapes: 75 tokens (rows over several 8-row blocks, the last partial), an
# odd hidden size, 8000 vocab rows of which the last 10 are padding, and a workspace that splits
# them into several chunks on CUDA (5 to 21 by dtype and op), each full chunk a multiple of the
# kernels' vector width and the last one partial and odd (their scalar tails);
# tests/tooling/test_op_table.py checks the chunk counts with the tiling the ops choose on CUDA.
TOKENS, HIDDEN, TEACHER_HIDDEN, VOCAB, VOCAB_SIZE = 75, 33, 41, 8000, 7990
WORKSPACE_BYTES = 2**19
# top_logprobs' k: more ids than a warp has lanes, its tops carried over several chunks.
TOP_K = 40

# chosen_logprob's logit maps and sampler filters: plain; softcapped; top_k (the stats pass's top
# rows); top_p alone (the search: hist_rows, the one kernel with shared memory and barriers, and
# top_rows), softcapped; top_k then top_p (decided on the tops).
CHOSEN_LOGPROB_SETTINGS = [{}, dict(softcap=3.0), dict(top_k=7), dict(top_p=0.9, softcap=3.0),
                           dict(top_k=20, top_p=0.8)]


def chosen_logprob(device):
    """Several chunks (the last one partial), padded rows, an ignored token; with each setting
    above; the weight gradient returned and added into a main_grad. Then three tokens per position
    (an ignored entry, a duplicate)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hidden = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(VOCAB, HIDDEN, device=device, dtype=dtype) * 0.2).requires_grad_(True)
        tokens = torch.randint(0, VOCAB_SIZE, (TOKENS,), device=device)
        tokens[0] = -100
        for settings in CHOSEN_LOGPROB_SETTINGS:
            for main_grad in (None, torch.zeros(VOCAB, HIDDEN, device=device)):
                lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, tokens, temperature=0.7, vocab_size=VOCAB_SIZE,
                                                      return_entropy=True, workspace_bytes=WORKSPACE_BYTES,
                                                      main_grad=main_grad, **settings)
                (lp.sum() + ent.sum()).backward()
        many = torch.stack([tokens, tokens.flip(0), tokens], 1)
        many[1, 0] = -100
        lp, ent = fused_rl_ops.chosen_logprob(hidden, weight, many, temperature=0.7, vocab_size=VOCAB_SIZE,
                                              return_entropy=True, workspace_bytes=WORKSPACE_BYTES, softcap=3.0)
        (lp.sum() + ent.sum()).backward()


def top_logprobs(device):
    """TOP_K ids over several chunks (the last one partial), padded rows, a masked position, a
    softcap; the backward (chosen_logprob's ops)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hidden = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(VOCAB, HIDDEN, device=device, dtype=dtype) * 0.2).requires_grad_(True)
        mask = torch.ones(TOKENS, dtype=torch.bool, device=device)
        mask[3] = False
        _, top = fused_rl_ops.top_logprobs(hidden, weight, TOP_K, temperature=0.7, softcap=3.0, vocab_size=VOCAB_SIZE,
                                           mask=mask)
        top.sum().backward()


def value_head(device):
    """70 rows (a full and a partial 64-row block of the weight gradient), H = 13 and a misaligned
    view for the scalar paths."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for H in (16, 13):
            storage = torch.randn(70 * H + 1, device=device, dtype=dtype)
            weight = torch.randn(1, H, device=device, requires_grad=True)
            bias = torch.randn((), device=device, requires_grad=True)
            for offset in (0, 1):
                hidden = storage[offset : offset + 70 * H].view(70, H).detach().requires_grad_(True)
                fused_rl_ops.value_head(hidden, weight, bias).sum().backward()


def vocab_divergence(device):
    """Several chunks (the last one partial), padded rows, a wider teacher, a masked position; every
    kind, with and without softcaps; the weight gradient returned and added into a main_grad."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hidden = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(VOCAB, HIDDEN, device=device, dtype=dtype) * 0.2).requires_grad_(True)
        teacher_hidden = torch.randn(TOKENS, TEACHER_HIDDEN, device=device, dtype=dtype)
        teacher_weight = torch.randn(VOCAB, TEACHER_HIDDEN, device=device, dtype=dtype) * 0.2
        mask = torch.ones(TOKENS, dtype=torch.bool, device=device)
        mask[3] = False
        for kind, caps in (("forward_kl", {}), ("reverse_kl", dict(softcap=3.0)),
                           ("jsd", dict(softcap=3.0, teacher_softcap=2.0))):
            for main_grad in (None, torch.zeros(VOCAB, HIDDEN, device=device)):
                fused_rl_ops.vocab_divergence(hidden, weight, teacher_hidden, teacher_weight, kind=kind, mask=mask,
                                              temperature=0.7, vocab_size=VOCAB_SIZE, workspace_bytes=WORKSPACE_BYTES,
                                              main_grad=main_grad, **caps).sum().backward()
