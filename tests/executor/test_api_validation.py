"""API misuse fails at once, in the caller's thread, with a UsageError naming the argument
(issue 8, defect 5 c/d/e), and the reference model's parameters are checked (5 b).

In process (no worker processes): ``WorkerSpec`` checks and the executor API checks.
The new error types are looked up on the module in each test, so that each test
fails on its own where they do not exist.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest

import omni_async
import omni_async.core.errors as errors
import omni_async.errors
from helpers.executor_harness import RELAXED, ToyWorker, req
from omni_async.core.config import MAX_SECONDS, Deadlines, InvalidConfig
from omni_async.core.errors import MessageValidationError, RpcFailed, UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.executor.config import ExecutorConfig, ProcessGroupConfig
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.models.tiny import TinyDiffusionWorker
from omni_async.worker.host import WorkerOptions


@pytest.fixture
def ex() -> Iterator[InProcessExecutor]:
    with InProcessExecutor(ToyWorker, deadlines=RELAXED) as e:
        yield e


def _raises_at_once(fn: Any, *args: Any, match: str) -> UsageError:
    """``fn(*args)`` raises a UsageError matching ``match`` without waiting on a worker."""
    t0 = time.monotonic()
    with pytest.raises(UsageError, match=match) as err:
        fn(*args)
    assert time.monotonic() - t0 < 1.0
    return err.value


# ----------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: DiffusionRequest("r1", "x"), "params"),  # type: ignore[arg-type]
        (lambda: DiffusionRequest("r1", ["steps", 3]), "params"),  # type: ignore[arg-type]
        (lambda: DiffusionRequest("r1", {1: "one"}), "params"),  # type: ignore[dict-item]
        (lambda: DiffusionRequest(""), "request_id"),
        (lambda: DiffusionRequest(7), "request_id"),  # type: ignore[arg-type]
    ],
)
def test_request_fields_are_validated_at_construction(build: Any, argument: str) -> None:
    with pytest.raises(MessageValidationError, match=argument):
        build()


@pytest.mark.parametrize(
    ("params", "parameter"),
    [
        ({"steps": -3}, "steps"),
        ({"height": 0}, "height"),
        ({"width": "64"}, "width"),
        ({"seed": 1.5}, "seed"),
        ({"height": True}, "height"),
        ({"stepz": 3}, "stepz"),
    ],
)
def test_reference_model_rejects_bad_parameters_naming_parameter_and_request(
    params: dict[str, object], parameter: str
) -> None:
    r = DiffusionRequest("req-7", params)
    with pytest.raises(errors.InvalidRequest) as err:
        TinyDiffusionWorker.validate_request(r)
    assert err.value.parameter == parameter and err.value.request_id == "req-7"
    assert repr(parameter) in str(err.value) and "'req-7'" in str(err.value)
    assert isinstance(err.value, MessageValidationError)
    # The forward checks too, for callers that reach the model without an executor.
    with pytest.raises(errors.InvalidRequest):
        TinyDiffusionWorker(width=64).execute_model(r)


def test_reference_model_fails_a_bad_request_in_process_without_running_the_batch() -> None:
    """The worker checks too (a check only the model instance can make): the executor's is off here."""

    def no_check(request: DiffusionRequest) -> None:
        return None

    with InProcessExecutor(
        lambda rank: TinyDiffusionWorker(width=64), deadlines=RELAXED, validate_request=no_check
    ) as ex:
        good = DiffusionRequest("good", {"height": 8})
        with pytest.raises(RpcFailed) as err:
            ex.execute_batch([good, DiffusionRequest("bad", {"height": 8, "steps": -3})])
        failure = err.value.failures[0]
        assert failure.type_name == "InvalidRequest" and "'bad'" in failure.message and "'steps'" in failure.message
        assert ex.execute_request(good).async_output_id  # the executor carries on


# ----------------------------------------------------------------- executor API


def test_submit_and_execute_reject_what_is_not_a_request_at_once(ex: InProcessExecutor) -> None:
    _raises_at_once(ex.submit, "hello", match=r"submit: request must be a DiffusionRequest, got str")
    _raises_at_once(ex.execute_request, None, match=r"execute_request: request must be a DiffusionRequest")
    _raises_at_once(ex.submit_batch, "ab", match=r"submit_batch: requests must be a sequence of DiffusionRequest")
    _raises_at_once(ex.execute_batch, req("a"), match=r"for one request use submit/execute_request")
    _raises_at_once(ex.execute_batch, [req("a"), {"id": "b"}], match=r"execute_batch: requests\[1\] must be a Diff")
    _raises_at_once(ex.execute_batch, [], match="at least one request")
    with pytest.raises(UsageError, match="consumer"):
        ex.submit(req("a"), consumer=3)  # type: ignore[arg-type]
    # Nothing reached a worker: no call is pending, no answer came back.
    assert ex.metrics().pending_rpcs == 0
    assert ex.execute_request(req("ok")).async_output_id


