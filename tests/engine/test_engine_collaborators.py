"""The engine's collaborators on their own, each with real threads and a real event loop
and no engine around it: ``Admission``, ``Lifecycle``, ``PostProcessor``,
``EngineThreads``, ``RequestEnds``."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator

import pytest
import torch

from helpers.engine_harness import eventually, run
from helpers.executor_harness import RELAXED, make_toy, req
from omni_async.core.engine_states import EngineState, StageEvent, StageState
from omni_async.core.errors import InvalidRequest, RequestAborted, UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.admission import Admission
from omni_async.engine.config import EngineConfig
from omni_async.engine.ends import RequestEnds
from omni_async.engine.errors import EngineClosed, EngineOverloaded
from omni_async.engine.lifecycle import Lifecycle
from omni_async.engine.postprocessor import PostProcessor
from omni_async.engine.record import RequestRecord
from omni_async.engine.scheduler import SchedulerPhase
from omni_async.engine.threads import EngineThreads
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.worker.postprocess import PostProcess, UnknownPostProcess, register_postprocess

SE = StageEvent
SS = StageState


def _refuse_bad(request: DiffusionRequest) -> None:
    if "bad" in request.params:
        raise InvalidRequest(request.request_id, "bad", "is refused here")


def _admission(config: EngineConfig, post: PostProcessor | None = None) -> Admission:
    post = post or PostProcessor(config)
    a = Admission(config, None)
    a.open(None, validate=_refuse_bad, post_of=post.post_of, batch_key=lambda r: None)
    return a


# -- Admission ----------------------------------------------------------------------------


def test_admission_refuses_at_the_call_and_leaves_nothing_queued() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        a = _admission(EngineConfig(max_running=1, max_waiting=1))
        with pytest.raises(InvalidRequest):
            a.admit(req("bad", bad=1), None, "generate", streaming=False, loop=loop)
        with pytest.raises(UnknownPostProcess):
            a.admit(DiffusionRequest("nopost", {}, postprocess="no-such"), None, "generate", streaming=False, loop=loop)
        for rid in ("a", "b"):  # one running slot free, one place in the queue
            a.admit(req(rid), None, "generate", streaming=False, loop=loop)
        with pytest.raises(EngineOverloaded):
            a.admit(req("c"), None, "generate", streaming=False, loop=loop)
        with pytest.raises(UsageError, match="already in the engine"):
            a.admit(req("a"), None, "generate", streaming=False, loop=loop)
        assert sorted(a.records) == ["a", "b"] and a.counts["rejected"] == 3  # a duplicate id is a bug, not a refusal
        assert a.scheduler is not None and a.scheduler.waiting_ids() == ["a", "b"]

    run(body(), timeout=30)


def test_admission_runs_its_loop_admitting_what_fits_and_counts_each_end_once() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        a = _admission(EngineConfig(max_running=1))
        started: list[list[str]] = []
        task = loop.create_task(a.run(lambda recs: started.append([r.request_id for r in recs])))
        recs = [a.admit(req(rid), None, "generate", streaming=False, loop=loop) for rid in ("a", "b")]
        await eventually(lambda: started == [["a"]])
        assert recs[0].stage is SS.SUBMITTED and a.phase_of("b") is SchedulerPhase.WAITING
        a.fire(recs[0], SE.FAIL, outcome="rejected")
        a.fire(recs[0], SE.GONE)
        a.forget(recs[0])
        assert recs[0].gone.is_set() and "a" not in a.records
        await eventually(lambda: started == [["a"], ["b"]])
        assert a.counts["rejected"] == 1 and a.counts["failed"] == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(body(), timeout=30)


# -- Lifecycle ----------------------------------------------------------------------------


def test_lifecycle_starts_once_and_a_failed_start_is_final() -> None:
    async def body() -> None:
        builds: list[int] = []

        async def build() -> None:
            builds.append(1)

        life = Lifecycle("t", None)
        await asyncio.gather(life.start(build), life.start(build))
        assert life.state is EngineState.RUNNING and builds == [1]

        async def broken() -> None:
            raise UsageError("no")

        failed = Lifecycle("f", None)
        with pytest.raises(UsageError):
            await failed.start(broken)
        assert failed.state is EngineState.FAILED
        with pytest.raises(EngineClosed, match="failed to start"):
            await failed.start(build)

    run(body(), timeout=30)


def test_lifecycle_close_during_start_wins_and_shut_down_learns_nothing_started() -> None:
    async def body() -> None:
        gate = asyncio.Event()
        life = Lifecycle("c", None)
        calls: list[bool] = []

        async def build() -> None:
            await gate.wait()
            life.check_start_wanted()

        async def shut_down(deadline: float, started: bool) -> None:
            calls.append(started)

        starting = asyncio.create_task(life.start(build))
        await asyncio.sleep(0)
        closing = asyncio.create_task(life.close(5.0, shut_down))
        await asyncio.sleep(0.01)
        gate.set()
        with pytest.raises(EngineClosed, match="closed while it started"):
            await starting
        await closing
        assert life.state is EngineState.CLOSED and calls == [False]
        await life.close(5.0, shut_down)  # idempotent
        assert calls == [False]

    run(body(), timeout=30)


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, True, "1"])
def test_lifecycle_close_refuses_a_timeout_that_cannot_bound_it(timeout: object) -> None:
    async def body() -> None:
        async def shut_down(deadline: float, started: bool) -> None:
            raise AssertionError("not reached")

        with pytest.raises(UsageError, match="close: timeout"):
            await Lifecycle("x", None).close(timeout, shut_down)  # type: ignore[arg-type]

    run(body(), timeout=30)


# -- PostProcessor ------------------------------------------------------------------------


def _record(rid: str, loop: asyncio.AbstractEventLoop, post: PostProcessor) -> RequestRecord:
    from omni_async.core.engine_states import stage_machine

    request = DiffusionRequest(rid, {})
    rec = RequestRecord(request, None, loop.create_future(), 0.0, stage_machine(rid))
    rec.postprocess = post.post_of(request)
    rec.pipeline = "engine-test-collab"
    for event in (SE.ADMIT, SE.SENT, SE.COMPUTE_DONE, SE.OUTPUT):
        rec.machine.fire(event)
    return rec


def test_the_post_processor_decides_on_its_thread_whether_a_host_stage_runs() -> None:
    """A request that ended while its output waited for the one busy thread is only
    released: its host stage never runs (issue 29)."""
    entered, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def host(out: DiffusionOutput) -> float:
        ran.append(out.request_id)
        if out.request_id == "busy":
            entered.set()
            assert release.wait(30)
        return float(out.output.sum())

    register_postprocess(PostProcess("engine-test-collab", host=host), replace=True)
    released: list[str] = []

    async def body() -> None:
        loop = asyncio.get_running_loop()
        post = PostProcessor(EngineConfig(pipeline="engine-test-collab", postprocess_workers=1))
        post.start(loop, lambda out: released.append(out.request_id))
        busy, late = _record("busy", loop, post), _record("late", loop, post)
        first = asyncio.create_task(post.process(busy, DiffusionOutput("busy", torch.ones(2))))
        assert await asyncio.to_thread(entered.wait, 30)
        second = asyncio.create_task(post.process(late, DiffusionOutput("late", torch.ones(3))))
        await asyncio.sleep(0.05)
        late.machine.fire(SE.ABORT)  # the end is decided while its job waits for the thread
        release.set()
        assert (await first).value == 2.0
        assert (await second).value is None
        assert ran == ["busy"] and sorted(released) == ["busy", "late"]
        post.stop()

    run(body(), timeout=30)


# -- EngineThreads and RequestEnds --------------------------------------------------------


@pytest.fixture
def ex() -> Iterator[InProcessExecutor]:
    executor = InProcessExecutor(make_toy, deadlines=RELAXED)
    try:
        yield executor
    finally:
        executor.shutdown()


def test_the_threads_are_named_and_control_never_waits_behind_a_send() -> None:
    async def body() -> None:
        threads = EngineThreads(asyncio.get_running_loop(), sync_threads=1)
        blocked = threading.Event()
        send = threads.send(lambda: blocked.wait(30))
        name = await threads.control(lambda: threading.current_thread().name)
        assert name.startswith("omni-engine-control") and not send.done()
        assert (await threads.sync(lambda: threading.current_thread().name)).startswith("omni-engine-sync")
        blocked.set()
        assert await send
        threads.stop()

    run(body(), timeout=30)


def test_an_early_end_while_waiting_forgets_the_request_and_fails_its_caller(ex: InProcessExecutor) -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        a = _admission(EngineConfig())
        threads = EngineThreads(loop)
        ends = RequestEnds(a, threads, ex)
        rec = a.admit(req("w"), None, "generate", streaming=False, loop=loop)
        ends.end_early(rec, SE.ABORT)
        with pytest.raises(RequestAborted, match="never reached a worker"):
            await rec.result
        ends.end_early(rec, SE.CLOSE)  # the first end counts
        assert rec.gone.is_set() and len(a.records) == 0 and a.counts["aborted"] == 1
        threads.stop()

    run(body(), timeout=30)
