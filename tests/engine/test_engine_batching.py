"""Batching in the engine (``max_batch_size``), in process: real worker threads, the
executor's real batch calls, no mocks.  The worker records every call it gets
(``execute_model`` alone, ``execute_model_batch`` with its members), so a test sees
the batches the engine formed.

What is checked: batches form from compatible requests only and never exceed
``max_batch_size``; ``batch_wait_s`` bounds the wait for members; a member keeps its
own abort, failure, host stage, post-process, deadline and stream; the synchronous
path batches too; every test ends quiescent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import pytest
import torch

from helpers.engine_harness import assert_quiescent, eventually, in_thread, run
from helpers.executor_harness import (
    GATES,
    RELAXED,
    ToyWorker,
    expected_image,
    gate_name,
    opened_gates_on_exit,
)
from omni_async.core.config import Deadlines
from omni_async.core.engine_states import StageState
from omni_async.core.errors import ComputeTimeout, RequestAborted, RpcFailed, UsageError
from omni_async.core.messages import (
    BatchDiffusionOutput,
    DiffusionOutput,
    DiffusionRequest,
)
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import PostProcessFailed
from omni_async.engine.metrics import GenerationChunk, GenerationResult
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.worker.postprocess import (
    PostProcess,
    UnknownPostProcess,
    register_postprocess,
)


class BatchingToy(ToyWorker):
    """``ToyWorker`` with a batch key (param ``key``; ``"solo"``: never batched) that
    records each call's members."""

    def __init__(self, rank: int, calls: list[tuple[str, ...]]) -> None:
        super().__init__(rank)
        self.calls = calls

    @staticmethod
    def batch_key(request: DiffusionRequest) -> Hashable | None:
        key = request.params.get("key", "k")
        return None if key == "solo" else str(key)

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        self.calls.append((request.request_id,))
        return super().execute_model(request)

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        self.calls.append(tuple(r.request_id for r in requests))
        return super().execute_model_batch(requests)


def req(rid: str, **params: Any) -> DiffusionRequest:
    return DiffusionRequest(rid, params)


@pytest.fixture(autouse=True)
def _gates() -> Iterator[None]:
    with opened_gates_on_exit():
        yield


@pytest.fixture
def calls() -> list[tuple[str, ...]]:
    return []


@pytest.fixture
def ex(calls: list[tuple[str, ...]]) -> Iterator[InProcessExecutor]:
    with InProcessExecutor(lambda rank: BatchingToy(rank, calls), deadlines=RELAXED) as executor:
        yield executor


def _image(res: GenerationResult) -> torch.Tensor:
    out = res.output
    assert isinstance(out, dict)
    image = out["image"]
    assert isinstance(image, torch.Tensor)
    return image


def test_the_executor_reads_the_models_batch_key(ex: InProcessExecutor) -> None:
    assert ex.batch_key(req("a", key="x")) == "x"
    assert ex.batch_key(req("a", key="solo")) is None


def test_batches_form_up_to_max_batch_size_from_compatible_requests(
    ex: InProcessExecutor, calls: list[tuple[str, ...]]
) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=3, batch_wait_s=1.0) as engine:
            ids = [f"r{i}" for i in range(7)]
            results = await asyncio.gather(*(engine.generate(req(rid, value=float(i))) for i, rid in enumerate(ids)))
            for i, res in enumerate(results):
                assert res.request_id == ids[i]
                assert torch.equal(_image(res), expected_image(float(i)))  # each member its own output
            assert max(len(c) for c in calls) == 3
            assert sorted(rid for c in calls for rid in c) == ids  # each request once
            m = engine.metrics()
            assert m.batch_size_max == 3 and m.batched >= 2
            assert m.batches == len(calls)
            assert m.batch_size_mean == pytest.approx(7 / len(calls))
            assert m.requests["finished"] == 7
            await assert_quiescent(engine)

    run(body())


def test_incompatible_keys_never_share_a_batch(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    keys = {"a0": "a", "b0": "b", "a1": "a", "s0": "solo", "b1": "b", "a2": "a", "s1": "solo", "b2": "b"}

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=4, batch_wait_s=0.5) as engine:
            await asyncio.gather(*(engine.generate(req(rid, key=k)) for rid, k in keys.items()))
            await assert_quiescent(engine)

    run(body())
    for call in calls:
        assert len({keys[rid] for rid in call}) == 1, call
        if keys[call[0]] == "solo":
            assert len(call) == 1
    assert {c for c in calls if len(c) > 1} == {("a0", "a1", "a2"), ("b0", "b1", "b2")}


