"""The RPC dispatcher, sans-IO: path 1 (execute RPCs resolved by COMPUTE_DONE) and path 2."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OutputDropped,
    OutputOrphaned,
    ProtocolError,
    RpcFailed,
    WorkerDied,
)
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    ComputeDone,
    DiffusionOutput,
    Failure,
    OutputReady,
    RpcResult,
    RunnerOutput,
)
from omni_async.core.registry import OutputRegistry, apply_resolutions
from omni_async.core.states import RequestState
from omni_async.verify.recorder import ListTracer

Msg = AsyncDiffusionOutput
S = RequestState
BOOM = Failure("ValueError", "forward exploded", "Traceback ...")


class Harness:
    def __init__(
        self,
        world_size: int = 1,
        reply_rank: int = 0,
        compute_timeout: float | None = None,
        output_timeout: float | None = None,
        known_call: Callable[[str], bool] | None = None,
    ) -> None:
        self.released: list[Any] = []
        self.tracer = ListTracer()
        self.registry = OutputRegistry(
            output_timeout=output_timeout, release_hook=lambda p: self.released.append(p.output), tracer=self.tracer
        )
        self.d = Dispatcher(
            self.registry,
            world_size=world_size,
            reply_rank=reply_rank,
            compute_timeout=compute_timeout,
            tracer=self.tracer,
            known_call=known_call,
        )
        self.now = 0.0

    def handle(self, msg: AsyncDiffusionOutput) -> AsyncDiffusionOutput | None:
        routed = self.d.handle(msg, now=self.now)
        self.settle()
        return routed

    def settle(self) -> None:
        apply_resolutions(self.d.take_resolutions())

    def submit(self, rpc_id: str, method: str = "execute_model_batch", **kw: Any) -> Future[tuple[RunnerOutput, ...]]:
        fut = self.d.submit(rpc_id, method, now=self.now, **kw)
        self.settle()
        return fut

    def output(self, oid: str, rank: int = 0) -> None:
        self.handle(OutputReady(oid, DiffusionOutput(request_id=f"req-{oid}", output=f"payload-{oid}"), rank=rank))

    def expire(self, now: float) -> None:
        self.now = now
        self.d.expire(now)
        self.settle()


def cd(rpc_id: str, ids: list[str], rank: int = 0) -> AsyncDiffusionOutput:
    return ComputeDone(rpc_id, tuple(ids), tuple(f"req-{i}" for i in ids), rank=rank)


def exc_of(fut: Future[Any]) -> BaseException:
    assert fut.done() and not fut.cancelled()
    e = fut.exception(timeout=0)
    assert e is not None
    return e


# --------------------------------------------------------------------------- path 1


def test_single_rank_resolves_on_compute_done_with_one_runner_output_per_request() -> None:
    h = Harness()
    fut = h.submit("rpc-1", consumer="c1")
    assert not fut.done() and h.d.pending_rpcs() == 1
    h.handle(cd("rpc-1", ["o1", "o2"]))
    result = fut.result(timeout=0)
    assert result == (
        RunnerOutput(request_id="req-o1", finished=True, async_output_id="o1"),
        RunnerOutput(request_id="req-o2", finished=True, async_output_id="o2"),
    )
    assert len(h.d) == 0
    # The ids are registered before the future resolves: waiting works at once.
    for oid in ("o1", "o2"):
        rec = next(r for r in h.registry if r.output_id == oid)
        assert rec.state is S.COMPUTE_DONE and rec.consumer == "c1" and rec.request_id == f"req-{oid}"


def test_ids_are_registered_before_the_rpc_future_resolves() -> None:
    """The engine learns an id only from the RPC future: its record must already exist."""
    h = Harness()
    seen: list[S | None] = []
    fut = h.submit("rpc-1")
    fut.add_done_callback(lambda f: seen.append(h.registry.state_of(f.result()[0].async_output_id or "")))
    h.handle(cd("rpc-1", ["o1"]))
    assert seen == [S.COMPUTE_DONE]


def test_f12_call_resolves_only_when_every_rank_answered() -> None:
    h = Harness(world_size=3, reply_rank=0)
    fut = h.submit("rpc-1")
    h.handle(cd("rpc-1", ["o1"], rank=0))
    assert not fut.done(), "rank 0's COMPUTE_DONE alone must not resolve the call"
    h.handle(RpcResult("rpc-1", None, rank=2))
    assert not fut.done()
    h.handle(RpcResult("rpc-1", None, rank=1))
    assert fut.result(timeout=0)[0].async_output_id == "o1"


@pytest.mark.parametrize("order", ["cd-first", "fail-first"])
def test_f12_any_rank_failure_fails_the_call_and_drops_its_outputs(order: str) -> None:
    h = Harness(world_size=2, reply_rank=0)
    fut = h.submit("rpc-1")
    msgs = [cd("rpc-1", ["o1", "o2"], rank=0), RpcResult.failed("rpc-1", BOOM, rank=1)]
    if order == "fail-first":
        msgs.reverse()
    h.output("o2")  # early arrival of one output
    for m in msgs:
        h.handle(m)
    err = exc_of(fut)
    assert isinstance(err, RpcFailed) and set(err.failures) == {1} and err.failures[1] == BOOM
    assert "rank(s) [1]" in str(err)
    assert h.released == ["payload-o2"], "the early output was released at once"
    assert h.registry.state_of("o1") is S.DROPPING
    h.output("o1")
    assert h.released == ["payload-o2", "payload-o1"]
    assert len(h.registry) == 0


def test_reply_rank_failure_fails_the_call() -> None:
    h = Harness(world_size=2, reply_rank=1)
    fut = h.submit("rpc-1")
    h.handle(RpcResult("rpc-1", None, rank=0))
    h.handle(RpcResult.failed("rpc-1", BOOM, rank=1))
    err = exc_of(fut)
    assert isinstance(err, RpcFailed) and set(err.failures) == {1}


def test_every_failed_rank_is_named() -> None:
    h = Harness(world_size=3)
    fut = h.submit("rpc-1")
    h.handle(RpcResult.failed("rpc-1", BOOM, rank=2))
    h.handle(RpcResult.failed("rpc-1", Failure("OSError", "x"), rank=0))
    h.handle(RpcResult("rpc-1", None, rank=1))
    err = exc_of(fut)
    assert isinstance(err, RpcFailed) and sorted(err.failures) == [0, 2]


def test_compute_done_from_a_non_reply_rank_fails_the_call() -> None:
    h = Harness(world_size=2, reply_rank=0)
    fut = h.submit("rpc-1")
    h.handle(cd("rpc-1", ["stray"], rank=1))
    assert h.d.counters["protocol_errors"] == 1
    assert h.registry.state_of("stray") is S.DROPPING, "what the wrong rank announced is dropped"
    h.handle(cd("rpc-1", ["o1"], rank=0))
    err = exc_of(fut)
    assert isinstance(err, RpcFailed) and err.failures[1].type_name == "ProtocolError"
    h.output("o1")
    h.output("stray", rank=1)
    assert sorted(h.released) == ["payload-o1", "payload-stray"]
    assert len(h.registry) == 0


def test_duplicate_answer_is_a_protocol_error_and_ignored() -> None:
    h = Harness(world_size=2)
    fut = h.submit("rpc-1")
    h.handle(RpcResult("rpc-1", None, rank=1))
    h.handle(RpcResult.failed("rpc-1", BOOM, rank=1))  # a second answer from rank 1
    assert h.d.counters["protocol_errors"] == 1 and not fut.done()
    h.handle(cd("rpc-1", ["o1"], rank=0))
    assert fut.result(timeout=0)[0].async_output_id == "o1", "the first answer counts"


def test_duplicate_compute_done_from_the_reply_rank_is_ignored() -> None:
    h = Harness(world_size=2)
    fut = h.submit("rpc-1")
    h.handle(cd("rpc-1", ["o1"], rank=0))
    h.handle(cd("rpc-1", ["o1"], rank=0))
    assert h.d.counters["protocol_errors"] == 1 and h.registry.stats.protocol_errors == 1
    assert h.registry.state_of("o1") is S.COMPUTE_DONE, "the first announcement stands"
    h.handle(RpcResult("rpc-1", None, rank=1))
    assert fut.result(timeout=0)[0].async_output_id == "o1"


def test_answer_from_a_rank_outside_the_world_is_a_protocol_error() -> None:
    h = Harness(world_size=1)
    fut = h.submit("rpc-1")
    h.handle(RpcResult("rpc-1", None, rank=5))
    assert h.d.counters["protocol_errors"] == 1 and not fut.done()
    h.handle(cd("rpc-1", ["o1"]))
    assert fut.done()


def test_reply_rank_answering_without_compute_done_is_a_protocol_error() -> None:
    h = Harness()
    fut = h.submit("rpc-1")
    h.handle(RpcResult("rpc-1", "a plain result", rank=0))
    assert isinstance(exc_of(fut), ProtocolError)


def test_compute_done_naming_another_calls_id_fails_the_call_and_spares_the_other() -> None:
    """A COMPUTE_DONE that names an id already announced by another call.

    It used to hand that id out as the second call's own, and on the second call's
    failure drop it: the first call's output.
    """
    h = Harness(world_size=2)
    first = h.submit("rpc-1")
    h.handle(cd("rpc-1", ["o1"], rank=0))
    h.handle(RpcResult("rpc-1", None, rank=1))
    assert first.result(timeout=0)[0].async_output_id == "o1"
    waiter = h.registry.wait("o1")

    second = h.submit("rpc-2")
    h.handle(cd("rpc-2", ["o1", "o2"], rank=0))  # a buggy worker reuses o1
    h.handle(RpcResult.failed("rpc-2", BOOM, rank=1))
    err = exc_of(second)
    assert isinstance(err, RpcFailed) and set(err.failures) == {0, 1}
    assert err.failures[0].type_name == "ProtocolError"
    assert not waiter.done() and h.registry.state_of("o1") is S.COMPUTE_DONE, "o1 still belongs to rpc-1"
    assert h.registry.state_of("o2") is S.DROPPING
    h.output("o1")
    h.settle()
    assert waiter.result(timeout=0).output == "payload-o1"


def test_compute_done_naming_another_calls_id_fails_even_a_successful_call() -> None:
    h = Harness()
    h.submit("rpc-1")
    h.handle(cd("rpc-1", ["o1"]))
    second = h.submit("rpc-2")
    h.handle(cd("rpc-2", ["o1"]))
    assert isinstance(exc_of(second), RpcFailed), "the call must never hand out another call's id"


def test_cancelled_rpc_drops_its_outputs() -> None:
    h = Harness(world_size=2)
    fut = h.submit("rpc-1")
    assert fut.cancel()
    h.handle(cd("rpc-1", ["o1"], rank=0))
    h.handle(RpcResult("rpc-1", None, rank=1))
    assert fut.cancelled() and h.registry.state_of("o1") is S.DROPPING
    h.output("o1")
    assert h.released == ["payload-o1"] and len(h.registry) == 0 and len(h.d) == 0


# --------------------------------------------------------------------------- deadlines (F4)


def test_compute_timeout_fails_the_call_naming_the_missing_ranks() -> None:
    h = Harness(world_size=3, compute_timeout=10.0)
    fut = h.submit("rpc-1")
    assert h.d.next_deadline() == 10.0
    h.handle(cd("rpc-1", ["o1"], rank=0))
    h.handle(RpcResult("rpc-1", None, rank=2))
    h.expire(9.99)
    assert not fut.done()
    h.expire(10.0)
    err = exc_of(fut)
    assert isinstance(err, ComputeTimeout) and isinstance(err, TimeoutError) and "[1]" in str(err)
    assert h.d.counters["compute_timeouts"] == 1 and len(h.d) == 0
    assert h.registry.state_of("o1") is S.DROPPING, "what was announced has no owner now"
    # Late answers: the output is released, the empty RPC_RESULT is discarded (nobody reads it).
    late = RpcResult("rpc-1", None, rank=1)
    assert h.handle(late) is None and h.d.counters["late_rpc_results"] == 1
    h.output("o1")
    assert h.released == ["payload-o1"] and len(h.registry) == 0


def test_late_answers_of_ended_execute_calls_are_not_kept_for_path_2() -> None:
    """Issue 17, defect 15: each execute call ended by its compute deadline gets its
    ranks' late answers (the worker's RequestAborted once the cancel reached the forward,
    or a non-reply rank's empty RPC_RESULT).  Routed to the synchronous buffer, they
    stayed there until a collective_rpc, which an engine may never make: two messages
    per timed-out call, without bound.  The dispatcher discards them.  A late answer that
    carries a result, and path 2's answers, still go to the caller."""
    h = Harness(world_size=2, compute_timeout=1.0)
    aborted = Failure("RequestAborted", "cancelled while the forward ran", "Traceback ...")
    routed = []
    for i in range(100):
        fut = h.submit(f"rpc-{i}")
        h.expire(h.now + 1.0)
        assert isinstance(exc_of(fut), ComputeTimeout)
        routed += [
            h.handle(RpcResult.failed(f"rpc-{i}", aborted, rank=0)),
            h.handle(RpcResult(f"rpc-{i}", None, rank=1)),
        ]
    assert routed == [None] * 200 and h.d.counters["late_rpc_results"] == 200 and len(h.d) == 0
    assert h.d.counters["protocol_errors"] == 0
    fut = h.submit("rpc-x")
    h.expire(h.now + 1.0)
    with_result = RpcResult("rpc-x", {"step": 3}, rank=1)
    assert h.handle(with_result) == with_result, "a result goes to the caller, which gives back what it holds"
    collective = RpcResult("collective-1", None, rank=0)
    assert h.handle(collective) == collective and h.d.counters["late_rpc_results"] == 200


