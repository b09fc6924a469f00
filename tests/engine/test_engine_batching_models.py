"""Batching with the library's own models: a batched member gets the very bits it gets
alone (``TinyDiffusionWorker`` over real worker processes and shared memory,
``DiTPipelineWorker`` in process: its stacked batch is batch-invariant), and an abort
of one member mid-forward (the model checks cancellation between its steps) leaves
the others finishing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from helpers.engine_harness import assert_quiescent, eventually, run
from helpers.leaks import kept_for_the_module
from omni_async.core.config import Deadlines
from omni_async.core.engine_states import StageState
from omni_async.core.errors import RequestAborted
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.models.dit import DiTPipelineWorker

DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)
TINY = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 64, "steps": 3})


@pytest.fixture(scope="module")
def tiny() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(TINY, deadlines=DEADLINES))


def _tensors(res: GenerationResult) -> dict[str, torch.Tensor]:
    out = res.output
    assert isinstance(out, dict)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


async def _results(engine: AsyncDiffusionEngine, reqs: list[DiffusionRequest]) -> list[GenerationResult]:
    return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))


def test_tiny_members_are_bit_exact_against_unbatched(tiny: MultiprocDiffusionExecutor) -> None:
    reqs = [DiffusionRequest(f"t{i}", {"height": 48, "seed": 100 + i}) for i in range(4)]

    async def body() -> None:
        async with AsyncDiffusionEngine(tiny, max_batch_size=4, batch_wait_s=1.0) as batched:
            got = await _results(batched, reqs)
            assert batched.metrics().batch_size_max == 4
            await assert_quiescent(batched)
        async with AsyncDiffusionEngine(tiny) as alone:
            want = await _results(alone, [DiffusionRequest(f"a{i}", r.params) for i, r in enumerate(reqs)])
            await assert_quiescent(alone)
        for g, w in zip(got, want, strict=True):
            gt, wt = _tensors(g), _tensors(w)
            assert gt.keys() == wt.keys() == {"image", "digest"}
            for k in gt:
                assert torch.equal(gt[k], wt[k]), k
        assert len({int(_tensors(g)["digest"]) for g in got}) == 4  # each its own seed

    run(body())


def test_an_abort_mid_forward_leaves_the_other_members_finishing(tiny: MultiprocDiffusionExecutor) -> None:
    reqs = [DiffusionRequest(f"m{i}", {"height": 32, "seed": i, "step_ms": 150}) for i in range(3)]

    async def body() -> None:
        async with AsyncDiffusionEngine(tiny, max_batch_size=3, batch_wait_s=1.0) as engine:
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await eventually(lambda: all(engine.stage_of(r.request_id) is StageState.COMPUTING for r in reqs))
            await engine.abort("m1", wait=True)
            with pytest.raises(RequestAborted):
                await tasks[1]
            for i in (0, 2):
                assert (await tasks[i]).request_id == f"m{i}"
            m = engine.metrics()
            assert m.requests["aborted"] == 1 and m.requests["finished"] == 2 and m.batch_size_max == 3
            await assert_quiescent(engine)

    run(body())


def test_dit_members_are_bit_exact_against_unbatched() -> None:
    def make(rank: int) -> DiTPipelineWorker:
        return DiTPipelineWorker(hidden_size=32, depth=1, heads=2, decoder_width=16, steps=2)

    reqs = [DiffusionRequest(f"d{i}", {"height": 32, "width": 32, "seed": i}) for i in range(3)]
    video = DiffusionRequest("v", {"height": 16, "width": 16, "num_frames": 3, "seed": 9})

    async def body() -> None:
        with InProcessExecutor(make, deadlines=DEADLINES) as ex:
            assert ex.batch_key(reqs[0]) == ex.batch_key(reqs[1]) != ex.batch_key(video)
            async with AsyncDiffusionEngine(ex, max_batch_size=3, batch_wait_s=1.0) as batched:
                got = await _results(batched, [*reqs, video])
                assert batched.metrics().batch_size_max == 3
            async with AsyncDiffusionEngine(ex) as alone:
                want = await _results(alone, [DiffusionRequest(f"a{r.request_id}", r.params) for r in [*reqs, video]])
        for g, w in zip(got, want, strict=True):
            gt, wt = _tensors(g), _tensors(w)
            assert gt.keys() == wt.keys() and gt
            for k in gt:
                assert torch.equal(gt[k], wt[k]), (g.request_id, k)

    run(body())
