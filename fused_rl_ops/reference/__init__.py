"""Naive PyTorch implementations of every op: the path the benchmarks compare against, and (run in
float64) the independent reference the tests check the kernels with."""
import math
from typing import Optional

import torch

from ..logit_options import LogitMap, LogitOptions


def clamped_swiglu(x: torch.Tensor, limit: Optional[float] = 7.0, *, alpha: float = 1.702,
                   linear_offset: float = 1.0, interleaved: bool = False,
                   scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eager chunk, clamp, sigmoid and multiply, in x's dtype; with scale (one per row), then times
    scale in the promoted dtype and back to x's dtype, as megatron-core's MLP applies routing weights.

    The clamp is spelled with torch.where so that its gradient follows the op's contract: kept on
    the boundary (|u| = L, g = L) and NaN for NaN inputs. torch.clamp's own gradient (torch 2.14)
    is zero on the boundary and for NaN."""
    if interleaved:
        g, u = x[..., 0::2], x[..., 1::2]
    else:
        g, u = x.chunk(2, dim=-1)
    if limit is not None:
        g = torch.where(g > limit, limit, g)
        u = torch.where(u > limit, limit, torch.where(u < -limit, -limit, u))
    y = g * torch.sigmoid(alpha * g) * (u + linear_offset)
    if scale is None:
        return y
    return (y * scale.reshape(*y.shape[:-1], 1)).to(x.dtype)


def sampler_filter(logits: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None) -> torch.Tensor:
    """logits [..., V] with the tokens vLLM's sampler drops set to -inf: top-k keeps every logit at
    least the k-th largest; top-p then keeps each token whose probability (softmax of what top-k
    kept) carried by logits strictly above its own is below top_p, which is vLLM's rule (sort
    ascending, drop the tokens whose cumulative probability is at most 1 - top_p, keep the largest)
    where no logits tie, and keeps a tied group whole when vLLM keeps any of it. Rows whose largest
    logit is not finite are left as they are."""
    filterable = torch.isfinite(logits.max(-1, keepdim=True).values)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(filterable & (logits < kth), float("-inf"))
    if top_p is not None and top_p < 1:
        descending = logits.sort(dim=-1, descending=True).values
        cumulative = torch.softmax(descending, dim=-1).cumsum(-1)
        cumulative = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative], -1)
        # The mass above each logit: the cumulative before the first of the logits equal to it.
        above = cumulative.gather(-1, torch.searchsorted(-descending.contiguous(), -logits.contiguous(), side="left"))
        logits = logits.masked_fill(filterable & (above >= top_p), float("-inf"))
    return logits


def apply_logit_map(logits: torch.Tensor, logit_map: LogitMap) -> torch.Tensor:
    """The logits capped to softcap * tanh(logits / softcap) when the map has a softcap, then
    divided by its temperature, written out in torch."""
    if logit_map.softcap is not None:
        logits = logit_map.softcap * torch.tanh(logits / logit_map.softcap)
    return logits / logit_map.temperature


def chosen_logprob(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *, ignore_index: int = -100,
                   vocab_size: Optional[int] = None, skip_ignored: bool = True, **logit_options):
    """Materialised logits (GEMM in the inputs' dtype, then fp32; fp64 for fp64) under the logit
    options (keywords of fused_rl_ops.LogitOptions): the logit map (apply_logit_map), filtered with
    top_k / top_p as vLLM's sampler does (sampler_filter), log_softmax and gather. Returns
    (logprob, entropy); rows of weight at or beyond vocab_size are padding. A token the filter
    drops has logprob -inf. ignore_index positions get logprob 0; by default (skip_ignored) their
    rows are left out (entropy 0, no gradient), else every row is computed and they keep their
    entropy (as fused_rl_ops.chosen_logprob gives them)."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    ignore = tokens == ignore_index
    if skip_ignored:
        scored = ~ignore
        logprob, entropy = chosen_logprob(hidden[scored], weight, tokens[scored], ignore_index=ignore_index,
                                          vocab_size=vocab_size, skip_ignored=False, **logit_options)
        zeros = torch.zeros(tokens.shape, dtype=acc, device=hidden.device)
        return zeros.index_put((scored,), logprob), zeros.index_put((scored,), entropy)
    options = LogitOptions(**logit_options)
    logits = apply_logit_map((hidden @ weight.T).to(acc), options.logit_map)
    valid = weight.shape[0] if vocab_size is None else vocab_size
    if options.top_k is not None or options.top_p is not None:
        logits = torch.cat([sampler_filter(logits[..., :valid], options.top_k, options.top_p), logits[..., valid:]], -1)
    if valid < weight.shape[0]:
        padding = torch.arange(weight.shape[0], device=weight.device) >= valid
        logits = logits.masked_fill(padding, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, torch.where(ignore, 0, tokens).unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    return torch.where(ignore, 0.0, chosen), entropy


_NO_MAP = LogitOptions().logit_map  # z = x


def vocab_divergence(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                     teacher_weight: torch.Tensor, *, kind: str, beta: float = 0.5, logit_map: LogitMap = _NO_MAP,
                     teacher_logit_map: LogitMap = _NO_MAP, mask: Optional[torch.Tensor] = None,
                     vocab_size: Optional[int] = None) -> torch.Tensor:
    """Both models' materialised logits (GEMM in each pair's dtype, then fp32; fp64 for fp64) under
    their logit maps (apply_logit_map: the student's logit_map, the teacher's teacher_logit_map;
    default none) over the first vocab_size rows, log_softmax, and the divergence written out per
    position: forward_kl sum p (log p - log q), reverse_kl sum q (log q - log p), jsd beta KL(p || M)
    + (1 - beta) KL(q || M) with M = beta p + (1 - beta) q (p the teacher's, q the student's; a token
    of probability 0 adds 0). mask False: 0."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    rows = weight.shape[0] if vocab_size is None else vocab_size
    log_q = torch.log_softmax(apply_logit_map((hidden @ weight[:rows].T).to(acc), logit_map), -1)
    log_p = torch.log_softmax(apply_logit_map((teacher_hidden @ teacher_weight[:rows].T).to(acc), teacher_logit_map),
                              -1)
    divergence = divergence_of_logprobs(log_q, log_p, kind=kind, beta=beta)
    return divergence if mask is None else torch.where(mask, divergence, 0.0)


def divergence_of_logprobs(log_q: torch.Tensor, log_p: torch.Tensor, *, kind: str, beta: float = 0.5) -> torch.Tensor:
    """The divergence of kind between the student's log-softmax log_q and the teacher's log_p
    [..., V], written out (vocab_divergence's docstring): [...]."""
    def kl(log_a, log_b):  # sum a (log a - log b), 0 log 0 = 0
        a = log_a.exp()
        return torch.where(a == 0, 0.0, a * (log_a - log_b)).sum(-1)

    if kind == "forward_kl":
        return kl(log_p, log_q)
    if kind == "reverse_kl":
        return kl(log_q, log_p)
    log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
    return beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m)


def value_head(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear on hidden cast to fp32 (fp64 for float64 hidden), the usual PyTorch value head."""
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    b = None if bias is None else bias.to(dtype).reshape(1)
    return torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype).reshape(1, -1), b).squeeze(-1)