def test_duplicate_request_ids_in_a_batch_are_rejected(ex: InProcessExecutor) -> None:
    _raises_at_once(ex.execute_batch, [req("a"), req("b"), req("a")], match=r"request id 'a' appears more than once")
    _raises_at_once(ex.submit_batch, [req("a"), req("a")], match=r"submit_batch: request id 'a'")


def test_output_calls_reject_wrong_arguments(ex: InProcessExecutor) -> None:
    _raises_at_once(ex.release_output, "x", match=r"release_output: output must be the DiffusionOutput")
    _raises_at_once(ex.wait_output_ready, 42, match=r"wait_output_ready: async_output_id must be a non-empty str")
    _raises_at_once(ex.wait_output_ready, "", match=r"async_output_id must be a non-empty str")
    _raises_at_once(ex.drop_output, None, match=r"drop_output: async_output_id must be a non-empty str")
    assert ex.release_output(DiffusionOutput("r")) == 0


# ------------------------------------------------------------------- WorkerSpec


@pytest.mark.parametrize(
    ("factory", "kwargs", "match"),
    [
        (print, {}, r"must be a 'module:callable' string.*got builtin_function_or_method.*mypkg\.models:MyWorker"),
        (TinyDiffusionWorker, {}, r"must be a 'module:callable' string.*got type"),
        ("omni_async.models.tiny.TinyDiffusionWorker", {}, r"'module:callable'.*mypkg\.models:MyWorker"),
        ("no_such_module_xyz:Worker", {}, r"cannot import 'no_such_module_xyz'.*ModuleNotFoundError"),
        ("omni_async.models.tiny:NoSuchWorker", {}, r"has no 'NoSuchWorker'"),
        ("omni_async.models.tiny:torch", {}, r"is a module, not a callable"),
        ("omni_async.models.tiny:TinyDiffusionWorker", [("width", 64)], r"kwargs must be a mapping"),
        ("omni_async.models.tiny:TinyDiffusionWorker", {1: 2}, r"kwargs keys must be str"),
    ],
)
def test_worker_spec_validates_its_fields(factory: Any, kwargs: Any, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        WorkerSpec(factory, kwargs)


def test_worker_spec_import_check_can_be_turned_off() -> None:
    spec = WorkerSpec("no_such_module_xyz:Worker", check_import=False)
    assert spec.request_validator() is None
    with pytest.raises(UsageError, match="cannot import"):
        spec.build(0)


def test_worker_spec_finds_the_models_static_validator() -> None:
    spec = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 64})
    validate = spec.request_validator()
    assert validate is not None
    with pytest.raises(errors.InvalidRequest, match="'steps'"):
        validate(DiffusionRequest("r", {"steps": -3}))
    assert WorkerSpec("helpers.mp_workers:ScriptedWorker").request_validator() is None


def test_multiproc_executor_wants_a_worker_spec() -> None:
    with pytest.raises(UsageError, match="spec must be a WorkerSpec"):
        MultiprocDiffusionExecutor("omni_async.models.tiny:TinyDiffusionWorker")  # type: ignore[arg-type]


def test_new_error_types_are_exported() -> None:
    """Errors are exported from omni_async.errors, and still import from omni_async."""
    for name in ("InvalidRequest", "WorkerStartupFailed"):
        assert name in omni_async.errors.__all__ and getattr(omni_async, name) is getattr(errors, name)


def test_in_process_executor_checks_requests_with_the_models_validator_at_the_call() -> None:
    """Both executors fail a bad request at the call: in process too, nothing reaches a worker."""
    with InProcessExecutor(lambda rank: TinyDiffusionWorker()) as ex:
        with pytest.raises(errors.InvalidRequest, match="'steps'"):
            ex.submit(DiffusionRequest("bad", {"steps": -3}))
        assert ex.metrics().pending_outputs == 0
        assert ex.execute_request(DiffusionRequest("good", {"steps": 2})).async_output_id is not None


