"""The multiprocess executor with real worker processes, shared memory, pipes and threads.

Every test ends with no segment of ours left in /dev/shm (conftest's autouse fixture).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from helpers.finalizers import quiet_finalizers
from helpers.leaks import kept_for_the_module
from helpers.mp_workers import expected_image
from helpers.traces import keep
from omni_async.core.config import Deadlines
from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OmniAsyncError,
    OutputAlreadyClaimed,
    RemoteError,
    RpcFailed,
    WorkerDied,
)
from omni_async.core.messages import DiffusionOutput, DiffusionRequest, OutputReady, RunnerOutput
from omni_async.executor import RequestHandle
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.transport.errors import OutputStillViewed
from omni_async.transport.packing import pack_diffusion_output_shm, settle_releases
from omni_async.transport.shm import SegmentPool
from omni_async.verify.recorder import ListTracer

SPEC = WorkerSpec("helpers.mp_workers:ScriptedWorker", pass_rank=True)
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


def _req(rid: str, **params: object) -> DiffusionRequest:
    return DiffusionRequest(rid, params)


def _wait_ok(ex: MultiprocDiffusionExecutor, ro: RunnerOutput, params: Mapping[str, object]) -> None:
    assert ro.async_output_id is not None
    _check_ok(ex, ro, ex.wait_output_ready(ro.async_output_id).result(timeout=30), params)


def _take_ok(ex: MultiprocDiffusionExecutor, h: RequestHandle, params: Mapping[str, object]) -> None:
    """The handle's output, claimed for it at COMPUTE_DONE, as ``_wait_ok`` checks it."""
    out = h.output.result(timeout=30)
    _check_ok(ex, h.computed.result(timeout=30), out, params)


def _check_ok(
    ex: MultiprocDiffusionExecutor, ro: RunnerOutput, out: DiffusionOutput, params: Mapping[str, object]
) -> None:
    assert out.request_id == ro.request_id
    assert out.async_output_id == ro.async_output_id
    exp = expected_image(params)
    got = out.output["image"]
    assert got.dtype == exp.dtype
    assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
    del got  # a view still alive would make the release fail (OutputStillViewed)
    assert ex.release_output(out) == (1 if exp.numel() * exp.element_size() > (64 << 10) else 0)


def _assert_quiet(ex: MultiprocDiffusionExecutor) -> None:
    m = ex.metrics()
    assert m.pending_outputs == 0 and m.pending_rpcs == 0 and m.held_payloads == 0, m
    assert ex.pool.stats().outstanding == 0, ex.pool.outstanding()


@pytest.fixture(scope="module")
def ex2() -> Iterator[MultiprocDiffusionExecutor]:
    """Two ranks, reply rank 0: shared by the tests that leave it healthy.

    Its pool lives for the whole module, so the per-test /dev/shm check skips its
    prefix; after shutdown none of its segments may remain (``kept_for_the_module``).
    """
    tracer = ListTracer()
    try:
        yield from kept_for_the_module(
            MultiprocDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES, tracer=tracer)
        )
    finally:
        keep("multiproc", tracer)


@pytest.fixture
def tracer() -> Iterator[ListTracer]:
    """Records the executor's protocol trace; kept for the TLC trace validation."""
    t = ListTracer()
    yield t
    keep("multiproc", t)


def test_request_mode_single_and_batch_bit_exact(ex2: MultiprocDiffusionExecutor) -> None:
    cases = [
        {"seed": 1, "dtype": "bfloat16", "numel": 1 << 18},
        {"seed": 2, "dtype": "float16", "numel": 1 << 18},
        {"seed": 3, "dtype": "float32", "numel": 1 << 17},
        {"seed": 4, "dtype": "int8", "numel": 1 << 20},
        {"seed": 5, "dtype": "int64", "numel": 100},  # inline
    ]
    ro = ex2.execute_request(_req("single", **cases[0]))
    assert ro.result is None and ro.async_output_id
    _wait_ok(ex2, ro, cases[0])
    ros = ex2.execute_batch([_req(f"b{i}", **c) for i, c in enumerate(cases)])
    assert [r.request_id for r in ros] == [f"b{i}" for i in range(len(cases))]
    assert len({r.async_output_id for r in ros}) == len(cases)
    for r, c in zip(ros, cases, strict=True):
        _wait_ok(ex2, r, c)
    _assert_quiet(ex2)


