"""The result pump with real threads and the real in-process channel.

Each test builds the executor side by hand (channel -> pump -> dispatcher -> registry) and
plays the workers from test threads, so it can do what workers only do when they are
broken: race, repeat, crash, write from many threads at once.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import (
    ExecutorShutdown,
    OutputTimeout,
    RemoteError,
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
from omni_async.core.registry import OutputRegistry
from omni_async.core.states import LifecycleState
from omni_async.executor.pump import ResultPump
from omni_async.transport.channel import InProcessChannel

Msg = AsyncDiffusionOutput
TIMEOUT = 10.0


def payload(oid: str) -> DiffusionOutput:
    return DiffusionOutput(request_id=f"req-{oid}", output=f"payload-{oid}")


class Rig:
    """Channel + pump + dispatcher + registry, with a release hook that counts."""

    def __init__(
        self,
        *,
        world_size: int = 1,
        output_timeout: float | None = None,
        compute_timeout: float | None = None,
        release_hook: Callable[[DiffusionOutput], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.channel = InProcessChannel(put_timeout=TIMEOUT)
        self.released: list[str] = []
        self._lock = threading.Lock()
        self.registry = OutputRegistry(
            output_timeout=output_timeout, release_hook=release_hook if release_hook is not None else self._release
        )
        self.dispatcher = Dispatcher(self.registry, world_size=world_size, compute_timeout=compute_timeout)
        self.pump = ResultPump(self.channel, self.dispatcher, poll_interval=0.01, clock=clock)
        self.pump.start()
        self._seq = itertools.count()

    def _release(self, p: DiffusionOutput) -> None:
        with self._lock:
            self.released.append(str(p.output))

    def submit(self, rpc_id: str, consumer: str | None = None) -> Future[tuple[RunnerOutput, ...]]:
        now = self.pump.now()
        return self.pump.call(lambda d: d.submit(rpc_id, "execute_model", now=now, consumer=consumer))

    def announce(self, *oids: str, consumer: str | None = None) -> None:
        """Register ids as a reply rank's COMPUTE_DONE would (through a real RPC)."""
        rpc_id = f"announce-{next(self._seq)}"
        fut = self.submit(rpc_id, consumer=consumer)
        self.channel.put(ComputeDone(rpc_id, oids, tuple(f"req-{o}" for o in oids)))
        assert [ro.async_output_id for ro in fut.result(timeout=TIMEOUT)] == list(oids)

    def wait(self, oid: str, *, cancel_callback: bool = True) -> Future[DiffusionOutput]:
        """What ``DiffusionExecutor.wait_output_ready`` does: cancelling abandons the output."""
        fut = self.pump.call(lambda d: d.registry.wait(oid))
        if cancel_callback:

            def on_done(f: Future[DiffusionOutput]) -> None:
                if f.cancelled():
                    self.pump.call(lambda d: d.registry.cancel(oid, f))

            fut.add_done_callback(on_done)
        return fut

    def barrier(self) -> None:
        """Return once the pump has handled every message put before this call."""
        token = f"barrier-{next(self._seq)}"
        self.channel.put(RpcResult(token, None))
        while True:
            msg = self.pump.sync_buffer.get(timeout=TIMEOUT)
            if msg.rpc_id == token:
                return

    def stop(self) -> None:
        self.pump.stop("test teardown", timeout=TIMEOUT)
        self.channel.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.stop()


