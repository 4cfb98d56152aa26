"""The sampler's filter of chosen_logprob (top_k, top_p): per token, the threshold tau of the kept set
{z >= tau} over the whole (vocab-parallel) vocabulary, found without the logits.

The rule is the one of vLLM's sampler, with ties decided together. z are the logits after the logit
map (the fp32 values the row kernels compute). top_k keeps every logit at least the
k-th largest. top_p then keeps, of those, every token whose logits strictly above its own carry a
probability mass below top_p (the masses renormalised over what top_k kept): sorted descending, the
tokens up to and including the first at which the cumulative probability reaches top_p, with every
token tied with it. Where all logits differ this is vLLM's rule (sorted ascending, the tokens whose
cumulative probability is at most 1 - top_p are dropped; the most likely is always kept); where
vLLM's sort would split a group of tied logits, the group is kept whole exactly when vLLM keeps any
of it. The masses are summed in float64 from the fp32 logits; a token whose cumulative mass lies
within rounding (about 1e-7 relative) of top_p may fall either way.

How (the C++ ops' top_rows and hist_rows kernels are the other side). With top_k, the stats pass also
gives each row's top: its top_k largest logits and how many more equal the smallest of them, which
merge across ranks exactly (merge_tops). top_k's threshold is the k-th largest; top_p's after top_k
is decided on them (first_reaching), which hold the whole top-k set; and the kept set's row max,
log-sum and entropy are summed from them too (kept_partials), so top_k costs no pass over the
vocabulary beyond the stats pass. top_p alone is searched (_search): a pass adds the masses of
the logits of a window of z (first the 32 below the row max) to a histogram of SEARCH_BINS bins, in
integer units of 2^-40 of the top token's mass (their sums do not depend on the order of the
additions; ranks all-reduce them); the bin where the cumulative mass reaches top_p is the next
window, whose pass also collects its TOP_P_CANDIDATES largest logits to decide on. Each window is
SEARCH_BINS times narrower: within a few rounds a window's logits are all collected, or are one
value (a tie group). Typically two rounds; each is one pass over the logits and a host
synchronisation (whether any row still searches). Then a last stats pass sums the kept logits'
partials (the logits above the last window are known by their mass alone).

Rows whose maximum is not finite (a NaN, +inf, or no logit above -inf) are not filtered (threshold
-inf), so that they stay what they are without the filter.
"""
import math
from typing import Callable, NamedTuple

import torch

# Mirrors of the kernels' constants: the columns before a top's values (top_column: seen, held,
# ties) and the bins of a search histogram (kSearchBins).
TOP_HEADER = 3
SEARCH_BINS = 512
# How many of a search window's largest logits a round collects.
TOP_P_CANDIDATES = 1024
# The first search window: the logits within FIRST_WINDOW below the row max (smaller masses are 0
# in units of 2^-40: exp(-27.8) = 2^-40).
_FIRST_WINDOW = 32.0
_UNIT = 2.0**-40
_MAX_ROUNDS = 6  # cells of 2^-49 at the last: every window is one value long before


class Tops(NamedTuple):
    """Rows' tops merged over ranks: values [N, W] sorted descending (-inf past held), held [N] (how
    many are values), ties [N] (how many more logits equal values[held - 1] where held == W) and
    seen [N] (how many logits were given)."""
    values: torch.Tensor
    held: torch.Tensor
    ties: torch.Tensor
    seen: torch.Tensor

    @property
    def complete(self) -> torch.Tensor:
        """Whether the candidates hold every logit given (with the ties)."""
        return self.seen <= self.held + self.ties


