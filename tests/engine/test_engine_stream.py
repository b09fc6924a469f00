"""``AsyncDiffusionEngine.generate_stream`` over worker processes (``MultiprocDiffusionExecutor``,
the reference model streaming previews, real shared memory): chunks in order then the
result, post-processed and owning their memory; a failed chunk or call ends the stream
with its typed error; closing the iterator early, cancelling its task, an abort and
close all release everything; a slow consumer holds no more than the budget and the
engine post-processes nothing ahead of it.  Every test ends quiescent: nothing in the
engine, the registry empty, no segment held (conftest's autouse fixture checks /dev/shm).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import generate_latest

from helpers.engine_harness import assert_quiescent, executor_quiet, run
from helpers.leaks import kept_for_the_module
from omni_async.core.config import Deadlines
from omni_async.core.errors import RemoteError, RequestAborted, RpcFailed
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EngineClosed
from omni_async.engine.metrics import GenerationChunk, GenerationResult
from omni_async.engine.sync import DiffusionEngine
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.models.tiny import image_digest
from omni_async.transport.packing import settle_releases
from omni_async.worker.postprocess import PostProcess, register_postprocess

WIDTH = 128
SPEC = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": WIDTH, "steps": 6})
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


def r(rid: str, **params: object) -> DiffusionRequest:
    return DiffusionRequest(rid, {"height": 256, **params})


@pytest.fixture(scope="module")
def shared() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES))


def nothing_left(engine: AsyncDiffusionEngine) -> None:
    """Quiescent *now* (no waiting): what an awaited close or abort must guarantee."""
    settle_releases()
    assert len(engine) == 0
    assert not any(executor_quiet(engine.executor).values()), executor_quiet(engine.executor)


@pytest.mark.slow
def test_chunks_come_in_order_post_processed_then_the_result(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            items = [item async for item in engine.generate_stream(r("a", seed=1, preview_every=2))]
            await assert_quiescent(engine)  # every segment is back while the items live on
            *chunks, result = items
            assert all(isinstance(c, GenerationChunk) for c in chunks) and isinstance(result, GenerationResult)
            assert [c.seq for c in chunks if isinstance(c, GenerationChunk)] == [0, 1, 2]
            assert [c.output["info"]["step"] for c in chunks] == [2, 4, 6]
            for c in chunks:
                assert int(image_digest(c.output["image"])) == int(c.output["digest"])  # owned, bit-exact
            assert torch.equal(chunks[-1].output["image"], result.output["image"])
            assert result.timings.forward > 0 and engine.metrics().requests["finished"] == 1
            assert engine.metrics().chunks == 3 and engine.metrics().as_dict()["chunks"] == 3
            text = generate_latest(engine.prometheus_registry()).decode()
            assert "omni_async_engine_chunks_total 3.0" in text

    run(body())


def test_a_failed_chunk_ends_the_stream_with_its_typed_failure(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            got: list[object] = []
            with pytest.raises(RemoteError) as info:
                async for item in engine.generate_stream(r("f", preview_every=1, unpackable_preview=True, step_ms=20)):
                    got.append(item)
            assert info.value.failure.type_name == "UnsupportedOutputType" and got == []
            await assert_quiescent(engine)
            assert engine.metrics().requests["failed"] == 1

    run(body())


def test_a_failed_call_ends_the_stream_with_its_error(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            seqs = []
            with pytest.raises(RpcFailed, match="at step 2"):
                async for item in engine.generate_stream(r("g", preview_every=1, raise_at_step=2)):
                    assert isinstance(item, GenerationChunk)
                    seqs.append(item.seq)
            assert seqs == [0, 1][: len(seqs)]
            await assert_quiescent(engine)

    run(body())


def test_closing_the_iterator_early_releases_everything_before_aclose_returns(
    shared: MultiprocDiffusionExecutor,
) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            it = engine.generate_stream(r("c", preview_every=1, steps=40, step_ms=20))
            async with contextlib.aclosing(it):
                async for item in it:
                    assert isinstance(item, GenerationChunk) and item.seq == 0
                    await asyncio.sleep(0.1)  # more chunks announced meanwhile, none taken
                    break
            nothing_left(engine)  # aclose returned: nothing of the request remains
            assert engine.metrics().requests["cancelled"] == 1
            # The forward was stopped, not run to its end.
            assert (await asyncio.to_thread(shared.worker_metrics))[0].aborted_calls >= 1

    run(body())


def test_cancelling_the_consuming_task_mid_stream_releases_everything(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            first = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate_stream(r("t", preview_every=1, steps=40, step_ms=20)):
                    first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await assert_quiescent(engine)

    run(body())


def test_abort_mid_stream_raises_request_aborted_and_wait_leaves_nothing(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            seen: list[int] = []

            async def consume() -> None:
                async for item in engine.generate_stream(r("x", preview_every=1, steps=40, step_ms=20)):
                    assert isinstance(item, GenerationChunk)
                    seen.append(item.seq)
                    if item.seq == 1:
                        await engine.abort("x", wait=True)
                        nothing_left(engine)

            with pytest.raises(RequestAborted):
                await consume()
            assert seen == [0, 1]
            await assert_quiescent(engine)
            assert engine.metrics().requests["aborted"] == 1

    run(body())


def test_close_mid_stream_fails_it_with_engine_closed(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        engine = AsyncDiffusionEngine(shared)
        await engine.start()
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate_stream(r("z", preview_every=1, steps=40, step_ms=20)):
                started.set()
                await asyncio.sleep(0.05)

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        await engine.close()
        with pytest.raises(EngineClosed):
            await task
        nothing_left(engine)

    run(body())


class CountingHost:
    """A host stage that counts its calls (an owned copy of the image)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, output: DiffusionOutput) -> torch.Tensor:
        with self.lock:
            self.calls += 1
        image: torch.Tensor = output.output["image"]
        return image.clone()


