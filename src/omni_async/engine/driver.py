"""``RequestDriver``: one request's walk through its stage machine.

One driver task per admitted request (``start``, handed to ``Admission.run``) walks it
through the executor: send (SENT), forward (COMPUTE_DONE: the running slot is freed at
once), output (OUTPUT: the handle's output, claimed for it by the pump), post-processing
(``PostProcessor``), outcome (RESULT); or, with ``async_output=False``, the synchronous
call (``_walk_sync``).  An end decided meanwhile (``RequestEnds``) is seen at the next
step; the driver forgets the request once nothing of it is left.  See ``engine``'s
module docstring for the steps and for who releases what at each end.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping

from omni_async.core.engine_states import StageEvent, StageState
from omni_async.core.errors import OutputDropped, UsageError
from omni_async.core.messages import DiffusionOutput, RunnerOutput
from omni_async.engine.admission import Admission
from omni_async.engine.ends import RequestEnds
from omni_async.engine.errors import EncodeFailed, PostProcessFailed
from omni_async.engine.metrics import STAGES, GenerationResult, LatencyHistogram, RequestTimings, forward_end
from omni_async.engine.postprocessor import PostProcessed, PostProcessor
from omni_async.engine.record import RequestRecord
from omni_async.engine.sending import Sender
from omni_async.engine.streaming import StreamReader
from omni_async.engine.threads import EngineThreads
from omni_async.executor.api import DiffusionExecutor
from omni_async.worker.stamps import (
    FORWARD_ENDED_AT,
    FORWARD_RETURNED_AT,
    FORWARD_STARTED_AT,
    PACK_ENDED_AT,
    PACK_STARTED_AT,
)

__all__ = ["RequestDriver"]

log = logging.getLogger("omni_async.engine.engine")

SS = StageState
SE = StageEvent


def _held_bytes(metrics: Mapping[str, float]) -> float:
    """The bytes an output holds outside the message: in a pooled segment, or a buffer in
    Ray's object store (``RayDiffusionExecutor``)."""
    return metrics.get("pack_shm_bytes", 0.0) + metrics.get("pack_stored_bytes", 0.0)


