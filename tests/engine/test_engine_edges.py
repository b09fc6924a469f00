"""The engine at its edges (issue 17): lifecycle races, the control path, accounting,
errors at the call.  Each test names the defect it holds down; each failed on the
engine before its lifecycle and request stages became machines.

Real executors throughout: ``InProcessExecutor`` where threads suffice (gates put a
request at the stage a test needs), ``MultiprocDiffusionExecutor`` where the defect
lives in processes and pipes (a blocked send, a factory that starts a worker)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest

from helpers.engine_harness import assert_quiescent, eventually, in_thread, run
from helpers.executor_harness import GATES, RELAXED, gate_name, make_toy, req
from omni_async.core.config import Deadlines
from omni_async.core.engine_states import EngineState, StageState
from omni_async.core.errors import InvalidRequest, OutputTimeout, RequestAborted, RequestNotSendable, UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EngineClosed
from omni_async.engine.sync import DiffusionEngine
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.models.tiny import TinyDiffusionWorker
from omni_async.worker.postprocess import PostProcess, register_postprocess

SCRIPTED = WorkerSpec("helpers.mp_workers:ScriptedWorker")


@pytest.fixture
def ex() -> Iterator[InProcessExecutor]:
    executor = InProcessExecutor(make_toy, deadlines=RELAXED)
    try:
        yield executor
    finally:
        GATES.open_all()
        executor.shutdown()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) is gone for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


# -- lifecycle ----------------------------------------------------------------------------


def test_close_returns_after_a_start_whose_factory_raised() -> None:
    """Defect 1: close() after a failed start returned never."""

    def factory() -> InProcessExecutor:
        raise RuntimeError("no executor today")

    async def body() -> None:
        engine = AsyncDiffusionEngine.from_factory(factory)
        try:
            with pytest.raises(RuntimeError, match="no executor today"):
                await engine.start()
        finally:
            await asyncio.wait_for(engine.close(), 5.0)
        assert engine.state is EngineState.FAILED and engine.closed
        with pytest.raises(EngineClosed, match="failed to start"):
            await engine.generate(req("r"))

    run(body(), timeout=30)


def test_close_returns_after_a_start_refused_a_step_mode_executor() -> None:
    """Defect 1, the other way in: an executor in step mode."""
    ex = InProcessExecutor(make_toy, deadlines=RELAXED, step_mode=True)

    async def body() -> None:
        engine = AsyncDiffusionEngine(ex)
        try:
            with pytest.raises(UsageError, match="request mode"):
                await engine.start()
        finally:
            await asyncio.wait_for(engine.close(), 5.0)
        assert engine.state is EngineState.FAILED
        made = engine.files.directory  # the output directory the start had made is gone with it
        assert made is not None and not os.path.exists(made)

    try:
        run(body(), timeout=30)
    finally:
        ex.shutdown()


def test_close_during_start_sticks_and_shuts_down_what_the_start_built() -> None:
    """Defect 2: a close while start() awaited left the engine started and serving."""
    built: list[InProcessExecutor] = []

    def factory() -> InProcessExecutor:
        time.sleep(0.3)
        built.append(InProcessExecutor(make_toy, deadlines=RELAXED))
        return built[-1]

    async def body() -> None:
        engine = AsyncDiffusionEngine.from_factory(factory)
        start = asyncio.create_task(engine.start())
        await asyncio.sleep(0)
        await asyncio.wait_for(engine.close(), 10.0)
        with pytest.raises(EngineClosed, match="closed while it started"):
            await start
        assert engine.closed and not engine.started and engine.state is EngineState.CLOSED
        with pytest.raises(EngineClosed):
            await engine.generate(req("r"))
        assert len(built) == 1
        with pytest.raises(Exception, match="shut down|closed"):
            built[0].submit(req("late"))

    run(body(), timeout=30)


def test_close_during_start_of_a_given_executor_sticks(ex: InProcessExecutor) -> None:
    """Defect 2, as the issue tried it: ``t = create_task(start()); sleep(0); close(); t``."""

    async def body() -> None:
        engine = AsyncDiffusionEngine(ex)
        t = asyncio.create_task(engine.start())
        await asyncio.sleep(0)
        await engine.close()
        with pytest.raises(EngineClosed):
            await t
        assert engine.closed and not engine.started
        with pytest.raises(EngineClosed):
            await engine.generate(req("r"))

    run(body(), timeout=30)


@pytest.mark.slow
def test_a_close_that_stops_waiting_for_the_factory_still_gets_its_executor_shut_down() -> None:
    """close(timeout=) bounds its wait for a slow factory; the start-up, when the factory
    returns, finds the engine CLOSED and shuts the executor down (no illegal step)."""
    built: list[InProcessExecutor] = []

    def factory() -> InProcessExecutor:
        time.sleep(1.0)
        built.append(InProcessExecutor(make_toy, deadlines=RELAXED))
        return built[-1]

    async def body() -> None:
        engine = AsyncDiffusionEngine.from_factory(factory)
        start = asyncio.create_task(engine.start())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await engine.close(timeout=0.2)
        assert time.monotonic() - t0 < 0.8 and engine.state is EngineState.CLOSED
        with pytest.raises(EngineClosed, match="closed while it started"):
            await asyncio.wait_for(start, 10.0)
        assert len(built) == 1
        with pytest.raises(Exception, match="shut down|closed"):
            built[0].submit(req("late"))

    run(body(), timeout=30)


@pytest.mark.slow
def test_a_cancelled_start_shuts_down_the_executor_its_factory_was_building() -> None:
    """Defect 3: cancelling start() while the factory built a MultiprocDiffusionExecutor
    leaked it (its worker alive for ever) and close() hung."""
    built: list[MultiprocDiffusionExecutor] = []
    factory_entered = threading.Event()

    def factory() -> MultiprocDiffusionExecutor:
        factory_entered.set()
        built.append(MultiprocDiffusionExecutor(SCRIPTED, deadlines=RELAXED))
        return built[-1]

    async def body() -> None:
        engine = AsyncDiffusionEngine.from_factory(factory)
        start = asyncio.create_task(engine.start())
        assert await in_thread(lambda: factory_entered.wait(10))
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        # close waits for the start-up to give up (the factory returns, its executor is shut down).
        await asyncio.wait_for(engine.close(), 60.0)
        assert engine.closed
        assert len(built) == 1
        pids = [p.pid for p in built[0].procs if p.pid is not None]
        assert pids
        await eventually(lambda: not any(alive(pid) for pid in pids), 10.0, "the worker gone")

    run(body(), timeout=120)


@pytest.mark.slow
def test_close_timeout_bounds_a_host_stage_that_does_not_return(
    ex: InProcessExecutor, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect 4, the host-stage half: close(timeout=1.0) waited for a stuck host stage."""
    stuck = threading.Event()
    entered = threading.Event()

    def host(output: DiffusionOutput) -> object:
        entered.set()
        stuck.wait(7.0)
        return 0

    register_postprocess(PostProcess("edge-stuck-host", host=host), replace=True)

    async def body() -> None:
        engine = AsyncDiffusionEngine(ex, pipeline="edge-stuck-host")
        await engine.start()
        call = asyncio.create_task(engine.generate(req("r")))
        assert await in_thread(lambda: entered.wait(10))
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="omni_async.engine.engine"):
            await engine.close(timeout=1.0)
        took = time.monotonic() - t0
        assert took < 2.5, took
        assert "host stage" in caplog.text and "abandoned" in caplog.text
        with pytest.raises(EngineClosed):
            await call

    try:
        run(body(), timeout=30)
    finally:
        stuck.set()


