"""Runs a test body in several real processes on gloo (CPU), as tensor-parallel ranks."""
import os

import torch.distributed as dist
import torch.multiprocessing as mp

_HOST = "127.0.0.1"


def _entry(rank, world_size, port, fn, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore(_HOST, port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.barrier()
        # No destroy_process_group(): after torch.distributed.checkpoint it was seen to abort the
        # process now and then ("terminate called without an active exception", about 1 run in
        # 20). Not reproduced since: a stress of 4-rank DCP save/load runs under heavy load on
        # torch 2.14.1 aborted neither with nor without it (counts in the commit adding this
        # comment), so the cause is unknown.


def run_distributed(fn, world_size: int, *args):
    """Calls fn(rank, world_size, *args) in world_size processes with the default group on gloo.

    fn must be a module-level function; an exception in any rank fails the caller with its traceback.
    The ranks meet at a store this process serves on a port the system picks as it binds (picking a
    free port first and binding it later lets a concurrent run take it in between)."""
    server = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    mp.start_processes(_entry, args=(world_size, server.port, fn, args), nprocs=world_size, start_method="spawn")
