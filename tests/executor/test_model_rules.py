"""What an executor refuses about a model when it is built (issue 17, defects 12 and 13).

* One rule for a model's ``validate_request``, in both executors: callable without an
  instance (static or class method, or a factory function's attribute), run in the
  caller's thread; an instance method is refused where the executor is built.
* ``WorkerSpec`` kwargs that do not pickle are refused at construction, named.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from helpers.mp_workers import ClassValidated, InstanceValidated, make_validated
from omni_async.core.config import Deadlines
from omni_async.core.errors import InvalidRequest, UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


# ------------------------------------------------------------------ defect 13: kwargs


@pytest.mark.parametrize("value", [lambda: 1, threading.Lock()], ids=["lambda", "lock"])
def test_worker_spec_refuses_kwargs_that_do_not_pickle_naming_the_argument(value: object) -> None:
    with pytest.raises(UsageError, match=r"WorkerSpec.kwargs\['fn'\] does not pickle"):
        WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", kwargs={"width": 64, "fn": value})
    with pytest.raises(UsageError, match=r"'fn'"):
        WorkerSpec("helpers.mp_workers:ScriptedWorker", kwargs={"fn": value}, check_import=False)


def test_worker_spec_takes_what_pickles_while_spawning() -> None:
    # A multiprocessing event pickles only as a Process argument: that is how kwargs travel.
    ev = multiprocessing.get_context("spawn").Event()
    spec = WorkerSpec("helpers.mp_workers:ScriptedWorker", kwargs={"rank": 0}, check_import=False)
    assert WorkerSpec("helpers.mp_workers:ScriptedWorker", kwargs={"ev": ev}, check_import=False).kwargs["ev"] is ev
    assert spec.kwargs == {"rank": 0}


# ------------------------------------------------------- defect 12: validate_request


def test_instance_method_validate_request_is_refused_by_worker_spec() -> None:
    with pytest.raises(UsageError, match=r"InstanceValidated.validate_request is an instance method.*@staticmethod"):
        WorkerSpec("helpers.mp_workers:InstanceValidated")


def test_instance_method_validate_request_is_refused_by_the_in_process_executor() -> None:
    with pytest.raises(UsageError, match=r"InstanceValidated.validate_request is an instance method.*@staticmethod"):
        InProcessExecutor(lambda rank: InstanceValidated(rank), deadlines=DEADLINES)


@pytest.mark.parametrize("make", [lambda rank: ClassValidated(rank), make_validated], ids=["classmethod", "factory"])
def test_in_process_executor_validates_in_the_callers_thread(make: object) -> None:
    ex = InProcessExecutor(make, deadlines=DEADLINES)  # type: ignore[arg-type]
    try:
        with pytest.raises(InvalidRequest) as err:
            ex.submit(DiffusionRequest("neg", {"size": -1}))
        assert err.value.parameter == "size" and err.value.request_id == "neg"
        with pytest.raises(InvalidRequest):
            ex.validate_request(DiffusionRequest("neg2", {"size": 0}))
        assert ex.metrics().pending_rpcs == 0
        assert ex.execute_request(DiffusionRequest("ok", {"size": 2, "numel": 8})).finished
    finally:
        ex.shutdown(timeout=10)


@pytest.mark.parametrize("factory", ["helpers.mp_workers:ClassValidated", "helpers.mp_workers:make_validated"])
@pytest.mark.slow
def test_worker_processes_validate_in_the_callers_thread(factory: str) -> None:
    with MultiprocDiffusionExecutor(WorkerSpec(factory), deadlines=DEADLINES) as ex:
        with pytest.raises(InvalidRequest) as err:
            ex.submit(DiffusionRequest("neg", {"size": -1}))
        assert err.value.parameter == "size"
        assert ex.metrics().pending_rpcs == 0
        ro = ex.execute_request(DiffusionRequest("ok", {"size": 2, "numel": 8}))
        assert ro.async_output_id is not None
        ex.release_output(ex.wait_output_ready(ro.async_output_id).result(timeout=30))


def test_the_reference_models_follow_the_rule() -> None:
    for factory in (
        "omni_async.models.tiny:TinyDiffusionWorker",
        "omni_async.models.synthetic:SyntheticForwardWorker",
    ):
        assert WorkerSpec(factory).request_validator() is not None, factory
