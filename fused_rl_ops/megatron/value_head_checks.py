"""Two checks `attach` makes of a value head, for mistakes that otherwise train silently.

- The same head on every tensor-parallel rank: the head is replicated over TP (each TP rank computes
  the values of the whole sequence and gets the complete gradient), so it must start the same on
  every TP rank. A head built after a per-rank seed, as RL frameworks seed, differs between them:
  each rank would give other values and train its own head. `check_same_on_tensor_parallel_ranks`
  compares the parameters' bytes across the output layer's TP group at attach; every rank gets
  every rank's bytes, so all raise together.
- The dtype the head had at attach: Megatron's Float16Module converts its whole module to bf16 /
  fp16 when it is built, so a model wrapped after attach has its head converted too (attach after
  Float16Module keeps it fp32). `DtypeCheck` warns, at the model's first forward, about a head
  whose parameters changed dtype since attach.
"""
import warnings

import torch
import torch.distributed as dist

__all__ = ["DtypeCheck", "check_same_on_tensor_parallel_ranks"]


def check_same_on_tensor_parallel_ranks(value_head, tp_group):
    """A ValueError, on every rank of tp_group, if value_head's parameters are not bitwise the same on
    all of them (nothing to check without torch.distributed or with one rank)."""
    if tp_group is None or not dist.is_initialized() or dist.get_world_size(tp_group) == 1:
        return
    named = list(value_head.named_parameters())
    local = torch.cat([param.detach().reshape(-1).view(torch.uint8) for _, param in named]) if named else None
    if local is None:
        return
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(pieces, local, group=tp_group)
    differing, start = [], 0
    for name, param in named:
        stop = start + param.numel() * param.element_size()
        if any(not torch.equal(piece[start:stop], pieces[0][start:stop]) for piece in pieces[1:]):
            differing.append(f"value_head.{name}")
        start = stop
    if differing:
        raise ValueError(
            f"attach: the value head's parameters differ between the tensor-parallel ranks ({', '.join(differing)}); "
            "each TP rank computes the same values and would train its own head. Build the head the same on "
            "every TP rank (the same seed, not a seed that depends on the rank), or broadcast its parameters "
            "from the TP group's first rank before attach: torch.distributed.broadcast(param.data, "
            "src=torch.distributed.get_global_rank(tp_group, 0), group=tp_group)"
        )


class DtypeCheck:
    """A forward pre-hook on the language model: at its first forward, a warning if the value head's
    parameters no longer have the dtypes they had at attach (module docstring); then it removes itself."""

    def __init__(self, language_model, value_head):
        self.value_head = value_head
        self.dtypes = {name: param.dtype for name, param in value_head.named_parameters()}
        self.handle = language_model.register_forward_pre_hook(self)

    def remove(self):
        self.handle.remove()

    def __call__(self, language_model, args):
        self.remove()
        changed = [f"value_head.{name} ({self.dtypes[name]} at attach, now {param.dtype})"
                   for name, param in self.value_head.named_parameters() if param.dtype != self.dtypes.get(name)]
        if changed:
            warnings.warn(
                f"{type(language_model).__name__}: the attached value head's parameters changed dtype after "
                f"attach: {', '.join(changed)}. Megatron's Float16Module converts its whole module when it is "
                "built; wrap the model in Float16Module first, then attach, so the head stays as it was "
                "(the order: Float16Module, attach, DistributedDataParallel, get_megatron_optimizer)"
            )