def test_steady_state_creates_no_segment(ex2: MultiprocDiffusionExecutor) -> None:
    params = {"seed": 7, "numel": 1 << 18}
    for i in range(3):  # warm-up
        _wait_ok(ex2, ex2.execute_request(_req(f"w{i}", **params)), params)
    created = ex2.pool.stats().created
    for i in range(20):
        _wait_ok(ex2, ex2.execute_request(_req(f"s{i}", **params)), params)
    stats = ex2.pool.stats()
    assert stats.created == created, stats
    assert stats.reused >= 20


def test_concurrent_submissions_and_waiters(ex2: MultiprocDiffusionExecutor) -> None:
    params = {"seed": 11, "numel": 1 << 17}
    handles = [ex2.submit(_req(f"c{i}", **params)) for i in range(24)]
    for h in handles:
        _take_ok(ex2, h, params)
    _assert_quiet(ex2)


def test_collective_rpc_and_rank_failure(ex2: MultiprocDiffusionExecutor) -> None:
    pids = ex2.collective_rpc("pid")
    assert len(set(pids)) == 2 and os.getpid() not in pids
    with pytest.raises(RpcFailed) as err:
        ex2.collective_rpc("fail")
    assert sorted(err.value.failures) == [0, 1]
    assert err.value.failures[1].type_name == "ValueError"


def test_exception_in_forward_fails_the_call(ex2: MultiprocDiffusionExecutor) -> None:
    with pytest.raises(RpcFailed) as err:
        ex2.execute_request(_req("boom", **{"raise": True}))
    assert err.value.failures[0].type_name == "RuntimeError"
    assert "forward of boom failed" in err.value.failures[0].traceback
    _assert_quiet(ex2)


def test_exception_in_packing_fails_the_waiter_with_typed_failure(ex2: MultiprocDiffusionExecutor) -> None:
    ro = ex2.execute_request(_req("bad", unpackable=True, numel=1 << 18))
    assert ro.async_output_id is not None
    with pytest.raises(RemoteError) as err:
        ex2.wait_output_ready(ro.async_output_id).result(timeout=30)
    assert err.value.failure.type_name == "UnsupportedOutputType"
    _assert_quiet(ex2)


def test_drop_before_and_after_output(ex2: MultiprocDiffusionExecutor) -> None:
    params = {"seed": 12, "numel": 1 << 18}
    ro = ex2.execute_request(_req("d1", **params))
    assert ro.async_output_id is not None
    ex2.drop_output(ro.async_output_id).result(timeout=30)  # acknowledged: gone
    fut = ex2.wait_output_ready(ro.async_output_id)
    with pytest.raises(OmniAsyncError):
        fut.result(timeout=5)
    ros = ex2.execute_batch([_req(f"d{i}", **params) for i in range(2, 6)])
    ex2.abort_outputs([r.async_output_id for r in ros if r.async_output_id], timeout=30)
    _assert_quiet(ex2)


def test_drain_and_sleep_wait_for_packing(ex2: MultiprocDiffusionExecutor) -> None:
    params = {"seed": 13, "numel": 1 << 20}
    ros = ex2.execute_batch([_req(f"dr{i}", **params) for i in range(3)])
    ex2.drain(timeout=30)  # F8: every output has left the packer
    assert ex2.worker_metrics()[0].packer.in_flight_outputs == 0
    assert ex2.collective_rpc("sleep") == ["asleep", "asleep"]
    for r in ros:
        _wait_ok(ex2, r, params)


@pytest.mark.slow
def test_several_ranks_one_failing_fails_the_call_f12(tracer: ListTracer) -> None:
    spec = WorkerSpec("helpers.mp_workers:ScriptedWorker", {"fail_rank": 1}, pass_rank=True)
    with MultiprocDiffusionExecutor(spec, world_size=2, deadlines=DEADLINES, tracer=tracer) as ex:
        with pytest.raises(RpcFailed) as err:
            ex.execute_request(_req("x", numel=1 << 18))
        assert list(err.value.failures) == [1]
        # Rank 0 announced an output; the failed call dropped it: nothing is left.
        deadline = time.monotonic() + 10
        while ex.metrics().pending_outputs and time.monotonic() < deadline:
            time.sleep(0.05)
        _assert_quiet(ex)