def test_late_compute_done_after_a_timeout_is_dropped() -> None:
    h = Harness(compute_timeout=1.0)
    fut = h.submit("rpc-1")
    h.output("o1")  # the packer was faster than the main thread
    h.expire(5.0)
    assert isinstance(exc_of(fut), ComputeTimeout)
    assert h.handle(cd("rpc-1", ["o1"])) is None
    assert h.d.counters["orphan_compute_done"] == 1
    assert h.released == ["payload-o1"] and len(h.registry) == 0


def test_submit_timeout_overrides_the_default() -> None:
    h = Harness(compute_timeout=100.0)
    h.submit("a", timeout=2.0)
    h.submit("b")
    h.submit("c", method="execute_model")
    assert h.d.next_deadline() == 2.0


def test_no_compute_timeout_means_no_deadline() -> None:
    h = Harness()
    fut = h.submit("rpc-1")
    assert h.d.next_deadline() is None
    h.expire(1e12)
    assert not fut.done()


def test_next_deadline_includes_the_registry() -> None:
    h = Harness(compute_timeout=50.0, output_timeout=3.0)
    h.submit("rpc-1")
    h.now = 1.0
    h.submit("rpc-2")
    h.handle(cd("rpc-2", ["o1"]))
    assert h.d.next_deadline() == 4.0
    h.expire(4.0)
    assert h.registry.stats.timeouts == 1
    assert h.d.next_deadline() == 50.0


