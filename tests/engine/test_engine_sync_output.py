"""The synchronous output path (``AsyncDiffusionEngine(async_output=False)``,
``execute_request(sync_output=True)``) and the worker's timestamps in each output's
metrics (``omni_async.worker.stamps``, read into ``RequestTimings``), over worker
processes and real shared memory.  Every test ends with nothing in the registry and no
segment left (conftest's autouse fixture checks /dev/shm)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

from helpers.engine_harness import assert_quiescent, eventually, run
from helpers.leaks import kept_for_the_module
from omni_async.core.config import Deadlines
from omni_async.core.errors import RequestAborted, UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EngineClosed
from omni_async.engine.metrics import GenerationResult, RequestTimings
from omni_async.engine.scheduler import SchedulerPhase
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.models.tiny import TinyDiffusionWorker, image_digest
from omni_async.worker.stamps import STAMPS

WIDTH = 128
SPEC = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": WIDTH, "steps": 2})
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


def r(rid: str, **params: object) -> DiffusionRequest:
    return DiffusionRequest(rid, {"height": 256, **params})


@pytest.fixture(scope="module")
def shared() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES))


def _assert_ordered(t: RequestTimings) -> None:
    """One clock for the worker's stamps and the engine's: the steps in the order they happen."""
    assert t.forward_started_at is not None and t.forward_ended_at is not None
    assert t.pack_started_at is not None and t.pack_ended_at is not None
    assert t.postprocess_started_at is not None
    steps = [
        t.enqueued_at,
        t.submitted_at,
        t.forward_started_at,
        t.forward_ended_at,
        t.pack_started_at,
        t.pack_ended_at,
        t.output_ready_at,
        t.postprocess_started_at,
        t.finished_at,
    ]
    assert steps == sorted(steps), steps
    assert t.forward_ended_at <= t.compute_done_at


@pytest.mark.parametrize("async_output", [True, False], ids=["async", "sync"])
@pytest.mark.slow
def test_results_on_either_path_are_intact_and_carry_the_workers_stamps(
    shared: MultiprocDiffusionExecutor, async_output: bool
) -> None:
    reference = TinyDiffusionWorker(width=WIDTH, steps=2)

    async def body() -> None:
        async with AsyncDiffusionEngine(shared, async_output=async_output) as engine:
            results = await asyncio.gather(*(engine.generate(r(f"r{i}", seed=i)) for i in range(5)))
            await assert_quiescent(engine)
            for i, res in enumerate(results):
                image = res.output["image"]
                assert int(image_digest(image)) == int(res.output["digest"])  # bit-exact transport
                expected = reference.execute_model(r("x", seed=i)).output["image"]
                assert torch.allclose(image, expected, atol=0.05)
                assert set(STAMPS) <= set(res.metrics)
                _assert_ordered(res.timings)
                assert res.timings.pack is not None and res.metrics["pack_shm_bytes"] >= 256 * WIDTH * 4
            forwards = sorted((res.timings.forward_started_at, res.timings.forward_ended_at) for res in results)
            for (_, end), (start, _) in zip(forwards, forwards[1:], strict=False):
                assert end is not None and start is not None and start >= end  # one worker: one forward at a time
            if not async_output:
                # The copy ran on the main thread, before the next forward started.
                packs = sorted((res.timings.pack_started_at, res.timings.pack_ended_at) for res in results)
                for (_, pack_end), (next_start, _) in zip(packs, forwards[1:], strict=False):
                    assert pack_end is not None and next_start is not None and next_start >= pack_end
            assert engine.metrics().requests["finished"] == 5

    run(body())


def test_an_abort_during_a_synchronous_call_waits_for_it_and_releases_its_output(
    shared: MultiprocDiffusionExecutor,
) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared, async_output=False, max_running=1) as engine:
            slow = asyncio.create_task(engine.generate(r("slow", steps=10, step_ms=50)))
            queued = asyncio.create_task(engine.generate(r("queued")))
            await eventually(lambda: engine.phase_of("slow") is SchedulerPhase.RUNNING)
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            await engine.abort(["slow", "queued"], wait=True)
            assert time.monotonic() - t0 > 0.1  # the call cannot be cancelled: it ran to its end
            for task in (slow, queued):
                with pytest.raises(RequestAborted):
                    await task
            await assert_quiescent(engine)
            ok = await engine.generate(r("after"))
            assert int(image_digest(ok.output["image"])) == int(ok.output["digest"])

    run(body())


def test_closing_with_synchronous_calls_in_flight_leaves_nothing(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        engine = AsyncDiffusionEngine(shared, async_output=False)
        await engine.start()
        tasks = [asyncio.create_task(engine.generate(r(f"c{i}", steps=4, step_ms=20))) for i in range(4)]
        await eventually(lambda: engine.phase_of("c0") is SchedulerPhase.RUNNING)
        await engine.close()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        # EngineClosed, or (a call that answered as the close began) its result.
        assert all(isinstance(o, (EngineClosed, GenerationResult)) for o in outcomes), outcomes
        assert any(isinstance(o, EngineClosed) for o in outcomes), outcomes
        await eventually(lambda: not shared.metrics().held_payloads and not shared.pool.stats().outstanding)

    run(body())


def test_streaming_needs_the_asynchronous_path(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared, async_output=False) as engine:
            with pytest.raises(UsageError, match="async_output=True"):
                async for _ in engine.generate_stream(r("s")):
                    pass

    run(body())


def test_async_output_must_be_a_bool(shared: MultiprocDiffusionExecutor) -> None:
    with pytest.raises(UsageError, match="async_output must be a bool"):
        AsyncDiffusionEngine(shared, async_output=1)  # type: ignore[arg-type]


def test_execute_request_sync_output_in_request_mode(shared: MultiprocDiffusionExecutor) -> None:
    ro = shared.execute_request(r("direct", seed=3), sync_output=True)
    assert ro.finished and ro.async_output_id is None and ro.result is not None
    out = ro.result
    try:
        assert int(image_digest(out.output["image"])) == int(out.output["digest"])
        assert set(STAMPS) <= set(out.metrics)
        assert out.metrics["forward_ended_at"] <= out.metrics["pack_started_at"] <= out.metrics["pack_ended_at"]
    finally:
        assert shared.release_output(out) == 1
    with pytest.raises(UsageError, match="exclude each other"):
        shared.execute_request(r("both"), sync_output=True, final_step_async=True)
    with pytest.raises(UsageError, match="sync_output must be a bool"):
        shared.execute_request(r("bad"), sync_output="yes")  # type: ignore[arg-type]


def test_in_process_workers_stamp_their_outputs_on_both_paths() -> None:
    ex = InProcessExecutor(lambda rank: TinyDiffusionWorker(width=WIDTH, steps=2), deadlines=DEADLINES)
    try:

        async def body() -> None:
            for async_output in (True, False):
                async with AsyncDiffusionEngine(ex, async_output=async_output) as engine:
                    res = await engine.generate(r(f"p-{async_output}"))
                    _assert_ordered(res.timings)

        run(body())
    finally:
        ex.shutdown()
