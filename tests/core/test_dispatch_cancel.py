"""The dispatcher's side of aborting calls in flight and of per-call deadlines (sans-IO).

``cancel`` marks the requests of pending calls and queues one ``CancelMessage`` per
call; the call still ends by its ranks' answers: the worker stopped (a
``RequestAborted`` failure) or finished anyway (its ids are dropped on arrival).  A
compute deadline cancels the forward the same way, and a rank that never answers it
is stuck after the grace period.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from omni_async.core.config import Deadlines
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import ComputeTimeout, OutputTimeout, RequestAborted, RpcFailed, WorkerStuck
from omni_async.core.messages import (
    AbortCause,
    AsyncDiffusionOutput,
    CancelMessage,
    ComputeDone,
    DiffusionOutput,
    Failure,
    OutputReady,
    RpcResult,
    RunnerOutput,
)
from omni_async.core.registry import OutputRegistry, apply_resolutions

Msg = AsyncDiffusionOutput
ABORTED = Failure("RequestAborted", "aborted by cancel_requests() while computing; its forward stopped")


class Rig:
    def __init__(self, world_size: int = 1, compute_timeout: float | None = None, output_timeout: float | None = None):
        self.released: list[Any] = []
        self.registry = OutputRegistry(output_timeout=output_timeout, release_hook=self.released.append)
        self.d = Dispatcher(self.registry, world_size=world_size, compute_timeout=compute_timeout)
        self.now = 0.0

    def settle(self) -> None:
        apply_resolutions(self.d.take_resolutions())

    def submit(self, rpc_id: str, rids: tuple[str, ...], **kw: Any) -> Future[tuple[RunnerOutput, ...]]:
        fut = self.d.submit(rpc_id, "execute_model_batch", now=self.now, request_ids=rids, **kw)
        self.settle()
        return fut

    def handle(self, msg: AsyncDiffusionOutput) -> None:
        self.d.handle(msg, now=self.now)
        self.settle()

    def cancel(self, *rids: str, cause: AbortCause = AbortCause.ABORT) -> tuple[int, list[CancelMessage]]:
        n = self.d.cancel(rids, cause=cause)
        self.settle()
        return n, self.d.take_cancels()

    def expire(self, now: float) -> None:
        self.now = now
        self.d.expire(now)
        self.settle()

    def quiet(self) -> bool:
        return len(self.registry) == 0 and self.d.pending_rpcs() == 0


def test_cancel_queues_one_message_per_call_and_ignores_unknown_ids() -> None:
    rig = Rig()
    rig.submit("c1", ("a", "b"))
    rig.submit("c2", ("c",))
    n, msgs = rig.cancel("a", "c", "nobody")
    assert n == 2
    assert msgs == [CancelMessage("c1", ("a",)), CancelMessage("c2", ("c",))]
    # Idempotent: the same cancel again sends nothing new.
    assert rig.cancel("a", "c") == (0, [])
    assert rig.cancel("nobody") == (0, [])


def test_a_call_the_worker_stopped_fails_with_request_aborted() -> None:
    rig = Rig()
    fut = rig.submit("c1", ("a",))
    rig.cancel("a")
    assert not fut.done()  # it ends by the worker's answer, not by the cancel itself
    rig.handle(RpcResult.failed("c1", ABORTED))
    err = fut.exception(0)
    assert isinstance(err, RequestAborted)
    assert err.request_id == "a" and err.request_ids == ("a",) and err.by == "abort" and err.rpc_id == "c1"
    assert "aborted by cancel_requests()" in str(err) and "its forward stopped" in str(err)
    assert rig.quiet()


def test_a_cancelled_call_that_finished_anyway_drops_its_ids_and_fails_once_they_are_gone() -> None:
    """The worker's forward ended before the cancel reached it: COMPUTE_DONE announces ids.
    They are dropped on arrival, and the call fails with RequestAborted only when nothing
    of it is left (its OUTPUT_READY released)."""
    rig = Rig()
    fut = rig.submit("c1", ("a",))
    rig.cancel("a")
    rig.handle(ComputeDone("c1", ("o1",), ("a",)))
    assert not fut.done(), "the output is still on its way: the abort is not complete"
    assert "o1" in rig.registry
    rig.handle(OutputReady("o1", DiffusionOutput("a", "payload")))
    err = fut.exception(0)
    assert isinstance(err, RequestAborted) and "forward finished before it saw the cancel" in str(err)
    assert len(rig.released) == 1  # the payload went back, held for nobody
    assert rig.quiet()


def test_cancelling_some_requests_of_a_batch_drops_only_their_outputs() -> None:
    rig = Rig()
    fut = rig.submit("c1", ("a", "b"))
    rig.cancel("a")
    rig.handle(OutputReady.failed("o1", Failure("Cancelled", "not packed")))  # the worker skipped a's pack
    rig.handle(ComputeDone("c1", ("o1", "o2"), ("a", "b")))
    outs = fut.result(0)
    assert outs == (
        RunnerOutput("a", finished=True, aborted=True),
        RunnerOutput("b", finished=True, async_output_id="o2"),
    )
    assert "o1" not in rig.registry and "o2" in rig.registry
    rig.handle(OutputReady("o2", DiffusionOutput("b", "pixels")))
    waiter = rig.registry.wait("o2")
    rig.settle()
    assert waiter.result(0).output == "pixels"
    assert rig.quiet()


def test_a_fully_cancelled_call_is_aborted_even_when_a_rank_failed_otherwise() -> None:
    rig = Rig(world_size=2)
    fut = rig.submit("c1", ("a",))
    rig.cancel("a")
    rig.handle(RpcResult.failed("c1", ABORTED, rank=0))
    rig.handle(RpcResult.failed("c1", Failure("RuntimeError", "boom"), rank=1))
    err = fut.exception(0)
    assert isinstance(err, RequestAborted) and "rank 1: boom" in str(err)


def test_a_partly_cancelled_call_that_fails_still_fails_with_its_error() -> None:
    rig = Rig()
    fut = rig.submit("c1", ("a", "b"))
    rig.cancel("a")
    rig.handle(RpcResult.failed("c1", Failure("RuntimeError", "boom")))
    assert isinstance(fut.exception(0), RpcFailed)


def test_compute_deadline_cancels_the_forward_and_a_rank_that_never_answers_is_stuck() -> None:
    rig = Rig(world_size=2, compute_timeout=10.0)
    fut = rig.submit("c1", ("a",))
    rig.handle(RpcResult("c1", None, rank=1))
    rig.expire(10.0)
    err = fut.exception(0)
    assert isinstance(err, ComputeTimeout) and "was cancelled on the workers" in str(err)
    assert rig.d.take_cancels() == [CancelMessage("c1", ("a",), AbortCause.DEADLINE)]
    assert rig.d.overdue_calls() == 1
    assert rig.d.stuck(12.0, grace=5.0) is None  # within the grace period
    stuck = rig.d.stuck(15.0, grace=5.0)
    assert isinstance(stuck, WorkerStuck)
    assert stuck.rank == 0 and stuck.rpc_id == "c1" and stuck.request_ids == ("a",)
    assert "rank 0" in str(stuck) and "'a'" in str(stuck)
    assert rig.d.stuck(1e9, grace=None) is None  # grace None: never
    # The rank stops at last: its late answer ends the overdue call.
    rig.handle(RpcResult.failed("c1", ABORTED, rank=0))
    assert rig.d.overdue_calls() == 0 and rig.d.stuck(100.0, grace=5.0) is None
    assert rig.quiet()


def test_a_late_compute_done_also_ends_an_overdue_call() -> None:
    rig = Rig(compute_timeout=1.0)
    rig.submit("c1", ("a",))
    rig.expire(1.0)
    rig.handle(ComputeDone("c1", ("o1",), ("a",)))
    assert rig.d.overdue_calls() == 0
    rig.handle(OutputReady("o1", DiffusionOutput("a", "late")))
    assert rig.quiet() and len(rig.released) == 1


def test_per_call_deadlines_replace_the_executors() -> None:
    rig = Rig(compute_timeout=100.0, output_timeout=100.0)
    short = rig.submit("c1", ("a",), deadlines=Deadlines(compute_timeout=1.0, output_timeout=2.0))
    default = rig.submit("c2", ("b",))
    unbounded = rig.submit("c3", ("c",), deadlines=Deadlines(compute_timeout=None, output_timeout=None))
    rig.expire(1.5)
    assert isinstance(short.exception(0), ComputeTimeout) and "compute_timeout=1.0" in str(short.exception(0))
    assert not default.done() and not unbounded.done()
    rig.handle(ComputeDone("c2", ("o2",), ("b",)))
    rig.handle(ComputeDone("c3", ("o3",), ("c",)))
    rig.expire(200.0)
    assert isinstance(rig.registry.wait("o2").exception(0), OutputTimeout)
    assert "o3" in rig.registry  # no output deadline for c3's ids
    rig.expire(1e6)
    assert "o3" in rig.registry


def test_a_per_call_output_timeout_bounds_that_calls_outputs() -> None:
    rig = Rig(output_timeout=None)
    rig.submit("c1", ("a",), deadlines=Deadlines(compute_timeout=None, output_timeout=2.0))
    rig.handle(ComputeDone("c1", ("o1",), ("a",)))
    rig.expire(1.9)
    assert "o1" in rig.registry
    rig.expire(2.1)
    err = rig.registry.wait("o1").exception(0)
    assert isinstance(err, OutputTimeout) and "output_timeout=2.0" in str(err)


@pytest.mark.parametrize("cause", list(AbortCause))
def test_abort_cause_phrases(cause: AbortCause) -> None:
    err = RequestAborted("r", by=cause.value)
    assert cause.phrase in str(err)