def test_slow_forward_does_not_throw_away_the_finished_output() -> None:
    """F4: the output deadline is measured from COMPUTE_DONE, not from the submit."""
    h = Harness(compute_timeout=100.0, output_timeout=5.0)
    fut = h.submit("rpc-1")
    h.now = 60.0  # a forward much longer than the output deadline
    h.handle(cd("rpc-1", ["o1"]))
    (ro,) = fut.result(timeout=0)
    waiter = h.registry.wait(ro.async_output_id or "")
    h.expire(64.0)
    h.output("o1")
    assert waiter.result(timeout=0).output == "payload-o1"


# --------------------------------------------------------------------------- path 2 and routing


def test_rpc_result_of_an_unknown_call_goes_to_the_sync_buffer() -> None:
    h = Harness(world_size=2)
    msg = RpcResult("collective-7", {"ok": True}, rank=1)
    assert h.handle(msg) == msg
    failed = RpcResult.failed("collective-7", BOOM, rank=0)
    assert h.handle(failed) == failed
    assert h.d.counters["protocol_errors"] == 0


def test_output_ready_goes_to_the_registry() -> None:
    h = Harness()
    assert h.handle(OutputReady.failed("o1", BOOM)) is None
    assert h.registry.state_of("o1") is S.EARLY_FAILED