def test_a_batch_waits_at_most_batch_wait_s_for_members(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    wait = 0.4

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=4, batch_wait_s=wait) as engine:
            t0 = time.monotonic()
            first = asyncio.create_task(engine.generate(req("first")))
            await asyncio.sleep(0.05)
            assert engine.stage_of("first") is StageState.WAITING  # held for members
            second = asyncio.create_task(engine.generate(req("second")))
            await asyncio.gather(first, second)
            took = time.monotonic() - t0
            assert wait * 0.9 <= took < wait + 5.0  # not before the wait ran out, nor long after
            assert calls == [("first", "second")]
            # A full batch goes at once, whatever the wait.
            calls.clear()
            t0 = time.monotonic()
            await asyncio.gather(*(engine.generate(req(f"f{i}")) for i in range(4)))
            assert time.monotonic() - t0 < wait * 0.9
            assert calls == [("f0", "f1", "f2", "f3")]
            await assert_quiescent(engine)

    run(body())


def test_batch_wait_zero_takes_what_waits_now(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=4, batch_wait_s=0) as engine:
            await engine.generate(req("alone"))
            assert calls == [("alone",)]
            await asyncio.gather(*(engine.generate(req(f"t{i}")) for i in range(3)))  # queued in one tick
            assert calls[1:] == [("t0", "t1", "t2")]
            await assert_quiescent(engine)

    run(body())


