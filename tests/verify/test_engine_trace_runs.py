"""Trace validation of real engine runs: ``AsyncDiffusionEngine(tracer=...)`` records
every step of its machines, and TLC confirms each recorded run is a behaviour of
``tla/EngineLifecycle.tla`` (through ``tla/TraceEngine.tla``): finished requests, aborts
while waiting and while computing, a caller that leaves, a stream whose consumer
leaves, close with work in flight, close during start, a factory that fails, a start
that is cancelled.  A few requests per run: the trace search grows with the requests
live at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest

from helpers.engine_harness import eventually, in_thread, run
from helpers.executor_harness import GATES, RELAXED, gate_name, make_toy, req
from helpers.tlc import require_tlc
from omni_async.core.engine_states import StageState
from omni_async.core.errors import RequestAborted, RpcFailed
from omni_async.core.trace import TraceEvent
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EngineClosed
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.verify.enginetrace import check_engine_traces
from omni_async.verify.recorder import ListTracer


async def served_and_aborted(tracer: ListTracer) -> None:
    gate = gate_name()
    with InProcessExecutor(make_toy, deadlines=RELAXED) as ex:
        engine = AsyncDiffusionEngine(ex, max_running=1, tracer=tracer)
        await engine.start()
        await engine.generate(req("done"))
        computing = asyncio.create_task(engine.generate(req("computing", gate=gate)))
        await eventually(lambda: engine.stage_of("computing") is StageState.COMPUTING)
        waiting = asyncio.create_task(engine.generate(req("waiting")))
        await eventually(lambda: engine.stage_of("waiting") is StageState.WAITING)
        await engine.abort("waiting")
        aborting = asyncio.create_task(engine.abort("computing", wait=True))
        await asyncio.sleep(0.02)
        GATES.open(gate)
        await aborting
        for t in (computing, waiting):
            with pytest.raises(RequestAborted):
                await t
        await engine.close()


async def left_and_closed(tracer: ListTracer) -> None:
    gate = gate_name()
    with InProcessExecutor(make_toy, deadlines=RELAXED) as ex:
        engine = AsyncDiffusionEngine(ex, tracer=tracer)
        await engine.start()
        leaving = asyncio.create_task(engine.generate(req("leaving", gate=gate)))
        await eventually(lambda: engine.stage_of("leaving") is StageState.COMPUTING)
        leaving.cancel()
        await eventually(lambda: len(engine) == 0)
        open_at_close = asyncio.create_task(engine.generate(req("closing", gate=gate)))
        await eventually(lambda: engine.stage_of("closing") is StageState.COMPUTING)
        closing = asyncio.create_task(engine.close())
        await asyncio.sleep(0.02)
        GATES.open(gate)
        await closing
        with pytest.raises(EngineClosed):
            await open_at_close


async def stream_left(tracer: ListTracer) -> None:
    with InProcessExecutor(make_toy, deadlines=RELAXED) as ex:
        async with AsyncDiffusionEngine(ex, tracer=tracer) as engine:
            stream = engine.generate_stream(req("s", chunks=2))
            await stream.__anext__()
            await stream.aclose()
            items = [item async for item in engine.generate_stream(req("t", chunks=1))]
            assert len(items) == 2


async def close_during_start(tracer: ListTracer) -> None:
    def factory() -> InProcessExecutor:
        time.sleep(0.2)
        return InProcessExecutor(make_toy, deadlines=RELAXED)

    engine = AsyncDiffusionEngine.from_factory(factory, tracer=tracer)
    start = asyncio.create_task(engine.start())
    await asyncio.sleep(0)
    await engine.close()
    with pytest.raises(EngineClosed):
        await start


async def factory_fails(tracer: ListTracer) -> None:
    def factory() -> InProcessExecutor:
        raise RuntimeError("no executor")

    engine = AsyncDiffusionEngine.from_factory(factory, tracer=tracer)
    with pytest.raises(RuntimeError):
        await engine.start()
    await engine.close()


async def start_cancelled(tracer: ListTracer) -> None:
    entered = threading.Event()

    def factory() -> InProcessExecutor:
        entered.set()
        time.sleep(0.2)
        return InProcessExecutor(make_toy, deadlines=RELAXED)

    engine = AsyncDiffusionEngine.from_factory(factory, tracer=tracer)
    start = asyncio.create_task(engine.start())
    assert await in_thread(lambda: entered.wait(10))
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    await engine.close()


async def batched(tracer: ListTracer) -> None:
    """A batch of three: one finishes, one is aborted mid-forward, one's forward raises
    (the batch fails, each member is sent again alone: only it fails); then a batch of
    two streams."""
    gate = gate_name()
    with InProcessExecutor(make_toy, deadlines=RELAXED) as ex:
        async with AsyncDiffusionEngine(
            ex, max_batch_size=3, batch_wait_s=1.0, batch_key=lambda r: "k", tracer=tracer
        ) as engine:
            tasks = [
                asyncio.create_task(engine.generate(req("ok", gate=gate))),
                asyncio.create_task(engine.generate(req("aborted", gate=gate))),
                asyncio.create_task(engine.generate(req("raises", gate=gate, fail_on=[0]))),
            ]
            await eventually(lambda: engine.stage_of("aborted") is StageState.COMPUTING)
            await engine.abort("aborted")
            GATES.open(gate)
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            assert outcomes[0].request_id == "ok"  # type: ignore[union-attr]
            assert isinstance(outcomes[1], RequestAborted) and isinstance(outcomes[2], RpcFailed)
            streams = await asyncio.gather(*(collect(engine.generate_stream(req(f"s{i}", chunks=1))) for i in range(2)))
            assert all(len(items) == 2 for items in streams)
            assert engine.metrics().batch_size_max == 3


async def collect(stream: AsyncIterator[object]) -> list[object]:
    return [item async for item in stream]


RUNS = [batched, served_and_aborted, left_and_closed, stream_left, close_during_start, factory_fails, start_cancelled]


@pytest.mark.tlc
@pytest.mark.slow
def test_recorded_engine_runs_are_behaviours_of_the_engine_model() -> None:
    tc = require_tlc()
    traces: list[list[TraceEvent]] = []
    for scenario in RUNS:
        tracer = ListTracer()
        run(scenario(tracer), timeout=60)
        traces.append(tracer.snapshot())
        assert traces[-1], scenario.__name__
    actions = {e.action for t in traces for e in t}
    assert actions == {"EngineFire", "StageFire"}
    res = check_engine_traces(traces, toolchain=tc)
    assert res.ok, res.summary()
