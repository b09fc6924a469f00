"""A host stage never writes into shared memory (issue 19): over worker processes (real
segments), a host stage that did not declare ``host_reads_only`` gets an owned copy,
never a view of a segment (``t.float()`` of a float32 tensor is ``t`` itself: an
in-place op on it wrote into the segment before); one that declared it gets the views,
and an in-place write fails its request with ``PostProcessFailed`` (and that request
only)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from helpers.engine_harness import assert_quiescent, run
from helpers.leaks import kept_for_the_module
from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import PostProcessFailed
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.transport.shm import mapping
from omni_async.worker.postprocess import PostProcess, register_postprocess

SPEC = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 32, "steps": 1})
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


@pytest.fixture(scope="module")
def ex() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES))


def in_shared_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a segment this process has mapped."""
    ptr = t.untyped_storage().data_ptr()
    with mapping._LOCK:
        spans = [(m.base.data_ptr(), m.size) for m in mapping._MAPPINGS.values()]
    return any(start <= ptr < start + size for start, size in spans)


SEEN: dict[str, bool] = {}


def _writes_in_place(output: DiffusionOutput, request: DiffusionRequest) -> float:
    image = output.output["image"]
    SEEN[request.request_id] = in_shared_memory(image)
    x = image.float()  # float32 already: x IS the input tensor
    x.mul_(0.0)  # before the fix: zeroed the segment's bytes
    return float(x.sum())


def _reads(output: DiffusionOutput, request: DiffusionRequest) -> float:
    image = output.output["image"]
    SEEN[request.request_id] = in_shared_memory(image)
    return float(image.sum())


def _declared_reader_that_writes(output: DiffusionOutput) -> float:
    image = output.output["image"]
    image.add_(1.0)
    return float(image.sum())


register_postprocess(PostProcess("host-input-writes", host=_writes_in_place), replace=True)
register_postprocess(PostProcess("host-input-reads", host=_reads, host_reads_only=True), replace=True)
register_postprocess(
    PostProcess("host-input-lies", host=_declared_reader_that_writes, host_reads_only=True), replace=True
)


def test_an_undeclared_host_stage_gets_an_owned_copy_never_the_segment(ex: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, pipeline="host-input-writes") as engine:
            res = await engine.generate(DiffusionRequest("w", {"height": 1024}))
            assert res.output == 0.0
            assert SEEN["w"] is False  # an owned copy: its in-place write reached no segment
            # A reader declared read-only gets the views (no copy on its path).
            read = await engine.generate(DiffusionRequest("r", {"height": 1024}, postprocess="host-input-reads"))
            assert SEEN["r"] is True
            assert isinstance(read.output, float) and read.output > 0
            await assert_quiescent(engine)

    run(body())


def test_a_declared_reader_that_writes_fails_its_request_only(ex: MultiprocDiffusionExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_batch_size=2, batch_wait_s=1.0) as engine:
            results = await asyncio.gather(
                engine.generate(DiffusionRequest("liar", {"height": 1024}, postprocess="host-input-lies")),
                engine.generate(DiffusionRequest("fine", {"height": 1024}, postprocess="host-input-reads")),
                return_exceptions=True,
            )
            err = results[0]
            assert isinstance(err, PostProcessFailed) and err.request_id == "liar"
            assert "host_reads_only=True but wrote into its input" in str(err)
            assert "output['image']" in str(err)
            assert isinstance(results[1], GenerationResult)
            await assert_quiescent(engine)

    run(body())
