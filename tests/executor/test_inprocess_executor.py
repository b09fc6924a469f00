"""InProcessExecutor end to end: real pump, packer and worker threads, the real (pickling) channel.

Where a test needs a pack function that raises or blocks, it builds the same wiring with
``HarnessExecutor`` (tests/_executor_harness.py) instead, so every path below runs the
real WorkerLoop, Packer, ResultPump, Dispatcher and OutputRegistry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

from helpers.executor_harness import (
    GATES,
    RELAXED,
    TIMEOUT,
    HarnessExecutor,
    ToyWorker,
    exc_of,
    expected_image,
    gate_name,
    make_toy,
    opened_gates_on_exit,
    req,
    wait_until,
)
from omni_async.core.config import Deadlines
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OutputAlreadyClaimed,
    OutputDropped,
    OutputError,
    OutputTimeout,
    RemoteError,
    RpcFailed,
    UsageError,
)
from omni_async.core.messages import CancelMessage, ComputeDone, DiffusionOutput, DiffusionRequest, RpcRequest
from omni_async.core.states import RequestState
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.link import RankEvents, RankLink
from omni_async.executor.store import InlineStore
from omni_async.transport.channel import InProcessChannel, ResultSender
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.verify.recorder import ListTracer
from omni_async.worker.packer import Packer


def quiet(ex: DiffusionExecutor) -> bool:
    m = ex.metrics()
    return m.pending_outputs == 0 and m.pending_rpcs == 0


E = TypeVar("E", bound=DiffusionExecutor)


def _making(build: Callable[..., E]) -> Iterator[Callable[..., E]]:
    """A factory fixture's body: executors built in the test are shut down after it."""
    made: list[DiffusionExecutor] = []

    def make(**kw: Any) -> E:
        ex = build(**kw)
        made.append(ex)
        return ex

    with opened_gates_on_exit():
        yield make
    for ex in made:
        ex.shutdown()


@pytest.fixture
def make_executor() -> Iterator[Callable[..., InProcessExecutor]]:
    yield from _making(lambda **kw: InProcessExecutor(make_toy, **{"deadlines": RELAXED, **kw}))


@pytest.fixture
def make_harness() -> Iterator[Callable[..., HarnessExecutor]]:
    yield from _making(HarnessExecutor)


# --------------------------------------------------------------------------- request mode