@pytest.mark.slow
def test_step_mode_call_failing_on_another_rank_gives_the_reply_ranks_output_back() -> None:
    """Step mode packs on the reply rank's main thread; when another rank fails the call
    (RpcFailed, F12) the output the reply rank packed has no owner: its segment goes
    back to the pool at once (it stayed leased until shutdown)."""
    spec = WorkerSpec("helpers.mp_workers:ScriptedWorker", {"fail_rank": 1}, pass_rank=True)
    with MultiprocDiffusionExecutor(spec, world_size=2, step_mode=True, deadlines=DEADLINES) as ex:
        for i in range(3):
            with pytest.raises(RpcFailed) as err:
                ex.execute_request(_req(f"sf{i}", numel=1 << 18))
            assert list(err.value.failures) == [1]
        with pytest.raises(RpcFailed):
            ex.execute_batch([_req("sfb1", numel=1 << 18), _req("sfb2", numel=1 << 18)])
        _assert_quiet(ex)


@pytest.mark.slow
def test_step_mode_answer_that_comes_after_its_timeout_gives_its_output_back() -> None:
    """A step-mode call that timed out: its answer, output packed, comes later and is
    discarded as stale by the next call -- with its segment, not kept until shutdown."""
    deadlines = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=0.5)
    with MultiprocDiffusionExecutor(SPEC, step_mode=True, deadlines=deadlines) as ex:
        with pytest.raises(ComputeTimeout):
            ex.execute_request(_req("slow", numel=1 << 18, sleep=1.5))
        time.sleep(1.5)
        ro = ex.execute_request(_req("next", numel=1 << 18))
        assert ro.result is not None and ex.stale_sync_answers == 1
        ex.release_output(ro.result)
        _assert_quiet(ex)


@pytest.mark.slow
def test_step_mode_returns_the_output_synchronously(tracer: ListTracer) -> None:
    with MultiprocDiffusionExecutor(SPEC, step_mode=True, deadlines=DEADLINES, tracer=tracer) as ex:
        params = {"seed": 21, "dtype": "bfloat16", "numel": 1 << 18}
        ro = ex.execute_request(_req("st", **params))
        assert ro.async_output_id is None and ro.result is not None
        assert torch.equal(ro.result.output["image"].view(torch.uint8), expected_image(params).view(torch.uint8))
        assert ex.release_output(ro.result) == 1
        ros = ex.execute_batch([_req("st1", seed=1), _req("st2", seed=2)])
        assert [r.request_id for r in ros] == ["st1", "st2"]
        for r in ros:
            assert r.result is not None
            ex.release_output(r.result)
        _assert_quiet(ex)


def _kill_and_expect_worker_died(ex: MultiprocDiffusionExecutor, fut: Future[Any], rank: int = 0) -> float:
    pid = ex.procs[rank].pid
    assert pid is not None
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDied) as err:
        fut.result(timeout=5)
    elapsed = time.monotonic() - t0
    assert err.value.rank == rank and err.value.exitcode == -signal.SIGKILL
    with pytest.raises(WorkerDied):
        ex.check_health()
    return elapsed


@pytest.mark.slow
def test_worker_killed_mid_forward_fails_waiters_promptly(tracer: ListTracer) -> None:
    with MultiprocDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES, tracer=tracer) as ex:
        fut = ex.submit(_req("slow", sleep=30)).computed
        time.sleep(0.3)  # the forward is running
        assert _kill_and_expect_worker_died(ex, fut, rank=1) < 3.0
        # The executor refuses new work with the same error.
        with pytest.raises(WorkerDied):
            ex.submit(_req("after"))


@pytest.mark.slow
def test_worker_killed_mid_pack_fails_the_output_waiter(tracer: ListTracer) -> None:
    # A pool with room for one 1 MiB segment: the second output's packing waits for a
    # segment the consumer still holds, so the kill lands inside the pack.
    pool = SegmentPool(max_bytes=1 << 20, max_segments=1)
    opts = WorkerOptions(lease_timeout=60)
    with MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, options=opts, pool=pool, tracer=tracer) as ex:
        params = {"seed": 31, "numel": (1 << 18) - 1024}
        first = ex.execute_request(_req("p1", **params))
        assert first.async_output_id is not None
        held = ex.wait_output_ready(first.async_output_id).result(timeout=30)  # holds the one segment
        second = ex.execute_request(_req("p2", **params))
        assert second.async_output_id is not None
        fut = ex.wait_output_ready(second.async_output_id)
        time.sleep(0.3)
        info_ok = not fut.done()
        assert info_ok, "the second output should still be packing"
        assert _kill_and_expect_worker_died(ex, fut) < 3.0
        ex.release_output(held)


