"""Streaming and final-step async through real worker processes (``MultiprocDiffusionExecutor``,
real shared memory): chunks in order, a failed chunk or call ends the stream with its typed
error, closing a stream and cancelling mid-stream release everything, a slow consumer is
bounded by the budget of held outputs, and step mode's final step takes the asynchronous
path with the same result as the synchronous one (its overlap measured, not asserted).
Every test ends with an empty registry and no segment held (conftest checks /dev/shm)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from helpers.leaks import kept_for_the_module
from helpers.mp_workers import expected_image
from omni_async.core.config import Deadlines
from omni_async.core.errors import (
    OutputAlreadyClaimed,
    OutputDropped,
    RemoteError,
    RequestAborted,
    RpcFailed,
    UsageError,
)
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.executor import RequestHandle
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.executor.stream import RequestStream
from omni_async.models.tiny import TinyDiffusionWorker, image_digest
from omni_async.transport.packing import settle_releases

WIDTH = 128
SPEC = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": WIDTH, "steps": 6})
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


def r(rid: str, **params: object) -> DiffusionRequest:
    return DiffusionRequest(rid, {"height": 256, **params})  # 128 KiB images: in shared memory


def quiet(ex: MultiprocDiffusionExecutor, timeout: float = 30.0) -> None:
    """Nothing of any request left: registry, held payloads, pending calls, segments."""
    deadline = time.monotonic() + timeout
    keys = ("pending_rpcs", "pending_outputs", "pending_waiters", "held_payloads", "held_outputs")
    while True:
        settle_releases()
        m = ex.metrics().as_dict()
        left = {k: m[k] for k in keys if m[k]}
        if not left:
            return
        assert time.monotonic() < deadline, f"not quiescent: {left}"
        time.sleep(0.02)


def streamed(ex: MultiprocDiffusionExecutor, request: DiffusionRequest) -> tuple[RequestHandle, RequestStream]:
    """``submit(stream=True)``: the handle (its ``output`` the final output) and its stream."""
    h = ex.submit(request, stream=True)
    assert h.stream is not None
    return h, h.stream


def drop_final(ex: MultiprocDiffusionExecutor, h: RequestHandle) -> None:
    """Drop the final output after COMPUTE_DONE; one delivered before the drop (the packer
    can be quick) is the caller's to release.  Either way nothing of it stays."""
    h.computed.result(30)
    h.drop().result(30)
    try:
        ex.release_output(h.output.result(30))
    except OutputDropped:
        pass


@pytest.fixture(scope="module")
def ex() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES))


def test_chunks_arrive_in_order_bit_exact_and_before_the_call_resolves(ex: MultiprocDiffusionExecutor) -> None:
    reference = TinyDiffusionWorker(width=WIDTH, steps=6)
    h, stream = streamed(ex, r("s1", seed=3, preview_every=2))
    with stream:
        chunks = []
        while (c := stream.next_chunk(timeout=30)) is not None:
            assert not stream.result.done() or c.seq <= 2
            chunks.append(c)
        assert stream.result.done(), "the stream ends when its call resolves"
        outputs = [c.output.result(30) for c in chunks]
    assert [c.seq for c in chunks] == [0, 1, 2]
    assert [o.output["info"]["step"] for o in outputs] == [2, 4, 6]
    for o in outputs:
        assert int(image_digest(o.output["image"])) == int(o.output["digest"])  # bit-exact transport
    final = h.output.result(30)
    # The preview after the last step is the final image.
    assert torch.equal(outputs[-1].output["image"], final.output["image"])
    expected = reference.execute_model(r("x", seed=3)).output["image"]
    assert torch.allclose(final.output["image"], expected, atol=0.05)
    for o in (*outputs, final):
        ex.release_output(o)
    del outputs, final
    quiet(ex)


def test_iterating_a_stream_yields_the_outputs(ex: MultiprocDiffusionExecutor) -> None:
    h, stream = streamed(ex, r("s2", preview_every=3))
    seen = []
    for out in stream:
        seen.append(out.output["info"]["step"])
        ex.release_output(out)
    assert seen == [3, 6] and stream.finished and stream.error is None
    final = h.output.result(30)
    ex.release_output(final)
    del final
    quiet(ex)


def test_a_failed_chunk_ends_the_stream_with_its_typed_failure(ex: MultiprocDiffusionExecutor) -> None:
    h, stream = streamed(ex, r("s3", preview_every=1, unpackable_preview=True))
    with pytest.raises(RemoteError) as info:
        for out in stream:
            ex.release_output(out)
    assert info.value.failure.type_name == "UnsupportedOutputType"
    assert stream.close().done() or stream.close().result(30) is None
    # The call itself went on: its final output is the caller's to take or drop.
    drop_final(ex, h)
    quiet(ex)


