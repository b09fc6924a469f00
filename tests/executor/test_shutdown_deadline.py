"""``shutdown(timeout=...)`` bounds the whole shutdown (issue 17, defect 4), through real processes.

A worker in a forward that never looks at cancellation (a 10 s sleep) cannot be asked
to stop: the shutdown terminates it, every rank at once, within the deadline, and
still fails every waiter and unlinks every segment of its pool.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from helpers.crash_children import gone
from omni_async.core.config import Deadlines
from omni_async.core.errors import ExecutorShutdown, UsageError, WorkerDied
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.transport.shm.files import entries

SPEC = WorkerSpec("helpers.mp_workers:ScriptedWorker", pass_rank=True)
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


@pytest.mark.slow
def test_shutdown_timeout_bounds_a_shutdown_behind_a_forward_that_ignores_cancel() -> None:
    ex = MultiprocDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES)
    pids = [p.pid for p in ex.procs if p.pid is not None]
    prefix = ex.pool.prefix
    try:
        fut = ex.submit(DiffusionRequest("stuck", {"sleep": 10.0})).computed
        time.sleep(0.5)  # both ranks are in the forward now
        assert not fut.done()
        t0 = time.monotonic()
        ex.shutdown("maintenance", timeout=1.0)
        took = time.monotonic() - t0
        assert took < 2.5, f"shutdown(timeout=1.0) took {took:.2f} s"
        assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]
        assert not entries(prefix), entries(prefix)
        with pytest.raises(ExecutorShutdown, match="maintenance"):
            fut.result(timeout=1)
        t0 = time.monotonic()
        ex.shutdown(timeout=1.0)  # idempotent, at once
        assert time.monotonic() - t0 < 0.1
    finally:
        ex.shutdown()


@pytest.mark.slow
def test_shutdown_after_a_rank_died_does_not_wait_for_the_survivors_forward() -> None:
    """A rank SIGKILLed mid-forward fails the call at once; the other rank goes on in a
    forward that ignores cancellation, for nobody.  Closing (as the engine does, with its
    60 s close timeout) must not wait for it: about a second, not half the deadline
    (20 s before the fix, the survivor's whole forward)."""
    ex = MultiprocDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES)
    pids = [p.pid for p in ex.procs if p.pid is not None]
    prefix = ex.pool.prefix
    try:
        fut = ex.submit(DiffusionRequest("doomed", {"sleep": 20.0})).computed
        time.sleep(0.5)  # both ranks are in the forward now
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDied):
            fut.result(timeout=10)
        assert ex.procs[0].is_alive()  # the survivor is still sleeping in its forward
        t0 = time.monotonic()
        ex.shutdown("the engine closed", timeout=60.0)
        took = time.monotonic() - t0
        assert took < 5.0, f"shutdown after a rank's death took {took:.2f} s"
        assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]
        assert not entries(prefix), entries(prefix)
    finally:
        ex.shutdown()


def test_a_worker_ignores_sigterm_and_sigint_and_its_forward_ends() -> None:
    """Ctrl-C and a service manager's stop signal the whole process group: a worker ignores
    both when they come from another process than its executor's (``transport.children``; here
    ``kill``), so the call in flight ends with its output and the executor still stops the
    worker when it shuts down (asked; exit 0).  Before, SIGTERM killed the worker
    mid-forward (``WorkerDied``, exit code -15)."""
    ex = MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES)
    try:
        fut = ex.submit(DiffusionRequest("r", {"sleep": 0.5})).computed
        time.sleep(0.2)  # in the forward now
        pid = ex.procs[0].pid
        assert pid is not None
        subprocess.run(["kill", "-TERM", str(pid)], check=True)
        subprocess.run(["kill", "-INT", str(pid)], check=True)
        assert fut.result(timeout=10) is not None
        assert ex.procs[0].is_alive()
        ex.shutdown()
        assert [p.exitcode for p in ex.procs] == [0]
    finally:
        ex.shutdown()


def test_shutdown_timeout_is_checked() -> None:
    ex = InProcessExecutor(lambda rank: object(), deadlines=DEADLINES)
    try:
        for bad in (-1.0, "1", True, float("nan")):
            with pytest.raises(UsageError, match="shutdown: timeout"):
                ex.shutdown(timeout=bad)  # type: ignore[arg-type]
    finally:
        ex.shutdown(timeout=5.0)
    with pytest.raises(ExecutorShutdown):
        ex.check_health()