@pytest.mark.slow
def test_shutdown_with_work_in_flight_fails_everything_and_is_idempotent(tracer: ListTracer) -> None:
    ex = MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, tracer=tracer)
    params = {"seed": 41, "numel": 1 << 18}
    done = ex.execute_request(_req("ok", **params))
    assert done.async_output_id is not None
    ready = ex.wait_output_ready(done.async_output_id).result(timeout=30)
    kept = ready.output["image"]
    pending = ex.submit(_req("slow", sleep=30)).computed
    time.sleep(0.2)
    t0 = time.monotonic()
    ex.shutdown()
    ex.shutdown()
    assert time.monotonic() - t0 < 15
    with pytest.raises(ExecutorShutdown):
        pending.result(timeout=1)
    with pytest.raises(ExecutorShutdown):
        ex.execute_request(_req("late"))
    assert all(not p.is_alive() for p in ex.procs)
    # Views outlive the pool: still readable (the mapping stays until they go), and the
    # release their finalizer attempts on the closed pool raises and logs nothing.
    assert torch.equal(kept, expected_image(params))
    with quiet_finalizers() as caught:
        del ready, kept
        settle_releases()
    assert caught == []


def test_outputs_for_nobody_are_released(ex2: MultiprocDiffusionExecutor) -> None:
    """F9/F11 through real processes: cancelled waiter and consumer gone."""
    params = {"seed": 51, "numel": 1 << 18}
    ro = ex2.execute_request(_req("cx", **params))
    assert ro.async_output_id is not None
    fut = ex2.wait_output_ready(ro.async_output_id)
    if not fut.cancel():
        # On a loaded machine the output can be READY before the wait: the future is
        # delivered at once, the cancel comes too late and the engine owns the output.
        ex2.release_output(fut.result(timeout=30))
    # Announced and never claimed (a handle would claim them): the consumer's to lose.
    ros = [ex2.execute_request(_req(f"g{i}", **params), consumer="stream-1") for i in range(2)]
    assert ex2.release_consumer("stream-1") == 2
    deadline = time.monotonic() + 10
    while (ex2.metrics().pending_outputs or ex2.pool.stats().outstanding) and time.monotonic() < deadline:
        time.sleep(0.05)
    _assert_quiet(ex2)
    assert all(r.async_output_id for r in ros)


@pytest.mark.slow
def test_backpressure_holds_the_next_forward_until_the_packer_has_room(tracer: ListTracer) -> None:
    """A full packer makes the worker wait before its next forward; never a drop."""
    pool = SegmentPool(max_bytes=1 << 20, max_segments=1)
    opts = WorkerOptions(max_outputs_in_flight=1, lease_timeout=60)
    with MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, options=opts, pool=pool, tracer=tracer) as ex:
        params = {"seed": 61, "numel": (1 << 18) - 1024}
        first = ex.execute_request(_req("q1", **params))
        assert first.async_output_id is not None
        held = ex.wait_output_ready(first.async_output_id).result(timeout=30)  # pins the one segment
        second = ex.execute_request(_req("q2", **params))  # forward runs; its pack waits for a segment
        third = ex.submit(_req("q3", **params))  # must wait for packer room before its forward
        time.sleep(0.5)
        assert not third.computed.done(), "the third forward started although the packer was full"
        ex.release_output(held)
        assert second.async_output_id is not None
        _wait_ok(ex, second, params)
        _take_ok(ex, third, params)
        packer = ex.worker_metrics()[0].packer
        assert packer.backpressure_waits >= 1 and packer.backpressure_seconds > 0.3, packer
        _assert_quiet(ex)


