"""Context parallel batches without Transformer Engine: each CP rank's part of a batch, the way
megatron-core's attention expects it, for plain rows and for packed (THD) rows.

megatron-core's `get_batch_on_this_cp_rank` cuts each sequence into 2 x CP chunks and gives CP rank
r chunks r and 2 x CP - 1 - r (rank 0 the first and the last: each rank gets as much causal
attention work); with packed rows (`cu_seqlens`, the documents of a row concatenated) it does so per
document through Transformer Engine's `thd_get_partitioned_indices`, so without TE a packed batch
cannot be split there. The same split here, on the CPU or any device, with or without a process
group (a data loader can prepare every rank's part):

- `shift_labels(tokens, cu_seqlens)`: the labels, shifted on the whole sequence (each document's
  within the document) before the split, ignore_index at each document's last position;
- `context_parallel_positions(length, cp_size, cp_rank, cu_seqlens)`: the positions a rank keeps;
- `split_for_context_parallel(batch, cp_size, cp_rank, cu_seqlens)`: those positions of every
  [b, s, ...] tensor of a batch (tokens, labels, loss mask, position ids).

cu_seqlens: the documents' offsets in the row, 1-D [0, ..., s] (PackedSeqParams' cu_seqlens_q), or
None for rows that are one sequence each. Each document's length (each row's, without cu_seqlens)
must be a multiple of 2 x CP: pad documents to one (with ignore_index labels and loss mask 0).
"""
from typing import Optional

import torch

__all__ = ["context_parallel_positions", "shift_labels", "split_for_context_parallel"]


def _document_bounds(length: int, cu_seqlens) -> list:
    """[(start, stop)] of each document of a row of length positions; cu_seqlens None: one."""
    if cu_seqlens is None:
        return [(0, length)]
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if (isinstance(cu_seqlens, torch.Tensor) and (cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point())) \
            or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != length \
            or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must be the documents' offsets in the row, 1-D integers rising from 0 to the "
                         f"row's length {length}, got {cu_seqlens}")
    return list(zip(offsets, offsets[1:]))


def shift_labels(tokens: torch.Tensor, cu_seqlens=None, ignore_index: int = -100) -> torch.Tensor:
    """[b, s] labels of tokens [b, s]: at each position the next token of its document (its row's
    without cu_seqlens), ignore_index at each document's last position (nothing follows there).
    Shift before the split: a rank's part shifted alone would score the position before each chunk
    boundary against the wrong token."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"shift_labels: tokens must be a [b, s] tensor, got "
                         f"{list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    labels = torch.full_like(tokens, ignore_index)
    for start, stop in _document_bounds(tokens.shape[1], cu_seqlens):
        labels[:, start:max(start, stop - 1)] = tokens[:, start + 1:stop]
    return labels


def context_parallel_positions(length: int, cp_size: int, cp_rank: int, cu_seqlens=None,
                               device: Optional[torch.device] = None) -> torch.Tensor:
    """int64 positions of a row of length positions that CP rank cp_rank of cp_size keeps, in its
    order: each document (the row without cu_seqlens) cut into 2 x cp_size equal chunks, the rank's
    chunks cp_rank and 2 x cp_size - 1 - cp_rank, document after document."""
    if not (isinstance(cp_size, int) and isinstance(cp_rank, int) and cp_size >= 1 and 0 <= cp_rank < cp_size):
        raise ValueError(f"cp_rank must lie in [0, cp_size) with cp_size >= 1, got cp_size={cp_size}, "
                         f"cp_rank={cp_rank}")
    pieces = []
    for number, (start, stop) in enumerate(_document_bounds(length, cu_seqlens)):
        if (stop - start) % (2 * cp_size):
            what = f"document {number} (positions {start}..{stop})" if cu_seqlens is not None else "the row"
            raise ValueError(f"{what} has length {stop - start}, not a multiple of 2 x cp_size = {2 * cp_size}: "
                             "each is cut into 2 x cp_size equal chunks; pad it to a multiple")
        chunk = (stop - start) // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk, device=device))
    return torch.cat(pieces)


def split_for_context_parallel(batch: dict, cp_size: int, cp_rank: int, cu_seqlens=None) -> dict:
    """CP rank cp_rank's part of batch: each tensor [b, s, ...] (tokens, labels, loss mask, position
    ids; not an attention mask) at the positions context_parallel_positions gives, along dim 1;
    None values stay None. Shift the labels first (shift_labels)."""
    lengths = {key: t.shape[1] if isinstance(t, torch.Tensor) and t.dim() >= 2 else None
               for key, t in batch.items() if t is not None}
    if not lengths or None in lengths.values() or len(set(lengths.values())) != 1:
        raise ValueError(f"split_for_context_parallel: batch must hold [b, s, ...] tensors of one sequence length s "
                         f"(or None), got {({k: getattr(t, 'shape', type(t).__name__) for k, t in batch.items()})}")
    positions = context_parallel_positions(next(iter(lengths.values())), cp_size, cp_rank, cu_seqlens)
    return {key: None if t is None else t.index_select(1, positions.to(t.device)) for key, t in batch.items()}