def test_a_failed_call_ends_the_stream_with_its_error(ex: MultiprocDiffusionExecutor) -> None:
    h, stream = streamed(ex, r("s4", preview_every=1, raise_at_step=3))
    steps = []
    with pytest.raises(RpcFailed, match="failed on purpose at step 3"):
        for out in stream:
            steps.append(out.output["info"]["step"])
            ex.release_output(out)
    assert steps == [1, 2, 3][: len(steps)], "chunks taken before the failure come in order"
    assert isinstance(stream.error, RpcFailed)
    with pytest.raises(RpcFailed):
        stream.result.result(30)
    with pytest.raises(RpcFailed):
        h.output.result(30)
    quiet(ex)


def test_closing_a_stream_early_releases_everything(ex: MultiprocDiffusionExecutor) -> None:
    released = ex.metrics().released
    h, stream = streamed(ex, r("s5", preview_every=1, steps=12, step_ms=20))
    first = stream.next_chunk(timeout=30)
    assert first is not None and first.seq == 0
    time.sleep(0.1)  # more chunks announced meanwhile, not taken
    stream.close().result(30)  # every chunk not taken is gone from the executor
    assert stream.next_chunk(timeout=5) is None
    ex.release_output(first.output.result(30))
    stream.result.result(30)  # closing the stream does not stop the forward
    drop_final(ex, h)
    quiet(ex)
    assert ex.metrics().released - released >= 2  # chunks dropped, released on arrival
    info = ex.worker_metrics()[0]
    assert info.chunks_sent >= 12


def test_cancel_requests_mid_stream_aborts_and_releases(ex: MultiprocDiffusionExecutor) -> None:
    h, stream = streamed(ex, r("s6", preview_every=1, steps=50, step_ms=20))
    first = stream.next_chunk(timeout=30)
    assert first is not None
    ex.cancel_requests(["s6"])
    with pytest.raises(RequestAborted):
        stream.result.result(30)
    with pytest.raises(RequestAborted):
        h.output.result(30)
    assert stream.next_chunk(timeout=30) is None
    assert isinstance(stream.error, RequestAborted)
    ex.release_output(first.output.result(30))
    quiet(ex)
    assert ex.worker_metrics()[0].chunks_sent < 60, "the forward stopped at its next step"


def test_a_stream_submission_checks_its_arguments(ex: MultiprocDiffusionExecutor) -> None:
    with pytest.raises(UsageError):
        ex.submit("not a request", stream=True)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        ex.submit(r("bad", preview_every=0), stream=True)
    with pytest.raises(UsageError, match="stream must be a bool"):
        ex.submit(r("odd"), stream=1)  # type: ignore[arg-type]
    quiet(ex)


@pytest.mark.slow
def test_a_slow_consumer_is_bounded_by_the_budget_and_loses_nothing() -> None:
    """Twelve previews, a budget of two held outputs, a consumer that starts late and reads
    slowly: never more than two outputs held, the worker's packing waits for room (and
    with it the forward), and every chunk arrives, in order."""
    ex = MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, max_held_outputs=2)
    try:
        held: list[float] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                held.append(ex.metrics().held_outputs)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        h, stream = streamed(ex, r("slow", preview_every=1, steps=12))
        time.sleep(1.0)  # nobody reads: the budget fills, the worker waits
        assert ex.metrics().pool_full == 1
        steps = []
        for out in stream:
            steps.append(out.output["info"]["step"])
            ex.release_output(out)
            del out
            time.sleep(0.02)
        final = h.output.result(30)
        ex.release_output(final)
        del final
        stop.set()
        watcher.join()
        assert steps == list(range(1, 13))
        waited = ex.metrics().pool_waits
        assert max(held) <= 2 and waited >= 1, (max(held), waited)
        assert ex.metrics().timeouts == 0
        quiet(ex)
    finally:
        stop.set()
        ex.shutdown()


# ------------------------------------------------------------------ final-step async

STEPWISE = WorkerSpec("helpers.mp_workers:StepwiseWorker", check_import=False)
NUMEL = 8 << 20  # 32 MiB of float32 per output


