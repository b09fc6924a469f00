"""A crashed engine leaks no shared memory (issue 8, defect 4), through real processes.

* The process that owns the executor is SIGKILLed with outputs held and in flight:
  its workers notice, unlink the whole pool (segments and lock file) and exit.
* A leftover that nobody cleaned (the workers were killed too) is swept by the next
  executor at construction.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import pytest

from helpers.crash_children import gone, group_members, kill_all, kill_group, mapped_semaphores, sem_files_of, start
from omni_async.cli import cleanup
from omni_async.core.config import Deadlines
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.transport.shm.files import dead_executor_files, entries, unlink_all_with_prefix

TINY = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 64, "steps": 2})


def _wait_for(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return True
        time.sleep(0.05)
    return bool(callable(cond) and cond())


@pytest.mark.slow
def test_sigkilled_owner_leaves_no_segment_and_no_worker() -> None:
    proc, owner = start("owner", "2")
    try:
        assert len(owner["workers"]) == 2
        files_before = entries(owner["prefix"])
        # Two held outputs (leased segments) and the pool's lock file, at least.
        assert len(files_before) >= 3, files_before
        assert any(n.endswith("lock") for n in files_before)
        proc.kill()
        proc.wait(timeout=30)
        clean = _wait_for(lambda: not entries(owner["prefix"]), 5.0)
        workers_gone = _wait_for(lambda: all(gone(w) for w in owner["workers"]), 5.0)
        assert clean, f"left in /dev/shm after the owner died: {sorted(entries(owner['prefix']))}"
        assert workers_gone, [w for w in owner["workers"] if not gone(w)]
    finally:
        for w in owner["workers"]:
            if not gone(w):
                os.kill(w, 9)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        unlink_all_with_prefix(owner["prefix"])  # so a failure here does not fail later tests


@pytest.mark.slow
def test_new_executor_sweeps_the_pools_of_dead_owners(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="omni_async.executor.multiproc")
    # Other test runs on this machine sweep dead owners' files too: when one takes our
    # leftover first, make a new one.
    for _ in range(3):
        caplog.clear()
        proc, owner = start("owner", "1")
        kill_all(proc, owner)
        leftovers = entries(owner["prefix"])
        try:
            assert len(leftovers) >= 3, leftovers  # the held segments and the lock file stayed
            with MultiprocDiffusionExecutor(TINY, deadlines=Deadlines(60, 60, 60)):
                assert not entries(owner["prefix"])
        finally:
            unlink_all_with_prefix(owner["prefix"])
        swept = [r.getMessage() for r in caplog.records if r.getMessage().startswith("swept ")]
        if swept and str(owner["pid"]) in swept[0]:
            assert "died without cleaning up" in swept[0], swept
            return
    pytest.fail(f"no sweep of the dead owner's pool was logged: {[r.getMessage() for r in caplog.records]}")


@pytest.mark.slow
def test_sigkill_of_the_whole_group_leaves_no_semaphore() -> None:
    """Issue 17, defect 14: the result channel's credit semaphores (one per worker) are
    named files in /dev/shm; killing the driver, its workers and multiprocessing's
    resource tracker at once used to leave one ``sem.mp-*`` per sender."""
    proc, owner = start("owner", "2")
    try:
        members = group_members(proc.pid)
        assert proc.pid in members and set(owner["workers"]) <= set(members), members
        made = mapped_semaphores(members)  # this child's group's semaphores, nobody else's
        assert len(made) >= 2, made  # one credit semaphore per worker at least
        kill_group(proc)
        left = sem_files_of(made)
        assert not left, f"left in /dev/shm by the killed group: {sorted(left)}"
    finally:
        if proc.poll() is None:
            kill_group(proc)
        unlink_all_with_prefix(owner["prefix"])


def test_cleanup_removes_the_named_semaphore_of_a_dead_executor(capsys: pytest.CaptureFixture[str]) -> None:
    """An executor killed while its workers start leaves its credit semaphore named: its
    name carries the dead executor's pid, and ``omni-async cleanup`` removes it."""
    proc, _ = start("channel")
    try:
        made = sem_files_of(mapped_semaphores([proc.pid]))
        assert len(made) == 1 and next(iter(made)).startswith(f"sem.omni-{proc.pid}-sem-"), made
        kill_group(proc)
        assert made <= {n for n in os.listdir("/dev/shm")}  # nobody unlinked it: the resource tracker died too
        assert made <= {f.name for f in dead_executor_files()}
        assert cleanup.run(argparse.Namespace(dry_run=False)) == 0
        assert not made & set(os.listdir("/dev/shm"))
        assert f"removed /dev/shm/{next(iter(made))}" in capsys.readouterr().out
    finally:
        if proc.poll() is None:
            kill_group(proc)


# A process that ends with its executor still running (never shut down): at exit the pool's
# lock file closes before multiprocessing stops the workers, whose deaths are still reported;
# reclaiming their segments then hit the closed file ("reclaiming the segments of dead worker
# 0 failed ... Bad file descriptor", a traceback per worker).  The pool now reads as closed.
_LEFT_RUNNING = """
from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

spec = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 64, "steps": 2})
for i in range(3):  # several executors alive at exit: each one's lock file closed before its workers stop
    ex = MultiprocDiffusionExecutor(spec, deadlines=Deadlines(compute_timeout=60, output_timeout=60))
    handle = ex.submit(DiffusionRequest(f"r{i}", {"seed": i}))
    handle.output.result(60)
    del handle
print("served", flush=True)
"""


@pytest.mark.slow
def test_an_executor_left_running_at_exit_ends_quietly() -> None:
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _LEFT_RUNNING], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "served" in done.stdout
    assert "reclaiming the segments" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