class RequestDriver:
    """The request drivers and the timings they measure (see the module docstring)."""

    def __init__(
        self,
        executor: DiffusionExecutor,
        admission: Admission,
        threads: EngineThreads,
        ends: RequestEnds,
        sender: Sender,
        streams: StreamReader,
        post: PostProcessor,
        *,
        async_output: bool,
    ) -> None:
        self._executor = executor
        self._admission = admission
        self._threads = threads
        self._ends = ends
        self._sender = sender
        self._streams = streams
        self._post = post
        self._async_output = async_output
        self.latency = {stage: LatencyHistogram() for stage in STAGES}
        self.pack_s_total = 0.0
        self.pack_bytes_total = 0.0

    def start(self, records: list[RequestRecord]) -> None:
        """Admitted together (ADMIT fired): a batch's send for two or more, and a driver
        task each.  Never raises into the admission loop: a group that cannot start
        fails its requests."""
        loop = asyncio.get_running_loop()
        try:
            if len(records) > 1:
                self._sender.start_group(records)  # before the drivers: they await its send
            for rec in records:
                rec.driver = loop.create_task(self._drive(rec), name=f"omni-engine-request-{rec.request_id}")
        except Exception as exc:  # a bug of ours: fail these requests, keep admitting others
            log.exception("engine: requests %s could not start", [r.request_id for r in records])
            for rec in records:
                if rec.driver is None:
                    self._ends.fail(rec, exc)
                    self._admission.forget(rec)

    async def _drive(self, rec: RequestRecord) -> None:
        try:
            await self._walk(rec)
            await self._streams.finish(rec)
        except asyncio.CancelledError:
            self._ends.end_early(rec, SE.CLOSE)
            raise
        except BaseException as exc:  # a bug of ours: fail the caller, never hang it
            log.exception("engine: the driver of request %r failed", rec.request_id)
            self._ends.fail(rec, exc)
        finally:
            if not rec.ended() and rec.stage is not SS.RESOLVED:
                self._ends.fail(rec, AssertionError(f"request {rec.request_id!r}: its driver ended in {rec.stage}"))
            self._admission.forget(rec)

    async def _walk(self, rec: RequestRecord) -> None:
        if rec.group is None and rec.ended():
            return  # aborted before it was sent: it never reaches a worker
        if not self._async_output:
            await self._walk_sync(rec)
            return
        rec.submitted_at = time.monotonic()
        try:
            handle = await self._sender.send(rec)
        except Exception as exc:
            # Refused by the executor at the call (its data does not travel, its
            # parameters are wrong): nothing reached a worker, the request is rejected.
            self._ends.fail(rec, exc, outcome="rejected" if isinstance(exc, UsageError) else None)
            return
        if handle is None:
            return  # it ended before its batch was sent: not in the call
        self._admission.fire(rec, SE.SENT)
        if rec.ended():
            self._ends.cancel_forward(rec)
            self._ends.close_stream(rec)
        while True:
            try:
                announced: RunnerOutput = await asyncio.wrap_future(handle.computed)
                break
            except Exception as exc:
                again = await self._sender.resend_after_batch_failed(rec, exc)
                if again is None:
                    self._ends.fail(rec, exc)
                    return
                handle = again
        rec.compute_done_at = time.monotonic()
        self._admission.compute_done(rec)  # the running slot is free: admit the next request now
        if announced.async_output_id is None:
            self._ends.fail(rec, UsageError(f"request {rec.request_id!r}: the executor answered without an output"))
            return
        self._admission.fire(rec, SE.COMPUTE_DONE)
        if rec.ended():
            self._ends.drop_computed(rec)
            await self._ends.await_drop(rec)
            return
        try:
            output = await asyncio.wrap_future(handle.output)
        except Exception as exc:
            if rec.drop is not None:
                await self._ends.await_drop(rec)
            elif not isinstance(exc, OutputDropped) or not rec.ended():
                self._ends.fail(rec, exc)
            return
        rec.output_ready_at = time.monotonic()
        await self._finish(rec, output)

    async def _walk_sync(self, rec: RequestRecord) -> None:
        """``async_output=False``: the request's call on the synchronous output path, on
        an ``omni-engine-sync`` thread; COMPUTE_DONE and the output arrive together."""
        if rec.group is not None:
            await self._walk_sync_member(rec)
            return
        self._admission.fire(rec, SE.SENT)  # the call is in flight on its thread
        rec.submitted_at = time.monotonic()
        call = self._threads.sync(functools.partial(self._executor.execute_request, rec.request, sync_output=True))
        try:
            # Shielded: a cancelled driver cannot stop the call; its output is released
            # when it arrives (below, or by _release_late).
            announced: RunnerOutput = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._release_late)
            raise
        except Exception as exc:
            self._ends.fail(rec, exc)
            return
        await self._sync_answered(rec, announced)

    async def _walk_sync_member(self, rec: RequestRecord) -> None:
        """A batch member on the synchronous path: its batch's one call (the group's send
        task, on a sync thread), its own ``RunnerOutput`` from it."""
        group = rec.group
        assert group is not None and group.send is not None
        rec.submitted_at = time.monotonic()
        sent = group.send
        try:
            # Shielded: a cancelled driver cannot stop the call; its member's output is
            # released when the call ends.
            got = (await asyncio.shield(sent)).get(rec.request_id)
        except asyncio.CancelledError:
            sent.add_done_callback(functools.partial(self._sender.release_member_late, rec.request_id))
            raise
        if got is None:
            return  # it ended before the call: not in it
        self._admission.fire(rec, SE.SENT)
        if isinstance(got, BaseException):
            self._ends.fail(rec, got)
            return
        assert isinstance(got, RunnerOutput)
        await self._sync_answered(rec, got)

    async def _sync_answered(self, rec: RequestRecord, announced: RunnerOutput) -> None:
        rec.compute_done_at = rec.output_ready_at = time.monotonic()
        self._admission.compute_done(rec)
        self._admission.fire(rec, SE.COMPUTE_DONE)
        output = announced.result
        if output is None:
            self._ends.fail(rec, UsageError(f"request {rec.request_id!r}: the synchronous answer carries no output"))
            return
        await self._finish(rec, output)

    def _release_late(self, call: asyncio.Future[RunnerOutput]) -> None:
        """The synchronous call of a driver that was cancelled ended: release its output."""
        if call.cancelled() or call.exception() is not None:
            return
        output = call.result().result
        if output is not None:
            self._post.release_later(output)

    async def _finish(self, rec: RequestRecord, output: DiffusionOutput) -> None:
        """Post-process ``output`` (the request's, here now) and hand the caller its result."""
        metrics = dict(output.metrics)
        nbytes = _held_bytes(metrics)
        if nbytes:
            self._admission.observe_output(int(nbytes))
        self._admission.fire(rec, SE.OUTPUT)
        try:
            done = await self._post.process(rec, output)
        except (PostProcessFailed, EncodeFailed) as exc:
            self._ends.fail(rec, exc)
            return
        finally:
            del output  # the release took its views back; nothing of it is kept here
        if rec.drop is not None:  # an abort raced the output's arrival: its drop found nothing left
            await self._ends.await_drop(rec)
        if rec.ended() or rec.result.done():
            self._post.discard_result(done.value)  # nobody takes it: no file or lease outlives the request
            return
        timings = self._timings(rec, metrics, done)
        # A plain request is FINISHED here; a stream's consumer still decides (RESOLVED).
        self._admission.fire(rec, SE.STREAM_RESULT if rec.streaming else SE.RESULT)
        rec.result.set_result(GenerationResult(rec.request_id, done.value, timings, metrics, rec.pipeline))

    def _timings(self, rec: RequestRecord, metrics: Mapping[str, float], done: PostProcessed) -> RequestTimings:
        finished = time.monotonic()
        pack_s = metrics.get("pack_s")
        forward_ended = forward_end(rec.compute_done_at, metrics.get(FORWARD_ENDED_AT))
        timings = RequestTimings(
            queued=rec.submitted_at - rec.enqueued_at,
            forward=forward_ended - rec.submitted_at,
            pack=pack_s,
            transfer_wait=max(0.0, rec.output_ready_at - forward_ended),
            postprocess=done.seconds,
            encode=done.encode_s,
            total=finished - rec.enqueued_at,
            enqueued_at=rec.enqueued_at,
            submitted_at=rec.submitted_at,
            compute_done_at=rec.compute_done_at,
            output_ready_at=rec.output_ready_at,
            finished_at=finished,
            postprocess_started_at=done.started,
            forward_started_at=metrics.get(FORWARD_STARTED_AT),
            forward_ended_at=metrics.get(FORWARD_ENDED_AT),
            forward_returned_at=metrics.get(FORWARD_RETURNED_AT),
            pack_started_at=metrics.get(PACK_STARTED_AT),
            pack_ended_at=metrics.get(PACK_ENDED_AT),
        )
        for stage in STAGES:
            seconds = getattr(timings, stage)
            if seconds is not None:
                self.latency[stage].observe(seconds)
        if pack_s is not None:
            self.pack_s_total += pack_s
            self.pack_bytes_total += _held_bytes(metrics) + metrics.get("pack_inline_bytes", 0.0)
        return timings