def test_orphan_compute_done_is_dropped() -> None:
    h = Harness()
    h.handle(cd("nobody", ["o1"]))
    assert h.d.counters["orphan_compute_done"] == 1 and h.registry.state_of("o1") is S.DROPPING
    h.output("o1")
    assert len(h.registry) == 0


def _recv_known(h: Harness) -> list[object]:
    return [e.fields.get("known") for e in h.tracer.snapshot() if e.action == "PumpRecv"]


def test_rpc_result_of_a_call_never_made_is_a_counted_protocol_error() -> None:
    """With ``known_call`` (the executor's: every rpc id it issued), an answer of any other
    call is refused, counted and never buffered (M3); a late answer of an issued one is."""
    h = Harness(known_call=lambda rpc_id: rpc_id.startswith("mine-"))
    assert h.handle(RpcResult("theirs-1", "x")) is None
    late = RpcResult("mine-7", "x")
    assert h.handle(late) == late
    assert h.d.counters["unknown_call_rpc_result"] == 1 and h.d.counters["protocol_errors"] == 1
    assert "theirs-1" in str(h.registry.errors[-1]) and isinstance(h.registry.errors[-1], ProtocolError)
    assert _recv_known(h) == [False, True], "the trace says which message belongs to no call"


def test_compute_done_of_a_call_never_made_is_counted_and_its_records_given_up() -> None:
    """M3 and M6: counted as a protocol error; its DROPPING record ends at now +
    compute_timeout (before its output deadline), and the tombstone swallows a late
    OUTPUT_READY; a COMPUTE_DONE of a call that ended is late, not an error."""
    h = Harness(compute_timeout=2.0, output_timeout=10.0)
    h.submit("ended")
    h.expire(2.0)  # "ended" timed out
    h.handle(cd("ended", ["late-1"]))
    h.handle(cd("never", ["g1"]))
    assert h.d.counters["unknown_call_compute_done"] == 1 and h.d.counters["protocol_errors"] == 1
    assert h.d.counters["orphan_compute_done"] == 2
    assert _recv_known(h) == [True, False]
    assert h.registry.state_of("g1") is S.DROPPING and h.registry.state_of("late-1") is S.DROPPING
    h.expire(3.9)
    assert h.registry.state_of("g1") is S.DROPPING
    h.expire(4.0)  # now + compute_timeout; "late-1" keeps waiting: its worker packs it
    assert h.registry.state_of("g1") is None and h.registry.stats.orphan_drops_expired == 1
    assert h.registry.state_of("late-1") is S.DROPPING
    h.output("g1")  # swallowed, its payload released
    assert h.released == ["payload-g1"] and h.d.counters["protocol_errors"] == 1


