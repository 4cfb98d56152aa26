"""chosen_logprob's kept_ids: the sampled tokens' logprob renormalised over the ids the rollout
engine's sampler kept at each position, and the entropy over them. No kernel of its own: the ops
score the sampled tokens and the kept ids as the call's entries (many tokens per position, one pass
over the vocabulary) and give their full-softmax logprobs lp = z - lse; over the kept set K,
log q_y = lp_y - logsumexp_{v in K} lp_v, the full log-sum-exp cancelling (docs/chosen_logprob.md)."""
import math
from typing import NamedTuple

import torch

from ._library import check_device
from ._vocab_parallel.tokens import check_token_range

OP = "chosen_logprob"


class KeptSet(NamedTuple):
    """A call's kept set: entries [..., m + k] (the m sampled tokens of a position, then its kept ids
    sorted, each id once: later copies are ignore_index; with skip_ignored every kept id of a
    position whose sampled tokens are all ignored is too, so that the ops leave it out), the
    caller's kept_ids (for its range check) and m."""
    entries: torch.Tensor
    kept_ids: torch.Tensor
    sampled: int
    ignore_index: int

    @classmethod
    def of(cls, hidden, tokens, kept_ids, options, ignore_index: int, skip_ignored: bool) -> "KeptSet":
        """The kept set of a call whose hidden and tokens are checked; a TypeError or ValueError
        naming kept_ids when it is not a [..., k] integer tensor of the positions' leading shape, or
        when the call also has the sampler's filter it stands in for."""
        if not isinstance(kept_ids, torch.Tensor):
            raise TypeError(f"{OP}: kept_ids must be a tensor, got {type(kept_ids).__name__}")
        if kept_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{OP}: kept_ids must be int64 or int32, got {kept_ids.dtype}")
        if options.top_k is not None or options.top_p is not None:
            raise ValueError(f"{OP}: kept_ids is the sampler's kept set, in place of its filter: give kept_ids or "
                             f"top_k / top_p, not both (got top_k={options.top_k}, top_p={options.top_p})")
        positions = tuple(hidden.shape[:-1])
        if kept_ids.dim() != len(positions) + 1 or tuple(kept_ids.shape[:-1]) != positions:
            raise ValueError(f"{OP}: kept_ids must be [..., k] with the tokens' leading shape {positions} (the "
                             f"positions), got {tuple(kept_ids.shape)} with tokens {tuple(tokens.shape)}")
        check_device(OP, hidden=hidden, kept_ids=kept_ids)
        sampled = (tokens if tokens.dim() > len(positions) else tokens[..., None]).to(torch.int64)
        kept = kept_ids.to(torch.int64).sort(-1).values
        repeated = torch.cat([torch.zeros_like(kept[..., :1], dtype=torch.bool), kept[..., 1:] == kept[..., :-1]], -1)
        unscored = (sampled == ignore_index).all(-1, keepdim=True) if skip_ignored else torch.zeros_like(repeated)
        kept = kept.masked_fill(repeated | unscored, ignore_index)
        return cls(torch.cat([sampled, kept], -1), kept_ids, sampled.shape[-1], ignore_index)

    def check_range(self, vocab_size: int) -> None:
        """Raises naming the first id of kept_ids outside [0, vocab_size) and not ignore_index."""
        check_token_range(OP, self.kept_ids, vocab_size, self.ignore_index, name="kept_ids")

    def renormalised(self, logprob, is_max, is_kept):
        """(logprob, entropy, is_max, is_kept) over the kept set: logprob, is_max and is_kept [N, m],
        entropy [N], from the entries' [N, m + k] full-softmax logprob, is_max and is_kept (False
        where an entry is ignored or, unchecked, out of range)."""
        entries = self.entries.reshape(logprob.shape)
        m = self.sampled
        sampled, ids, lp_sampled = entries[:, :m], entries[:, m:], logprob[:, :m]
        valid = ids != self.ignore_index
        any_kept = valid.any(-1, keepdim=True)
        lp_kept = torch.where(valid, logprob[:, m:], -math.inf)
        # A position with nothing kept sums zeros (its results are replaced below): no NaN gradient.
        log_sum = torch.logsumexp(torch.where(any_kept, lp_kept, 0.0), -1, keepdim=True)
        log_q = lp_kept - log_sum
        q = log_q.exp()
        entropy = torch.where(any_kept[:, 0], -(q * torch.where(q > 0, log_q, 0.0)).sum(-1), 0.0)
        member = ((sampled[:, :, None] == ids[:, None, :]) & valid[:, None, :]).any(-1)
        kept = member & is_kept[:, :m]
        # A token outside the set: -inf, or NaN where the position's values are NaN (never hidden).
        outside = torch.where(log_sum.isnan() | lp_sampled.isnan(), math.nan, -math.inf)
        logprob = torch.where(kept, lp_sampled - log_sum, torch.where(sampled == self.ignore_index, 0.0, outside))
        return logprob, entropy, is_max[:, :m], kept
