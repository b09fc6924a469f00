"""Abort of a running request, compute deadlines that stop the forward, per-call deadlines.

End to end with the reference model (``TinyDiffusionWorker``: ``step_ms`` makes each
denoising step a pause, so a "long forward" costs no CPU), on worker threads
(``InProcessExecutor``) and in worker processes (``MultiprocDiffusionExecutor``),
whose main thread is busy in the forward while the cancel arrives on the control pipe.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from helpers.executor_harness import exc_of, wait_until
from helpers.leaks import LONG_LIVED, with_prefix
from omni_async.core.config import Deadlines
from omni_async.core.errors import ComputeTimeout, RequestAborted, UsageError, WorkerStuck
from omni_async.core.messages import DiffusionRequest, RunnerOutput
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.handle import RequestHandle
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.models.tiny import TinyDiffusionWorker

RELAXED = Deadlines(compute_timeout=60.0, output_timeout=60.0, rpc_timeout=60.0, cancel_grace=1.0)
SPEC = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker")
# A forward of 400 steps of 25 ms: 10 s unless something stops it.
LONG = {"steps": 400, "step_ms": 25}


def _req(rid: str, **params: Any) -> DiffusionRequest:
    return DiffusionRequest(rid, params)


def _quiet(ex: DiffusionExecutor) -> bool:
    m = ex.metrics()
    quiet = m.pending_outputs == 0 and m.pending_rpcs == 0 and m.held_payloads == 0
    if isinstance(ex, MultiprocDiffusionExecutor):
        quiet = quiet and ex.pool.stats().outstanding == 0
    return quiet


def _consume(ex: DiffusionExecutor, ro: RunnerOutput) -> None:
    assert ro.async_output_id is not None and not ro.aborted
    out = ex.wait_output_ready(ro.async_output_id).result(timeout=30)
    assert out.request_id == ro.request_id
    del out.output["image"]  # no view may outlive the release
    ex.release_output(out)


def _consume_handle(ex: DiffusionExecutor, h: RequestHandle) -> None:
    out = h.output.result(timeout=30)
    assert out.request_id == h.request_id
    del out.output["image"]  # no view may outlive the release
    ex.release_output(out)


def _started(fut: Future[Any], seconds: float = 0.4) -> None:
    """Let the forward get going (the worker is in its step loop, not in the RPC queue)."""
    time.sleep(seconds)
    assert not fut.done()


@pytest.fixture(scope="module", params=["inprocess", "multiproc"])
def ex(request: pytest.FixtureRequest) -> Iterator[DiffusionExecutor]:
    executor: DiffusionExecutor
    if request.param == "inprocess":
        executor = InProcessExecutor(lambda rank: TinyDiffusionWorker(), deadlines=RELAXED)
        try:
            yield executor
        finally:
            executor.shutdown()
        return
    mp = MultiprocDiffusionExecutor(SPEC, deadlines=RELAXED)
    prefix = mp.pool.prefix
    LONG_LIVED.add(prefix)
    try:
        yield mp
    finally:
        mp.shutdown()
        LONG_LIVED.discard(prefix)
    assert not with_prefix(prefix), with_prefix(prefix)


@pytest.fixture(autouse=True)
def _healthy_after(ex: DiffusionExecutor) -> Iterator[None]:
    yield
    wait_until(lambda: _quiet(ex), timeout=15)
    ex.check_health()


# -- abort of a running request ------------------------------------------------------------


@pytest.mark.slow
def test_cancel_stops_a_running_forward(ex: DiffusionExecutor) -> None:
    fut = ex.submit(_req("long", **LONG)).computed
    _started(fut)
    t0 = time.monotonic()
    ex.cancel_requests(["long"])
    err = exc_of(fut)
    took = time.monotonic() - t0
    assert isinstance(err, RequestAborted), err
    assert err.request_id == "long" and err.by == "abort"
    assert "aborted by cancel_requests()" in str(err) and "while computing; its forward stopped" in str(err)
    assert took < 3.0, f"the forward did not stop at its next step ({took:.1f} s)"
    # The worker takes the next request at once.
    _consume(ex, ex.execute_request(_req("next", steps=2)))


def test_a_request_cancelled_before_its_forward_started_never_runs(ex: DiffusionExecutor) -> None:
    first = ex.submit(_req("first", **LONG)).computed
    queued = ex.submit(_req("queued", steps=2)).computed
    _started(first)
    ex.cancel_requests(["queued"])
    time.sleep(0.2)
    assert not queued.done(), "the queued call ends when the worker reaches it, not before"
    ex.cancel_requests(["first"])
    assert isinstance(exc_of(first), RequestAborted)
    err = exc_of(queued)
    assert isinstance(err, RequestAborted) and "before its forward started; it never ran" in str(err), err


@pytest.mark.slow
def test_a_model_that_ignores_the_check_finishes_and_nothing_is_kept(ex: DiffusionExecutor) -> None:
    fut = ex.submit(_req("stubborn", steps=40, step_ms=25, ignore_cancel=True)).computed
    _started(fut, 0.2)
    t0 = time.monotonic()
    ex.cancel_requests(["stubborn"])
    err = exc_of(fut)
    assert isinstance(err, RequestAborted) and "ran to the end" in str(err), err
    assert time.monotonic() - t0 > 0.3  # it really ran on (1 s forward, cancelled at 0.2 s)


@pytest.mark.slow
def test_cancelling_one_request_of_a_batch_drops_only_its_output(ex: DiffusionExecutor) -> None:
    # execute_batch's shape (one RunnerOutput per member, the cancelled one marked
    # ``aborted``), called on a thread so that the cancel can come while it blocks.
    with ThreadPoolExecutor(1) as caller:
        fut = caller.submit(ex.execute_batch, [_req("b1", steps=40, step_ms=10), _req("b2", steps=2)])
        wait_until(lambda: ex.metrics().pending_rpcs == 1)  # sent: the cancel will find it
        _started(fut, 0.1)

        ex.cancel_requests(["b1"])
        outs = fut.result(timeout=30)
    assert outs[0] == RunnerOutput("b1", finished=True, aborted=True)
    assert outs[1].request_id == "b2" and not outs[1].aborted
    _consume(ex, outs[1])


def _packer_counts(ex: DiffusionExecutor) -> tuple[int, int, int]:
    """Rank 0's packer: outputs packed, outputs reported cancelled without packing, bytes packed."""
    p = ex.worker_metrics()[0].packer
    return p.packed, p.cancelled, p.bytes_packed