def test_reply_rank_answering_without_compute_done_is_counted_when_it_answers() -> None:
    """Counted on arrival (M3), also when another rank's failure fails the call (RpcFailed)."""
    h = Harness(world_size=2)
    fut = h.submit("rpc-1")
    h.handle(RpcResult("rpc-1", None, rank=0))
    assert h.d.counters["answers_without_compute_done"] == 1 and h.d.counters["protocol_errors"] == 1
    h.handle(RpcResult.failed("rpc-1", BOOM, rank=1))
    assert isinstance(exc_of(fut), RpcFailed)
    assert h.d.counters["answers_without_compute_done"] == 1 and h.d.counters["protocol_errors"] == 1


def test_submit_validates_its_arguments() -> None:
    h = Harness()
    with pytest.raises(ValueError):
        h.submit("rpc-1", method="load_weights")
    h.submit("rpc-1")
    with pytest.raises(ValueError):
        h.submit("rpc-1")
    with pytest.raises(ValueError):
        Dispatcher(OutputRegistry(), world_size=2, reply_rank=2)


def test_forget_fails_a_call_that_was_never_sent() -> None:
    h = Harness()
    fut = h.submit("rpc-1")
    err = ExecutorShutdown("cannot send execute_model_batch to the workers: broken pipe")
    h.d.forget("rpc-1", err)
    h.d.forget("rpc-1", err)  # idempotent
    h.settle()
    assert len(h.d) == 0 and exc_of(fut) is err
    assert h.handle(cd("rpc-1", ["o1"])) is None and h.d.counters["orphan_compute_done"] == 1
    assert h.registry.state_of("o1") is RequestState.DROPPING  # the orphan's ids are dropped on arrival
    assert [e.action for e in h.tracer.snapshot()].count("RpcResolve") == 1


