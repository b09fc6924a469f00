"""AsyncDiffusionEngine end to end over worker processes (MultiprocDiffusionExecutor,
the reference model on CPU, real shared memory): results and timings, many more
requests than the budget of held outputs, aborts and cancelled tasks with a slow
forward, deadlines, worker death, close with work in flight, the event loop never
blocked, Prometheus.  Every test ends with nothing in the registry and no segment
left (conftest's autouse fixture checks /dev/shm).

The tests that take ``make`` (directly or through ``shared``) run over both transports:
``MultiprocDiffusionExecutor`` and ``RayDiffusionExecutor`` (one actor per rank, on the
session's two-node Ray cluster: the reply rank on the other node, so every output the
engine takes crosses through Ray's object store; skipped where Ray is not installed).  The model checks
cancellation between its steps (``step_ms``), so an abort stops the forward on both."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from helpers.engine_harness import assert_quiescent, eventually, run
from helpers.executors import KINDS, executor_class, worker_pids
from helpers.leaks import kept_for_the_module
from omni_async.core.config import Deadlines
from omni_async.core.errors import ComputeTimeout, RequestAborted, WorkerDied
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EngineClosed, PostProcessFailed
from omni_async.engine.scheduler import SchedulerPhase
from omni_async.executor.metrics import HeldOutputMetrics
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.models.tiny import TinyDiffusionWorker, image_digest
from omni_async.transport.errors import OutputStillViewed
from omni_async.worker.postprocess import PostProcess, register_postprocess

WIDTH = 128
SPEC = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": WIDTH, "steps": 2})
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


def r(rid: str, **params: object) -> DiffusionRequest:
    return DiffusionRequest(rid, {"height": 256, **params})


Make = Callable[..., MultiprocDiffusionExecutor]


@pytest.fixture(scope="module", params=KINDS)
def make(request: pytest.FixtureRequest) -> Make:
    """The executor class under test (both take the same arguments here)."""
    return executor_class(request.param, request)


@pytest.fixture(scope="module")
def shared(make: Make) -> Iterator[MultiprocDiffusionExecutor]:
    """One executor for the tests that leave it healthy (each checks it quiescent)."""
    yield from kept_for_the_module(make(SPEC, deadlines=DEADLINES))


def test_results_are_owned_copies_with_their_timings(shared: MultiprocDiffusionExecutor) -> None:
    reference = TinyDiffusionWorker(width=WIDTH, steps=2)

    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            results = await asyncio.gather(*(engine.generate(r(f"r{i}", seed=i)) for i in range(6)))
            await assert_quiescent(engine)  # every segment is back while the results live on
            for i, res in enumerate(results):
                image = res.output["image"]
                assert tuple(image.shape) == (256, WIDTH)
                assert int(image_digest(image)) == int(res.output["digest"])  # bit-exact transport
                expected = reference.execute_model(r("x", seed=i)).output["image"]
                assert torch.allclose(image, expected, atol=0.05)
                t = res.timings
                assert t.pack is not None and t.pack > 0
                assert res.metrics.get("pack_shm_bytes", 0) + res.metrics.get("pack_stored_bytes", 0) >= 256 * WIDTH * 4
            m = engine.metrics()
            assert m.requests["finished"] == 6 and m.largest_output_bytes >= 256 * WIDTH * 4
            assert isinstance(m.executor, HeldOutputMetrics), m.executor
            assert m.executor.held_outputs == 0 and m.pack_bytes_total > 0

    run(body())


def _slow_consumer(out: DiffusionOutput) -> torch.Tensor:
    time.sleep(0.05)
    image: torch.Tensor = out.output["image"]
    return image.clone()


register_postprocess(PostProcess("engine-mp-slow-consumer", host=_slow_consumer))


@pytest.mark.slow
def test_many_more_requests_than_the_budget_wait_in_the_engine_not_in_the_packer() -> None:
    """40 requests submitted at once and consumed slowly (a 50 ms host stage on one
    thread, against 10 ms forwards), with a budget of 4 held outputs and a 1 s output
    deadline: they queue in the engine, the packer never waits for room, no output
    expires, and never more than 4 outputs are held."""
    deadlines = Deadlines(compute_timeout=60, output_timeout=1.0, rpc_timeout=60)
    ex = MultiprocDiffusionExecutor(SPEC, deadlines=deadlines, max_held_outputs=4)

    async def body() -> None:
        async with AsyncDiffusionEngine(
            ex, max_running=2, pipeline="engine-mp-slow-consumer", postprocess_workers=1
        ) as engine:
            assert engine.metrics().in_flight_limit == 4
            held: list[float] = []
            stop = asyncio.Event()

            async def watch() -> None:
                while not stop.is_set():
                    held.append(ex.metrics().held_outputs)
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            t0 = time.monotonic()
            tasks = [asyncio.create_task(engine.generate(r(f"r{i}", seed=i, step_ms=5))) for i in range(40)]
            await asyncio.sleep(1.5)  # "consume later": longer than the output deadline
            results = await asyncio.gather(*tasks)
            stop.set()
            await watcher
            assert [x.request_id for x in results] == [f"r{i}" for i in range(40)]
            assert time.monotonic() - t0 > 2.0
            m = engine.metrics()
            assert isinstance(m.executor, HeldOutputMetrics), m.executor
            assert m.executor.pool_waits == 0 and m.executor.timeouts == 0, m.executor
            assert max(held) <= 4, max(held)
            assert m.budget_waits >= 1  # the budget, not max_running, held requests back
            await assert_quiescent(engine)

    try:
        run(body())
    finally:
        ex.shutdown()


@pytest.mark.parametrize("wait", [True, False])
def test_abort_during_a_forward_stops_it_at_the_next_step(shared: MultiprocDiffusionExecutor, wait: bool) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared, max_running=1) as engine:
            slow = asyncio.create_task(engine.generate(r("slow", steps=200, step_ms=50)))  # 10 s uncancelled
            queued = asyncio.create_task(engine.generate(r("queued")))
            await eventually(lambda: engine.phase_of("slow") is SchedulerPhase.RUNNING)
            await asyncio.sleep(0.3)  # inside the forward
            assert engine.phase_of("queued") is SchedulerPhase.WAITING
            t0 = time.monotonic()
            await engine.abort(["slow", "queued"], wait=wait)
            for task in (slow, queued):
                with pytest.raises(RequestAborted):
                    await task
            await assert_quiescent(engine)
            assert time.monotonic() - t0 < 5.0  # stopped at a step, not run to its end

    run(body())


@pytest.mark.slow
def test_abort_with_wait_of_a_forward_that_ignores_cancellation_returns_once_it_is_gone(
    shared: MultiprocDiffusionExecutor,
) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            task = asyncio.create_task(engine.generate(r("stubborn", steps=20, step_ms=50, ignore_cancel=True)))
            await eventually(lambda: engine.phase_of("stubborn") is SchedulerPhase.RUNNING)
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            await engine.abort("stubborn", wait=True)
            assert time.monotonic() - t0 > 0.3  # it waited for the forward's end
            assert len(engine) == 0
            m = shared.metrics()
            assert m.pending_rpcs == 0 and m.pending_outputs == 0
            with pytest.raises(RequestAborted):
                await task
            await assert_quiescent(engine)

    run(body())


def test_abort_while_post_processing_releases_the_segment(shared: MultiprocDiffusionExecutor) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(out: DiffusionOutput) -> torch.Tensor:
        entered.set()
        assert release.wait(30)
        image: torch.Tensor = out.output["image"]
        return image.clone()

    register_postprocess(PostProcess("engine-mp-slow", host=slow, host_reads_only=True), replace=True)

    async def body() -> None:
        async with AsyncDiffusionEngine(shared, pipeline="engine-mp-slow") as engine:
            task = asyncio.create_task(engine.generate(r("pp")))
            assert await asyncio.to_thread(entered.wait, 30)
            assert shared.metrics().held_outputs == 1
            aborting = asyncio.create_task(engine.abort("pp", wait=True))
            with pytest.raises(RequestAborted):
                await task
            release.set()
            await aborting
            assert shared.metrics().held_outputs == 0
            await assert_quiescent(engine)

    run(body())


def _keeps_a_view(out: DiffusionOutput) -> torch.Tensor:
    image: torch.Tensor = out.output["image"]
    return image[:4]  # a view of the segment: not allowed


register_postprocess(PostProcess("engine-mp-view", host=_keeps_a_view, host_reads_only=True))


def test_a_host_stage_that_returns_a_view_fails_typed_and_leaks_nothing(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared, pipeline="engine-mp-view") as engine:
            with pytest.raises(PostProcessFailed, match="still views the output's shared memory") as err:
                await engine.generate(r("v"))
            assert isinstance(err.value.__cause__, OutputStillViewed)
            await assert_quiescent(engine)

    run(body())


def test_a_cancelled_generate_task_releases_everything(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            task = asyncio.create_task(engine.generate(r("c", steps=100, step_ms=50)))
            await eventually(lambda: engine.phase_of("c") is SchedulerPhase.RUNNING)
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await assert_quiescent(engine, timeout=10)
            assert engine.metrics().requests["cancelled"] == 1

    run(body())


def test_a_per_request_compute_deadline_stops_the_forward(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            t0 = time.monotonic()
            with pytest.raises(ComputeTimeout):
                await engine.generate(
                    r("late", steps=200, step_ms=50), deadlines=Deadlines(compute_timeout=0.5, output_timeout=10)
                )
            assert time.monotonic() - t0 < 5.0
            ok = await engine.generate(r("next"))  # the worker is free again: the forward stopped
            assert ok.request_id == "next"
            assert engine.metrics().requests["failed"] == 1
            await assert_quiescent(engine)

    run(body())


@pytest.mark.slow
def test_the_event_loop_is_never_blocked_while_outputs_are_pending(shared: MultiprocDiffusionExecutor) -> None:
    """A ticker keeps its cadence while requests with slow forwards (~1 s) and sizable
    outputs (2 MB) go through: a blocking wait on any executor future would stall it
    for a whole forward."""

    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            gaps: list[float] = []
            stop = asyncio.Event()

            async def ticker() -> None:
                last = time.monotonic()
                while not stop.is_set():
                    await asyncio.sleep(0.01)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            tick = asyncio.create_task(ticker())
            await asyncio.gather(*(engine.generate(r(f"t{i}", height=4096, steps=20, step_ms=50)) for i in range(3)))
            stop.set()
            await tick
            assert len(gaps) > 50
            assert max(gaps) < 0.5, f"the event loop stalled for {max(gaps):.3f} s"
            await assert_quiescent(engine)

    run(body())


def test_prometheus_export_of_one_engine(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            await asyncio.gather(*(engine.generate(r(f"p{i}")) for i in range(3)))
            text = generate_latest(engine.prometheus_registry()).decode()
            assert 'omni_async_engine_requests_total{outcome="finished"} 3.0' in text
            assert 'omni_async_engine_request_seconds_count{stage="forward"} 3.0' in text
            assert 'omni_async_engine_request_seconds_bucket{le="+Inf",stage="total"} 3.0' in text
            assert "omni_async_executor_outputs_held 0.0" in text
            assert "omni_async_pump_up 1.0" in text and "omni_async_workers_up 1.0" in text
            assert "omni_async_engine_loop_up 1.0" in text
            # From another thread (an HTTP scrape): taken on the engine's loop.
            other = await asyncio.to_thread(lambda: generate_latest(engine.prometheus_registry()).decode())
            assert 'outcome="finished"} 3.0' in other
            await assert_quiescent(engine)

    run(body())


@pytest.mark.slow
def test_a_dead_worker_fails_its_request_and_health(make: Make) -> None:
    """SIGKILL of the worker (on Ray: of its actor's process) mid-forward: the typed death
    error (``ActorDied`` is a ``WorkerDied``) for the request and every later call."""
    ex = make(SPEC, deadlines=DEADLINES)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            task = asyncio.create_task(engine.generate(r("doomed", steps=200, step_ms=50)))
            await eventually(lambda: engine.phase_of("doomed") is SchedulerPhase.RUNNING)
            await asyncio.sleep(0.2)
            os.kill(worker_pids(ex)[0], signal.SIGKILL)
            with pytest.raises(WorkerDied):
                await task
            with pytest.raises(WorkerDied):
                engine.check_health()
            with pytest.raises(WorkerDied):
                await engine.generate(r("after"))
            m = engine.metrics()
            assert not m.executor_healthy and m.requests["failed"] == 2

    try:
        run(body())
    finally:
        ex.shutdown()


@pytest.mark.slow
def test_close_with_work_in_flight_fails_it_and_leaves_nothing(make: Make) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(out: DiffusionOutput) -> float:
        entered.set()
        release.wait(30)
        return float(out.output["image"].sum())

    register_postprocess(PostProcess("engine-mp-close", host=slow), replace=True)

    async def body() -> None:
        engine = AsyncDiffusionEngine.from_factory(
            lambda: make(SPEC, deadlines=DEADLINES), pipeline="engine-mp-close", max_running=1
        )
        await engine.start()
        ex = engine.executor
        post = asyncio.create_task(engine.generate(r("post")))
        assert await asyncio.to_thread(entered.wait, 30)
        computing = asyncio.create_task(engine.generate(r("computing", steps=200, step_ms=50)))
        await eventually(lambda: engine.phase_of("computing") is SchedulerPhase.RUNNING)
        waiting = asyncio.create_task(engine.generate(r("waiting")))
        await asyncio.sleep(0.2)
        closing = asyncio.create_task(engine.close())
        for t in (post, computing, waiting):
            with pytest.raises(EngineClosed):
                await t
        # "post" is still in its host stage, held by ``release``: close must not return
        # before it is gone (nothing opens that gate until this was checked).
        done, _ = await asyncio.wait([closing], timeout=0.5)
        assert not done, "close returned while a request's host stage still ran"
        release.set()
        await closing
        assert ex._closed and len(ex.registry) == 0 and len(engine) == 0
        assert engine.metrics().requests["closed"] == 3

    run(body())


@pytest.mark.slow
def test_the_tiny_pipeline_converts_on_the_worker_and_builds_images_in_the_engine() -> None:
    """pipeline "tiny": the device stage ships uint8 (a quarter of the bytes), the host
    stage returns a PIL image that owns its pixels."""
    spec = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": WIDTH, "steps": 2}, postprocess="tiny")
    reference = TinyDiffusionWorker(width=WIDTH, steps=2)

    async def body() -> None:
        engine = AsyncDiffusionEngine.from_factory(
            lambda: MultiprocDiffusionExecutor(spec, deadlines=DEADLINES), pipeline="tiny"
        )
        async with engine:
            results = await asyncio.gather(*(engine.generate(r(f"i{i}", height=1024, seed=i)) for i in range(3)))
            await assert_quiescent(engine)
        for i, res in enumerate(results):
            image = res.output
            assert (image.mode, image.size) == ("L", (WIDTH, 1024))
            assert res.metrics["pack_shm_bytes"] == 1024 * WIDTH  # uint8 crossed, not float32
            expected = reference.execute_model(r("x", height=1024, seed=i)).output["image"]
            got = torch.from_numpy(np.array(image)).to(torch.float32)
            assert float((got - expected.round()).abs().max()) <= 1.0

    run(body())