@pytest.mark.slow
def test_a_message_of_a_dead_worker_read_after_its_death_is_released_not_held() -> None:
    """TLC's DeathKeepsOpen through real processes: a worker's death closes the registry.

    A worker's packer can send OUTPUT_READY for an output whose COMPUTE_DONE the main
    thread never sent (killed in between); the pump may read it after the death was
    handled.  The registry must release its segment on arrival and keep nothing: left
    open (``fail_all(..., close=False)``), it would create an EARLY_READY record, with
    no deadline, that holds the segment forever.  The message is written through the
    executor's own end of the result channel, as if it had been in the pipe all along
    (no trace is kept: no worker machine of the spec sent it).
    """
    with MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES) as ex:
        fut = ex.submit(_req("slow", sleep=30)).computed
        time.sleep(0.3)
        # The call's future fails inside the pump's fail_all: the death is handled.
        _kill_and_expect_worker_died(ex, fut)
        released = ex.metrics().released
        oid = "r0-dead-7"
        image = torch.arange(1 << 17, dtype=torch.float32)  # 512 KiB: a real segment
        packed = pack_diffusion_output_shm(DiffusionOutput("late", {"image": image}, async_output_id=oid), pool=ex.pool)
        assert ex.pool.stats().outstanding == 1
        ex.ranks._channel.put(OutputReady(oid, packed, rank=0))
        deadline = time.monotonic() + 5
        while ex.metrics().released == released and time.monotonic() < deadline:
            time.sleep(0.05)
        m = ex.metrics()
        assert m.released == released + 1, f"the late output of the dead worker is held: {m}"
        assert m.pending_outputs == 0 and m.held_payloads == 0, m
        assert ex.pool.stats().outstanding == 0, ex.pool.outstanding()
        with pytest.raises(WorkerDied):
            ex.wait_output_ready(oid).result(timeout=5)


