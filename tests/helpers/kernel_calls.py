"""What reaches the extension's operators: a record of the torch.ops.fused_rl_ops calls a piece of
code makes, forward and backward, for the tests that check what the kernels compute (not only what
the results say)."""
from typing import NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_")


class KernelCall(NamedTuple):
    op: str  # the operator's name in the fused_rl_ops namespace, e.g. "chosen_logprob_stats"
    args: dict  # what it got, by the schema's argument names ("hidden", "tokens", "chunk_size", ...),
    # defaults included


class KernelCalls(TorchDispatchMode):
    """`with KernelCalls() as calls:` records every torch.ops.fused_rl_ops call made inside, in
    order (calls.calls), including those of the backward when it runs inside too."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fused_rl_ops":
            # Trailing arguments at their defaults may come without a value: the schema has it.
            defaults = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
            by_name = dict(defaults, **dict(zip((a.name for a in func._schema.arguments), args)), **(kwargs or {}))
            self.calls.append(KernelCall(func._schema.name.split("::")[1], by_name))
        return func(*args, **(kwargs or {}))

    def tokens(self, op: str) -> list:
        """The token ids of each call of a chosen_logprob operator (op: "chosen_logprob_stats" or
        "chosen_logprob_backward"), on the CPU: every row's."""
        return [call.args["tokens"].cpu() for call in self.calls if call.op == op]

    def computed_tokens(self, op: str) -> list:
        """The token ids of the rows each call of a chosen_logprob operator computes, on the CPU:
        those not equal to the ignore_index it got (every row without one)."""
        ignore = [call.args["ignore_index"] for call in self.calls if call.op == op]
        return [t if i is None else t[t != i] for t, i in zip(self.tokens(op), ignore)]


def scored(tokens: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """tokens flattened (in the [s, b] order of a Megatron processor's call: transpose first), less
    the ignored ones: the ids of the rows the ops should compute."""
    flat = tokens.reshape(-1).cpu()
    return flat[flat != ignore_index]


def gemm_dims(fn) -> list:
    """The sizes of the inputs of each GEMM fn() runs (on the CPU), inside the ops too (torch.profiler
    sees the aten calls inside an op, with their shapes): one set of sizes per GEMM."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [{size for shape in event.input_shapes for size in shape} for event in prof.events() if event.name in GEMMS]