def test_a_rejected_executor_construction_sweeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arguments are checked before the executor touches /dev/shm (the dead-pool sweep)."""
    from omni_async.executor import multiproc

    swept: list[bool] = []
    monkeypatch.setattr(multiproc, "_sweep_dead_pools", lambda: swept.append(True))
    with pytest.raises(UsageError, match="max_held_outputs"):
        MultiprocDiffusionExecutor(WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker"), max_held_outputs=0)
    assert swept == []


@pytest.mark.slow
def test_import_omni_async_does_not_import_ray() -> None:
    """``RayDiffusionExecutor`` is exported lazily: the package works without the ray extra."""
    import subprocess
    import sys

    code = "import sys, omni_async; assert 'ray' not in sys.modules; print(omni_async.__all__.count('RayDiffusionExecutor'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr


# ---------------------------------------------------- settings checked when made (issue 29)
#
# Each of these was accepted, or failed late with the wrong error: ExecutorConfig(tracer=123)
# hung the constructor until start_timeout (120 s); an infinite deadline overflowed in the
# process group's rendezvous; InProcessExecutor(deadlines=5) and the multiprocess executor's
# config=5 and pool='x' raised AttributeError; max_outputs_in_flight=0 raised ValueError in
# process, or spawned a worker that failed seconds later.  Now each is an InvalidConfig
# naming the field, raised before anything starts: the timeout marker keeps them fast.

TINY = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker")


def _refused_at_once(make: Any, field: str) -> InvalidConfig:
    """``make()`` raises InvalidConfig naming ``field``, within a second, starting no process."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    t0 = time.monotonic()
    with pytest.raises(InvalidConfig) as err:
        make()
    assert time.monotonic() - t0 < 1.0
    assert err.value.field == field and str(err.value).startswith(field), err.value
    assert set(multiprocessing.active_children()) <= before, "a worker process was started"
    return err.value


@pytest.mark.timeout(20)
def test_a_tracer_that_is_not_callable_is_refused_before_any_worker_starts() -> None:
    _refused_at_once(lambda: ExecutorConfig(tracer=123), "tracer")  # type: ignore[arg-type]
    err = _refused_at_once(lambda: MultiprocDiffusionExecutor(TINY, tracer=123, start_timeout=5), "tracer")  # type: ignore[arg-type]
    assert "got 123 (int)" in str(err)
    _refused_at_once(lambda: InProcessExecutor(ToyWorker, tracer=5), "tracer")  # type: ignore[arg-type]


@pytest.mark.timeout(20)
def test_an_infinite_timeout_is_refused_not_overflowed() -> None:
    _refused_at_once(lambda: ProcessGroupConfig(timeout=math.inf), "process_group.timeout")
    _refused_at_once(lambda: Deadlines(compute_timeout=math.inf), "Deadlines.compute_timeout")
    _refused_at_once(
        lambda: MultiprocDiffusionExecutor(TINY, process_group=ProcessGroupConfig(timeout=1e300)),
        "process_group.timeout",
    )


def test_the_longest_deadline_accepted_still_makes_a_rendezvous() -> None:
    """MAX_SECONDS is below every limit a deadline reaches: the process group's store takes
    it (an infinite compute deadline raised OverflowError here)."""
    from omni_async.executor.dist import GroupRendezvous

    pg = ProcessGroupConfig()
    cfg = ExecutorConfig(process_group=pg)
    group = GroupRendezvous(pg, cfg, Deadlines(compute_timeout=MAX_SECONDS))
    try:
        assert group.rendezvous.timeout == MAX_SECONDS
    finally:
        group.close()


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: InProcessExecutor(ToyWorker, deadlines=5), "deadlines"),  # type: ignore[arg-type]
        (lambda: InProcessExecutor(ToyWorker, max_outputs_in_flight=0), "max_outputs_in_flight"),
        (lambda: InProcessExecutor(ToyWorker, world_size=2, reply_rank=2), "reply_rank"),
        (lambda: InProcessExecutor(ToyWorker, loop_options={"packer": None}), "loop_options"),
        (lambda: InProcessExecutor(42), "make_worker"),  # type: ignore[arg-type]
        (lambda: MultiprocDiffusionExecutor(TINY, 5), "config"),  # type: ignore[arg-type]
        (lambda: MultiprocDiffusionExecutor(TINY, pool="x"), "pool"),  # type: ignore[arg-type]
        (
            lambda: MultiprocDiffusionExecutor(TINY, options=WorkerOptions(max_outputs_in_flight=0)),
            "WorkerOptions.max_outputs_in_flight",
        ),
        (lambda: MultiprocDiffusionExecutor(TINY, start_timeout=math.nan), "start_timeout"),
        (lambda: WorkerOptions(inline_threshold="big"), "WorkerOptions.inline_threshold"),  # type: ignore[arg-type]
        (lambda: WorkerOptions(device="gpu"), "WorkerOptions.device"),
        (lambda: WorkerOptions(lease_timeout=-1), "WorkerOptions.lease_timeout"),
    ],
)
def test_an_executor_argument_that_cannot_work_is_refused_naming_it(make: Any, field: str) -> None:
    _refused_at_once(make, field)


@pytest.mark.timeout(20)
def test_a_ray_executor_argument_is_checked_before_ray_starts() -> None:
    from omni_async.executor.ray_executor import RayDiffusionExecutor

    _refused_at_once(lambda: RayDiffusionExecutor(TINY, num_cpus_per_rank=math.nan), "num_cpus_per_rank")
    _refused_at_once(lambda: RayDiffusionExecutor(TINY, config=5), "config")  # type: ignore[arg-type]
    _refused_at_once(lambda: RayDiffusionExecutor(TINY, placement_strategy="TIGHT"), "placement_strategy")