@pytest.mark.slow
def test_close_timeout_bounds_a_forward_that_ignores_cancel() -> None:
    """Defect 4, the executor half: close(timeout=1.0) with a 10 s forward in flight took
    5.1 s (each worker joined for 5 s in turn before it was terminated)."""
    built: list[MultiprocDiffusionExecutor] = []

    def factory() -> MultiprocDiffusionExecutor:
        built.append(MultiprocDiffusionExecutor(SCRIPTED, world_size=2, deadlines=RELAXED))
        return built[-1]

    async def body() -> None:
        engine = AsyncDiffusionEngine.from_factory(factory)
        await engine.start()
        call = asyncio.create_task(engine.generate(DiffusionRequest("slow", {"sleep": 10.0})))
        await eventually(lambda: engine.stage_of("slow") is StageState.COMPUTING, 10.0, "computing")
        await asyncio.sleep(0.3)  # the forward is under way on both ranks
        t0 = time.monotonic()
        await engine.close(timeout=1.0)
        took = time.monotonic() - t0
        assert took < 2.5, took
        with pytest.raises(EngineClosed):
            await call
        pids = [p.pid for p in built[0].procs if p.pid is not None]
        await eventually(lambda: not any(alive(pid) for pid in pids), 5.0, "the workers gone")

    run(body(), timeout=60)


# -- the control path -------------------------------------------------------------------


