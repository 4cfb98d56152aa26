"""Megatron DDP's overlapped parameter all-gather, for the parameters the processor reads itself.

With `DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True)`,
megatron-core's DDP all-gathers each bucket of updated parameters lazily: the forward pre-hook it
registers on every module waits for the buckets of that module's own parameters (finish_param_sync)
and dispatches the next bucket's all-gather. The processor and the MTP loss read the output layer's
weight (or the tied embedding's), and a value head given as a weight, without running those
modules' forwards, so without more nothing would wait for their buckets: on a GPU the read would
race the all-gather, and the next step's start_param_sync fails its assertion.

`run_forward_pre_hooks_of_read_modules(output_layer)` runs, right before the read, the forward
pre-hooks of the modules whose parameters are read: the output layer, and the modules `attach`
registered for it (`register_read_modules`: the embedding that owns a tied weight, the holder of
a value head given as a weight). Their forward pre-hooks are what their forwards would have run
first (Megatron's param sync among them), so the weights are read as the modules' own forwards
would read them. Without Megatron's hooks there are none, and this does nothing.
"""
import functools
import weakref

import torch

__all__ = ["register_read_modules", "run_forward_pre_hooks_of_read_modules"]

# An attached model's output layer -> weak references to the other modules whose parameters are read.
_read_modules = weakref.WeakKeyDictionary()


def register_read_modules(output_layer, modules):
    """Records modules (besides output_layer) whose parameters are read with output_layer's; returns
    the undo step."""
    _read_modules[output_layer] = [weakref.ref(module) for module in modules]
    return functools.partial(_read_modules.pop, output_layer, None)


def run_forward_pre_hooks_of_read_modules(output_layer):
    """Runs the forward pre-hooks of output_layer and of the modules registered with it, as calling
    each module would before its forward (their results are not used)."""
    if not isinstance(output_layer, torch.nn.Module):
        return  # a stand-in holding a weight: no hooks
    for module in [output_layer, *(ref() for ref in _read_modules.get(output_layer, ()))]:
        if module is not None:
            _run_forward_pre_hooks(module)


def _run_forward_pre_hooks(module):
    # torch keeps a module's pre-hooks in _forward_pre_hooks, those registered with_kwargs marked in
    # _forward_pre_hooks_with_kwargs; there is no public way to run them without the forward.
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, (), {})
        else:
            hook(module, ())
