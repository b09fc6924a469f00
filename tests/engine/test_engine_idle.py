"""The engine never makes the worker wait (issue 20): requests stay queued on the worker
while the event loop is held up, judged from the worker's own stamps over real worker
processes.  Deterministic: the hold-up is the test's own (a blocking sleep on the loop),
two forwards long; no timing is asserted, only the order of events."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import RequestTimings
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

SPEC = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker", {"device": "cpu"})
FORWARD_S = 0.05
# The loop is held for more than two forwards: with one request queued on the worker
# (max_running=2) the worker then runs dry; with two (the default) it does not.
HOLD_S = 2.2 * FORWARD_S


def starved(timings: list[RequestTimings]) -> list[str]:
    """The forwards that ended with the request after them still waiting in the engine:
    it reached the worker (was sent) only after that forward had ended."""
    ts = sorted(timings, key=lambda t: t.forward_started_at or 0.0)
    out = []
    for a, b in itertools.pairwise(ts):
        assert a.forward_ended_at is not None and b.forward_started_at is not None
        if b.enqueued_at < a.forward_ended_at < b.submitted_at:
            out.append(f"forward ended at {a.forward_ended_at:.3f}, next sent at {b.submitted_at:.3f}")
    return out


def serve_with_a_held_loop(max_running: int | None) -> list[RequestTimings]:
    """12 requests at once; when the third result arrives the caller holds the event loop
    (a blocking sleep: a consumer's work, host stages holding the GIL) for ``HOLD_S``."""

    async def body() -> list[RequestTimings]:
        ex = MultiprocDiffusionExecutor(SPEC, deadlines=Deadlines(compute_timeout=60, output_timeout=60))
        params = {"forward_ms": 1e3 * FORWARD_S, "shape": [4]}
        timings: list[RequestTimings] = []
        try:
            async with AsyncDiffusionEngine(ex, max_running=max_running) as engine:
                await engine.generate(DiffusionRequest("warm-up", dict(params)))
                done = itertools.count()

                async def one(i: int) -> None:
                    result = await engine.generate(DiffusionRequest(f"r-{i}", dict(params)))
                    timings.append(result.timings)
                    if next(done) == 2:
                        time.sleep(HOLD_S)  # noqa: ASYNC251  # blocks the event loop on purpose

                await asyncio.gather(*(one(i) for i in range(12)))
        finally:
            ex.shutdown()
        return timings

    return asyncio.run(body())


def test_the_default_keeps_the_worker_fed_through_a_held_loop() -> None:
    timings = serve_with_a_held_loop(None)
    assert len(timings) == 12
    assert starved(timings) == []


@pytest.mark.slow
def test_one_request_queued_on_the_worker_runs_dry_behind_a_held_loop() -> None:
    """The control: ``max_running=2`` (the default before issue 20) leaves the worker idle."""
    assert starved(serve_with_a_held_loop(2))
