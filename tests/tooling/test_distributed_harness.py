"""The multi-process test harness (fused_rl_ops.testing.distributed): a rank leaving while gloo still
holds a finished collective's tensors exits cleanly (this once aborted the rank, see exit_rank), a
rank that raises fails the run at once, and a rank ends the processes it started before it leaves."""
import datetime
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fused_rl_ops.testing.distributed import exit_rank, run_distributed

IN_FLIGHT = 300


def _leave_with_collectives_in_flight(rank, port):
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    if rank == 1:
        # Queue all-reduces of tensors only gloo's work objects keep alive, and leave: rank 0 completes
        # them one by one while this rank exits, so gloo's worker frees them while the rank is leaving.
        for _ in range(IN_FLIGHT):
            dist.all_reduce(torch.ones(10), async_op=True)
    else:
        try:
            for _ in range(IN_FLIGHT):
                dist.all_reduce(torch.ones(10))
                time.sleep(0.002)
        except RuntimeError:
            pass  # rank 1 is gone before all of them ran: expected, this rank only serves them
    exit_rank()


def test_rank_exits_cleanly_with_collectives_in_flight():
    # Leaving through interpreter finalization instead made rank 1 abort (SIGABRT) in 4 of 5 runs.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(_leave_with_collectives_in_flight, args=(server.port,), nprocs=2, start_method="spawn")


def _raise_while_the_other_rank_waits(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 rejects its arguments")
    dist.all_reduce(torch.ones(1))  # waits for rank 1, which never joins it
    dist.all_reduce(torch.ones(1))


def test_a_rank_that_raises_fails_the_run_at_once():
    """A hang check, not a timing: before, the raising rank waited in a barrier and the run ended only
    at gloo's 30-minute timeout."""
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 rejects its arguments"):
        run_distributed(_raise_while_the_other_rank_waits, 2)
    assert time.monotonic() - start < 120


def _sleep_with_a_child(pids):
    """A rank's child, which starts a process of its own; both inherit the rank's stdout and sleep."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pids.put(grandchild.pid)
    time.sleep(600)


def _start_processes_that_hold_stdout(rank, world_size, pid_dir, raising_rank):
    """Starts a non-daemonic multiprocessing child, as megatron-core's checkpoint writers are, which
    starts a child of its own; writes their pids to pid_dir; raises on raising_rank."""
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    child = context.Process(target=_sleep_with_a_child, args=(pids,))
    child.start()
    for pid in (child.pid, pids.get(timeout=120)):
        (pathlib.Path(pid_dir) / f"{pid}.pid").write_text(str(pid))
    if rank == raising_rank:
        raise ValueError(f"rank {rank} fails after starting its processes")


def _running(pid):
    """Whether the process exists and is not a zombie (a zombie has ended and holds no files)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="run_distributed finds a rank's processes in /proc (Linux)")
@pytest.mark.parametrize("raising_rank", [None, 1])
def test_a_rank_ends_the_processes_it_started(tmp_path, raising_rank):
    """The run's output read through a pipe, as `pytest ... | tee log` reads it, ends when the run does:
    each rank's child and grandchild (inheriting its stdout) are gone, whether the rank leaves through
    exit_rank or raises. A hang check, not a timing: before, the read waited for the 600-second
    sleepers (the timeout ends it)."""
    # Run from the checkout's root, which `python -c` puts first on the path: this file is then the
    # module tests.tooling.test_distributed_harness there, and fused_rl_ops the
    # checkout's, as for this test.
    program = (
        "from tests.tooling.test_distributed_harness import _start_processes_that_hold_stdout as ranks; "
        "from fused_rl_ops.testing.distributed import run_distributed; "
        f"run_distributed(ranks, 2, {str(tmp_path)!r}, {raising_rank})"
    )
    try:
        run = subprocess.run([sys.executable, "-c", program], cwd=pathlib.Path(__file__).resolve().parents[2],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    finally:
        pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
        running = [pid for pid in pids if _running(pid)]
        for pid in running:  # a failing run leaves no sleepers behind
            os.kill(pid, signal.SIGKILL)
    output = run.stdout.decode(errors="replace")
    if raising_rank is None:
        assert run.returncode == 0, output
    else:
        assert run.returncode != 0 and f"rank {raising_rank} fails after starting its processes" in output, output
    assert len(pids) == 4 and running == []