def merge_tops(tops: torch.Tensor) -> Tops:
    """The rows' tops of all ranks, [ranks, N, TOP_HEADER + W] (a rank's values a heap), merged: the
    W largest of their union and the count of further logits equal to the W-th. Every logit of the
    union's W largest is in some rank's top, and a rank holding W values has none above its smallest
    outside them, so the count is exact wherever the W-th largest is finite (a -inf one has no mass
    and filters nothing)."""
    width = tops.shape[-1] - TOP_HEADER
    seen, held, ties = (tops[..., c].long() for c in range(TOP_HEADER))
    heaps = tops[..., TOP_HEADER:]
    slots = torch.arange(width, device=tops.device) < held[..., None]
    union = torch.where(slots, heaps, -math.inf).permute(1, 0, 2).reshape(tops.shape[1], -1)
    union = union.sort(dim=1, descending=True).values
    values = union[:, :width]
    held_all = held.sum(0).clamp(max=width)
    last = values[:, width - 1]
    # A rank's smallest held value is its heap's root.
    rank_ties = torch.where(heaps[..., 0] == last, ties, 0).sum(0)
    ties_all = (union[:, width:] == last[:, None]).sum(1) + rank_ties
    return Tops(values, held_all, torch.where(held_all == width, ties_all, 0), seen.sum(0))


def empty_top(row_max: torch.Tensor) -> torch.Tensor:
    """A search pass's empty top, [N, TOP_HEADER + TOP_P_CANDIDATES]."""
    return row_max.new_zeros(row_max.shape[0], TOP_HEADER + TOP_P_CANDIDATES)


def _cumulative(tops: Tops, row_max: torch.Tensor, above: torch.Tensor):
    """The cumulative mass (float64, relative to exp(row_max)) at each candidate in descending order,
    from the mass `above` of the logits above them ([N, W], valid where held), and at the end of the
    smallest's ties ([N])."""
    slots = torch.arange(tops.values.shape[1], device=row_max.device) < tops.held[:, None]
    mass = torch.where(slots, torch.exp(tops.values.double() - row_max.double()[:, None]), 0.0)
    cumulative = above[:, None] + mass.cumsum(1)
    smallest = (tops.held - 1).clamp(min=0)[:, None]
    end = cumulative.gather(1, smallest)[:, 0] + tops.ties * mass.gather(1, smallest)[:, 0]
    return cumulative, slots, end


def first_reaching(tops: Tops, row_max: torch.Tensor, above: torch.Tensor, target: torch.Tensor):
    """(tau, reached): the first candidate, in descending order, at which the cumulative mass
    (_cumulative) reaches target, with every logit tied with it; reached False where none does (tau:
    the smallest candidate)."""
    cumulative, slots, end = _cumulative(tops, row_max, above)
    reach = (cumulative >= target[:, None]) & slots
    first = torch.where(reach.any(1), reach.int().argmax(1), (tops.held - 1).clamp(min=0))
    return tops.values.gather(1, first[:, None])[:, 0], reach.any(1) | (end >= target)


def thresholds(tops, row_max: torch.Tensor, log_sum: torch.Tensor, top_k, top_p, search: Callable,
               gather: Callable, all_reduce: Callable):
    """(tau, kept): per token, the threshold of the kept set ([N], row_max's dtype), and with top_k
    the kept set's (row max, log-sum, entropy) (kept_partials; None with top_p alone: a stats pass
    with the threshold gives them).

    tops: with top_k, this rank's [pieces, N, TOP_HEADER + top_k] tops from the stats pass (one
    top per piece of its shard); row_max, log_sum: the merged row max and log-sum relative to it
    (CombinedColumns). search(window, hist, collect) runs one search pass on this rank, adding to
    hist, and returns with collect its pieces' tops ([pieces, N, TOP_HEADER + TOP_P_CANDIDATES],
    empty_top filled); gather(t) stacks every rank's [pieces, ...] t, all_reduce(t) sums t over the
    ranks in place."""
    filterable = torch.isfinite(row_max)
    kept = None
    if top_k is None:
        target = top_p * torch.exp(log_sum.double())  # the row's mass relative to exp(row_max)
        tau = _search(filterable, row_max, target, search, gather, all_reduce)
    else:
        merged = merge_tops(gather(tops))
        if top_p is None:  # the k-th largest, where a row has k logits
            tau = torch.where(merged.held == top_k, merged.values[:, -1], -math.inf)
        else:  # the candidates, with their ties, are the whole top-k set
            zero = torch.zeros_like(row_max, dtype=torch.float64)
            total = _cumulative(merged, row_max, zero)[2]
            tau, _ = first_reaching(merged, row_max, zero, top_p * total)
        kept = kept_partials(merged, tau)
    return torch.where(filterable, tau, -math.inf).to(row_max.dtype), kept