def test_forget_drops_what_the_ranks_that_got_it_announced() -> None:
    """Rank 0 got the broadcast and answered before the send to rank 1 failed."""
    h = Harness(world_size=2)
    fut = h.submit("rpc-1")
    h.handle(cd("rpc-1", ["o1", "o2"]))
    h.output("o1")
    assert h.registry.state_of("o1") is RequestState.READY
    h.d.forget("rpc-1", ExecutorShutdown("cannot send to rank 1"))
    h.settle()
    assert isinstance(exc_of(fut), ExecutorShutdown)
    assert len(h.registry) == 1 and h.registry.state_of("o2") is RequestState.DROPPING
    assert h.released == ["payload-o1"]  # nobody owns the ids any more: dropped, released
    h.output("o2")
    assert len(h.registry) == 0 and h.released == ["payload-o1", "payload-o2"]
    assert h.d.take_worker_drops() == ["o2"]  # its packer may skip it


# --------------------------------------------------------------------------- shutdown


def test_fail_all_fails_every_call_and_every_output() -> None:
    h = Harness(world_size=2)
    f1 = h.submit("rpc-1")
    f2 = h.submit("rpc-2")
    h.handle(cd("rpc-2", ["o2"], rank=0))
    h.handle(RpcResult("rpc-2", None, rank=1))
    waiter = h.registry.wait("o2")
    h.d.fail_all(lambda oid: ExecutorShutdown("stopping", output_id=oid), close=True)
    h.settle()
    assert isinstance(exc_of(f1), ExecutorShutdown)
    assert f2.done() and not f2.exception(timeout=0)
    assert isinstance(exc_of(waiter), ExecutorShutdown)
    assert len(h.d) == 0 and len(h.registry) == 0 and h.registry.closed


def test_submit_after_close_fails_at_once() -> None:
    """After the pump stopped nothing will resolve a new call: it must not wait forever."""
    h = Harness()
    h.d.fail_all(lambda oid: ExecutorShutdown("the result channel closed", output_id=oid), close=True)
    fut = h.submit("rpc-1")
    assert isinstance(exc_of(fut), ExecutorShutdown)
    assert len(h.d) == 0