def _leased(ex: DiffusionExecutor) -> int:
    """Segments leased so far (the pool's shared counter: the worker processes' leases count)."""
    return ex.pool.stats().leased if isinstance(ex, MultiprocDiffusionExecutor) else 0


# An image over the inline threshold (64 KiB), so that its output leases a segment.
SIZE = {"height": 1024}
BIG = {"steps": 2, **SIZE}


def test_a_batch_member_cancelled_during_its_forward_is_never_packed(ex: DiffusionExecutor) -> None:
    """The member cancelled while the batch's forward runs is not packed or shipped.

    Its result alone (``aborted``) cannot tell: the executor drops the id with the call's
    end, so an output packed and shipped anyway is released on arrival (a wasted copy and
    segment).  The packer's counters must show one output packed (the survivor's, its
    bytes those of the same request run alone) and one reported cancelled; in worker
    processes the pool leased the segments of one output, not two.  Killed by the mutant
    that packs every member regardless (``skip = False`` in the worker loop).
    """
    # The survivor alone: what packing one such output costs.
    packed0, cancelled0, bytes0 = _packer_counts(ex)
    leased0 = _leased(ex)
    _consume(ex, ex.execute_request(_req("alone", **BIG)))
    wait_until(lambda: _packer_counts(ex)[0] == packed0 + 1)
    packed1, cancelled1, bytes1 = _packer_counts(ex)
    one_bytes, one_leases = bytes1 - bytes0, _leased(ex) - leased0
    assert cancelled1 == cancelled0 and one_bytes > 0
    if isinstance(ex, MultiprocDiffusionExecutor):
        assert one_leases > 0
    # The batch: b1 (long) is cancelled during the forward, b2 survives.
    cancelled, survivor = ex.submit_batch([_req("p1", steps=40, step_ms=10, **SIZE), _req("p2", **BIG)])
    _started(cancelled.computed, 0.1)
    ex.cancel_requests(["p1"])
    for fut in (cancelled.computed, cancelled.output):
        err = exc_of(fut)
        assert isinstance(err, RequestAborted) and "the rest of its batch went on" in str(err), err
    out = survivor.output.result(timeout=30)
    assert out.request_id == "p2"
    del out.output["image"]  # no view may outlive the release
    ex.release_output(out)
    # Both members have been handled by the packer (in order) once the counters add up.
    wait_until(lambda: sum(_packer_counts(ex)[:2]) >= packed1 + cancelled1 + 2)
    packed2, cancelled2, bytes2 = _packer_counts(ex)
    assert (packed2 - packed1, cancelled2 - cancelled1) == (1, 1), "the cancelled member was packed"
    assert bytes2 - bytes1 == one_bytes, "bytes of more than the survivor's output were packed"
    assert _leased(ex) - leased0 - one_leases == one_leases, "segments leased for the cancelled member"