def kept_partials(tops: Tops, tau: torch.Tensor):
    """The row max, log-sum relative to it and entropy (float64, [N] each) of the logits at or above
    tau, where the tops hold them all: the values held at or above tau, and the ties of the smallest
    held when it is at or above tau (top_k's kept set, with or without top_p)."""
    values = tops.values.double()
    m = values[:, 0]
    slots = torch.arange(values.shape[1], device=values.device) < tops.held[:, None]
    count = (slots & (values >= tau.double()[:, None])).double()  # how many logits each value stands for
    smallest = (tops.held - 1).clamp(min=0)[:, None]
    count = count.scatter_add(1, smallest, count.gather(1, smallest) * tops.ties.double()[:, None])
    d = values - m[:, None]
    weight = count * torch.exp(torch.where(count > 0, d, 0.0))  # a -inf logit kept has weight 0
    s = weight.sum(1)
    t = (weight * torch.where(weight > 0, d, 0.0)).sum(1)
    return m, torch.log(s), torch.log(s) - t / s


def _search(searching, row_max, target, search, gather, all_reduce):
    """top_p's thresholds of the rows searching (-inf elsewhere), from search rounds (module
    docstring). A window is (sigma, hi): its bins are the cells j = hi - floor(z sigma) in
    [0, SEARCH_BINS) (the kernels' SearchWindow); `above` counts the mass
    units of the logits above it. Every window holds mass: the first holds the row max, the next is a
    bin with mass, and the bins where the cumulative first reaches the target are past the window's
    top (above stays below the target)."""
    N, device = row_max.shape[0], row_max.device
    sigma = torch.full((N,), SEARCH_BINS / _FIRST_WINDOW, dtype=torch.float64, device=device)
    hi = torch.floor(row_max.double() * sigma)
    above = torch.zeros(N, dtype=torch.int64, device=device)
    target_units = target / _UNIT
    tau = found = torch.full_like(row_max, -math.inf)
    for round_ in range(_MAX_ROUNDS):
        if not bool(searching.any()):  # a host synchronisation
            return tau
        collect = round_ > 0  # the first window is the whole top of the row: it only finds the next
        hist = torch.zeros(N, SEARCH_BINS, dtype=torch.int64, device=device)
        top = search(torch.stack([torch.where(searching, sigma, 0.0), hi], 1), hist, collect)
        all_reduce(hist)
        if collect:
            tops = merge_tops(gather(top))
            found, reached = first_reaching(tops, row_max, above * _UNIT, target)
            done = searching & (tops.held > 0) & (reached | tops.complete)
            tau = torch.where(done, found, tau)
            searching = searching & ~done
        # The next window: the bin where the cumulative mass reaches the target, or where rounding
        # leaves it short, the lowest bin holding mass.
        cumulative = above[:, None] + hist.cumsum(1)
        reach = cumulative.double() >= target_units[:, None]
        lowest_with_mass = (SEARCH_BINS - 1) - (hist > 0).flip(1).int().argmax(1)
        b = torch.where(reach.any(1), reach.int().argmax(1), lowest_with_mass)[:, None]
        above = torch.where(searching, (cumulative.gather(1, b) - hist.gather(1, b))[:, 0], above)
        hi = torch.where(searching, (hi - b[:, 0]) * SEARCH_BINS + (SEARCH_BINS - 1), hi)
        sigma = sigma * SEARCH_BINS
    # Rows still searching after the last round (cells of 2^-49, far below the fp32 spacing of any
    # logit but tiny ones near 0): the largest logits of their last window are kept.
    return torch.where(searching, found, tau)
