"""Argument checks of the Python wrappers that hold while torch.compile traces them, and when the
host may read tensor values."""
import math
from numbers import Real

import torch


def values_readable(*tensors: torch.Tensor) -> bool:
    """Whether the host may read these tensors' values: not while torch.compile or torch.export
    traces (their tensors are fake, and a value read is a data-dependent guard that fullgraph
    refuses), and not for meta tensors (they have no values). Non-tensors are left to the type
    checks that follow."""
    return not torch.compiler.is_compiling() and not any(
        isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors)


def is_positive_finite(value) -> bool:
    """A positive finite real number: a Python or NumPy scalar, not a bool (the kernels take it by
    value, so not a tensor)."""
    return isinstance(value, Real) and not isinstance(value, bool) and 0 < value < math.inf


def check_temperature(op: str, temperature) -> None:
    if not is_positive_finite(temperature):
        raise ValueError(f"{op}: temperature must be a positive finite number, got {temperature!r}")


def check_softcap(op: str, softcap) -> None:
    """softcap is None (no cap) or a positive finite number c: logits c * tanh(logits / c)."""
    if softcap is not None and not is_positive_finite(softcap):
        raise ValueError(f"{op}: softcap must be None or a positive finite number, got {softcap!r}")


def check_hidden_size(op: str, hidden: torch.Tensor) -> None:
    if hidden.shape[-1] == 0:
        raise ValueError(f"{op}: hidden's last dimension (the hidden size H) must be at least 1, "
                         f"got hidden of shape {tuple(hidden.shape)}")