def test_fail_all_without_close_keeps_working() -> None:
    h = Harness()
    f1 = h.submit("rpc-1")
    h.d.fail_all(lambda oid: WorkerDied(0, -9, output_id=oid), outcome="worker_died")
    h.settle()
    assert isinstance(exc_of(f1), WorkerDied)
    f2 = h.submit("rpc-2")
    h.handle(cd("rpc-2", ["o1"]))
    assert f2.result(timeout=0)[0].async_output_id == "o1"


def test_drop_of_an_announced_output_fails_its_waiter() -> None:
    h = Harness()
    h.submit("rpc-1")
    h.handle(cd("rpc-1", ["o1"]))
    w = h.registry.wait("o1")
    h.registry.drop("o1")
    h.settle()
    assert isinstance(exc_of(w), OutputDropped)


# --------------------------------------------------------------------------- trace


def test_trace_names_the_rpc_actions() -> None:
    h = Harness(world_size=2)
    h.submit("rpc-1")
    h.handle(cd("rpc-1", ["o1"], rank=0))
    h.handle(RpcResult("rpc-1", None, rank=1))
    actions = [e.action for e in h.tracer.snapshot()]
    assert actions[0] == "RpcSubmit"
    assert actions.count("PumpRecv") == 2 and actions.count("RpcAnswer") == 2
    assert actions[-1] == "RpcResolve"
    resolve = h.tracer.snapshot()[-1]
    assert resolve.fields == {"rpc_id": "rpc-1", "outcome": "ok"}
    submit = h.tracer.snapshot()[0]
    assert submit.fields["ranks"] == "0,1" and submit.fields["method"] == "execute_model_batch"


def test_output_deadline_is_measured_from_the_calls_resolution() -> None:
    """F4 with several ranks: the reply rank's COMPUTE_DONE can precede the last answer."""
    h = Harness(world_size=2, output_timeout=10.0)
    fut = h.submit("r1", "execute_model")
    h.handle(ComputeDone("r1", ("o1",), ("q1",), rank=0))
    h.now = 8.0  # the other rank answers late
    h.handle(RpcResult("r1", None, rank=1))
    assert fut.result(timeout=0)[0].async_output_id == "o1"
    h.d.expire(12.0)  # 12 s after COMPUTE_DONE, 4 s after the engine learned the id
    h.settle()
    assert h.registry.state_of("o1") is S.COMPUTE_DONE
    h.d.expire(18.5)
    h.settle()
    assert h.registry.state_of("o1") is S.RELEASING


def test_dropped_outputs_still_being_packed_are_reported_for_the_workers() -> None:
    """A failed call drops what its reply rank announced; the workers hear of it (F15)."""
    h = Harness(world_size=2)
    fut = h.submit("r1", "execute_model_batch")
    h.handle(OutputReady("o1", DiffusionOutput("q1", output="x"), rank=0))  # o1 arrived early
    h.handle(ComputeDone("r1", ("o1", "o2"), ("q1", "q2"), rank=0))
    h.handle(RpcResult.failed("r1", BOOM, rank=1))
    with pytest.raises(RpcFailed):
        fut.result(timeout=0)
    # o1 is gone already (its output was here); only o2 may still be in a packer.
    assert h.d.take_worker_drops() == ["o2"]
    assert h.d.take_worker_drops() == []


# ------------------------------------------------------------------ defect 3: a COMPUTE_DONE that was never sent

SEND_FAILED = Failure("ChannelFull", "cannot send COMPUTE_DONE", "Traceback ...")