def test_request_mode_single_request(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    ro = ex.execute_request(req("r1", value=3.0))
    assert ro.request_id == "r1" and ro.result is None and ro.async_output_id
    out = ex.wait_output_ready(ro.async_output_id).result(timeout=TIMEOUT)
    assert out.request_id == "r1" and out.async_output_id == ro.async_output_id
    assert torch.equal(out.output["image"], expected_image(3.0))
    assert out.output["rank"] == 0
    m = ex.metrics()
    assert m.delivered == 1 and m.pending_outputs == 0 and m.protocol_errors == 0
    assert m.dispatch_errors == 0


def test_request_mode_batch_each_request_gets_its_own_output(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    ros = ex.execute_batch([req(f"b{i}", value=float(i)) for i in range(4)])
    assert [ro.request_id for ro in ros] == ["b0", "b1", "b2", "b3"]
    ids = [ro.async_output_id for ro in ros]
    assert len(set(ids)) == 4 and all(ids)
    for i, ro in reversed(list(enumerate(ros))):
        assert ro.async_output_id is not None
        out = ex.wait_output_ready(ro.async_output_id).result(timeout=TIMEOUT)
        assert out.request_id == f"b{i}" and torch.equal(out.output["image"], expected_image(float(i)))
    assert quiet(ex)


def test_request_mode_many_requests_in_flight(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor(max_outputs_in_flight=2)
    handles = [ex.submit(req(f"r{i}", value=float(i))) for i in range(30)]
    for i, h in enumerate(handles):
        assert torch.equal(h.output.result(timeout=TIMEOUT).output["image"], expected_image(float(i)))
    assert ex.metrics().delivered == 30 and quiet(ex)
    assert ex.packers[0].metrics.packed == 30


def test_execute_request_blocks_until_compute_done(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    ro = ex.execute_request(req("r1"))
    assert ro.async_output_id is not None
    assert ex.wait_output_ready(ro.async_output_id).result(timeout=TIMEOUT).request_id == "r1"


def test_an_output_id_is_delivered_to_exactly_one_waiter(make_executor: Callable[..., InProcessExecutor]) -> None:
    """A second wait_output_ready on an id fails at once with a typed error, before and
    after the first waiter got the output (never "unknown id", never a second delivery)."""
    ex = make_executor()
    ro = ex.execute_request(req("r1", value=2.0))
    oid = ro.async_output_id
    assert oid is not None
    first = ex.wait_output_ready(oid)
    err = exc_of(ex.wait_output_ready(oid))
    assert isinstance(err, OutputAlreadyClaimed) and isinstance(err, UsageError) and err.output_id == oid
    assert torch.equal(first.result(timeout=TIMEOUT).output["image"], expected_image(2.0))
    err = exc_of(ex.wait_output_ready(oid))
    assert isinstance(err, OutputAlreadyClaimed) and "delivered" in str(err)
    # An id never announced is still "unknown", and does not count as claimed.
    assert not isinstance(exc_of(ex.wait_output_ready("nope")), OutputAlreadyClaimed)
    assert not isinstance(exc_of(ex.wait_output_ready("nope")), OutputAlreadyClaimed)
    assert ex.metrics().delivered == 1 and quiet(ex)


def test_empty_batch_is_a_usage_error(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    with pytest.raises(UsageError):
        ex.submit_batch([])


# --------------------------------------------------------------------------- step mode


def test_step_mode_returns_outputs_directly(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor(step_mode=True, world_size=2)
    ro = ex.execute_request(req("s1", value=5.0))
    assert ro.async_output_id is None and ro.result is not None
    assert torch.equal(ro.result.output["image"], expected_image(5.0)) and ro.result.output["rank"] == 0
    ros = ex.execute_batch([req("s2"), req("s3")])
    assert [r.request_id for r in ros] == ["s2", "s3"] and all(r.result is not None for r in ros)
    with pytest.raises(UsageError):
        ex.submit(req("s4"))
    with pytest.raises(RpcFailed) as info:
        ex.execute_request(req("s5", fail_on=[1]))
    assert set(info.value.failures) == {1}
    assert quiet(ex) and ex.metrics().pending_outputs == 0


# --------------------------------------------------------------------------- several ranks (F12)


@pytest.mark.parametrize("reply_rank", [0, 2])
def test_several_ranks_only_the_reply_rank_ships(
    make_executor: Callable[..., InProcessExecutor], reply_rank: int
) -> None:
    ex = make_executor(world_size=3, reply_rank=reply_rank)
    ro = ex.execute_request(req("r1"))
    out = ex.wait_output_ready(ro.async_output_id or "").result(timeout=TIMEOUT)
    assert out.output["rank"] == reply_rank
    assert [p.metrics.packed for p in ex.packers] == [1 if r == reply_rank else 0 for r in range(3)]
    assert quiet(ex)


@pytest.mark.parametrize("failing", [[1], [0], [0, 2]])
def test_several_ranks_one_failing_fails_the_call(
    make_executor: Callable[..., InProcessExecutor], failing: list[int]
) -> None:
    ex = make_executor(world_size=3)
    handles = ex.submit_batch([req("r1", fail_on=failing), req("r2", fail_on=failing)])
    err = exc_of(handles[0].computed)
    assert exc_of(handles[1].computed) is err and all(exc_of(h.output) is err for h in handles)
    assert isinstance(err, RpcFailed) and sorted(err.failures) == failing
    for h in handles:  # every member fails with the call's error, its output too
        assert exc_of(h.computed) is err and exc_of(h.output) is err
    for rank in failing:
        assert err.failures[rank].type_name == "ValueError"
        assert f"failed on rank {rank}" in err.failures[rank].message
    if 0 not in failing:
        # The reply rank's outputs were announced and then dropped: they are released on arrival.
        wait_until(lambda: ex.metrics().released == 2)
    wait_until(lambda: quiet(ex))
    assert ex.metrics().delivered == 0


# --------------------------------------------------------------------------- failures (F2)


def test_exception_in_forward_reaches_the_caller_typed(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    err = exc_of(ex.submit(req("r1", fail_on=[0])).computed)
    assert isinstance(err, RpcFailed)
    f = err.failures[0]
    assert f.type_name == "ValueError" and "forward of r1 failed" in f.message
    assert "_forward" in f.traceback and "raise ValueError" in f.traceback
    # The executor keeps working.
    ro = ex.execute_request(req("r2"))
    assert ex.wait_output_ready(ro.async_output_id or "").result(timeout=TIMEOUT).request_id == "r2"


def _raising_pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
    raise MemoryError(f"no segment for {output.request_id}")


def test_exception_in_packing_fails_the_waiter_at_once(make_harness: Callable[..., HarnessExecutor]) -> None:
    ex = make_harness(make_packer=lambda rank, ch: Packer(rank, ch, pack=_raising_pack))
    ro = ex.execute_request(req("r1"))
    t0 = time.monotonic()
    err = exc_of(ex.wait_output_ready(ro.async_output_id or ""))
    assert time.monotonic() - t0 < 5.0, "not a 60 s output timeout"
    assert isinstance(err, RemoteError) and err.output_id == ro.async_output_id and err.rank == 0
    assert err.failure.type_name == "MemoryError" and "no segment for r1" in err.failure.message
    assert "_raising_pack" in err.failure.traceback
    assert ex.packers[0].metrics.failed == 1
    assert quiet(ex)


def test_unpicklable_output_fails_the_waiter(make_executor: Callable[..., InProcessExecutor]) -> None:
    """The channel pickles in the packer thread: an output that cannot travel becomes a typed failure."""

    class Local:  # a local class cannot be pickled
        pass

    class LocalWorker(ToyWorker):
        def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
            return DiffusionOutput(request.request_id, {"bad": Local()})

    ex = InProcessExecutor(LocalWorker, deadlines=RELAXED)
    try:
        ro = ex.execute_request(req("r1"))
        err = exc_of(ex.wait_output_ready(ro.async_output_id or ""))
        assert isinstance(err, RemoteError) and err.failure.type_name == "UnpicklableMessage"
    finally:
        ex.shutdown()


# --------------------------------------------------------------------------- back-pressure and drain


class SignallingPacker(Packer):
    """Sets ``waiting`` when the main thread is about to wait for room (no private state read)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_outputs = int(kwargs.get("max_outputs", 4))
        self.waiting = threading.Event()

    def wait_for_room(self, count: int = 1, nbytes: int = 0, timeout: float | None = None) -> bool:
        if self.metrics.in_flight_outputs + count > self.max_outputs:
            self.waiting.set()
        return super().wait_for_room(count, nbytes, timeout)


def test_backpressure_waits_for_the_packer(make_executor: Callable[..., InProcessExecutor]) -> None:
    """max_outputs_in_flight=1 with a slow pack: the next forward waits, and the metrics show it."""
    made: list[SignallingPacker] = []

    def make_packer(rank: int, ch: ResultSender) -> Packer:
        p = SignallingPacker(rank, ch, max_outputs=1)
        made.append(p)
        return p

    with opened_gates_on_exit():
        ex = HarnessExecutor(make_packer=make_packer)
        try:
            gate = gate_name()
            first = ex.execute_request(req("r1", pickle_gate=gate))
            assert GATES.wait_entered(gate), "the packer is packing r1"
            second = ex.submit(req("r2"))
            assert made[0].waiting.wait(TIMEOUT), "the worker waits for room before the forward"
            assert not second.computed.done() and ex.loops[0].worker.forwards == 1  # type: ignore[attr-defined]
            GATES.open(gate)
            assert ex.wait_output_ready(first.async_output_id or "").result(timeout=TIMEOUT)
            assert second.output.result(timeout=TIMEOUT)
            m = made[0].metrics
            assert m.backpressure_waits == 1 and m.backpressure_seconds > 0
            assert m.in_flight_outputs == 0 and m.packed == 2
        finally:
            ex.shutdown()


def test_drain_waits_for_in_flight_packs(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    gate = gate_name()
    ro = ex.execute_request(req("r1", pickle_gate=gate))
    assert GATES.wait_entered(gate)
    assert not ex.packers[0].drain(timeout=0.05), "a pack is in flight"
    with pytest.raises(RpcFailed) as info:
        ex.drain(timeout=0.05)
    assert info.value.failures[0].type_name == "TimeoutError"
    GATES.open(gate)
    ex.drain(timeout=TIMEOUT)
    assert ex.packers[0].drain(timeout=0) and ex.packers[0].metrics.in_flight_outputs == 0
    assert ex.wait_output_ready(ro.async_output_id or "").result(timeout=TIMEOUT).request_id == "r1"


def test_metrics_record_how_long_engines_waited_for_outputs(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    gate = gate_name()
    ro = ex.execute_request(req("r1", pickle_gate=gate))
    fut = ex.wait_output_ready(ro.async_output_id or "")
    assert GATES.wait_entered(gate)
    time.sleep(0.2)  # the engine waits on a pack held by the gate
    GATES.open(gate)
    fut.result(timeout=TIMEOUT)
    failed = ex.wait_output_ready("never-announced")  # fails at once: not a delivered output
    assert failed.exception(timeout=TIMEOUT) is not None
    wait_until(lambda: ex.metrics().output_waits == 1)  # counted by a done-callback, just after
    m = ex.metrics()
    assert m.output_waits == 1
    assert 0.2 <= m.output_wait_s_max == m.output_wait_s_total < TIMEOUT


# --------------------------------------------------------------------------- waiters, drops, consumers


def test_cancelled_waiter_output_is_released(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    gate = gate_name()
    ro = ex.execute_request(req("r1", pickle_gate=gate))
    fut = ex.wait_output_ready(ro.async_output_id or "")
    assert fut.cancel()
    GATES.open(gate)
    wait_until(lambda: ex.metrics().released == 1)
    assert quiet(ex) and ex.metrics().delivered == 0


def test_abort_outputs_returns_when_they_are_gone(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    gate = gate_name()
    ros = ex.execute_batch([req("a", pickle_gate=gate), req("b"), req("c")])
    ids = [ro.async_output_id or "" for ro in ros]
    waiter = ex.wait_output_ready(ids[1])
    assert GATES.wait_entered(gate)
    done = threading.Event()

    def abort() -> None:
        ex.abort_outputs(ids, timeout=TIMEOUT)
        done.set()

    t = threading.Thread(target=abort)
    t.start()
    assert isinstance(exc_of(waiter), OutputDropped)
    assert not done.wait(0.05), "'a' is still being packed: the abort is not acknowledged yet"
    GATES.open(gate)
    t.join(TIMEOUT)
    assert done.is_set() and quiet(ex)
    assert isinstance(exc_of(ex.wait_output_ready(ids[0])), OutputError)


def test_release_consumer_releases_unclaimed_outputs(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    mine = ex.execute_batch([req("m1"), req("m2")], consumer="stream-1")
    other = ex.execute_request(req("o1"), consumer="stream-2")
    ex.drain(timeout=TIMEOUT)
    wait_until(lambda: ex.metrics().held_payloads == 3)
    assert ex.release_consumer("stream-1") == 2
    assert ex.metrics().released == 2
    for ro in mine:
        assert isinstance(exc_of(ex.wait_output_ready(ro.async_output_id or "")), OutputError)
    assert ex.wait_output_ready(other.async_output_id or "").result(timeout=TIMEOUT).request_id == "o1"
    assert quiet(ex)


# --------------------------------------------------------------------------- collective_rpc


def test_collective_rpc_returns_answers_in_rank_order(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor(world_size=3)
    assert ex.collective_rpc("ping") == [("pong", 0), ("pong", 1), ("pong", 2)]
    assert ex.collective_rpc("fail_on", ([],), {"message": "unused"}) == [0, 1, 2]


def test_collective_rpc_errors_name_the_failed_ranks(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor(world_size=3)
    with pytest.raises(RpcFailed) as info:
        ex.collective_rpc("fail_on", ([1, 2],), {"message": "bad weights"})
    err = info.value
    assert err.method == "fail_on" and sorted(err.failures) == [1, 2]
    assert "rank(s) [1, 2]" in str(err) and "bad weights on rank 2" in str(err)
    assert err.failures[1].type_name == "RuntimeError"
    for method in ("no_such_method", "_secret"):
        with pytest.raises(RpcFailed) as info2:
            ex.collective_rpc(method)
        assert sorted(info2.value.failures) == [0, 1, 2]
        assert {f.type_name for f in info2.value.failures.values()} == {"UsageError"}
    t0 = time.monotonic()
    with pytest.raises(UsageError):
        ex.collective_rpc("drop_outputs", (["x"],))  # a control message: no answer would ever come
    assert time.monotonic() - t0 < 3.0  # refused at once, not after an RPC timeout
    assert ex.collective_rpc("ping")[0] == ("pong", 0), "still serving"


def test_collective_rpc_timeout_and_stale_answer(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor(world_size=2)
    gate = gate_name()
    with pytest.raises(ComputeTimeout):
        ex.collective_rpc("wait_gate", (gate,), timeout=0.1)
    GATES.open(gate)
    assert ex.collective_rpc("ping") == [("pong", 0), ("pong", 1)]
    assert ex.stale_sync_answers == 2, "the late answers of the timed-out call were discarded"


# --------------------------------------------------------------------------- deadlines (F4)


def test_compute_deadline_fails_a_slow_forward(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor(deadlines=Deadlines(compute_timeout=0.2, output_timeout=60.0, rpc_timeout=60.0))
    gate = gate_name()
    t0 = time.monotonic()
    err = exc_of(ex.submit(req("slow", gate=gate)).computed)
    assert isinstance(err, ComputeTimeout) and "[0]" in str(err)
    assert 0.2 <= time.monotonic() - t0 < 5.0
    assert ex.metrics().compute_timeouts == 1
    assert ex.metrics().overdue_calls == 1  # the deadline cancelled the forward; the worker has not answered
    # The forward (which never checks for cancellation) finishes late: the worker sees
    # its call cancelled and discards the output instead of announcing and packing it.
    GATES.open(gate)
    wait_until(lambda: ex.metrics().overdue_calls == 0)
    assert ex.metrics().released == 0 and ex.metrics().orphaned_outputs == 0
    assert quiet(ex)


def test_output_deadline_releases_an_unclaimed_output(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor(deadlines=Deadlines(compute_timeout=60.0, output_timeout=0.2, rpc_timeout=60.0))
    ro = ex.execute_request(req("r1"))
    wait_until(lambda: ex.metrics().timeouts == 1)
    assert ex.metrics().released == 1 and quiet(ex)
    assert isinstance(exc_of(ex.wait_output_ready(ro.async_output_id or "")), OutputError)


def test_output_deadline_fails_a_pending_waiter(make_executor: Callable[..., InProcessExecutor]) -> None:
    # The waiter must be added before the deadline passes: 0.5 s leaves a loaded CI machine room.
    ex = make_executor(deadlines=Deadlines(compute_timeout=60.0, output_timeout=0.5, rpc_timeout=60.0))
    gate = gate_name()
    ro = ex.execute_request(req("r1", pickle_gate=gate))
    err = exc_of(ex.wait_output_ready(ro.async_output_id or ""))
    assert isinstance(err, OutputTimeout) and isinstance(err, TimeoutError)
    GATES.open(gate)
    wait_until(lambda: ex.metrics().released == 1)
    assert quiet(ex)


# --------------------------------------------------------------------------- shutdown (F16)


def test_shutdown_with_work_in_flight(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    pack_gate, forward_gate = gate_name(), gate_name()
    ro = ex.execute_request(req("r1", pickle_gate=pack_gate))
    waiter = ex.wait_output_ready(ro.async_output_id or "")
    assert GATES.wait_entered(pack_gate)
    rpc = ex.submit(req("r2", gate=forward_gate)).computed
    assert GATES.wait_entered(forward_gate)
    finished = threading.Event()

    def stop() -> None:
        ex.shutdown("operator stop")
        finished.set()

    t = threading.Thread(target=stop)
    t0 = time.monotonic()
    t.start()
    for fut in (waiter, rpc):
        err = exc_of(fut)
        assert isinstance(err, ExecutorShutdown) and "operator stop" in str(err)
    assert time.monotonic() - t0 < 2.0, "every waiter fails at once, before the workers are joined"
    GATES.open(forward_gate)
    GATES.open(pack_gate)
    assert finished.wait(TIMEOUT)
    t.join(TIMEOUT)
    t1 = time.monotonic()
    ex.shutdown()
    ex.shutdown("again")
    assert time.monotonic() - t1 < 0.5, "idempotent and prompt"
    with pytest.raises(ExecutorShutdown):
        ex.check_health()
    with pytest.raises(ExecutorShutdown):
        ex.submit(req("r3"))
    assert isinstance(exc_of(ex.wait_output_ready(ro.async_output_id or "")), ExecutorShutdown)
    assert not ex.pump.healthy()
    assert all(not p.alive() for p in ex.packers)


def test_shutdown_of_an_idle_executor_is_prompt(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor(world_size=3)
    ex.execute_request(req("r1"))
    t0 = time.monotonic()
    ex.shutdown()
    assert time.monotonic() - t0 < 2.0
    assert not ex.pump.healthy() and all(not p.alive() for p in ex.packers)


def test_context_manager_shuts_down() -> None:
    with InProcessExecutor(make_toy, deadlines=RELAXED) as ex:
        ex.check_health()
        ro = ex.execute_request(req("r1"))
        assert ex.wait_output_ready(ro.async_output_id or "").result(timeout=TIMEOUT)
    with pytest.raises(ExecutorShutdown):
        ex.check_health()


def test_health_and_metrics(make_executor: Callable[..., InProcessExecutor]) -> None:
    ex = make_executor()
    ex.check_health()
    m = ex.metrics().as_dict()
    for key in (
        "pending_rpcs",
        "pending_outputs",
        "pending_waiters",
        "held_payloads",
        "delivered",
        "released",
        "timeouts",
        "protocol_errors",
        "compute_timeouts",
        "dispatch_errors",
        "messages",
    ):
        assert m[key] == 0, key


def test_trace_of_a_request(make_executor: Callable[..., InProcessExecutor]) -> None:
    tracer = ListTracer()
    ex = make_executor(tracer=tracer)
    ro = ex.execute_request(req("r1"))
    ex.wait_output_ready(ro.async_output_id or "").result(timeout=TIMEOUT)
    actions = [e.action for e in tracer.snapshot()]
    for a in (
        "RpcSubmit",
        "PumpRecv",
        "RpcAnswer",
        "RpcResolve",
        "WaiterAdd",
        "PayloadDeliver",
        "Remove",
        "WorkerFire",
    ):
        assert a in actions, a


# --------------------------------------------------------------------------- cancelled calls


class _SilentRanks(RankLink):
    """No workers: the test plays them by hand through the pump, and reads what was sent."""

    def __init__(self) -> None:
        self.receiver = InProcessChannel()
        self.sent: list[RpcRequest] = []

    def start(self, events: RankEvents | None, deadline: float, start_timeout: float) -> None:
        pass

    def broadcast(self, req: RpcRequest, wire: list[bytes] | None) -> None:
        self.sent.append(req)

    def deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        pass

    def stop(self, deadline: float | None) -> None:
        pass


class _SilentExecutor(DiffusionExecutor):
    def __init__(self) -> None:
        self.ranks = _SilentRanks()
        super().__init__(
            self.ranks,
            InlineStore(),
            deadlines=Deadlines(compute_timeout=None, output_timeout=None, rpc_timeout=None),
        )
        self.sent = self.ranks.sent
        self.pump.start()


def test_call_cancelled_after_its_answer_was_claimed_drops_its_outputs() -> None:
    """The caller cancels in the window between the pump claiming the call's future and setting it.

    The call's RunnerOutputs used to be thrown away with nobody told: its outputs stayed
    in the registry until the output deadline -- forever without one.
    """
    ex = _SilentExecutor()
    try:
        fut = ex.submit(req("r1")).computed
        (sent,) = ex.sent
        msg = ComputeDone(sent.rpc_id, ("o1",), ("r1",))

        def answer_then_cancel(d: Dispatcher) -> bool:
            d.handle(msg, now=ex.pump.now())  # claims the call's future (RUNNING)
            return fut.cancel()  # the caller gives up before the future is set

        assert ex.pump.call(answer_then_cancel)
        assert fut.cancelled()
        assert ex.registry.state_of("o1") is RequestState.DROPPING
        assert [r.method for r in ex.sent] == ["execute_model", "drop_outputs"], "the workers are told (F15)"
    finally:
        ex.shutdown()


def test_backpressure_counts_every_output_of_a_batch() -> None:
    """A batch of N needs room for N outputs; an empty packer always has room (no deadlock)."""
    from omni_async.core.states import RequestEvent, request_machine
    from omni_async.transport.channel import InProcessChannel as _Ch

    p = Packer(0, _Ch(), max_outputs=2)  # never started: a submitted output stays in flight
    assert p.wait_for_room(5, timeout=0)  # empty: a batch larger than the budget still runs
    m = request_machine("o1")
    for e in (RequestEvent.FORWARD, RequestEvent.COMPUTE_DONE):
        m.fire(e)
    p.submit("o1", DiffusionOutput("q1"), m)
    assert not p.wait_for_room(2, timeout=0.01)
    assert p.wait_for_room(1, timeout=0)


def test_outputs_of_a_failed_call_are_not_packed_f15(make_executor: Callable[..., InProcessExecutor]) -> None:
    """Rank 1 fails the call: the reply rank's queued output is cancelled in its packer."""
    ex = make_executor(world_size=2)
    gate = gate_name()
    busy = ex.execute_request(req("busy", pickle_gate=gate))  # rank 0's packer is stuck on this one
    assert GATES.wait_entered(gate)
    with pytest.raises(RpcFailed):
        ex.execute_request(req("doomed", fail_on=[1]))
    assert ex.collective_rpc("ping") == [("pong", 0), ("pong", 1)]  # carries the drop ahead of it
    GATES.open(gate)
    assert ex.wait_output_ready(busy.async_output_id or "").result(timeout=TIMEOUT)
    ex.drain(timeout=TIMEOUT)
    assert ex.packers[0].metrics.cancelled == 1 and ex.packers[0].metrics.packed == 1
    deadline = time.monotonic() + TIMEOUT
    while ex.metrics().pending_outputs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ex.metrics().pending_outputs == 0
