"""Argument checks of the Python wrappers that hold while torch.compile traces them, and when the
host may read tensor values. The ops' options are checked by their declarations (_options.py)."""
import torch


def values_readable(*tensors: torch.Tensor) -> bool:
    """Whether the host may read these tensors' values: not while torch.compile or torch.export
    traces (their tensors are fake, and a value read is a data-dependent guard that fullgraph
    refuses), not while a CUDA graph is captured on the current stream (a read synchronises, which
    capture forbids), and not for meta tensors (they have no values). Non-tensors are left to the
    type checks that follow."""
    if torch.compiler.is_compiling():
        return False
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in tensors):
        return False
    # Asked only for CUDA tensors: the question initialises CUDA.
    return not (any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing())


def check_hidden_size(op: str, hidden: torch.Tensor) -> None:
    if hidden.shape[-1] == 0:
        raise ValueError(f"{op}: hidden's last dimension (the hidden size H) must be at least 1, "
                         f"got hidden of shape {tuple(hidden.shape)}")


def check_mask(op: str, mask, hidden: torch.Tensor) -> None:
    """A mask of the positions an op computes (True): None, or a bool tensor of hidden's leading
    shape (its device is checked with the op's tensors)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{op}: mask must be a tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool or mask.shape != hidden.shape[:-1]:
        raise ValueError(f"{op}: mask must be a bool tensor of hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {mask.dtype} {tuple(mask.shape)}")