def test_cancelling_every_request_of_a_batch_stops_it(ex: DiffusionExecutor) -> None:
    handles = ex.submit_batch([_req("c1", **LONG), _req("c2", **LONG)])
    _started(handles[0].computed)
    ex.cancel_requests(["c1"])
    time.sleep(0.2)
    assert not any(h.computed.done() for h in handles), "one member cancelled: the batch goes on"
    ex.cancel_requests(["c2", "c1"])
    for h in handles:
        err = exc_of(h.computed)
        assert isinstance(err, RequestAborted) and err.request_ids == ("c1", "c2"), err


def test_cancel_of_unknown_or_finished_requests_is_a_no_op(ex: DiffusionExecutor) -> None:
    ro = ex.execute_request(_req("done", steps=2))
    ex.cancel_requests(["done", "never-submitted"])
    ex.cancel_requests([])
    _consume(ex, ro)


@pytest.mark.parametrize(
    "bad",
    ["one-id", b"bytes", None, 3, [1], [""], {"a": 1}],
    ids=["str", "bytes", "none", "int", "int-item", "empty-item", "mapping"],
)
def test_cancel_requests_rejects_bad_input(ex: DiffusionExecutor, bad: Any) -> None:
    with pytest.raises(UsageError, match="cancel_requests"):
        ex.cancel_requests(bad)


# -- compute deadlines stop the forward; per-call deadlines ------------------------------------


def test_a_per_call_compute_deadline_stops_the_forward(ex: DiffusionExecutor) -> None:
    fut = ex.submit(_req("slow", **LONG), deadlines=Deadlines(compute_timeout=0.5)).computed
    err = exc_of(fut)
    assert isinstance(err, ComputeTimeout) and "compute_timeout=0.5" in str(err) and "cancelled" in str(err)
    # The worker stops within a step or so: the next request does not wait out the 10 s forward.
    t0 = time.monotonic()
    _consume(ex, ex.execute_request(_req("after", steps=2)))
    assert time.monotonic() - t0 < 3.0
    wait_until(lambda: ex.metrics().overdue_calls == 0, timeout=5)


@pytest.mark.slow
def test_a_worker_that_ignores_its_deadline_is_reported_stuck(ex: DiffusionExecutor) -> None:
    fut = ex.submit(
        _req("stuck", steps=100, step_ms=30, ignore_cancel=True), deadlines=Deadlines(compute_timeout=0.3)
    ).computed
    assert isinstance(exc_of(fut), ComputeTimeout)
    ex.check_health()  # within the grace period (1 s)
    time.sleep(1.2)
    with pytest.raises(WorkerStuck) as info:
        ex.check_health()
    assert info.value.rank == 0 and info.value.request_ids == ("stuck",)
    assert "rank 0" in str(info.value) and "'stuck'" in str(info.value)
    # Once the forward ends (3 s in all) the worker answers, and health is back.
    wait_until(lambda: ex.metrics().overdue_calls == 0, timeout=10)
    ex.check_health()


def test_a_per_call_output_deadline_replaces_the_executors(ex: DiffusionExecutor) -> None:
    ro = ex.execute_request(_req("unclaimed", steps=2), deadlines=Deadlines(output_timeout=0.3))
    assert ro.async_output_id is not None
    time.sleep(0.6)
    err = exc_of(ex.wait_output_ready(ro.async_output_id))
    assert "output_timeout=0.3" in str(err), err


def test_deadlines_must_be_a_deadlines(ex: DiffusionExecutor) -> None:
    with pytest.raises(UsageError, match="deadlines must be a Deadlines"):
        ex.submit(_req("x"), deadlines=5.0)  # type: ignore[arg-type]
