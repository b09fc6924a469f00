"""One named test per failure mode of the reference implementation that this layer rules out.

The F-numbers are DESIGN.md section 2's table.  Each test's docstring says what went wrong
in the reference and what we check.  Transport failure modes (F1, F5, F13, F14) are
tested with the channel, the segment pool and the packing code; F8 (drain) in
test_inprocess_executor.py and the multiprocess tests.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from helpers.executor_harness import (
    GATES,
    RELAXED,
    TIMEOUT,
    HarnessExecutor,
    exc_of,
    expected_image,
    gate_name,
    make_toy,
    opened_gates_on_exit,
    req,
    wait_until,
)
from helpers.traces import keep
from omni_async.core.config import ENV_OUTPUT_TIMEOUT, Deadlines
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OutputDropped,
    OutputError,
    OutputOrphaned,
    OutputTimeout,
    RemoteError,
    RpcFailed,
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
from omni_async.core.states import RequestEvent, RequestState, request_machine
from omni_async.core.trace import FieldValue
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.pump import ResultPump
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.errors import ChannelClosed, ChannelFull
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.verify.recorder import ListTracer
from omni_async.worker.packer import Packer

Msg = AsyncDiffusionOutput
S = RequestState


class Releases:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.payloads: list[DiffusionOutput] = []

    def __call__(self, p: DiffusionOutput) -> None:
        with self._lock:
            self.payloads.append(p)

    def __len__(self) -> int:
        with self._lock:
            return len(self.payloads)


def quiet(ex: DiffusionExecutor) -> bool:
    m = ex.metrics()
    return m.pending_outputs == 0 and m.pending_rpcs == 0


@pytest.fixture
def executors() -> Iterator[list[DiffusionExecutor]]:
    made: list[DiffusionExecutor] = []
    with opened_gates_on_exit():
        yield made
    for ex in made:
        ex.shutdown()


def in_process(made: list[DiffusionExecutor], **kw: Any) -> InProcessExecutor:
    kw.setdefault("deadlines", RELAXED)
    ex = InProcessExecutor(make_toy, **kw)
    made.append(ex)
    return ex


def harness(made: list[DiffusionExecutor], **kw: Any) -> HarnessExecutor:
    ex = HarnessExecutor(**kw)
    made.append(ex)
    return ex


class PumpRig:
    """The executor side by hand (channel, pump, dispatcher, registry) for tests that play the workers."""

    def __init__(self, release_hook: Callable[[DiffusionOutput], None], output_timeout: float | None = None) -> None:
        self.channel = InProcessChannel(put_timeout=TIMEOUT)
        self.registry = OutputRegistry(output_timeout=output_timeout, release_hook=release_hook)
        self.dispatcher = Dispatcher(self.registry)
        self.pump = ResultPump(self.channel, self.dispatcher, poll_interval=0.01)
        self.pump.start()

    def submit(self, rpc_id: str) -> Future[tuple[RunnerOutput, ...]]:
        now = self.pump.now()
        return self.pump.call(lambda d: d.submit(rpc_id, "execute_model_batch", now=now))

    def wait(self, oid: str) -> Future[DiffusionOutput]:
        return self.pump.call(lambda d: d.registry.wait(oid))

    def barrier(self) -> None:
        token = f"barrier-{uuid.uuid4().hex}"
        self.channel.put(RpcResult(token, None))
        while self.pump.sync_buffer.get(timeout=TIMEOUT).rpc_id != token:
            pass

    def stop(self) -> None:
        self.pump.stop(timeout=TIMEOUT)
        self.channel.close()


def payload(oid: str) -> DiffusionOutput:
    return DiffusionOutput(request_id=f"req-{oid}", output=f"payload-{oid}")


# --------------------------------------------------------------------------- F2


def _failing_pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
    raise RuntimeError(f"segment pool exhausted while packing {output.request_id}")


def test_f2_packing_error_fails_the_waiter_at_once_with_a_typed_failure(executors: list[DiffusionExecutor]) -> None:
    """F2: the reference cached a packing error as None, so the caller saw a 30 s timeout.

    We check the waiter fails at once (well inside a 60 s output deadline) with a
    RemoteError carrying the type name, the message and the remote traceback.
    """
    ex = harness(executors, make_packer=lambda rank, ch: Packer(rank, ch, pack=_failing_pack))
    ro = ex.execute_request(req("r1"))
    t0 = time.monotonic()
    err = exc_of(ex.wait_output_ready(ro.async_output_id or ""))
    assert time.monotonic() - t0 < 5.0
    assert isinstance(err, RemoteError)
    assert err.failure.type_name == "RuntimeError"
    assert err.failure.message == "segment pool exhausted while packing r1"
    assert "_failing_pack" in err.failure.traceback
    assert "segment pool exhausted" in str(err) and "remote traceback" in str(err)
    assert quiet(ex)


def _broken_event() -> DeviceEvent | None:
    raise RuntimeError("cudaEventRecord failed: device lost")


def test_f2_event_recording_error_fails_the_call_at_once(executors: list[DiffusionExecutor]) -> None:
    """F2: an error after the forward (recording the device event) must travel as a typed failure.

    It escaped the worker loop unanswered, so the call waited for its whole compute
    deadline and then reported a timeout instead of the error.
    """
    ex = harness(executors, loop_options={"record_event": _broken_event})
    t0 = time.monotonic()
    err = exc_of(ex.submit(req("r1")).computed)
    assert time.monotonic() - t0 < 5.0, "not the 60 s compute deadline"
    assert isinstance(err, RpcFailed) and err.failures[0].type_name == "RuntimeError"
    assert "device lost" in err.failures[0].message
    assert quiet(ex) and ex.packers[0].metrics.in_flight_outputs == 0
    ro = ex.collective_rpc("ping")
    assert ro == [("pong", 0)], "the worker keeps serving"


# --------------------------------------------------------------------------- F3


def test_f3_waiter_cancelled_between_check_and_set_does_not_kill_the_pump() -> None:
    """F3: a waiter cancelled between "is it done?" and "set result" raised inside the pump and killed it.

    We cancel waiters without telling the registry (the window of the race), deliver their
    outputs, and check the pump is alive and healthy, counted no error, released every
    abandoned output once, and still delivers to the next waiter.
    """
    released = Releases()
    rig = PumpRig(released)
    try:
        rpc = rig.submit("rpc-1")
        oids = tuple(f"o{i}" for i in range(20))
        rig.channel.put(ComputeDone("rpc-1", oids, tuple(f"req-{o}" for o in oids)))
        assert len(rpc.result(timeout=TIMEOUT)) == 20
        futs = [rig.wait(o) for o in oids]
        for f in futs[:10]:
            assert f.cancel()  # the registry has not heard of it
        for o in oids:
            rig.channel.put(OutputReady(o, payload(o)))
        for o, f in zip(oids[10:], futs[10:], strict=True):
            assert f.result(timeout=TIMEOUT).output == f"payload-{o}"
        rig.barrier()
        assert sorted(str(p.output) for p in released.payloads) == sorted(f"payload-{o}" for o in oids[:10])
        assert rig.pump.healthy() and rig.pump.dispatch_errors == 0 and len(rig.registry) == 0
    finally:
        rig.stop()


def test_f3_no_exception_in_dispatch_stops_the_pump_and_liveness_is_health(executors: list[DiffusionExecutor]) -> None:
    """F3: the engine looked healthy while its pump was dead.

    A release hook that raises and a malformed message must not stop the pump; and when
    the pump does stop, ``check_health`` says so.
    """

    def bad_hook(p: DiffusionOutput) -> None:
        raise OSError("unlink failed")

    ex = harness(executors, release_hook=bad_hook)
    ro = ex.execute_request(req("r1", pickle_gate=(g := gate_name())))
    ex.wait_output_ready(ro.async_output_id or "").cancel()  # its output will be released: the hook raises
    bad = OutputReady("x", payload("x"))
    object.__setattr__(bad, "output", None)  # slipped past validation
    ex.channel.put(bad)
    GATES.open(g)
    wait_until(lambda: ex.metrics().released == 1)
    ex.check_health()
    ro2 = ex.execute_request(req("r2"))
    assert ex.wait_output_ready(ro2.async_output_id or "").result(timeout=TIMEOUT).request_id == "r2"
    assert ex.metrics().dispatch_errors == 1 and ex.registry.stats.release_errors == 1
    ex.pump.stop("pump stopped by the test")
    with pytest.raises(ExecutorShutdown, match="pump"):
        ex.check_health()


def test_f3_an_exception_while_dispatching_a_valid_message_is_caught_by_the_pump(
    executors: list[DiffusionExecutor], caplog: pytest.LogCaptureFixture
) -> None:
    """F3 at the pump's guard: a message that passes the channel's validation but whose
    dispatch raises must not stop the pump.

    The malformed message of the test above is refused when the in-process channel is
    read, before the dispatcher sees it, so it never reaches the guard around
    ``Dispatcher.handle``.  Here a valid message (a stray RPC_RESULT) makes ``handle``
    raise through the executor's own tracer (a trace recorder that fails, say on a full
    disk), once: the error is counted and logged, the message dropped, the pump stays
    alive, health stays green, and the messages after it are dispatched.  Killed by the
    mutant that removes the guard (the exception then ends the pump thread).
    """
    token = f"poison-{uuid.uuid4().hex[:8]}"
    raised: list[str] = []

    def tracer(action: str, fields: Mapping[str, FieldValue]) -> None:
        if action == "PumpRecv" and fields.get("rpc_id") == token and not raised:
            raised.append(token)
            raise RuntimeError("the trace recorder failed")

    caplog.set_level(logging.ERROR, logger="omni_async.executor.pump")
    ex = harness(executors, tracer=tracer)
    ro1 = ex.execute_request(req("r1"))
    assert ex.wait_output_ready(ro1.async_output_id or "").result(timeout=TIMEOUT).request_id == "r1"
    assert ex.metrics().dispatch_errors == 0
    ex.channel.put(RpcResult(token, None))  # valid: the channel hands it to the dispatcher
    wait_until(lambda: ex.metrics().dispatch_errors == 1 or not ex.pump.healthy())
    assert raised == [token]
    assert ex.pump.healthy(), "the exception from Dispatcher.handle ended the pump"
    ex.check_health()
    ro2 = ex.execute_request(req("r2"))
    assert ex.wait_output_ready(ro2.async_output_id or "").result(timeout=TIMEOUT).request_id == "r2"
    assert ex.pump.healthy() and ex.metrics().dispatch_errors == 1
    ex.check_health()
    logged = [r.getMessage() for r in caplog.records if r.name == "omni_async.executor.pump"]
    assert any("dispatching" in m and token in m and "message dropped" in m for m in logged), logged


# --------------------------------------------------------------------------- F4


def test_f4_separate_deadlines_measured_from_the_right_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """F4: one fixed timeout measured the wrong thing and threw away finished renders.

    With a fake clock: a forward longer than the output deadline still delivers (the
    output deadline starts at COMPUTE_DONE), the compute deadline fails a call that gets
    no COMPUTE_DONE, and both come from the constructor or the environment.
    """
    registry = OutputRegistry(output_timeout=5.0)
    d = Dispatcher(registry, compute_timeout=100.0)

    def settle() -> None:
        apply_resolutions(d.take_resolutions())

    slow = d.submit("slow", "execute_model", now=0.0)
    d.expire(60.0)  # 60 s of forward: past the output deadline, inside the compute deadline
    d.handle(ComputeDone("slow", ("o1",), ("r1",)), now=60.0)
    settle()
    (ro,) = slow.result(timeout=0)
    waiter = registry.wait(ro.async_output_id or "")
    d.expire(64.9)
    d.handle(OutputReady("o1", payload("o1")), now=64.9)
    settle()
    assert waiter.result(timeout=0).output == "payload-o1", "a finished render is not thrown away"

    stuck = d.submit("stuck", "execute_model", now=0.0)
    d.expire(99.9)
    settle()
    assert not stuck.done()
    d.expire(100.0)
    settle()
    assert isinstance(exc_of(stuck), ComputeTimeout)

    late = d.submit("late", "execute_model", now=200.0)
    d.handle(ComputeDone("late", ("o2",), ("r2",)), now=201.0)
    settle()
    w2 = registry.wait("o2")
    d.expire(205.9)
    settle()
    assert not w2.done()
    d.expire(206.0)  # 5 s after COMPUTE_DONE
    settle()
    assert isinstance(exc_of(w2), OutputTimeout) and late.done()

    monkeypatch.setenv(ENV_OUTPUT_TIMEOUT, "0.25")
    ex = InProcessExecutor(make_toy)
    try:
        assert ex.deadlines.output_timeout == 0.25 and ex.deadlines.compute_timeout == Deadlines().compute_timeout
    finally:
        ex.shutdown()
    ex2 = InProcessExecutor(make_toy, deadlines=Deadlines(compute_timeout=3.0, output_timeout=None))
    try:
        assert (ex2.deadlines.compute_timeout, ex2.deadlines.output_timeout) == (3.0, None)
    finally:
        ex2.shutdown()


# --------------------------------------------------------------------------- F6


def test_f6_batch_outputs_before_compute_done_reach_their_own_waiters() -> None:
    """F6: the batch output arrived before the executor had registered how to split it; every request hung.

    The worker names one output id per request in COMPUTE_DONE, so there is no split map:
    every OUTPUT_READY of a batch arrives first here, then the COMPUTE_DONE, and each
    request's waiter gets its own output.
    """
    released = Releases()
    rig = PumpRig(released)
    try:
        rpc = rig.submit("batch-1")
        oids = ("b0", "b1", "b2", "b3")
        for o in reversed(oids):
            rig.channel.put(OutputReady(o, payload(o)))
        rig.barrier()
        assert not rpc.done() and len(rig.registry) == 4
        assert {r.state for r in rig.registry} == {S.EARLY_READY}
        rig.channel.put(ComputeDone("batch-1", oids, tuple(f"req-{o}" for o in oids)))
        ros = rpc.result(timeout=TIMEOUT)
        assert [r.request_id for r in ros] == [f"req-{o}" for o in oids]
        for r in ros:
            out = rig.wait(r.async_output_id or "").result(timeout=TIMEOUT)
            assert out.request_id == r.request_id and out.output == f"payload-{r.async_output_id}"
        assert len(rig.registry) == 0 and len(released) == 0
    finally:
        rig.stop()


# --------------------------------------------------------------------------- F7


def test_f7_many_threads_write_one_channel_and_nothing_vanishes() -> None:
    """F7: two threads wrote a single-writer queue and a message vanished.

    Four real packer threads and four worker main threads write one channel at once;
    every COMPUTE_DONE and every OUTPUT_READY arrives and every output reaches its waiter.
    """
    released = Releases()
    rig = PumpRig(released)
    ranks, per_rank = 4, 50
    packers = [Packer(rank, rig.channel, max_outputs=per_rank) for rank in range(ranks)]
    for p in packers:
        p.start()
    rpcs = {(r, i): rig.submit(f"rpc-{r}-{i}") for r in range(ranks) for i in range(per_rank)}
    start = threading.Barrier(ranks)

    def main_thread(rank: int) -> None:
        start.wait(TIMEOUT)
        for i in range(per_rank):
            oid = f"o-{rank}-{i}"
            m = request_machine(oid)
            m.fire(RequestEvent.FORWARD)
            m.fire(RequestEvent.COMPUTE_DONE)
            packers[rank].submit(oid, payload(oid), m)
            rig.channel.put(ComputeDone(f"rpc-{rank}-{i}", (oid,), (f"req-{oid}",), rank=0))

    threads = [threading.Thread(target=main_thread, args=(r,)) for r in range(ranks)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT * 3)
        for (r, i), fut in rpcs.items():
            (ro,) = fut.result(timeout=TIMEOUT)
            assert rig.wait(ro.async_output_id or "").result(timeout=TIMEOUT).output == f"payload-o-{r}-{i}"
        for p in packers:
            assert p.drain(TIMEOUT)
        rig.barrier()
        assert rig.channel.sent == ranks * per_rank * 2 + 1
        assert rig.pump.messages == rig.channel.sent and rig.pump.dispatch_errors == 0
        assert len(rig.registry) == 0 and len(released) == 0
    finally:
        for p in packers:
            p.stop(TIMEOUT)
        rig.stop()


# --------------------------------------------------------------------------- F9, F10, F11


def test_f9_late_output_for_cancelled_waiter_is_released(executors: list[DiffusionExecutor]) -> None:
    """F9: a late output for a cancelled waiter was cached forever.

    We cancel the waiter while the output is still being packed; the moment it arrives
    the release hook is called for it, exactly once, and nothing of it remains.
    """
    released = Releases()
    ex = harness(executors, release_hook=released)
    g = gate_name()
    ro = ex.execute_request(req("r1", pickle_gate=g))
    waiter = ex.wait_output_ready(ro.async_output_id or "")
    assert GATES.wait_entered(g)
    assert waiter.cancel()
    assert len(released) == 0
    GATES.open(g)
    wait_until(lambda: len(released) == 1)
    assert released.payloads[0].async_output_id == ro.async_output_id
    assert quiet(ex) and ex.metrics().delivered == 0
    ex.drain(TIMEOUT)
    assert len(released) == 1, "released once"


def test_f10_abort_in_every_state_leaves_nothing() -> None:
    """F10: an aborted request's output was cached forever (one full image or video per abort).

    A drop is valid in every registry state; the held payload is released at once, the
    drop is acknowledged when the id's last message arrived, and no record is left.
    """

    def cd(r: OutputRegistry) -> None:
        r.on_compute_done(["o"], now=0.0)

    def out(r: OutputRegistry) -> None:
        r.on_output("o", output=payload("o"))

    def fail(r: OutputRegistry) -> None:
        r.on_output("o", failure=Failure("E", "m"))

    def abandon(r: OutputRegistry) -> None:
        f = r.wait("o")
        f.cancel()
        r.cancel("o", f)

    def drop(r: OutputRegistry) -> None:
        r.drop("o")

    scenarios: dict[S, list[Callable[[OutputRegistry], Any]]] = {
        S.COMPUTE_DONE: [cd],
        S.READY: [cd, out],
        S.FAILED: [cd, fail],
        S.EARLY_READY: [out],
        S.EARLY_FAILED: [fail],
        S.DROPPING: [cd, drop],
        S.DROPPING_EARLY: [out, drop],
        S.RELEASING: [cd, abandon],
        S.RELEASING_EARLY: [out, abandon],
    }
    for state, steps in scenarios.items():
        released = Releases()
        reg = OutputRegistry(release_hook=released)
        for step in steps:
            step(reg)
        assert reg.state_of("o") is state
        before = len(released)
        held = reg.held_payloads() == 1 and state in (S.READY, S.EARLY_READY)
        gone = reg.drop("o")
        apply_resolutions(reg.take_resolutions())
        assert len(released) == before + held, state
        if state in (S.COMPUTE_DONE, S.DROPPING, S.RELEASING):
            assert not gone.done()
            out(reg)
        elif state in (S.EARLY_READY, S.EARLY_FAILED, S.DROPPING_EARLY, S.RELEASING_EARLY):
            assert not gone.done()
            cd(reg)
        apply_resolutions(reg.take_resolutions())
        assert gone.done() and len(reg) == 0, state
        assert reg.held_payloads() == 0 and reg.stats.protocol_errors == 0


def test_f11_unclaimed_outputs_released_when_the_consumer_leaves_times_out_or_shuts_down(
    executors: list[DiffusionExecutor],
) -> None:
    """F11: outputs leaked when the consumer stream vanished without an abort.

    Outputs nobody claims are released when their consumer goes away, when their output
    deadline passes, and when the executor shuts down.
    """
    released = Releases()
    ex = harness(executors, release_hook=released)
    gone_consumer = ex.execute_batch([req("a"), req("b")], consumer="stream-that-vanished")
    kept = ex.execute_request(req("c"), consumer="stream-alive")
    ex.drain(TIMEOUT)
    wait_until(lambda: ex.metrics().held_payloads == 3)
    assert ex.release_consumer("stream-that-vanished") == 2
    assert sorted(p.request_id for p in released.payloads) == ["a", "b"]
    for ro in gone_consumer:
        assert isinstance(exc_of(ex.wait_output_ready(ro.async_output_id or "")), OutputError)
    assert ex.wait_output_ready(kept.async_output_id or "").result(timeout=TIMEOUT).request_id == "c"

    released_t = Releases()
    ex_t = harness(
        executors,
        release_hook=released_t,
        deadlines=Deadlines(compute_timeout=60.0, output_timeout=0.2, rpc_timeout=60.0),
    )
    unclaimed = ex_t.execute_request(req("d"))
    wait_until(lambda: len(released_t) == 1)  # nobody claimed it within its output deadline
    assert released_t.payloads[0].async_output_id == unclaimed.async_output_id
    assert ex_t.metrics().timeouts == 1 and quiet(ex_t)

    released_s = Releases()
    ex_s = harness(executors, release_hook=released_s)
    ro = ex_s.execute_request(req("e"))
    ex_s.drain(TIMEOUT)
    wait_until(lambda: ex_s.metrics().held_payloads == 1)
    ex_s.shutdown()
    assert [p.async_output_id for p in released_s.payloads] == [ro.async_output_id]


# --------------------------------------------------------------------------- F12


def test_f12_reply_rank_compute_done_does_not_hide_another_ranks_error(executors: list[DiffusionExecutor]) -> None:
    """F12: rank 0's COMPUTE_DONE resolved the call before another rank's error arrived.

    Rank 0 answers first (its outputs are announced) while rank 1 is still computing; the
    call stays pending, and when rank 1 fails the call fails naming rank 1, and rank 0's
    outputs are released.
    """
    ex = in_process(executors, world_size=2)
    g = gate_name()
    handles = ex.submit_batch([req("r1", gate=g, gate_ranks=[1], fail_on=[1]), req("r2")])
    assert GATES.wait_entered(g)
    wait_until(lambda: ex.metrics().pending_outputs == 2)  # rank 0's COMPUTE_DONE is in
    assert not any(h.computed.done() or h.output.done() for h in handles), "one rank's answer must not resolve the call"
    GATES.open(g)
    err = exc_of(handles[0].computed)
    assert all(exc_of(f) is err for h in handles for f in (h.computed, h.output))
    assert isinstance(err, RpcFailed) and sorted(err.failures) == [1]
    assert "failed on rank 1" in err.failures[1].message
    wait_until(lambda: ex.metrics().released == 2)
    assert quiet(ex) and ex.metrics().delivered == 0


# --------------------------------------------------------------------------- defect 3


class RefusingChannel(InProcessChannel):
    """An in-process channel whose put refuses some messages of the workers' main threads.

    ``refuse`` says which: "compute_done" (the COMPUTE_DONE put raises, as a full or
    broken pipe makes it), or "answers" (so does any failure that would replace it).
    Every other message travels as usual; the packers' OUTPUT_READY included.
    """

    def __init__(self, refuse: str) -> None:
        super().__init__(put_timeout=TIMEOUT)
        self.refuse = refuse
        self.refused = 0

    def put(self, msg: AsyncDiffusionOutput, timeout: float | None = None) -> None:
        failed_answer = isinstance(msg, RpcResult) and msg.failure is not None
        if isinstance(msg, ComputeDone) or (isinstance(msg, RpcResult) and self.refuse == "answers" and failed_answer):
            self.refused += 1
            raise ChannelFull(f"no room for {msg.kind!r} of {msg.rpc_id}", nbytes=0, timeout=timeout)
        super().put(msg, timeout)


def test_d3_compute_done_that_cannot_be_sent_leaves_nothing_held(executors: list[DiffusionExecutor]) -> None:
    """Defect 3: the worker handed its outputs to the packer, then its COMPUTE_DONE put raised.

    The worker answered the call with a failure naming nothing, so the outputs the packer
    shipped anyway were held (segments leased) until shutdown, with no counter showing
    them.  We check the call fails with the send error, both outputs are released in
    whatever order they and the failure arrive, nothing is held, and the deadline
    backstop was not needed (tla/buggy/SendFailKeepsShipped.cfg).
    """
    released = Releases()
    channel = RefusingChannel("compute_done")
    tracer = ListTracer()
    ex = in_process(executors, channel=channel, release_hook=released, tracer=tracer)
    with pytest.raises(RpcFailed) as info:
        ex.execute_batch([req("r1"), req("r2")])
    err = info.value
    assert isinstance(err, RpcFailed) and err.failures[0].type_name == "ChannelFull"
    wait_until(lambda: len(released) == 2)
    wait_until(lambda: quiet(ex))
    m = ex.metrics()
    assert m.held_payloads == 0 and m.orphaned_outputs == 0 and m.protocol_errors == 0
    assert channel.refused == 1
    ro = ex.collective_rpc("ping")
    assert ro == [("pong", 0)], "the worker keeps serving"
    ex.shutdown()
    keep("failure_modes", tracer)  # validated against tla/AsyncOutput.tla (test_trace_validation)


def test_d3_backstop_releases_an_output_whose_call_never_got_an_answer(executors: list[DiffusionExecutor]) -> None:
    """Defect 3, the backstop: not even the failure could be sent, so no message names the output.

    The call times out (compute deadline); the record the early OUTPUT_READY created gets
    its own deadline, no earlier than the call's, after which it is released, counted in
    ``metrics().orphaned_outputs`` and recorded as an ``OutputOrphaned``.
    """
    released = Releases()
    tracer = ListTracer()
    ex = in_process(
        executors,
        channel=RefusingChannel("answers"),
        release_hook=released,
        tracer=tracer,
        deadlines=Deadlines(compute_timeout=0.5, output_timeout=60.0, rpc_timeout=60.0),
    )
    assert isinstance(exc_of(ex.submit(req("r1")).computed), ComputeTimeout)
    wait_until(lambda: len(released) == 1)
    wait_until(lambda: ex.metrics().orphaned_outputs == 1)
    assert quiet(ex) and ex.metrics().held_payloads == 0
    (orphan,) = ex.pump.call(lambda d: list(d.registry.orphans))
    assert isinstance(orphan, OutputOrphaned)
    ex.shutdown()
    keep("failure_modes", tracer)


# --------------------------------------------------------------------------- F15


def test_f15_abort_before_packing_cancels_the_packing(executors: list[DiffusionExecutor]) -> None:
    """F15: aborted requests were still packed and shipped.

    The packer is busy with the first output of a batch; the second is dropped before its
    packing starts: the packer skips it (a Cancelled failure ends its record) and the
    drop is acknowledged once nothing of it remains.
    """
    ex = in_process(executors, max_outputs_in_flight=4)
    g = gate_name()
    first, second = ex.execute_batch([req("a", pickle_gate=g, value=7.0), req("b")])
    waiter = ex.wait_output_ready(first.async_output_id or "")
    assert GATES.wait_entered(g), "the packer is busy with 'a'"
    gone = ex.drop_output(second.async_output_id or "")
    assert not gone.done()
    assert ex.collective_rpc("ping") == [("pong", 0)]  # the worker has handled the drop (FIFO)
    GATES.open(g)
    assert gone.result(timeout=TIMEOUT) is None
    out = waiter.result(timeout=TIMEOUT)
    assert out.request_id == "a" and bool((out.output["image"] == expected_image(7.0)).all())
    m = ex.packers[0].metrics
    assert m.cancelled == 1 and m.packed == 1, "'b' was never packed"
    assert quiet(ex) and ex.metrics().released == 0


def test_f15_a_drop_cancels_only_the_dropped_outputs_of_the_queue() -> None:
    """F15's cancellation is per id: the outputs queued beside a dropped one still ship.

    Five outputs queue behind a slow pack (the first); the third is dropped.  The
    packer sends one Cancelled failure, for the third, and every other output as a
    success carrying its own bytes.  (A cancellation that swept the whole queue would
    pass the F15 test above, whose only queued output is the dropped one.)
    """
    channel = InProcessChannel(put_timeout=TIMEOUT)
    first_started, release_first = threading.Event(), threading.Event()

    def slow_first(output: DiffusionOutput, stream: Any, event: Any) -> DiffusionOutput:
        if output.async_output_id == "o0":
            first_started.set()
            assert release_first.wait(TIMEOUT)
        return output

    packer = Packer(0, channel, pack=slow_first, max_outputs=8)
    packer.start()
    ids = [f"o{i}" for i in range(5)]

    def image(i: int) -> torch.Tensor:
        return torch.full((1000,), float(i)) + torch.arange(1000.0) * (i + 1)

    try:
        for i, oid in enumerate(ids):
            m = request_machine(oid)
            m.fire(RequestEvent.FORWARD)
            m.fire(RequestEvent.COMPUTE_DONE)
            packer.submit(oid, DiffusionOutput(f"req-{i}", {"image": image(i)}), m)
        assert first_started.wait(TIMEOUT), "the packer is busy with o0; o1..o4 are queued"
        assert packer.drop(["o2"]) == 1
        release_first.set()
        got: dict[str, OutputReady] = {}
        while len(got) < len(ids):
            msg = channel.get(TIMEOUT)
            assert msg is not None, f"only {sorted(got)} arrived"
            assert isinstance(msg, OutputReady) and msg.async_output_id is not None
            got[msg.async_output_id] = msg
        assert packer.drain(TIMEOUT)
    finally:
        release_first.set()
        assert packer.stop(TIMEOUT)
    cancelled = got.pop("o2")
    assert cancelled.failure is not None and cancelled.failure.type_name == "Cancelled"
    for oid, msg in got.items():
        assert msg.failure is None, f"{oid} was not dropped but failed: {msg.failure}"
        assert msg.output is not None
        i = int(oid[1:])
        assert msg.output.request_id == f"req-{i}"
        assert torch.equal(msg.output.output["image"], image(i)), f"{oid} arrived with foreign bytes"
    assert packer.metrics.cancelled == 1 and packer.metrics.packed == 4


# --------------------------------------------------------------------------- F16


def test_f16_shutdown_is_idempotent_fails_every_waiter_and_never_hangs(executors: list[DiffusionExecutor]) -> None:
    """F16: shutdown left completed outputs cached, and pack thread joins could hang.

    With an output being packed, a held output and a forward in flight, shutdown fails
    every waiter and call with ExecutorShutdown at once, releases the held output, and
    a second shutdown returns at once; a packer blocked on a full channel is freed by
    closing the channel, so its join returns promptly.
    """
    released = Releases()
    ex = harness(executors, release_hook=released)
    held = ex.execute_request(req("held"))
    ex.drain(TIMEOUT)
    pg, fg = gate_name(), gate_name()
    packing = ex.execute_request(req("packing", pickle_gate=pg))
    waiter = ex.wait_output_ready(packing.async_output_id or "")
    assert GATES.wait_entered(pg)
    call = ex.submit(req("computing", gate=fg)).computed
    assert GATES.wait_entered(fg)
    done = threading.Event()

    def stop() -> None:
        ex.shutdown("going away")
        done.set()

    t = threading.Thread(target=stop)
    t.start()
    for f in (waiter, call):
        e = exc_of(f)
        assert isinstance(e, ExecutorShutdown) and "going away" in str(e)
    wait_until(lambda: len(released) >= 1)
    assert released.payloads[0].async_output_id == held.async_output_id
    GATES.open(fg)
    GATES.open(pg)
    assert done.wait(TIMEOUT)
    t.join(TIMEOUT)
    t0 = time.monotonic()
    ex.shutdown()
    assert time.monotonic() - t0 < 2.0  # nothing left to join: no join timeout is waited out
    assert len(ex.registry) == 0 and ex.registry.closed
    assert isinstance(exc_of(ex.wait_output_ready(held.async_output_id or "")), ExecutorShutdown)

    # A packer stuck in put() on a full channel nobody reads: close() frees it, the join returns.
    channel = InProcessChannel(maxsize=1, put_timeout=None)
    channel.put(RpcResult("filler", None))
    packer = Packer(0, channel)
    packer.start()
    for i in range(3):
        m = request_machine(f"s{i}", RequestState.COMPUTE_DONE)
        packer.submit(f"s{i}", payload(f"s{i}"), m)
    assert not packer.drain(0.05), "blocked on the full channel"
    channel.close()
    t0 = time.monotonic()
    assert packer.stop(TIMEOUT)
    assert time.monotonic() - t0 < 2.0 and not packer.alive()
    with pytest.raises(ChannelClosed):
        channel.put(RpcResult("late", None))


def test_f16_dropped_outputs_are_gone_after_shutdown(executors: list[DiffusionExecutor]) -> None:
    """F16 with F10: an acknowledged drop pending at shutdown resolves; nothing is left behind."""
    ex = in_process(executors)
    g = gate_name()
    ro = ex.execute_request(req("r1", pickle_gate=g))
    assert GATES.wait_entered(g)
    gone = ex.drop_output(ro.async_output_id or "")
    assert not gone.done()
    waiter = ex.wait_output_ready(ro.async_output_id or "")
    assert isinstance(exc_of(waiter), OutputDropped)
    GATES.open(g)
    assert gone.result(timeout=TIMEOUT) is None
    ex.shutdown()
    assert len(ex.registry) == 0
