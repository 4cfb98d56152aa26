"""Runs a test body in several real processes on gloo (CPU), as tensor-parallel ranks."""
import collections
import multiprocessing
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_HOST = "127.0.0.1"
# The ranks are forked from a forkserver that has imported those of these the caller has: a
# spawned rank imported them itself, about 3 s of CPU for torch and 6 more for megatron-core (more
# for verl's fused forward, in tests/integrations/test_verl.py), in every rank of every run, most of a multi-rank
# test's time (docs/testing.md). Only third-party modules: a rank imports fused_rl_ops and the test's
# module from the caller's sys.path, which the forkserver's imports do not follow.
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "verl.models.mcore.model_forward_fused"]
# After a rank fails, how long the others get to leave by themselves (their collectives with it fail
# once it is gone), ending their processes on the way, before the parent stops them with SIGTERM.
_GRACE_PERIOD_S = 10


def _entry(rank, world_size, port, fn, args):
    # One thread a rank: the ranks share the machine's cores. torch was imported in the forkserver,
    # so the variable reaches only the processes the rank starts.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore(_HOST, port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        # No barrier on an exception: the rank leaves at once with its traceback; the others' waits
        # for it fail, or the parent stops them.
        _end_child_processes()
        raise
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
    rank, so leaving at once loses nothing. The processes the rank started are ended first
    (_end_child_processes)."""
    sys.stdout.flush()
    sys.stderr.flush()
    _end_child_processes()
    os._exit(0)


def _end_child_processes():
    """Kills the processes this rank started and the ones they started.

    Why: os._exit skips multiprocessing's exit handler, and megatron-core's dist_checkpointing leaves
    processes running (a multiprocessing Manager for its write results, an async writer). They
    inherit the rank's stdout and would outlive it holding it open, so a pipeline reading the run's
    output (`pytest ... | tee log`) would never end. The processes are found in /proc (Linux; elsewhere
    none are). A rank that the parent stops with SIGTERM (still running a grace period after another
    rank failed) does not get here."""
    if not os.path.isdir("/proc"):
        return
    children_of = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    # "pid (command) state ppid ...": the command may hold spaces and parentheses.
                    parent = int(stat.read().rpartition(")")[2].split()[1])
            except OSError:
                continue  # it ended meanwhile
            children_of[parent].append(int(entry))
    descendants, unvisited = [], list(children_of[os.getpid()])
    while unvisited:
        pid = unvisited.pop()
        descendants.append(pid)
        unvisited += children_of[pid]
    # Not reaped here: multiprocessing reaps its own when a rank that raised finalizes.
    for pid in descendants:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_distributed(fn, world_size: int, *args):
    """Calls fn(rank, world_size, *args) in world_size processes with the default group on gloo.

    fn must be a module-level function; an exception in any rank fails the caller with its traceback
    as soon as that rank raises (the other ranks leave, or are stopped, even inside a collective).
    Each rank ends the processes it started before it leaves (_end_child_processes).
    The ranks meet at a store this process serves on a port the system picks as it binds (picking a
    free port first and binding it later lets a concurrent run take it in between).
    The ranks are forked from this process's forkserver (started at the first call, with torch and,
    if this process has imported them, megatron-core and verl's fused forward imported): they get its
    environment as it was then, and this process's sys.path and working directory as they are now."""
    server = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    multiprocessing.set_forkserver_preload([name for name in _PRELOAD if name in sys.modules])  # read at its start
    ranks = mp.start_processes(
        _entry, args=(world_size, server.port, fn, args), nprocs=world_size, start_method="forkserver", join=False
    )
    while not ranks.join(grace_period=_GRACE_PERIOD_S):
        pass
