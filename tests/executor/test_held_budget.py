"""The budget of held outputs (issue 8): one setting, a visible stall, errors that name it.

Outputs packed into shared memory are held until the engine releases them.  The
executor bounds them with ``max_held_outputs``/``max_held_bytes``; when the budget is
full a worker's packing waits (and its forwards with it).  That wait used to be
silent until outputs vanished with "unknown output id".  Real worker processes here,
with a budget of 3 outputs and short timeouts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from helpers.mp_workers import expected_image
from omni_async.core.config import Deadlines
from omni_async.core.errors import OutputTimeout, RemoteError, UsageError
from omni_async.core.messages import DiffusionRequest, RunnerOutput
from omni_async.errors import HeldOutputsFull
from omni_async.executor.multiproc import (
    MultiprocDiffusionExecutor,
    WorkerOptions,
    WorkerSpec,
)
from omni_async.transport.shm import SegmentPool

SPEC = WorkerSpec("helpers.mp_workers:ScriptedWorker", pass_rank=True)
PARAMS = {"numel": 1 << 17}  # 512 KiB of float32: one segment per output


def _req(rid: str, **params: object) -> DiffusionRequest:
    return DiffusionRequest(rid, {**PARAMS, **params})


def _until(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _oid(ro: RunnerOutput) -> str:
    assert ro.async_output_id is not None
    return ro.async_output_id


@pytest.mark.slow
def test_a_full_budget_is_visible_at_once_and_the_output_fails_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    deadlines = Deadlines(compute_timeout=30, output_timeout=30, rpc_timeout=30)
    opts = WorkerOptions(lease_timeout=1.0)
    with MultiprocDiffusionExecutor(SPEC, deadlines=deadlines, options=opts, max_held_outputs=3) as ex:
        m = ex.metrics()
        assert m.max_held_outputs == 3 and m.held_outputs == 0 and m.pool_full == 0, m
        assert ex.pool.max_segments == 3 and m.max_held_bytes == ex.pool.max_bytes
        caplog.set_level(logging.WARNING, logger="omni_async.executor.multiproc")
        held = [ex.execute_request(_req(f"h{i}", seed=i)) for i in range(3)]  # nobody claims them yet
        assert _until(lambda: ex.metrics().held_outputs == 3), ex.metrics()
        assert ex.metrics().pool_full == 0
        t0 = time.monotonic()
        fourth = ex.execute_request(_req("h3", seed=3))  # its forward runs; its pack finds no room
        waiter = ex.wait_output_ready(_oid(fourth))
        # Visible at once: in metrics() and in the log, naming the budget.
        assert _until(lambda: ex.metrics().pool_full == 1.0, 1.0), ex.metrics()
        assert _until(lambda: "max_held_outputs=3" in caplog.text, 1.5), caplog.text
        assert ex.metrics().pool_full_s > 0
        warning = caplog.text
        assert "budget of held outputs is full: 3 of max_held_outputs=3" in warning
        assert "MultiprocDiffusionExecutor(max_held_outputs=..., max_held_bytes=...)" in warning
        # After the lease timeout: a typed failure that names the budget, not a silent wait.
        with pytest.raises(RemoteError) as err:
            waiter.result(timeout=10)
        assert time.monotonic() - t0 < 6
        assert err.value.failure.type_name == HeldOutputsFull.__name__
        assert f"output {fourth.async_output_id} of request 'h3'" in err.value.failure.message
        assert "max_held_outputs=3" in err.value.failure.message
        assert "max_held_bytes=" in err.value.failure.message
        m = ex.metrics()
        assert m.pool_exhausted == 1 and m.pool_waits >= 1 and m.pool_wait_s_total >= 0.9, m
        # Claiming and releasing the held outputs makes room: the budget works again.
        for i, ro in enumerate(held):
            out = ex.wait_output_ready(_oid(ro)).result(timeout=10)
            assert bool((out.output["image"] == expected_image({**PARAMS, "seed": i})).all())
            assert ex.release_output(out) == 1
        assert _until(lambda: ex.metrics().pool_full == 0), ex.metrics()
        again = ex.execute_request(_req("h4", seed=4))
        out = ex.wait_output_ready(_oid(again)).result(timeout=10)
        assert ex.release_output(out) == 1
        assert _until(lambda: ex.metrics().held_outputs == 0 and ex.metrics().pending_outputs == 0)


@pytest.mark.slow
def test_outputs_submitted_beyond_the_budget_expire_saying_so() -> None:
    """The demo's pattern: submit everything, claim later.  Nothing is 'unknown'.

    Five outputs, room for three: the fourth's packing waits until the first outputs
    expire unclaimed (output_timeout) and are released; every later wait says the
    output expired, after how long, and under which deadline.
    """
    deadlines = Deadlines(compute_timeout=30, output_timeout=1.5, rpc_timeout=30)
    with MultiprocDiffusionExecutor(SPEC, deadlines=deadlines, max_held_outputs=3) as ex:
        ros = [ex.execute_request(_req(f"e{i}", seed=i)) for i in range(5)]
        assert _until(lambda: ex.metrics().pool_full == 1.0, 1.0), ex.metrics()
        assert _until(lambda: ex.metrics().timeouts == 5), ex.metrics()
        for ro in ros:
            with pytest.raises(OutputTimeout) as err:
                ex.wait_output_ready(_oid(ro)).result(timeout=10)
            text = str(err.value)
            assert f"of request {ro.request_id!r} expired unclaimed after" in text, text
            assert "(output_timeout=1.5)" in text and "unknown" not in text
        assert _until(lambda: ex.metrics().held_outputs == 0 and ex.metrics().pending_outputs == 0)
        assert ex.metrics().pool_exhausted == 0  # they waited, none gave up: the expiry made room


def test_the_budget_is_one_setting() -> None:
    with pytest.raises(UsageError, match="the pool is the budget"):
        with SegmentPool(max_bytes=1 << 20, max_segments=2) as pool:
            MultiprocDiffusionExecutor(SPEC, pool=pool, max_held_outputs=3)
    for bad in ({"max_held_outputs": 0}, {"max_held_bytes": -1}, {"max_held_outputs": 2.5}):
        with pytest.raises(UsageError):
            MultiprocDiffusionExecutor(SPEC, **bad)
