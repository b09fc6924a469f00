"""Errors that keep their cause, through real worker processes (issue 8, defect 5 a/b/c/d).

The new error types are looked up on the module in each test, so that each test
fails on its own where they do not exist.
"""

from __future__ import annotations

import time

import pytest

import omni_async.core.errors as errors
from omni_async.core.config import Deadlines
from omni_async.core.errors import RpcFailed, UsageError, WorkerDied
from omni_async.core.messages import DiffusionRequest, Failure
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.transport.shm import SegmentPool
from omni_async.transport.shm.files import entries

DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


@pytest.mark.slow
def test_model_that_fails_to_build_raises_with_the_remote_type_message_and_rank() -> None:
    spec = WorkerSpec("helpers.mp_workers:BrokenWorker", {"fail_rank": 1}, pass_rank=True)
    pool = SegmentPool(max_bytes=1 << 20)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied) as err:
        MultiprocDiffusionExecutor(spec, world_size=2, deadlines=DEADLINES, pool=pool, start_timeout=60)
    assert time.monotonic() - t0 < 30
    e = err.value
    assert isinstance(e, errors.WorkerStartupFailed)
    assert e.rank == 1 and e.exitcode == 1
    assert e.failure is not None
    assert e.failure.type_name == "FileNotFoundError"
    assert "no weights at /nonexistent/model.safetensors" in e.failure.message
    assert "BrokenWorker" in e.failure.traceback or "__init__" in e.failure.traceback
    msg = str(e)
    assert "rank 1" in msg and "FileNotFoundError: rank 1: no weights" in msg and "remote traceback" in msg
    assert not entries(pool.prefix)  # the failed start cleaned up after itself


@pytest.mark.slow
def test_bad_requests_and_arguments_fail_in_the_caller_before_any_round_trip() -> None:
    spec = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 64, "steps": 2})
    with MultiprocDiffusionExecutor(spec, deadlines=DEADLINES) as ex:
        # The model's static validate_request runs in this process, before sending.
        t0 = time.monotonic()
        with pytest.raises(errors.InvalidRequest) as bad:
            ex.execute_request(DiffusionRequest("neg", {"steps": -3}))
        with pytest.raises(errors.InvalidRequest, match="'height'"):
            ex.submit_batch([DiffusionRequest("a", {"height": 8}), DiffusionRequest("b", {"height": 0})])
        with pytest.raises(UsageError, match="request must be a DiffusionRequest"):
            ex.submit("hello")  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="release_output: output must be"):
            ex.release_output("x")  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="wait_output_ready: async_output_id"):
            ex.wait_output_ready(3)  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 1.0
        assert bad.value.parameter == "steps" and bad.value.request_id == "neg"
        assert ex.metrics().pending_rpcs == 0
        # What only the worker instance can tell (its own width) fails that call, typed.
        with pytest.raises(RpcFailed) as remote:
            ex.execute_request(DiffusionRequest("wide", {"width": 32}))
        assert remote.value.failures[0].type_name == "InvalidRequest"
        assert "'width'" in remote.value.failures[0].message
        ro = ex.execute_request(DiffusionRequest("fine", {"height": 8}))
        assert ro.async_output_id is not None
        ex.release_output(ex.wait_output_ready(ro.async_output_id).result(timeout=30))


@pytest.mark.slow
def test_worker_killed_by_an_exception_reports_it_with_worker_died() -> None:
    spec = WorkerSpec("helpers.mp_workers:ScriptedWorker", pass_rank=True)
    with MultiprocDiffusionExecutor(spec, deadlines=DEADLINES) as ex:
        fut = ex.submit(DiffusionRequest("doomed", {"fatal": "the device fell off the bus"})).computed
        with pytest.raises(WorkerDied) as err:
            fut.result(timeout=30)
        e = err.value
        assert e.rank == 0 and e.exitcode == 1
        assert e.failure is not None and e.failure.type_name == "Fatal"
        assert "the device fell off the bus" in str(e)
        with pytest.raises(WorkerDied, match="Fatal: forward of doomed"):
            ex.check_health()


def test_a_worker_startup_failure_of_a_ray_actor_says_actor_not_exit_code() -> None:
    """RayDiffusionExecutor's actors have no exit code of ours (it is None): "(a Ray actor)"
    replaces "exit code None" in both forms of the message; a process's stay as they were."""
    failure = Failure("FileNotFoundError", "no weights", "Traceback ...")
    started = errors.WorkerStartupFailed(2, None, failure=failure, actor=True)
    assert str(started).startswith("worker rank 2 (a Ray actor) failed to start: FileNotFoundError: no weights")
    silent = errors.WorkerStartupFailed(2, None, actor=True)
    assert str(silent) == "worker rank 2 (a Ray actor) died while starting"
    for err in (started, silent):
        assert err.actor and err.exitcode is None and err.rank == 2 and "exit code" not in str(err)
    assert isinstance(silent, errors.WorkerDied)
    process = errors.WorkerStartupFailed(2, 1, failure=failure)
    assert not process.actor and "failed to start (exit code 1): FileNotFoundError" in str(process)