@pytest.mark.slow
def test_an_abort_does_not_wait_behind_a_send_that_a_full_pipe_blocks() -> None:
    """Defect 5: A computes (10 s, cancellable); B's 4 MB parameter blocks its send on the
    worker's full pipe; abort("A", wait=True) waited behind that send for A's whole forward."""
    ex = MultiprocDiffusionExecutor(SCRIPTED, deadlines=RELAXED)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_running=2) as engine:
            a = asyncio.create_task(engine.generate(DiffusionRequest("A", {"cancellable_sleep": 10.0})))
            await eventually(lambda: engine.stage_of("A") is StageState.COMPUTING, 10.0, "A computing")
            await asyncio.sleep(0.2)
            b = asyncio.create_task(engine.generate(DiffusionRequest("B", {"blob": b"x" * (4 << 20)})))
            await eventually(lambda: engine.stage_of("B") is StageState.SUBMITTED, 10.0, "B sending")
            await asyncio.sleep(0.3)  # B's send is blocked on the pipe by now
            t0 = time.monotonic()
            await asyncio.wait_for(engine.abort("A", wait=True), 8.0)
            took = time.monotonic() - t0
            assert took < 3.0, took
            with pytest.raises(RequestAborted):
                await a
            result = await asyncio.wait_for(b, 30.0)  # B goes on once A stopped
            assert result.request_id == "B"
            await assert_quiescent(engine)

    try:
        run(body(), timeout=90)
    finally:
        ex.shutdown()


# -- accounting -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_stream_whose_chunk_expired_is_counted_failed() -> None:
    """Defect 6: a chunk past its output deadline raised OutputTimeout to the consumer, yet
    the request was counted finished (its result had been set at the forward's end)."""
    ex = InProcessExecutor(make_toy, deadlines=Deadlines(compute_timeout=60, output_timeout=0.3, rpc_timeout=60))

    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            stream = engine.generate_stream(req("s", chunks=2))
            await stream.__anext__()  # the first chunk; the forward ends at once
            await eventually(lambda: engine.stage_of("s") is StageState.RESOLVED, 10.0, "the result set")
            await asyncio.sleep(1.0)  # the consumer comes back after the second chunk expired
            with pytest.raises(OutputTimeout):
                async for _ in stream:
                    pass
            await eventually(lambda: len(engine) == 0, 10.0, "the request gone")
            counts = engine.metrics().requests
            assert counts["failed"] == 1 and counts["finished"] == 0, counts
            await assert_quiescent(engine)

    try:
        run(body(), timeout=60)
    finally:
        ex.shutdown()


def test_a_consumer_that_leaves_after_the_forward_is_counted_cancelled(ex: InProcessExecutor) -> None:
    """Defect 6, the other half: a consumer that left a stream after the forward finished."""

    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            stream = engine.generate_stream(req("s", chunks=3))
            first = await stream.__anext__()
            assert first.request_id == "s"
            await eventually(lambda: engine.stage_of("s") is StageState.RESOLVED, 10.0, "the result set")
            await stream.aclose()
            counts = engine.metrics().requests
            assert counts["cancelled"] == 1 and counts["finished"] == 0, counts
            assert sum(counts.values()) == 1
            await assert_quiescent(engine)

    run(body(), timeout=60)


def test_every_request_is_counted_once_whatever_ends_it(ex: InProcessExecutor) -> None:
    """Finished, aborted while waiting and while computing, cancelled, closed: the counts
    add up to the requests, each under the end it had."""
    gate = gate_name()

    async def body() -> None:
        engine = AsyncDiffusionEngine(ex, max_running=1)
        await engine.start()
        assert (await engine.generate(req("ok"))).request_id == "ok"
        computing = asyncio.create_task(engine.generate(req("computing", gate=gate)))
        await eventually(lambda: engine.stage_of("computing") is StageState.COMPUTING)
        waiting = asyncio.create_task(engine.generate(req("waiting")))
        leaving = asyncio.create_task(engine.generate(req("leaving")))
        closing = asyncio.create_task(engine.generate(req("closing")))
        await eventually(lambda: engine.stage_of("closing") is StageState.WAITING)
        await engine.abort(["waiting"])
        leaving.cancel()
        # Aborted while it computes (its generate raises at once), and the engine closing
        # before its forward returns: "closing" never gets the running slot.  (Closing only
        # after the abort had completed let "closing" run and finish first, now and then,
        # on a loaded machine.)
        await engine.abort("computing")
        closed = asyncio.create_task(engine.close())
        await eventually(lambda: engine.closed)
        GATES.open(gate)
        await closed
        for t, exc in ((computing, RequestAborted), (waiting, RequestAborted), (closing, EngineClosed)):
            with pytest.raises(exc):
                await t
        with pytest.raises(asyncio.CancelledError):
            await leaving
        counts = engine.metrics().requests
        assert counts == {"finished": 1, "aborted": 2, "cancelled": 1, "closed": 1, "failed": 0, "rejected": 0}, counts

    run(body(), timeout=60)