def wait_until(pred: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    """For states no Event reports (a thread's liveness): poll, with a generous bound."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def state(pump: ResultPump) -> LifecycleState:
    """The pump's lifecycle state (a call, so mypy does not narrow it across a change)."""
    return pump.state


def exc_of(fut: Future[Any]) -> BaseException:
    e = fut.exception(timeout=TIMEOUT)
    assert e is not None
    return e


# --------------------------------------------------------------------------- F7: many writers


def test_many_producer_threads_lose_nothing(rig: Rig) -> None:
    """8 threads x 200 outputs write the channel at once; every output reaches its waiter."""
    threads, per_thread = 8, 200
    start = threading.Barrier(threads)
    rpc_futs: dict[str, Future[tuple[RunnerOutput, ...]]] = {}
    for t in range(threads):
        for j in range(per_thread):
            rpc_futs[f"rpc-{t}-{j}"] = rig.submit(f"rpc-{t}-{j}")
    errors: list[BaseException] = []

    def produce(t: int) -> None:
        try:
            start.wait(TIMEOUT)
            for j in range(per_thread):
                oid, rpc = f"o-{t}-{j}", f"rpc-{t}-{j}"
                cd = ComputeDone(rpc, (oid,), (f"req-{oid}",))
                ready = OutputReady(oid, payload(oid))
                # Half of them overtake their COMPUTE_DONE, as a packer thread can.
                for m in (ready, cd) if j % 2 else (cd, ready):
                    rig.channel.put(m)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    workers = [threading.Thread(target=produce, args=(t,), name=f"producer-{t}") for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(TIMEOUT * 3)
    assert not errors
    for t in range(threads):
        for j in range(per_thread):
            (ro,) = rpc_futs[f"rpc-{t}-{j}"].result(timeout=TIMEOUT)
            assert ro.async_output_id == f"o-{t}-{j}" and ro.request_id == f"req-o-{t}-{j}"
            got = rig.wait(f"o-{t}-{j}").result(timeout=TIMEOUT)
            assert got.output == f"payload-o-{t}-{j}" and got.async_output_id == f"o-{t}-{j}"
    total = threads * per_thread * 2
    assert rig.channel.sent == total
    rig.barrier()
    assert rig.pump.messages == total + 1
    assert rig.pump.dispatch_errors == 0
    assert len(rig.registry) == 0 and len(rig.dispatcher) == 0
    assert rig.registry.stats.delivered == threads * per_thread and rig.released == []
    assert rig.pump.healthy()


# --------------------------------------------------------------------------- F3: nothing stops the pump


def test_cancel_racing_delivery_never_kills_the_pump(rig: Rig) -> None:
    """Waiters cancelled from another thread while their outputs arrive: each ends exactly one way."""
    n = 400
    oids = [f"o{i}" for i in range(n)]
    rig.announce(*oids)
    futs = [rig.wait(oid) for oid in oids]
    go = threading.Event()

    def deliver() -> None:
        go.wait(TIMEOUT)
        for oid in oids:
            rig.channel.put(OutputReady(oid, payload(oid)))

    def cancel() -> None:
        go.wait(TIMEOUT)
        for f in futs:
            f.cancel()

    threads = [threading.Thread(target=deliver), threading.Thread(target=cancel)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(TIMEOUT * 3)
    rig.barrier()
    cancelled = [oid for oid, f in zip(oids, futs, strict=True) if f.cancelled()]
    delivered = [oid for oid, f in zip(oids, futs, strict=True) if not f.cancelled()]
    for oid, f in zip(oids, futs, strict=True):
        if not f.cancelled():
            assert f.result(timeout=TIMEOUT).output == f"payload-{oid}"
    assert sorted(rig.released) == sorted(f"payload-{oid}" for oid in cancelled), (
        "a cancelled waiter's output is released"
    )
    assert len(cancelled) + len(delivered) == n
    assert rig.registry.stats.delivered == len(delivered)
    assert len(rig.registry) == 0
    assert rig.pump.dispatch_errors == 0 and rig.pump.healthy()


def test_release_hook_that_raises_does_not_stop_the_pump() -> None:
    calls: list[str] = []

    def bad_hook(p: DiffusionOutput) -> None:
        calls.append(str(p.output))
        raise OSError("cannot unlink")

    rig = Rig(release_hook=bad_hook)
    try:
        rig.announce("dropped", "kept")
        gone = rig.pump.call(lambda d: d.registry.drop("dropped"))
        for _ in range(3):
            rig.channel.put(OutputReady("dropped", payload("dropped")))  # the 2nd and 3rd are duplicates
        rig.channel.put(OutputReady("kept", payload("kept")))
        assert gone.result(timeout=TIMEOUT) is None
        assert rig.wait("kept").result(timeout=TIMEOUT).output == "payload-kept"
        rig.barrier()
        assert calls == ["payload-dropped"] * 3
        assert rig.registry.stats.release_errors == 3
        assert len(rig.registry) == 0 and rig.pump.healthy()
    finally:
        rig.stop()


def test_malformed_message_is_counted_and_dropped(rig: Rig) -> None:
    """A message that slipped past validation (unpickling does not re-validate) must not stop the pump."""
    bad = OutputReady("o1", payload("o1"))
    object.__setattr__(bad, "output", None)  # now OUTPUT_READY with neither output nor failure
    rig.channel.put(bad)
    rig.announce("o2")
    rig.channel.put(OutputReady("o2", payload("o2")))
    assert rig.wait("o2").result(timeout=TIMEOUT).output == "payload-o2"
    assert rig.pump.dispatch_errors == 1 and rig.pump.healthy()


class _ExplodesOnLoad:
    def __reduce__(self) -> tuple[Callable[[], object], tuple[()]]:
        return (_explode, ())


def _explode() -> object:
    raise RuntimeError("cannot rebuild this object")


def test_undecodable_message_is_counted_and_skipped(rig: Rig) -> None:
    rig.channel.put(RpcResult("whatever", _ExplodesOnLoad()))
    rig.barrier()
    assert rig.pump.dispatch_errors == 1 and rig.pump.healthy()


def test_done_callbacks_that_call_back_into_the_executor_do_not_deadlock() -> None:
    """Futures are set after the pump releases its lock: a callback may call the executor."""
    rig = Rig()  # not the fixture: after a deadlock its teardown would block on the pump's lock
    rig.announce("w", "d")
    seen: dict[str, int] = {}
    done = threading.Event()

    def on_waiter(f: Future[DiffusionOutput]) -> None:
        seen["waiter"] = rig.pump.call(lambda d: len(d.registry))

    def on_gone(f: Future[None]) -> None:
        seen["gone"] = rig.pump.call(lambda d: len(d.registry))
        done.set()

    rig.wait("w", cancel_callback=False).add_done_callback(on_waiter)
    gone = rig.pump.call(lambda d: d.registry.drop("d"))
    assert not gone.done()
    gone.add_done_callback(on_gone)
    rig.channel.put(OutputReady("w", payload("w")))
    rig.channel.put(OutputReady("d", payload("d")))
    assert done.wait(TIMEOUT), "the pump deadlocked in a done-callback (its daemon thread is left stuck)"
    rig.barrier()
    assert seen == {"waiter": 1, "gone": 0}
    assert rig.pump.healthy()
    rig.stop()


# --------------------------------------------------------------------------- deadlines, health, stop


def test_output_deadline_expires_without_any_message() -> None:
    """The pump expires deadlines on its poll, with no message arriving (a fake clock: no race)."""
    now = [1000.0]
    rig = Rig(output_timeout=5.0, clock=lambda: now[0])
    try:
        rig.announce("o1")
        fut = rig.wait("o1")
        rig.barrier()
        assert not fut.done()
        now[0] = 1004.9
        rig.barrier()
        assert not fut.done()
        now[0] = 1005.0
        err = exc_of(fut)
        assert isinstance(err, OutputTimeout) and err.output_id == "o1"
        rig.channel.put(OutputReady("o1", payload("o1")))
        rig.barrier()
        assert rig.released == ["payload-o1"] and len(rig.registry) == 0
    finally:
        rig.stop()


def test_typed_failure_reaches_the_waiter(rig: Rig) -> None:
    rig.announce("o1")
    fut = rig.wait("o1")
    failure = Failure("CudaError", "copy failed", "Traceback ...")
    rig.channel.put(OutputReady.failed("o1", failure, rank=0))
    err = exc_of(fut)
    assert isinstance(err, RemoteError) and err.failure == failure and err.rank == 0


def test_health_reports_pump_liveness() -> None:
    rig = Rig()
    rig.barrier()  # the loop is running
    assert rig.pump.healthy() and state(rig.pump) is LifecycleState.RUNNING
    rig.pump.stop("done", timeout=TIMEOUT)
    assert not rig.pump.healthy() and state(rig.pump) is LifecycleState.STOPPED
    rig.channel.close()


def test_pump_that_never_started_is_not_healthy() -> None:
    pump = ResultPump(InProcessChannel(), Dispatcher(OutputRegistry()))
    assert not pump.healthy() and state(pump) is LifecycleState.STARTING
    pump.stop()
    assert state(pump) is LifecycleState.STOPPED


def test_stop_fails_every_pending_waiter_and_rpc_at_once(rig: Rig) -> None:
    rig.announce("o1", "o2")
    rig.channel.put(OutputReady("early", payload("early")))
    waiters = [rig.wait("o1"), rig.wait("o2")]
    rpc = rig.submit("pending-rpc")
    rig.barrier()
    rig.pump.stop("maintenance window", timeout=TIMEOUT)
    pending: list[Future[Any]] = [*waiters, rpc]
    for f in pending:
        assert f.done(), "failed before stop() returned"
        err = exc_of(f)
        assert isinstance(err, ExecutorShutdown) and "maintenance window" in str(err)
    assert rig.released == ["payload-early"]
    assert len(rig.registry) == 0 and len(rig.dispatcher) == 0
    rig.pump.stop("again")  # idempotent
    # After the stop: new work fails at once instead of waiting forever.
    assert isinstance(exc_of(rig.wait("o3")), ExecutorShutdown)
    assert isinstance(exc_of(rig.submit("late-rpc")), ExecutorShutdown)


def test_closed_channel_stops_the_pump_and_fails_waiters(rig: Rig) -> None:
    rig.announce("o1")
    fut = rig.wait("o1")
    rig.channel.close()
    err = exc_of(fut)
    assert isinstance(err, ExecutorShutdown) and "result channel closed" in str(err)
    wait_until(lambda: not rig.pump.healthy())
    assert state(rig.pump) is LifecycleState.STOPPED


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_crashed_pump_fails_everything_and_reports_failed() -> None:
    armed = threading.Event()

    def clock() -> float:
        if armed.is_set():
            raise SystemError("clock broke")
        return time.monotonic()

    rig = Rig(clock=clock)
    try:
        rig.announce("o1")
        fut = rig.wait("o1")
        armed.set()
        err = exc_of(fut)
        assert isinstance(err, ExecutorShutdown) and "crashed" in str(err)
        wait_until(lambda: state(rig.pump) is LifecycleState.FAILED)
        assert not rig.pump.healthy()
        rig.pump.stop(timeout=TIMEOUT)  # joins the thread, so its traceback is reported here
    finally:
        rig.channel.close()


def test_fail_all_without_stopping_the_pump(rig: Rig) -> None:
    """A worker died: everything pending fails with WorkerDied, the pump keeps serving."""
    rig.announce("o1")
    fut = rig.wait("o1")
    rpc = rig.submit("r1")
    rig.pump.fail_all(lambda oid: WorkerDied(1, -9, output_id=oid), "worker_died")
    assert isinstance(exc_of(fut), WorkerDied) and isinstance(exc_of(rpc), WorkerDied)
    assert rig.pump.healthy()
    rig.channel.put(OutputReady("o1", payload("o1")))  # the late output of a force-released id
    rig.announce("o2")
    rig.channel.put(OutputReady("o2", payload("o2")))
    assert rig.wait("o2").result(timeout=TIMEOUT).output == "payload-o2"
    rig.barrier()
    assert rig.released == ["payload-o1"] and len(rig.registry) == 0
    assert rig.registry.stats.protocol_errors == 0
