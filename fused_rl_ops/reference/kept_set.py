"""The naive kept-set logprob: the rollout sampler's kept set as a mask over materialised logits,
log_softmax over it. Written apart from fused_rl_ops/_kept_set.py; the tests compare against it."""
from typing import Optional

import torch

from ..logit_options import LogitMap, LogitOptions
from . import apply_logit_map


def kept_set_log_softmax(logits: torch.Tensor, tokens: torch.Tensor, kept_ids: torch.Tensor, *,
                         ignore_index: int = -100):
    """(logprob [...], entropy [...], is_kept [...]) of tokens [...] under softmax(logits [..., V])
    restricted to the ids of kept_ids [..., k] (ignore_index entries name none; an id named twice is
    one member): log_softmax of the logits with every other id at -inf. A token outside the set
    gets -inf (NaN where the set's log-sum-exp is NaN); one equal to ignore_index logprob 0 and
    entropy 0; a position with nothing kept entropy 0."""
    named = kept_ids != ignore_index
    counts = torch.zeros(logits.shape, dtype=torch.int64, device=logits.device)
    in_set = counts.scatter_add_(-1, torch.where(named, kept_ids, 0), named.long()) > 0
    any_kept = in_set.any(-1, keepdim=True)
    masked = logits.masked_fill(~in_set, float("-inf"))
    # A position with nothing kept takes zeros here (all its tokens get -inf): no NaN gradient.
    logp = masked - torch.logsumexp(torch.where(any_kept, masked, 0.0), -1, keepdim=True)
    p = logp.exp()
    entropy = torch.where(any_kept[..., 0], -(p * torch.where(p > 0, logp, 0.0)).sum(-1), 0.0)
    ignored = tokens == ignore_index
    index = torch.where(ignored, 0, tokens)[..., None]
    is_kept = in_set.gather(-1, index)[..., 0] & ~ignored
    logprob = torch.where(ignored, 0.0, logp.gather(-1, index)[..., 0])
    return logprob, torch.where(ignored, 0.0, entropy), is_kept


def kept_set_logprob(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, kept_ids: torch.Tensor, *,
                     ignore_index: int = -100, vocab_size: Optional[int] = None,
                     logit_map: LogitMap = LogitOptions().logit_map):
    """kept_set_log_softmax over the materialised logits of the first vocab_size rows of weight
    (GEMM in the inputs' dtype, then fp32; fp64 for fp64) under logit_map (apply_logit_map)."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = apply_logit_map((hidden @ weight[:vocab_size].T).to(acc), logit_map)
    return kept_set_log_softmax(logits, tokens, kept_ids, ignore_index=ignore_index)