@pytest.mark.slow
def test_shutdown_with_sends_in_flight_is_quiet(capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 8: workers whose result pipe closed at shutdown exit quietly.

    At shutdown one forward is running (its COMPUTE_DONE will find the pipe closed) and
    one output waits for a segment the engine holds (its failure will too).  Neither
    may print ``ChannelClosed ... Broken pipe`` tracebacks: the reader is gone on
    purpose, which a worker logs at debug level and exits.
    """
    pool = SegmentPool(max_bytes=1 << 20, max_segments=1)
    opts = WorkerOptions(lease_timeout=0.5)
    ex = MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, options=opts, pool=pool)
    try:
        params = {"seed": 71, "numel": (1 << 18) - 1024}
        first = ex.execute_request(_req("h1", **params))
        assert first.async_output_id is not None
        held = ex.wait_output_ready(first.async_output_id).result(timeout=30)  # the one segment
        ex.execute_request(_req("h2", **params))  # its pack waits for the segment, then fails
        ex.submit(_req("h3", sleep=1.0, **params))  # a forward still running at shutdown
        time.sleep(0.3)
    finally:
        ex.shutdown()
    del held
    assert all(p.exitcode == 0 for p in ex.procs), [p.exitcode for p in ex.procs]
    err = capfd.readouterr().err
    for noise in ("Traceback", "ChannelClosed", "Broken pipe"):
        assert noise not in err, err


def _image_of(ex: MultiprocDiffusionExecutor, rid: str, params: Mapping[str, object]) -> Any:
    ro = ex.execute_request(_req(rid, **params))
    assert ro.async_output_id is not None
    return ex.wait_output_ready(ro.async_output_id).result(timeout=30)


@pytest.mark.slow
def test_a_kept_tensor_never_changes_after_release_through_workers(tracer: ListTracer) -> None:
    """Issue 8: keep a tensor, release its output, run requests that reuse the segment.

    Before the fix the release succeeded and the next request's bytes showed through
    the kept tensor (its sum changed, no error).  Now the release fails loudly and the
    segment stays out of the pool until the tensor is gone.
    """
    pool = SegmentPool(max_bytes=4 << 20, max_segments=2)
    params = {"seed": 71, "numel": (1 << 18) - 1024}  # ~1 MiB: every output in one size class
    with MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, pool=pool, tracer=tracer) as ex:
        out = _image_of(ex, "k0", params)
        kept = out.output["image"]
        before = kept.clone()
        loud = False
        try:
            ex.release_output(out)
        except OutputStillViewed as err:
            loud = True
            assert err.output_id == out.async_output_id and err.views == 1
            assert "copy" in str(err)
        del out
        for i in range(4):
            p = {"seed": 100 + i, "numel": params["numel"]}
            _wait_ok(ex, ex.execute_request(_req(f"k{i + 1}", **p)), p)
        assert torch.equal(kept, before), f"kept tensor changed: sum {float(before.sum())} -> {float(kept.sum())}"
        assert loud, "release_output with a live view must fail loudly"
        del kept
        settle_releases()
        _assert_quiet(ex)


@pytest.mark.slow
def test_a_segment_is_reused_only_after_the_last_view_is_gone_through_workers(tracer: ListTracer) -> None:
    pool = SegmentPool(max_bytes=4 << 20, max_segments=2)
    params = {"seed": 72, "numel": (1 << 18) - 1024}
    with MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, pool=pool, tracer=tracer) as ex:
        out = _image_of(ex, "v0", params)
        view = out.output["image"][::4]
        del out  # no release_output: the view alone holds the segment
        settle_releases()
        assert pool.stats().outstanding == 1
        _wait_ok(ex, ex.execute_request(_req("v1", **params)), params)
        st = pool.stats()
        assert st.created == 2 and st.outstanding == 1, st  # the viewed segment was not reused
        assert torch.equal(view, expected_image(params)[::4])
        del view
        settle_releases()
        assert pool.stats().outstanding == 0
        for i in range(3):
            _wait_ok(ex, ex.execute_request(_req(f"v{i + 2}", **params)), params)
        st = pool.stats()
        assert st.created == 2 and st.reused >= 3, st
        _assert_quiet(ex)


def test_an_output_id_is_delivered_to_exactly_one_waiter(ex2: MultiprocDiffusionExecutor) -> None:
    """The second-waiter rule: a second wait_output_ready on an id fails at once, typed."""
    params = {"seed": 73, "numel": 1 << 18}
    ro = ex2.execute_request(_req("once", **params))
    oid = ro.async_output_id
    assert oid is not None
    first = ex2.wait_output_ready(oid)
    second = ex2.wait_output_ready(oid)  # while the first is pending (or just delivered)
    with pytest.raises(OutputAlreadyClaimed) as err:
        second.result(timeout=1)
    assert err.value.output_id == oid and "exactly one" in str(err.value)
    out = first.result(timeout=30)
    later = ex2.wait_output_ready(oid)  # after delivery: says so, not "unknown id"
    with pytest.raises(OutputAlreadyClaimed, match="delivered"):
        later.result(timeout=1)
    assert ex2.release_output(out) == 1
    _assert_quiet(ex2)


def test_each_rank_gets_its_own_gpu_when_there_are_enough() -> None:
    """``device="cuda"`` without an index: rank r on ``cuda:r``, round-robin over fewer GPUs;
    an explicit index or another device is used as given."""
    from omni_async.executor.multiproc import device_for_rank

    assert [device_for_rank("cuda", r, 2) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert [device_for_rank("cuda", r, 2) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert device_for_rank("cuda:1", 0, 2) == "cuda:1" and device_for_rank("cpu", 1, 2) == "cpu"
    assert device_for_rank("cuda", 1, 0) == "cuda"  # no GPU counted: left to the process's current device


@pytest.mark.slow
def test_the_packing_rank_maps_the_segments_made_ahead_while_starting() -> None:
    """Segments made ahead (``pool.prewarm`` before the executor starts) are mapped -- and
    on CUDA registered as pinned memory -- by the rank that packs, while it starts: its
    first packs pay neither (on an H200 a 512 MB segment first used inside a run cost its
    pack ~175 ms and held the rank's next CUDA call as long).  Ranks that never pack map
    nothing."""
    pool = SegmentPool(max_segments=8)
    pool.prewarm(1 << 20, 2)
    with MultiprocDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES, pool=pool) as ex:
        info = ex.worker_metrics()
        assert info[0].mapped_segments == 2, info[0]
        assert info[0].pinned_segments == (2 if torch.cuda.is_available() else 0), info[0]
        assert info[1].mapped_segments == 0, info[1]
        _wait_ok(ex, ex.execute_request(_req("r", numel=1 << 17)), {"numel": 1 << 17})
        assert pool.stats().created == 2  # the request used a segment made ahead
