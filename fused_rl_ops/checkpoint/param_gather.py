"""Why data-parallel replicas can hold different bytes at a save: megatron-core's DDP with
`overlap_param_gather=True` leaves each rank's updated range of the parameters in place after
`optimizer.step()` and all-gathers the rest lazily, in the next forward's pre-hooks. Saved before
that, the replicas differ, and the replica check (ranks.py) names this cause and its fix. The DDP
is found without importing megatron: the module itself, or the model chunks of a
DistributedOptimizer (or of the members of a ChainedOptimizer)."""
from typing import Optional


def _ddp_modules(module, optimizer) -> list:
    found = [module] if hasattr(module, "bucket_groups") and hasattr(module, "ddp_config") else []
    for member in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        found += list(getattr(member, "model_chunks", None) or [])
    return found


def _gather_pending(ddp) -> bool:
    """Whether a bucket group of ddp has its parameter all-gather not yet dispatched or in flight."""
    if not getattr(ddp.ddp_config, "overlap_param_gather", False):
        return False
    groups = list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))
    return any(not g.param_gather_dispatched or g.param_gather_handle is not None for g in groups)


def pending_param_gather(module, optimizer) -> Optional[str]:
    """The explanation of differing replicas when megatron-core's DDP over module (or optimizer's
    model chunks) has a parameter all-gather pending (module docstring), else None."""
    if not any(_gather_pending(ddp) for ddp in _ddp_modules(module, optimizer)):
        return None
    return ("megatron-core's DDP runs with overlap_param_gather and has not yet all-gathered the parameters since "
            "the last optimizer step (each data-parallel rank holds its own updated range until the next forward); "
            "call ddp_model.start_param_sync(force_sync=True) before saving")
