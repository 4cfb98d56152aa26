"""Runs a test body in several real processes on gloo (CPU), as tensor-parallel ranks."""
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

_HOST = "127.0.0.1"


def _entry(rank, world_size, port, fn, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore(_HOST, port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    # No barrier on an exception: the rank leaves at once with its traceback, and the parent then
    # stops the others, which may be waiting for it in a collective.
    fn(rank, world_size, *args)
    dist.barrier()
    exit_rank()


def exit_rank():
    """Ends this rank's process now, with exit code 0, without finalizing the interpreter.

    Why: a gloo worker thread drops its reference to a collective's work a moment after the work
    completes. When that is the last reference to a tensor Python made, freeing it takes the GIL, and
    if the rank is finalizing by then, CPython 3.12 ends the thread with pthread_exit, whose forced
    unwind meets a noexcept destructor: std::terminate, "terminate called without an active
    exception", SIGABRT (it hit test_chosen_logprob_tp's ranks now and then); a core's backtrace reads
    ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil ->
    PyThread_exit_thread -> std::terminate. destroy_process_group() first would join gloo's threads
    only when nothing else holds the group, and torch itself holds groups past it (the default
    arguments of torch.distributed.nn.functional, DTensor's redistribute caches; megatron-core's
    destroy_model_parallel leaves two group globals set). After the barrier no peer waits on this
    rank, so leaving at once loses nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args):
    """Calls fn(rank, world_size, *args) in world_size processes with the default group on gloo.

    fn must be a module-level function; an exception in any rank fails the caller with its traceback
    as soon as that rank raises (the other ranks are stopped, even inside a collective).
    The ranks meet at a store this process serves on a port the system picks as it binds (picking a
    free port first and binding it later lets a concurrent run take it in between)."""
    server = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    mp.start_processes(_entry, args=(world_size, server.port, fn, args), nprocs=world_size, start_method="spawn")