def test_max_batch_size_one_never_batches(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            await asyncio.gather(*(engine.generate(req(f"r{i}")) for i in range(5)))
            m = engine.metrics()
            assert (m.batches, m.batched, m.batch_size_max, m.batch_size_mean) == (5, 0, 1, 1.0)

    run(body())
    assert all(len(c) == 1 for c in calls)
    assert calls == [(f"r{i}",) for i in range(5)]  # execute_model, as before batching existed


def test_an_aborted_member_leaves_the_others_finishing(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    gate = gate_name()

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=3, batch_wait_s=1.0) as engine:
            tasks = [asyncio.create_task(engine.generate(req(f"m{i}", gate=gate, value=float(i)))) for i in range(3)]
            assert await in_thread(lambda: GATES.wait_entered(gate))  # the batch's forward runs
            await eventually(lambda: all(engine.stage_of(f"m{i}") is StageState.COMPUTING for i in range(3)))
            await engine.abort("m1")
            with pytest.raises(RequestAborted):
                await tasks[1]
            GATES.open(gate)
            for i in (0, 2):
                assert torch.equal(_image(await tasks[i]), expected_image(float(i)))
            assert engine.metrics().requests["aborted"] == 1
            await assert_quiescent(engine)

    run(body())
    assert calls == [("m0", "m1", "m2")]


def test_a_member_whose_forward_raises_fails_alone(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=3, batch_wait_s=1.0) as engine:
            results = await asyncio.gather(
                engine.generate(req("ok0")),
                engine.generate(req("bad", fail_on=[0])),
                engine.generate(req("ok1", value=2.0)),
                return_exceptions=True,
            )
            assert isinstance(results[1], RpcFailed) and "forward of bad failed" in str(results[1])
            assert isinstance(results[0], GenerationResult) and torch.equal(_image(results[0]), expected_image())
            assert isinstance(results[2], GenerationResult) and torch.equal(_image(results[2]), expected_image(2.0))
            assert engine.metrics().requests == {**engine.metrics().requests, "finished": 2, "failed": 1}
            await assert_quiescent(engine)

    run(body())
    # The batch, then each member alone.
    assert calls[0] == ("ok0", "bad", "ok1")
    assert sorted(calls[1:]) == [("bad",), ("ok0",), ("ok1",)]


def _fails(output: DiffusionOutput) -> object:
    raise ValueError("this host stage always fails")


def _with_request(output: DiffusionOutput, request: DiffusionRequest) -> object:
    out = output.output
    assert isinstance(out, dict)
    return {"scaled": out["image"] * float(request.params["scale"]), "request": request.request_id}


register_postprocess(PostProcess("batching-fails", host=_fails), replace=True)
register_postprocess(PostProcess("batching-with-request", host=_with_request), replace=True)


def test_a_members_failing_host_stage_fails_only_it(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=3, batch_wait_s=1.0) as engine:
            bad = DiffusionRequest("bad", {}, postprocess="batching-fails")
            good = DiffusionRequest("good", {"scale": 3}, postprocess="batching-with-request")
            results = await asyncio.gather(
                engine.generate(req("plain")), engine.generate(bad), engine.generate(good), return_exceptions=True
            )
            assert isinstance(results[1], PostProcessFailed)
            assert results[1].request_id == "bad" and results[1].pipeline == "batching-fails"
            assert "always fails" in str(results[1])
            plain, scaled = results[0], results[2]
            assert isinstance(plain, GenerationResult) and plain.pipeline is None
            assert torch.equal(_image(plain), expected_image())
            assert isinstance(scaled, GenerationResult) and scaled.pipeline == "batching-with-request"
            assert torch.equal(scaled.output["scaled"], expected_image() * 3)  # the stage saw its request
            assert scaled.output["request"] == "good"
            await assert_quiescent(engine)

    run(body())
    assert calls == [("plain", "bad", "good")]


def test_an_unknown_post_process_is_refused_at_the_call_naming_the_request(ex: InProcessExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            with pytest.raises(UnknownPostProcess) as err:
                await engine.generate(DiffusionRequest("typo", {}, postprocess="no-such-pipeline"))
            assert err.value.request_id == "typo"
            assert "request 'typo'" in str(err.value) and "'no-such-pipeline'" in str(err.value)
            assert "batching-fails" in err.value.known
            assert engine.metrics().requests["rejected"] == 1
            assert len(engine) == 0

    run(body())


def test_members_keep_their_own_deadlines(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    gate = gate_name()
    short = Deadlines(compute_timeout=0.3, output_timeout=60.0, rpc_timeout=60.0)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=4, batch_wait_s=0.3, max_running=8) as engine:
            hurried = asyncio.create_task(engine.generate(req("hurried", gate=gate), deadlines=short))
            others = [asyncio.create_task(engine.generate(req(f"o{i}"))) for i in range(2)]
            with pytest.raises(ComputeTimeout):
                await hurried
            GATES.open(gate)
            for t in others:
                assert torch.equal(_image(await t), expected_image())
            await assert_quiescent(engine)

    run(body())
    # Another deadline is another call: "hurried" never shares the others' batch.
    assert ("hurried",) in calls and ("o0", "o1") in calls


def test_streaming_members_each_get_their_chunks(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    async def consume(engine: AsyncDiffusionEngine, rid: str) -> list[GenerationChunk | GenerationResult]:
        return [item async for item in engine.generate_stream(req(rid, chunks=2, value=3.0))]

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=3, batch_wait_s=1.0) as engine:
            plain = asyncio.create_task(engine.generate(req("plain")))
            streams = await asyncio.gather(*(consume(engine, f"s{i}") for i in range(3)))
            await plain
            for i, items in enumerate(streams):
                chunks = [c for c in items if isinstance(c, GenerationChunk)]
                assert [c.seq for c in chunks] == [0, 1] and all(c.request_id == f"s{i}" for c in chunks)
                assert torch.equal(chunks[1].output["chunk"], torch.full((2,), 1.0))
                final = items[-1]
                assert isinstance(final, GenerationResult) and torch.equal(_image(final), expected_image(3.0))
            assert engine.metrics().chunks == 6
            await assert_quiescent(engine)

    run(body())
    assert ("s0", "s1", "s2") in calls and ("plain",) in calls  # a stream never batches with a plain request


def test_the_synchronous_path_batches_and_isolates_a_failing_member(
    ex: InProcessExecutor, calls: list[tuple[str, ...]]
) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=3, batch_wait_s=1.0, async_output=False) as engine:
            results = await asyncio.gather(*(engine.generate(req(f"r{i}", value=float(i))) for i in range(3)))
            for i, res in enumerate(results):
                assert torch.equal(_image(res), expected_image(float(i)))
            assert calls == [("r0", "r1", "r2")]
            calls.clear()
            outcome = await asyncio.gather(
                engine.generate(req("a")), engine.generate(req("b", fail_on=[0])), return_exceptions=True
            )
            assert isinstance(outcome[0], GenerationResult) and isinstance(outcome[1], RpcFailed)
            assert calls[0] == ("a", "b") and sorted(calls[1:]) == [("a",), ("b",)]
            await assert_quiescent(engine)

    run(body())


def test_batching_options_are_checked(ex: InProcessExecutor) -> None:
    with pytest.raises(UsageError, match=r"max_running \(2\) is below max_batch_size \(4\)"):
        AsyncDiffusionEngine(ex, max_batch_size=4, max_running=2)
    with pytest.raises(UsageError, match="max_batch_size must be a positive int"):
        AsyncDiffusionEngine(ex, max_batch_size=0)
    with pytest.raises(UsageError, match="batch_wait_s must be a finite number of seconds >= 0"):
        AsyncDiffusionEngine(ex, max_batch_size=2, batch_wait_s=-1)
    with pytest.raises(UsageError, match="batch_key must be a callable"):
        AsyncDiffusionEngine(ex, max_batch_size=2, batch_key="x")  # type: ignore[arg-type]
    engine = AsyncDiffusionEngine(ex, max_batch_size=4)
    assert engine.config.running_slots == 8  # default: two batches


def test_an_explicit_batch_key_overrides_the_models(ex: InProcessExecutor, calls: list[tuple[str, ...]]) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=4, batch_wait_s=0.5, batch_key=lambda r: None) as engine:
            await asyncio.gather(*(engine.generate(req(f"r{i}")) for i in range(3)))

    run(body())
    assert all(len(c) == 1 for c in calls)