def test_the_blocking_generate_times_out_after_the_request_is_gone() -> None:
    """Defect 7: generate(timeout=) raised an empty TimeoutError before the request was
    released, so a retry with the same id was refused.  A model that checks for
    cancellation between its steps: the call returns at once, the request gone."""
    ex = InProcessExecutor(lambda rank: TinyDiffusionWorker(width=16), deadlines=RELAXED)
    try:
        with DiffusionEngine(ex) as engine:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"request 'r'.*0\.3 s.*aborted and released"):
                engine.generate(DiffusionRequest("r", {"height": 8, "steps": 500, "step_ms": 10}), timeout=0.3)
            assert time.monotonic() - t0 < 3.0
            assert len(engine.engine) == 0
            again = engine.generate(DiffusionRequest("r", {"height": 8}), timeout=30)
            assert again.request_id == "r"
            counts = engine.metrics().requests
            assert counts["finished"] == 1 and counts["cancelled"] == 1, counts
    finally:
        ex.shutdown()


# -- errors at the call -----------------------------------------------------------------


def _refuse_bad(request: DiffusionRequest) -> None:
    if "bad" in request.params:
        raise InvalidRequest(request.request_id, "bad", "is refused by this model")


def test_an_invalid_request_fails_at_the_call_while_the_running_slot_is_busy() -> None:
    """Defect 8: a request the model's validate_request refuses waited in the queue for
    the running slot before it failed."""
    ex = InProcessExecutor(make_toy, deadlines=RELAXED, validate_request=_refuse_bad)
    gate = gate_name()

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_running=1) as engine:
            busy = asyncio.create_task(engine.generate(req("busy", gate=gate)))
            await eventually(lambda: engine.stage_of("busy") is StageState.COMPUTING)
            t0 = time.monotonic()
            with pytest.raises(InvalidRequest, match="'bad'"):
                await engine.generate(req("invalid", bad=1))
            assert time.monotonic() - t0 < 1.0
            assert engine.stage_of("invalid") is None and engine.metrics().requests["rejected"] == 1
            GATES.open(gate)
            await busy
            # Issue 29: the engine goes on serving after a refusal (its loop task alive).
            engine.check_health()
            assert (await engine.generate(req("after"))).request_id == "after"
            assert engine.metrics().loop_alive

    try:
        run(body(), timeout=30)
    finally:
        GATES.open(gate)
        ex.shutdown()


@pytest.mark.slow
def test_a_parameter_that_does_not_pickle_fails_its_request_not_the_engine() -> None:
    """Defect 10: a parameter that does not pickle raised ExecutorShutdown from a healthy
    executor; now the request fails with RequestNotSendable naming it, and the next one
    is served.  Issue 29: it was counted ``failed``; refused at the call, it is ``rejected``."""
    ex = MultiprocDiffusionExecutor(SCRIPTED, deadlines=RELAXED)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            with pytest.raises(RequestNotSendable, match="'lock'") as info:
                await engine.generate(DiffusionRequest("odd", {"lock": threading.Lock()}))
            assert info.value.request_id == "odd" and info.value.parameter == "lock"
            engine.check_health()
            assert (await engine.generate(DiffusionRequest("next", {}))).request_id == "next"
            # Refused at the call (its data does not travel): rejected, not failed.
            counts = engine.metrics().requests
            assert counts["rejected"] == 1 and counts["failed"] == 0, counts
            await assert_quiescent(engine)

    try:
        run(body(), timeout=60)
    finally:
        ex.shutdown()


@pytest.mark.parametrize("ids", [123, None, [7], b"r", ["r", 7], {"r": 1}])
def test_abort_refuses_anything_but_ids_with_one_error(ex: InProcessExecutor, ids: object) -> None:
    """Defect 9: abort(123) and abort(None) raised a bare TypeError, abort([7]) UsageError."""

    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            with pytest.raises(UsageError, match="abort: request"):
                await engine.abort(ids)  # type: ignore[arg-type]

    run(body(), timeout=30)


def test_generate_from_another_event_loop_is_refused_and_leaves_nothing(ex: InProcessExecutor) -> None:
    """Defect 11: generate awaited on another thread's loop raised a raw RuntimeError and
    left the request in the engine until close."""

    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            caught: list[BaseException] = []

            def elsewhere() -> None:
                try:
                    asyncio.run(engine.generate(req("r")))
                except BaseException as exc:
                    caught.append(exc)

            await in_thread(elsewhere)
            assert len(caught) == 1 and isinstance(caught[0], UsageError), caught
            assert "another event loop" in str(caught[0])
            assert len(engine) == 0
            assert (await engine.generate(req("r"))).request_id == "r"

    run(body(), timeout=30)
