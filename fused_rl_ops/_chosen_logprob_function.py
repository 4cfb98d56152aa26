"""chosen_logprob's autograd Function: the stats pass, the tensor-parallel merge, the sampler's filter
and the backward, over every row (the ops leave out the ignored ones themselves)."""
import dataclasses
import math
from typing import NamedTuple

import torch

from ._library import ops
from ._vocab_parallel import sampler_filter
from ._vocab_parallel.main_grad import placeholder_gradient


class CombinedColumns(NamedTuple):
    """The columns of chosen_logprob_combine's [N, 3 + k] output: the shards' partials merged
    (combined_column): the row max, the log-sum relative to it (lse = row_max + log_sum), the
    entropy [N] each, and the chosen logits [N, k]."""
    row_max: torch.Tensor
    log_sum: torch.Tensor
    entropy: torch.Tensor
    chosen: torch.Tensor


# chosen_logprob_stats' [N, 3 + k] partials of a shard (stats_column): its max m, sum exp(z - m),
# sum exp(z - m) (z - m), then from column CHOSEN the k chosen logits (0 where another shard holds
# the token), then with top_width the row's top; their merge keeps CHOSEN as the first chosen column.
CHOSEN = 3


def stats_pass(hidden, weight, tokens, kernel_options, pieces, *threshold) -> torch.Tensor:
    """chosen_logprob_stats' partials of each piece of this rank's shard, [pieces, N, C]."""
    return torch.stack([ops.chosen_logprob_stats(hidden, w, tokens, *o.arguments(), *threshold)
                        for o, w in pieces.each(kernel_options, weight)])


def combine(pieces, stats: torch.Tensor) -> CombinedColumns:
    """The partials of chosen_logprob_stats ([pieces, N, 3 + k] on each rank) merged over every
    piece of every rank, in vocabulary order. lse = row_max + log_sum, kept apart: z - row_max is
    exact near the top of the row."""
    merged = ops.chosen_logprob_combine(pieces.gather(stats))
    return CombinedColumns(*merged[:, :CHOSEN].unbind(1), merged[:, CHOSEN:])


def _kept_set(hidden, weight, stats, merged, options, kernel_options, pieces):
    """The tokens' thresholds of the sampler's filter and with top_k the kept set's partials
    (sampler_filter.thresholds), from the stats pass's tops, with search passes where top_p alone
    needs them."""

    def search(window, hist, collect):
        tops = []
        for o, w in pieces.each(kernel_options, weight):
            top = sampler_filter.empty_top(merged.row_max) if collect else None
            ops.chosen_logprob_search(hidden, w, merged.row_max, window, hist, top, *o.shared_arguments())
            tops.append(top)
        return torch.stack(tops) if collect else None

    tops = stats[..., CHOSEN + merged.chosen.shape[1]:] if options.top_k is not None else None
    return sampler_filter.thresholds(tops, merged.row_max, merged.log_sum, options.top_k, options.top_p, search,
                                     pieces.gather, pieces.tp.all_reduce)


def _filtered(hidden, weight, tokens, stats, merged, options, kernel_options, pieces):
    """(merged, threshold): the ranks' partials of the kept set merged (CombinedColumns; merged
    itself without a filter), and its tokens' thresholds (None without a filter)."""
    if options.top_k is None and options.top_p is None:
        return merged, None
    threshold, kept = _kept_set(hidden, weight, stats, merged, options, kernel_options, pieces)
    if kept is None:  # a stats pass over the logits at or above the threshold
        unfiltered = kernel_options._replace(own=dataclasses.replace(kernel_options.own, top_width=0))
        return combine(pieces, stats_pass(hidden, weight, tokens, unfiltered, pieces, threshold)), threshold
    # From the tops; rows that are not filtered (threshold -inf: a NaN or inf) as they are.
    filtered = torch.isfinite(threshold)
    return CombinedColumns(*(torch.where(filtered, k.to(c.dtype), c) for k, c in zip(kept, merged[:3])),
                           merged.chosen), threshold


class ChosenLogprobFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, ignore, main_grad, options, kernel_options, pieces, reduce_hidden_grad,
                weight_placeholder):
        """hidden [N, H], tokens [N] int64 (one per position) or [N, k] (k per position), ignore
        (tokens == ignore_index) of tokens' shape; options the call's LogitOptions, kernel_options
        the ops' (KernelOptions), pieces its VocabPieces. Returns logprob,
        is_max and is_kept of tokens' shape and entropy [N]; rows the ops leave out
        (kernel_options.own's ignore_index: every entry ignored) have empty partials: their
        entropy is the caller's to replace."""
        per_position = tokens.dim() == 1
        stats = stats_pass(hidden, weight, tokens, kernel_options, pieces)
        merged = combine(pieces, stats[..., :CHOSEN + (1 if per_position else tokens.shape[1])])
        merged, threshold = _filtered(hidden, weight, tokens, stats, merged, options, kernel_options, pieces)
        # Per-position values against the entries: [N] against [N], or [N, 1] against [N, k].
        per_entry = (lambda t: t) if per_position else (lambda t: t[:, None])
        chosen = merged.chosen[:, 0] if per_position else merged.chosen
        row_max = per_entry(merged.row_max)
        logprob = torch.where(ignore, 0.0, (chosen - row_max) - per_entry(merged.log_sum))
        # Both come from the same fp32 logit buffer, so a chosen maximum compares equal exactly; and
        # the threshold is one of those logits.
        is_max = (chosen == row_max) & ~ignore
        dropped = torch.zeros_like(ignore) if threshold is None else (chosen < per_entry(threshold)) & ~ignore
        logprob = torch.where(dropped, -math.inf, logprob)
        is_kept = ~(ignore | dropped)
        ctx.mark_non_differentiable(is_max, is_kept)
        # Ignored tokens and tokens outside the kept set (logprob -inf) pass no logprob gradient.
        ctx.save_for_backward(hidden, weight, tokens, ignore | dropped, merged.row_max, merged.log_sum, merged.entropy,
                              threshold)
        ctx.kernel_options, ctx.pieces = kernel_options, pieces
        ctx.reduce_hidden_grad, ctx.weight_placeholder = reduce_hidden_grad, weight_placeholder
        # main_grad is the backward's output buffer, not an input of its math: kept on ctx, not saved
        # (autograd's version check would trip on its in-place updates).
        ctx.main_grad = main_grad
        return logprob, merged.entropy, is_max, is_kept

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_is_max, grad_is_kept):
        hidden, weight, tokens, no_logprob_grad, row_max, log_sum, entropy, threshold = ctx.saved_tensors
        grad_logprob = (torch.zeros_like(tokens, dtype=entropy.dtype) if grad_logprob is None
                        else torch.where(no_logprob_grad, 0.0, grad_logprob))
        grad_entropy = torch.zeros_like(entropy) if grad_entropy is None else grad_entropy
        log_sum_minus_entropy = log_sum - entropy
        grad_logprob, grad_entropy = (g.to(entropy.dtype).contiguous() for g in (grad_logprob, grad_entropy))
        # Per piece: an unreduced hidden gradient and its [rows, H] weight gradient, padded rows zeroed
        # by the op; or none, added into main_grad or the pieces' buffer (VocabPieces.weight_grad_buffer).
        grad_weights, buffer = [], ctx.pieces.weight_grad_buffer(weight, ctx.main_grad)

        def hidden_grads():
            for o, w, g in ctx.pieces.each(ctx.kernel_options, weight, buffer):
                grad_hidden, grad_weight = ops.chosen_logprob_backward(
                    hidden, w, tokens, row_max, log_sum, log_sum_minus_entropy, grad_logprob, grad_entropy, g,
                    *o.arguments(), threshold)
                grad_weights.append(grad_weight)
                yield grad_hidden

        grad_hidden = ctx.pieces.sum(hidden_grads(), ctx.reduce_hidden_grad)
        if ctx.main_grad is not None:
            grad_weight = placeholder_gradient(weight, ctx.weight_placeholder)
        else:
            grad_weight = ctx.pieces.weight_grad(buffer, grad_weights)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None, None, None
