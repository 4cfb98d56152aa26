"""The host check of token ids against the vocabulary."""
import torch


def check_token_range(op: str, tokens: torch.Tensor, vocab_size: int, ignore_index: int,
                      per_position: bool = True, name: str = "tokens") -> int:
    """Raises when an id is neither in [0, vocab_size) nor ignore_index, naming the first such
    entry as name[index] (the caller's tensor, in its layout); returns the number of scored
    positions (with an id not ignored; per_position False: tokens [..., k] hold k entries per
    position). One host read of two integers (a synchronisation on CUDA)."""
    ignored = tokens == ignore_index
    invalid = ~ignored & ((tokens < 0) | (tokens >= vocab_size))
    scored = ~ignored if per_position else ~ignored.all(-1)
    # One copy to the host, then item() on host tensors, which a dispatch mode sees (tolist() it does not).
    num_invalid, num_scored = (int(n) for n in torch.stack([invalid.sum(), scored.sum()]).cpu())
    if num_invalid:
        bad = tokens[invalid][:5].tolist()
        first = tuple(invalid.nonzero()[0].tolist())
        raise ValueError(f"{op}: token ids must lie in [0, {vocab_size}) or equal ignore_index "
                         f"({ignore_index}); found {bad}, the first at {name}[{', '.join(map(str, first))}]")
    return num_scored


def mark_out_of_range(tokens: torch.Tensor, ignored: torch.Tensor, vocab_size: int, logprob: torch.Tensor):
    """(logprob, out_of_range) for ids that were not checked: an id outside [0, vocab_size) (not
    ignored) matches no row and would get a finite -lse; NaN marks it instead (and, through the
    product, its gradients), with no host synchronisation."""
    out_of_range = ~ignored & ((tokens < 0) | (tokens >= vocab_size))
    return logprob * torch.where(out_of_range, float("nan"), 1.0), out_of_range
