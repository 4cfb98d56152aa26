"""The host check of token ids against the vocabulary."""
import torch


def check_token_range(op: str, tokens: torch.Tensor, vocab_size: int, ignore_index: int) -> int:
    """Raises when an id is neither in [0, vocab_size) nor ignore_index; returns the number of
    scored ids (the others). One host read of two integers (a synchronisation on CUDA)."""
    ignored = tokens == ignore_index
    invalid = ~ignored & ((tokens < 0) | (tokens >= vocab_size))
    # One copy to the host, then item() on host tensors, which a dispatch mode sees (tolist() it does not).
    num_invalid, num_scored = (int(n) for n in torch.stack([invalid.sum(), (~ignored).sum()]).cpu())
    if num_invalid:
        bad = tokens[invalid][:5].tolist()
        raise ValueError(f"{op}: token ids must lie in [0, {vocab_size}) or equal ignore_index "
                         f"({ignore_index}); found {bad}")
    return num_scored


def mark_out_of_range(tokens: torch.Tensor, ignored: torch.Tensor, vocab_size: int, logprob: torch.Tensor):
    """(logprob, out_of_range) for ids that were not checked: an id outside [0, vocab_size) (not
    ignored) matches no row and would get a finite -lse; NaN marks it instead (and, through the
    product, its gradients), with no host synchronisation."""
    out_of_range = ~ignored & ((tokens < 0) | (tokens >= vocab_size))
    return logprob * torch.where(out_of_range, float("nan"), 1.0), out_of_range