def _run_steps(ex: MultiprocDiffusionExecutor, n: int, *, final_async: bool) -> tuple[list[DiffusionOutput], float]:
    # Request ids repeat across runs: each run ends every request it starts.
    """``n`` requests, each run to its end step by step, back to back; the outputs and the time."""
    outputs: list[DiffusionOutput] = []
    t0 = time.perf_counter()
    pending = []
    for i in range(n):
        req = DiffusionRequest(
            f"{'a' if final_async else 's'}{i}", {"steps": 3, "step_ms": 30, "numel": NUMEL, "seed": i}
        )
        while True:
            ro = ex.execute_request(req, final_step_async=final_async)
            if ro.finished:
                break
        if final_async:
            assert ro.result is None and ro.async_output_id is not None
            pending.append(ex.wait_output_ready(ro.async_output_id))  # copied while the next request's steps run
        else:
            assert ro.result is not None and ro.async_output_id is None
            outputs.append(ro.result)
    outputs.extend(f.result(60) for f in pending)
    return outputs, time.perf_counter() - t0


@pytest.mark.slow
def test_final_step_async_gives_the_synchronous_result_and_overlaps_the_copy() -> None:
    ex = MultiprocDiffusionExecutor(STEPWISE, step_mode=True, deadlines=DEADLINES)
    try:
        n = 4
        for warm in (False, True):  # segments made and paged in once, for both paths
            outs, _ = _run_steps(ex, 2, final_async=warm)
            for o in outs:
                ex.release_output(o)
            del outs
        sync, sync_s = _run_steps(ex, n, final_async=False)
        got, async_s = _run_steps(ex, n, final_async=True)
        for i, (a, b) in enumerate(zip(sync, got, strict=True)):
            assert torch.equal(a.output["image"], b.output["image"])
            assert torch.equal(b.output["image"], expected_image({"numel": NUMEL, "seed": i}))
        pack = [float(o.metrics.get("pack_s", 0.0)) for o in got]
        print(
            f"\nstep mode, {n} requests of 3 steps x 30 ms, {NUMEL * 4 >> 20} MiB outputs: "
            f"synchronous {sync_s * 1000:.0f} ms, final-step async {async_s * 1000:.0f} ms "
            f"(copy {sum(pack) / n * 1000:.1f} ms per output, overlapped with the next request's steps)"
        )
        for o in (*sync, *got):
            ex.release_output(o)
        del sync, got
        quiet(ex)
    finally:
        ex.shutdown()


@pytest.mark.slow
def test_final_step_async_is_a_step_mode_option() -> None:
    ex = MultiprocDiffusionExecutor(STEPWISE, step_mode=True, final_step_async=True, deadlines=DEADLINES)
    try:
        req = DiffusionRequest("d", {"steps": 2, "numel": 1 << 10})
        assert not ex.execute_request(req).finished  # the executor's default: async
        ro = ex.execute_request(req)
        assert ro.finished and ro.async_output_id is not None and ro.result is None
        out = ex.wait_output_ready(ro.async_output_id).result(30)
        assert torch.equal(out.output["image"], expected_image({"numel": 1 << 10}))
        ex.release_output(out)
        del out
        with pytest.raises(UsageError):
            ex.execute_request(req, final_step_async=1)  # type: ignore[arg-type]
        quiet(ex)
    finally:
        ex.shutdown()
    with pytest.raises(UsageError, match="option of step mode"):
        MultiprocDiffusionExecutor(STEPWISE, final_step_async=True)


def test_submit_with_stream_claims_the_final_output_for_its_handle(ex: MultiprocDiffusionExecutor) -> None:
    """``submit(stream=True)``: the chunks on ``handle.stream`` and the final output on
    ``handle.output``, claimed by the pump at COMPUTE_DONE (no id travels back down)."""
    h = ex.submit(r("s9", seed=5, preview_every=3), stream=True)
    assert h.stream is not None and h.stream.result is h.computed
    steps = []
    for out in h.stream:
        steps.append(out.output["info"]["step"])
        ex.release_output(out)
    final = h.output.result(30)
    assert steps == [3, 6] and final.async_output_id == h.computed.result().async_output_id
    with pytest.raises(OutputAlreadyClaimed):
        ex.wait_output_ready(final.async_output_id or "").result(5)
    ex.release_output(final)
    del final
    quiet(ex)


def test_a_handle_drops_its_output_after_compute_done(ex: MultiprocDiffusionExecutor) -> None:
    h = ex.submit(r("s10", seed=6, step_ms=100))
    with pytest.raises(UsageError, match="cancel_requests"):
        h.drop()  # before COMPUTE_DONE (6 steps of 100 ms still to run): the forward is cancelled instead
    h.computed.result(30)
    h.drop().result(30)
    # Dropped before it was delivered it fails; delivered first (the packer can be quick),
    # it is the caller's to release.  Either way nothing of it stays.
    try:
        ex.release_output(h.output.result(30))
    except OutputDropped:
        pass
    quiet(ex)
