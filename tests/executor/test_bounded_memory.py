"""What the executor keeps per finished request stays bounded (issue 17, defect 15)."""

from __future__ import annotations

import time

import pytest

from omni_async.core.config import Deadlines
from omni_async.core.errors import ComputeTimeout, OmniAsyncError
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

TINY = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 64, "steps": 2})


@pytest.mark.slow
def test_calls_ended_by_their_compute_deadline_leave_nothing_in_the_synchronous_buffer() -> None:
    """Every call that ends on its compute deadline gets the worker's late answer (a
    RequestAborted once the cancel reached the forward).  It used to stay in the pump's
    synchronous buffer until the next collective_rpc -- which an engine serving requests
    never makes: one message with its traceback per timed-out (or engine-deadlined)
    request, for the executor's whole life.  Now nothing is left there."""
    deadlines = Deadlines(compute_timeout=0.002, output_timeout=5.0, rpc_timeout=60.0)
    with MultiprocDiffusionExecutor(TINY, deadlines=deadlines) as ex:
        timed_out = 0
        for i in range(40):
            # 3 steps of 20 ms each against a 2 ms deadline: every call times out, whatever
            # the machine's load (a fast forward of real work could beat the deadline).
            try:
                out = ex.execute_request(DiffusionRequest(f"r{i}", {"seed": i, "height": 8, "steps": 3, "step_ms": 20}))
            except ComputeTimeout:
                timed_out += 1
                continue
            except OmniAsyncError:
                continue
            assert out.async_output_id is not None
            ex.release_output(ex.wait_output_ready(out.async_output_id).result(timeout=30))
        assert timed_out >= 5, "the deadline is too loose for the test to say anything"
        deadline = time.monotonic() + 10.0
        while ex.dispatcher.counters["late_rpc_results"] < timed_out and time.monotonic() < deadline:
            time.sleep(0.02)  # the late answers arrive after their calls ended
        assert ex.pump.sync_buffer.qsize() == 0
        assert ex.dispatcher.counters["late_rpc_results"] >= timed_out
        assert ex.collective_rpc("ping") is not None, "path 2 still works"
        assert ex.stale_sync_answers == 0
