"""A crashed engine leaks no shared memory (issue 8, defect 4), through real processes.

* The process that owns the executor is SIGKILLed with outputs held and in flight:
  its workers notice, unlink the whole pool (segments and lock file) and exit.
* A leftover that nobody cleaned (the workers were killed too) is swept by the next
  executor at construction.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
from helpers.crash_children import gone, kill_all, start

from omni_async.core.config import Deadlines
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.transport.shm.files import entries, unlink_all_with_prefix

TINY = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 64, "steps": 2})


def _wait_for(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return True
        time.sleep(0.05)
    return bool(callable(cond) and cond())


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