@pytest.mark.parametrize("order", ["outputs first", "failure first"])
def test_failed_compute_done_send_drops_what_the_packer_ships(order: str) -> None:
    """Defect 3: the reply rank handed its outputs to the packer, then its COMPUTE_DONE put raised.

    Its failed answer names the ids it had handed over (``compute_failed``): the dispatcher
    registers them and drops them with the failed call, so an output that arrived early
    is released at once and one that arrives later is released on arrival.  Before the
    fix the failure named nothing and an early output was held for nobody until shutdown
    (tla/buggy/SendFailKeepsShipped.cfg: NoOrphanPayload).
    """
    h = Harness(world_size=2)
    fut = h.submit("r1")
    if order == "outputs first":
        h.output("o1")
        assert h.registry.state_of("o1") is S.EARLY_READY
    h.handle(RpcResult.compute_failed("r1", ("o1", "o2"), SEND_FAILED, rank=0))
    assert not fut.done(), "F12: the call still waits for rank 1"
    h.handle(RpcResult("r1", None, rank=1))
    err = exc_of(fut)
    assert isinstance(err, RpcFailed) and err.failures[0].type_name == "ChannelFull"
    if order == "failure first":
        h.output("o1")
    assert h.released == ["payload-o1"], "released at once, not held for nobody"
    assert h.registry.state_of("o2") is S.DROPPING
    h.output("o2")
    assert h.released == ["payload-o1", "payload-o2"]
    assert len(h.registry) == 0 and len(h.d) == 0
    assert h.registry.stats.protocol_errors == 0 and h.d.counters["protocol_errors"] == 0
    assert h.registry.stats.orphaned == 0, "the precise fix, not the deadline backstop"


def test_failed_compute_done_of_a_call_that_timed_out_is_an_orphan() -> None:
    h = Harness(compute_timeout=8.0)
    fut = h.submit("r1")
    h.output("o1")
    h.expire(8.0)
    assert isinstance(exc_of(fut), ComputeTimeout)
    h.handle(RpcResult.compute_failed("r1", ("o1",), SEND_FAILED, rank=0))
    assert h.released == ["payload-o1"] and len(h.registry) == 0
    assert h.d.counters["orphan_compute_done"] == 1


def test_early_output_whose_compute_done_never_comes_is_released_at_its_deadline() -> None:
    """Defect 3's backstop: every record is bounded.

    A record an early OUTPUT_READY created waits for its COMPUTE_DONE until the
    compute deadline of every call pending at its arrival (its own call has ended by
    then), at least ``compute_timeout`` from the arrival; then it is force-released,
    counted (``stats.orphaned``) and typed (``OutputOrphaned``).  A COMPUTE_DONE that
    still comes is swallowed by the tombstone.
    """
    h = Harness(compute_timeout=8.0)
    fut = h.submit("r1")  # compute deadline 8
    h.now = 1.0
    h.output("o1")  # early: deadline max(1 + 8, 8) = 9
    assert h.registry.state_of("o1") is S.EARLY_READY
    h.expire(8.0)
    assert isinstance(exc_of(fut), ComputeTimeout)
    assert h.registry.state_of("o1") is S.EARLY_READY and h.released == [], "not before its deadline"
    assert h.d.next_deadline() == 9.0
    h.expire(9.0)
    assert h.released == ["payload-o1"] and len(h.registry) == 0
    assert h.registry.stats.orphaned == 1 and h.registry.stats.timeouts == 0
    (orphan,) = h.registry.orphans
    assert isinstance(orphan, OutputOrphaned) and orphan.output_id == "o1"
    h.handle(cd("r1", ["o1"]))  # the COMPUTE_DONE after all: expected by the tombstone
    assert h.registry.stats.protocol_errors == 0 and len(h.registry) == 0 and h.released == ["payload-o1"]


def test_early_deadline_waits_for_every_pending_call() -> None:
    """An early output may belong to any pending call: its deadline is no earlier than theirs."""
    h = Harness(compute_timeout=8.0)
    h.submit("r1", timeout=30.0)
    h.now = 1.0
    h.output("o1")
    h.expire(20.0)
    assert h.registry.state_of("o1") is S.EARLY_READY, "r1 may still announce it"
    h.handle(cd("r1", ["o1"]))
    assert h.registry.state_of("o1") is S.READY and h.registry.stats.orphaned == 0


def test_no_compute_timeout_means_no_early_deadline() -> None:
    h = Harness()
    h.submit("r1")
    h.output("o1")
    assert h.d.next_deadline() is None