COUNTING = CountingHost()
register_postprocess(PostProcess("engine-stream-counting", host=COUNTING))


@pytest.mark.slow
def test_a_slow_consumer_holds_no_more_than_the_budget_and_nothing_is_processed_ahead() -> None:
    """Twelve previews over a budget of two held outputs; the consumer takes one, then
    stalls for a second: the engine post-processed only what was asked for, never more than
    two outputs are held, the worker waited for room, and every chunk arrives in order."""
    ex = MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, max_held_outputs=2)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, pipeline="engine-stream-counting") as engine:
            held: list[float] = []
            stop = asyncio.Event()

            async def watch() -> None:
                while not stop.is_set():
                    held.append((await asyncio.to_thread(ex.metrics)).held_outputs)
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            calls0 = COUNTING.calls
            seqs = []
            async for item in engine.generate_stream(r("slow", preview_every=1, steps=12)):
                if isinstance(item, GenerationChunk):
                    seqs.append(item.seq)
                    if item.seq == 0:
                        await asyncio.sleep(1.0)
                        assert COUNTING.calls - calls0 == 1, "the engine post-processed chunks nobody asked for"
                        assert ex.metrics().pool_full == 1
            stop.set()
            await watcher
            assert seqs == list(range(12))
            m = ex.metrics()
            assert max(held) <= 2 and m.pool_waits >= 1 and m.timeouts == 0, (max(held), m)
            await assert_quiescent(engine)

    try:
        run(body())
    finally:
        ex.shutdown()


def test_generate_stream_checks_its_arguments(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared) as engine:
            from omni_async.core.errors import UsageError

            with pytest.raises(UsageError):
                async for _ in engine.generate_stream("nope"):  # type: ignore[arg-type]
                    pass
            assert len(engine) == 0

    run(body())


def test_many_streams_at_once(shared: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(shared, max_running=2) as engine:

            async def one(i: int) -> list[int]:
                steps = []
                async for item in engine.generate_stream(r(f"m{i}", seed=i, preview_every=2)):
                    if isinstance(item, GenerationChunk):
                        steps.append(item.output["info"]["step"])
                return steps

            t0 = time.monotonic()
            got = await asyncio.gather(*(one(i) for i in range(5)))
            assert got == [[2, 4, 6]] * 5, got
            assert time.monotonic() - t0 < 60
            await assert_quiescent(engine)

    run(body())


def test_the_sync_facade_streams_and_closing_early_leaves_nothing(shared: MultiprocDiffusionExecutor) -> None:
    """``DiffusionEngine.generate_stream``: the same items as the async stream; closing the
    iterator after its first chunk aborts the request and returns once nothing of it remains."""
    with DiffusionEngine(shared) as engine:
        items = list(engine.generate_stream(r("s", seed=3, preview_every=2)))
        assert [type(i).__name__ for i in items] == ["GenerationChunk"] * 3 + ["GenerationResult"]
        assert [i.seq for i in items if isinstance(i, GenerationChunk)] == [0, 1, 2]
        it = engine.generate_stream(r("e", preview_every=1, steps=40, step_ms=20))
        first = next(it)
        assert isinstance(first, GenerationChunk) and first.seq == 0
        it.close()
        settle_releases()
        assert len(engine.engine) == 0
        assert not any(executor_quiet(shared).values()), executor_quiet(shared)
        assert engine.metrics().requests["cancelled"] == 1
        with pytest.raises(RequestAborted):
            for _item in engine.generate_stream(r("x", preview_every=1, steps=40, step_ms=20)):
                engine.abort("x")
