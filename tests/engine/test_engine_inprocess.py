"""AsyncDiffusionEngine over InProcessExecutor (threads, the real protocol): gates in
the toy worker's forward and in its packing put a request exactly at the stage a test
needs.  Every test ends quiescent: nothing in the engine, the registry or a packer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from helpers.engine_harness import assert_quiescent, eventually, in_thread, run
from helpers.executor_harness import GATES, RELAXED, ToyWorker, gate_name, make_toy, req
from omni_async.core.engine_states import StageState
from omni_async.core.errors import RequestAborted, RpcFailed, UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import (
    EngineClosed,
    EngineDead,
    EngineNotStarted,
    EngineOverloaded,
    PostProcessFailed,
)
from omni_async.engine.scheduler import SchedulerPhase
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.worker.postprocess import PostProcess, UnknownPostProcess, register_postprocess


@pytest.fixture
def ex() -> Iterator[InProcessExecutor]:
    executor = InProcessExecutor(make_toy, deadlines=RELAXED)
    try:
        yield executor
    finally:
        GATES.open_all()  # no worker or packer thread stays blocked after a failed test
        executor.shutdown()


def worker(ex: InProcessExecutor) -> ToyWorker:
    w = ex.loops[0].worker
    assert isinstance(w, ToyWorker)
    return w


# -- generate ---------------------------------------------------------------------------


def test_concurrent_generate_returns_each_result_with_its_timings(ex: InProcessExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            results = await asyncio.gather(*(engine.generate(req(f"r{i}", value=float(i))) for i in range(8)))
            for i, r in enumerate(results):
                assert r.request_id == f"r{i}"
                assert torch.equal(r.output["image"], torch.full((8,), float(i)))
                t = r.timings
                assert t.enqueued_at <= t.submitted_at <= t.compute_done_at <= t.output_ready_at <= t.finished_at
                assert t.total >= t.queued + t.forward + t.transfer_wait
                assert t.pack is None  # the in-process packer does not copy; worker processes say
            # FIFO: sent in the order generate was called.
            sent = [r.timings.submitted_at for r in results]
            assert sent == sorted(sent)
            m = engine.metrics()
            assert m.requests["finished"] == 8 and sum(m.requests.values()) == 8
            assert m.latency["total"].count == 8 and m.latency["forward"].count == 8
            await assert_quiescent(engine)

    run(body())


def test_the_running_slot_frees_at_compute_done_and_the_next_request_is_sent_early(
    ex: InProcessExecutor,
) -> None:
    """max_running=2: b is on the worker while a computes.  a's packing held: b still
    runs its forward (a, output pending, no longer takes a running slot)."""

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_running=2) as engine:
            fwd, pack = gate_name(), gate_name()
            a = asyncio.create_task(engine.generate(req("a", gate=fwd, pickle_gate=pack)))
            b = asyncio.create_task(engine.generate(req("b")))
            c = asyncio.create_task(engine.generate(req("c")))
            assert await in_thread(lambda: GATES.wait_entered(fwd))
            await eventually(lambda: engine.phase_of("b") is SchedulerPhase.RUNNING, what="b sent while a computes")
            assert engine.phase_of("c") is SchedulerPhase.WAITING  # two running already
            GATES.open(fwd)
            assert await in_thread(lambda: GATES.wait_entered(pack))  # a packing, held
            # a holds its output; b and c run their forwards meanwhile, c's output
            # waits behind a's packing in the packer's queue.
            await eventually(lambda: engine.phase_of("c") is SchedulerPhase.HOLDING, what="c computed")
            assert engine.phase_of("a") is SchedulerPhase.HOLDING and not a.done()
            GATES.open(pack)
            results = await asyncio.gather(a, b, c)
            assert [r.request_id for r in results] == ["a", "b", "c"]
            assert results[1].timings.submitted_at < results[0].timings.compute_done_at
            await assert_quiescent(engine)

    run(body())


def test_max_running_one_keeps_the_next_request_in_the_engine(ex: InProcessExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_running=1) as engine:
            fwd = gate_name()
            a = asyncio.create_task(engine.generate(req("a", gate=fwd)))
            b = asyncio.create_task(engine.generate(req("b")))
            assert await in_thread(lambda: GATES.wait_entered(fwd))
            await asyncio.sleep(0.05)
            assert engine.phase_of("b") is SchedulerPhase.WAITING
            GATES.open(fwd)
            await asyncio.gather(a, b)
            await assert_quiescent(engine)

    run(body())


def test_the_in_flight_cap_holds_requests_in_the_engine_and_counts_budget_waits(ex: InProcessExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_running=2, max_in_flight=2) as engine:
            pack = gate_name()
            a = asyncio.create_task(engine.generate(req("a", pickle_gate=pack)))
            b = asyncio.create_task(engine.generate(req("b")))
            c = asyncio.create_task(engine.generate(req("c")))
            await eventually(lambda: engine.phase_of("b") is SchedulerPhase.HOLDING, what="b computed")
            await asyncio.sleep(0.05)
            assert engine.phase_of("c") is SchedulerPhase.WAITING  # a running slot is free, the cap is not
            m = engine.metrics()
            assert m.in_flight_limit == 2 and m.budget_waits == 1 and m.holding == 2
            GATES.open(pack)
            await asyncio.gather(a, b, c)
            assert engine.metrics().budget_wait_s > 0
            await assert_quiescent(engine)

    run(body())


def test_a_full_waiting_queue_refuses_at_the_call(ex: InProcessExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_running=1, max_waiting=1) as engine:
            fwd = gate_name()
            a = asyncio.create_task(engine.generate(req("a", gate=fwd)))
            await eventually(lambda: engine.phase_of("a") is SchedulerPhase.RUNNING)
            b = asyncio.create_task(engine.generate(req("b")))
            await asyncio.sleep(0)
            with pytest.raises(EngineOverloaded, match="max_waiting=1") as err:
                await engine.generate(req("c"))
            assert err.value.request_id == "c"
            with pytest.raises(UsageError, match="already in the engine"):
                await engine.generate(req("b"))
            GATES.open(fwd)
            await asyncio.gather(a, b)
            assert engine.metrics().requests["rejected"] == 1
            await assert_quiescent(engine)

    run(body())


def test_a_failed_forward_reaches_generate_typed(ex: InProcessExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            with pytest.raises(RpcFailed, match="failed on rank 0"):
                await engine.generate(req("bad", fail_on=[0]))
            ok = await engine.generate(req("ok"))
            assert ok.request_id == "ok"
            assert engine.metrics().requests["failed"] == 1
            await assert_quiescent(engine)

    run(body())


# -- post-processing ----------------------------------------------------------------------


def _image_sum(out: DiffusionOutput) -> float:
    return float(out.output["image"].sum())


register_postprocess(PostProcess("engine-test-sum", host=_image_sum))


def _fails(out: DiffusionOutput) -> object:
    raise ValueError(f"cannot post-process {out.request_id}")


register_postprocess(PostProcess("engine-test-fails", host=_fails))


def test_the_host_stage_runs_off_the_event_loop_and_its_result_is_returned(ex: InProcessExecutor) -> None:
    seen: list[str] = []

    def host(out: DiffusionOutput) -> float:
        seen.append(threading.current_thread().name)
        return _image_sum(out)

    register_postprocess(PostProcess("engine-test-thread", host=host), replace=True)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, pipeline="engine-test-thread") as engine:
            r = await engine.generate(req("p", value=2.0))
            assert r.output == 16.0 and r.pipeline == "engine-test-thread"
            assert r.timings.postprocess > 0
            await assert_quiescent(engine)

    run(body())
    assert seen and all(name.startswith("omni-postprocess") for name in seen), seen


def test_a_failing_host_stage_fails_its_request_typed(ex: InProcessExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, pipeline="engine-test-fails") as engine:
            with pytest.raises(PostProcessFailed, match="cannot post-process bad") as err:
                await engine.generate(req("bad"))
            assert err.value.request_id == "bad" and err.value.pipeline == "engine-test-fails"
            assert isinstance(err.value.__cause__, ValueError)
            await assert_quiescent(engine)

    run(body())


def test_an_unknown_pipeline_fails_at_construction(ex: InProcessExecutor) -> None:
    with pytest.raises(UnknownPostProcess, match="no-such-pipeline"):
        AsyncDiffusionEngine(ex, pipeline="no-such-pipeline")


# -- abort, at every stage ------------------------------------------------------------------


@pytest.mark.parametrize("wait", [True, False])
def test_abort_while_waiting_never_reaches_a_worker(ex: InProcessExecutor, wait: bool) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_running=1) as engine:
            fwd = gate_name()
            a = asyncio.create_task(engine.generate(req("a", gate=fwd)))
            b = asyncio.create_task(engine.generate(req("b")))
            assert await in_thread(lambda: GATES.wait_entered(fwd))
            assert engine.phase_of("b") is SchedulerPhase.WAITING
            await engine.abort("b", wait=wait)
            with pytest.raises(RequestAborted, match="never reached a worker") as err:
                await b
            assert err.value.request_id == "b"
            GATES.open(fwd)
            await a
            assert worker(ex).forwards == 1  # b's forward never ran
            assert engine.metrics().requests["aborted"] == 1
            await assert_quiescent(engine)

    run(body())


@pytest.mark.parametrize("wait", [True, False])
def test_abort_during_the_forward(ex: InProcessExecutor, wait: bool) -> None:
    """The toy forward ignores cancellation: it finishes, and its output is dropped on
    arrival; abort(wait=True) returns only after that."""

    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            fwd = gate_name()
            a = asyncio.create_task(engine.generate(req("a", gate=fwd)))
            assert await in_thread(lambda: GATES.wait_entered(fwd))
            aborting = asyncio.create_task(engine.abort("a", wait=wait))
            with pytest.raises(RequestAborted, match="during its forward"):
                await a
            if wait:
                await asyncio.sleep(0.05)
                assert not aborting.done()  # the worker still holds it
            GATES.open(fwd)
            await aborting
            if wait:
                assert len(engine) == 0 and not any(
                    ex.metrics().as_dict()[k] for k in ("pending_rpcs", "pending_outputs")
                )
            await assert_quiescent(engine)

    run(body())


@pytest.mark.parametrize("wait", [True, False])
def test_abort_after_compute_done_before_packing_cancels_the_packing(ex: InProcessExecutor, wait: bool) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            pack = gate_name()
            a = asyncio.create_task(engine.generate(req("a", pickle_gate=pack)))
            assert await in_thread(lambda: GATES.wait_entered(pack))  # the packer is busy with a
            b = asyncio.create_task(engine.generate(req("b")))
            await eventually(lambda: engine.phase_of("b") is SchedulerPhase.HOLDING, what="b computed, queued to pack")
            aborting = asyncio.create_task(engine.abort("b", wait=wait))
            with pytest.raises(RequestAborted, match="before its output arrived"):
                await b
            # The drop reaches the packer while it is still busy with a: b is cancelled, unpacked.
            await eventually(lambda: bool(ex.packers[0]._cancelled), what="the drop reached the packer")
            if wait:
                await asyncio.sleep(0.05)
                assert not aborting.done()  # the drop is acknowledged only once the packer let go of it
            GATES.open(pack)
            await aborting
            await a
            await assert_quiescent(engine)
            assert ex.packers[0].metrics.cancelled == 1  # F15: b was never packed

    run(body())


@pytest.mark.parametrize("wait", [True, False])
def test_abort_while_post_processing_discards_the_result(ex: InProcessExecutor, wait: bool) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(out: DiffusionOutput) -> float:
        entered.set()
        assert release.wait(30)
        return _image_sum(out)

    register_postprocess(PostProcess("engine-test-slow", host=slow), replace=True)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, pipeline="engine-test-slow") as engine:
            a = asyncio.create_task(engine.generate(req("a")))
            assert await in_thread(lambda: entered.wait(30))
            aborting = asyncio.create_task(engine.abort(["a", "unknown-id"], wait=wait))
            with pytest.raises(RequestAborted, match="while its output was post-processed"):
                await a
            release.set()
            await aborting
            m = engine.metrics()
            assert m.requests["aborted"] == 1 and m.requests["finished"] == 0
            await assert_quiescent(engine)

    run(body())


def test_a_request_aborted_while_its_output_waits_for_a_busy_host_thread_never_runs_its_host_stage(
    ex: InProcessExecutor,
) -> None:
    """Issue 29: whether a request still wants its host stage was decided when its output
    was queued for the post-processing thread, not when the thread took it, so a request
    aborted while that thread was busy with another ran its host stage anyway."""
    entered, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def host(out: DiffusionOutput, request: DiffusionRequest) -> float:
        ran.append(request.request_id)
        if request.request_id == "busy":
            entered.set()
            assert release.wait(30)
        return _image_sum(out)

    register_postprocess(PostProcess("engine-test-busy-host", host=host), replace=True)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, pipeline="engine-test-busy-host", postprocess_workers=1) as engine:
            busy = asyncio.create_task(engine.generate(req("busy")))
            assert await in_thread(lambda: entered.wait(30))
            queued = asyncio.create_task(engine.generate(req("queued")))
            # Its output is here and waits for the one thread, which "busy" holds.
            await eventually(lambda: engine.stage_of("queued") is StageState.POSTPROCESSING)
            await engine.abort("queued")
            with pytest.raises(RequestAborted, match="while its output was post-processed"):
                await queued
            release.set()
            await busy
            await assert_quiescent(engine)
            assert ran == ["busy"], ran
            m = engine.metrics()
            assert m.requests["aborted"] == 1 and m.requests["finished"] == 1

    run(body())


def test_an_idle_engine_takes_requests_started_together_into_its_free_running_slots_first(
    ex: InProcessExecutor,
) -> None:
    """Issue 29: an idle engine with max_running=2, max_waiting=1 refused two of three
    requests started together with EngineOverloaded: two fit the running slots and one
    the queue."""

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_running=2, max_waiting=1) as engine:
            results = await asyncio.gather(*(engine.generate(req(f"r{i}")) for i in range(3)))
            assert [r.request_id for r in results] == ["r0", "r1", "r2"]
            assert engine.metrics().requests["rejected"] == 0
            await assert_quiescent(engine)

    run(body())


def test_a_cancelled_generate_task_releases_everything_of_its_request(ex: InProcessExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            fwd, pack = gate_name(), gate_name()
            computing = asyncio.create_task(engine.generate(req("computing", gate=fwd)))
            assert await in_thread(lambda: GATES.wait_entered(fwd))
            computing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await computing
            GATES.open(fwd)
            await assert_quiescent(engine)
            packing = asyncio.create_task(engine.generate(req("packing", pickle_gate=pack)))
            assert await in_thread(lambda: GATES.wait_entered(pack))
            packing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await packing
            GATES.open(pack)
            await assert_quiescent(engine)
            assert engine.metrics().requests["cancelled"] == 2

    run(body())


# -- close, health, start ----------------------------------------------------------------


def test_close_fails_every_pending_request_and_leaves_nothing(ex: InProcessExecutor) -> None:
    async def body() -> None:
        engine = AsyncDiffusionEngine(ex, max_running=1)
        await engine.start()
        fwd, pack = gate_name(), gate_name()
        holding = asyncio.create_task(engine.generate(req("holding", pickle_gate=pack)))
        assert await in_thread(lambda: GATES.wait_entered(pack))
        computing = asyncio.create_task(engine.generate(req("computing", gate=fwd)))
        assert await in_thread(lambda: GATES.wait_entered(fwd))
        waiting = asyncio.create_task(engine.generate(req("waiting")))
        await asyncio.sleep(0)
        closing = asyncio.create_task(engine.close())
        for t in (holding, computing, waiting):
            with pytest.raises(EngineClosed, match="closed before request"):
                await t
        # "computing" and "holding" are still on the worker, held by their gates: close
        # must not return before they are gone (deterministic: nothing opens the gates
        # until this has been checked).
        done, _ = await asyncio.wait([closing], timeout=0.5)
        assert not done, "close returned while requests were still on a worker"
        GATES.open(fwd)
        GATES.open(pack)
        await closing
        assert engine.closed and engine.metrics().requests["closed"] == 3
        assert not any(ex.metrics().as_dict()[k] for k in ("pending_rpcs", "pending_outputs", "held_payloads"))
        assert worker(ex).forwards == 2  # "waiting" never reached the worker
        with pytest.raises(EngineClosed):
            await engine.generate(req("late"))
        with pytest.raises(EngineClosed):
            engine.check_health()
        await engine.close()  # idempotent

    run(body())


def test_an_engine_from_a_factory_owns_its_executor() -> None:
    built: list[InProcessExecutor] = []

    def factory() -> InProcessExecutor:
        built.append(InProcessExecutor(make_toy, deadlines=RELAXED))
        return built[-1]

    async def body() -> None:
        engine = AsyncDiffusionEngine.from_factory(factory)
        with pytest.raises(EngineNotStarted):
            _ = engine.executor
        with pytest.raises(EngineNotStarted):
            await engine.generate(req("early"))
        async with engine:
            assert engine.executor is built[0]
            r = await engine.generate(req("r"))
            assert r.request_id == "r"
            engine.check_health()
        assert built[0]._closed  # shut down by close()

    run(body())


def test_check_health_fails_when_the_loop_task_died(ex: InProcessExecutor) -> None:
    async def body() -> None:
        async with AsyncDiffusionEngine(ex, max_running=1) as engine:
            engine.check_health()
            fwd = gate_name()
            a = asyncio.create_task(engine.generate(req("a", gate=fwd)))
            assert await in_thread(lambda: GATES.wait_entered(fwd))
            b = asyncio.create_task(engine.generate(req("b")))
            await asyncio.sleep(0)

            def broken(now: float) -> list[list[str]]:
                raise RuntimeError("scheduler bug")

            assert engine._admission.scheduler is not None
            engine._admission.scheduler.schedule_batches = broken  # type: ignore[method-assign]  # fault injection
            engine._admission.wake.set()
            with pytest.raises(EngineDead, match="scheduler bug"):
                await b  # waiting requests fail at once: nobody would admit them
            with pytest.raises(EngineDead) as err:
                engine.check_health()
            assert isinstance(err.value.__cause__, RuntimeError)
            assert not engine.metrics().loop_alive
            with pytest.raises(EngineDead):
                await engine.generate(req("c"))
            GATES.open(fwd)
            assert (await a).request_id == "a"  # a request already sent finishes
            await assert_quiescent(engine)

    run(body())


def test_arguments_are_checked(ex: InProcessExecutor) -> None:
    with pytest.raises(UsageError, match="DiffusionExecutor"):
        AsyncDiffusionEngine(object())  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="max_running"):
        AsyncDiffusionEngine(ex, max_running=0)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            with pytest.raises(UsageError, match="DiffusionRequest"):
                await engine.generate("not a request")  # type: ignore[arg-type]
            with pytest.raises(UsageError, match="request ids must be str"):
                await engine.abort([1])  # type: ignore[list-item]

    run(body())
