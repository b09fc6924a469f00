"""The engine's loop and each request's driver.

The loop task (``omni-engine-loop``) admits waiting requests as far as the scheduler
allows and starts one driver task per admitted request, which walks it through the
executor: send, forward (COMPUTE_DONE), output, post-processing, outcome; or, with
``async_output=False``, the synchronous call (``_walk_sync``).  See ``engine``'s module
docstring for the steps and for who releases what at each end.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping

from omni_async.core.engine_states import EngineState, StageEvent, StageState
from omni_async.core.errors import OutputDropped, UsageError
from omni_async.core.messages import DiffusionOutput, RunnerOutput
from omni_async.engine.base import log
from omni_async.engine.batching import EngineBatches
from omni_async.engine.errors import PostProcessFailed
from omni_async.engine.metrics import STAGES, GenerationResult, RequestTimings, forward_end
from omni_async.engine.record import RequestRecord
from omni_async.worker.stamps import (
    FORWARD_ENDED_AT,
    FORWARD_RETURNED_AT,
    FORWARD_STARTED_AT,
    PACK_ENDED_AT,
    PACK_STARTED_AT,
)

__all__ = ["EngineDriver"]

SS = StageState
SE = StageEvent
ES = EngineState


def _held_bytes(metrics: Mapping[str, float]) -> float:
    """The bytes an output holds outside the message: in a pooled segment, or a buffer in
    Ray's object store (``RayDiffusionExecutor``)."""
    return metrics.get("pack_shm_bytes", 0.0) + metrics.get("pack_stored_bytes", 0.0)


class EngineDriver(EngineBatches):
    """The loop task and the request drivers (see the module docstring)."""

    async def _run(self) -> None:
        assert self._scheduler is not None and self._loop is not None
        timer: asyncio.TimerHandle | None = None
        while True:
            self._wake.clear()
            for batch in self._scheduler.schedule_batches(time.monotonic()):
                recs = [self._records[rid] for rid in batch]
                for rec in recs:
                    self._fire(rec, SE.ADMIT)
                if len(recs) > 1:
                    self._start_group(recs)  # before the drivers: they await its send
                for rec in recs:
                    rid = rec.request_id
                    rec.driver = self._loop.create_task(self._drive(rec), name=f"omni-engine-request-{rid}")
            held = self._scheduler.held_until
            if held is not None:
                # A batch waits for more members: look again when its wait ends.
                timer = self._loop.call_later(max(0.0, held - time.monotonic()), self._wake.set)
            try:
                await self._wake.wait()
            finally:
                if timer is not None:
                    timer.cancel()
                    timer = None

    def _on_loop_end(self, task: asyncio.Task[None]) -> None:
        """The loop task ended: at close, by design; otherwise it died (a bug of ours).
        Nobody would admit the waiting requests any more: fail them with ``EngineDead``
        (the ones already sent go on with their drivers)."""
        if task.cancelled() or self._life.state is not ES.RUNNING:
            return
        err = self._dead()
        log.error("engine: %s", err)
        for rec in list(self._records.values()):
            if rec.stage is SS.WAITING:
                self._fail(rec, err)  # WAITING -> FAILED: forgotten at once

    async def _drive(self, rec: RequestRecord) -> None:
        try:
            await self._walk(rec)
            await self._finish_stream(rec)
        except asyncio.CancelledError:
            self._end_early(rec, SE.CLOSE)
            raise
        except BaseException as exc:  # a bug of ours: fail the caller, never hang it
            log.exception("engine: the driver of request %r failed", rec.request_id)
            self._fail(rec, exc)
        finally:
            if not rec.ended() and rec.stage is not SS.RESOLVED:
                self._fail(rec, AssertionError(f"request {rec.request_id!r}: its driver ended in stage {rec.stage}"))
            self._forget(rec)

    async def _walk(self, rec: RequestRecord) -> None:
        ex = self.executor
        rid = rec.request_id
        if rec.group is None and rec.ended():
            return  # aborted before it was sent: it never reaches a worker
        if not self._async_output:
            await self._walk_sync(rec)
            return
        rec.submitted_at = time.monotonic()
        try:
            if rec.group is None:
                sent = await self._send_alone(rec)
            else:
                member = await self._member_sent(rec)
                if member is None:
                    return  # it ended before its batch was sent: not in the call
                sent = member
        except Exception as exc:
            self._fail(rec, exc)
            return
        execute, output_future = sent
        self._fire(rec, SE.SENT)
        if rec.ended():
            self._cancel_forward(rec)
            self._close_stream(rec)
        while True:
            try:
                announced: RunnerOutput = await asyncio.wrap_future(execute)
                break
            except Exception as exc:
                again = await self._alone_after_batch_failed(rec, exc)
                if again is None:
                    self._fail(rec, exc)
                    return
                execute, output_future = again
        rec.compute_done_at = time.monotonic()
        assert self._scheduler is not None
        self._scheduler.compute_done(rid)
        self._wake.set()  # the running slot is free: admit the next request now
        rec.output_id = announced.async_output_id
        if rec.output_id is None:
            self._fail(rec, UsageError(f"request {rid!r}: the executor answered without an output id"))
            return
        self._fire(rec, SE.COMPUTE_DONE)
        if rec.ended():
            self._drop_output(rec)
            await self._await_drop(rec)
            return
        ready = ex.wait_output_ready(rec.output_id) if output_future is None else output_future
        try:
            output = await asyncio.wrap_future(ready)
        except Exception as exc:
            if rec.drop is not None:
                await self._await_drop(rec)
            elif not isinstance(exc, OutputDropped) or not rec.ended():
                self._fail(rec, exc)
            return
        rec.output_ready_at = time.monotonic()
        await self._finish(rec, output)

    async def _walk_sync(self, rec: RequestRecord) -> None:
        """``async_output=False``: the request's call on the synchronous output path, on
        an ``omni-engine-sync`` thread; COMPUTE_DONE and the output arrive together."""
        ex = self.executor
        assert self._loop is not None and self._sync is not None and self._scheduler is not None
        if rec.group is not None:
            await self._walk_sync_member(rec)
            return
        self._fire(rec, SE.SENT)  # the call is in flight on its thread
        rec.submitted_at = time.monotonic()
        call = self._loop.run_in_executor(
            self._sync, functools.partial(ex.execute_request, rec.request, sync_output=True)
        )
        try:
            # Shielded: a cancelled driver cannot stop the call; its output is released
            # when it arrives (below, or by _release_late).
            announced: RunnerOutput = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._release_late)
            raise
        except Exception as exc:
            self._fail(rec, exc)
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
            sent.add_done_callback(functools.partial(self._release_member_late, rec.request_id))
            raise
        if got is None:
            return  # it ended before the call: not in it
        self._fire(rec, SE.SENT)
        if isinstance(got, BaseException):
            self._fail(rec, got)
            return
        assert isinstance(got, RunnerOutput)
        await self._sync_answered(rec, got)

    async def _sync_answered(self, rec: RequestRecord, announced: RunnerOutput) -> None:
        rid = rec.request_id
        assert self._scheduler is not None
        rec.compute_done_at = rec.output_ready_at = time.monotonic()
        self._scheduler.compute_done(rid)
        self._wake.set()
        self._fire(rec, SE.COMPUTE_DONE)
        output = announced.result
        if output is None:
            self._fail(rec, UsageError(f"request {rid!r}: the executor's synchronous answer carries no output"))
            return
        await self._finish(rec, output)

    def _release_late(self, call: asyncio.Future[RunnerOutput]) -> None:
        """The synchronous call of a driver that was cancelled ended: release its output."""
        if call.cancelled() or call.exception() is not None:
            return
        output = call.result().result
        if output is not None:
            self._release_output_later(output)

    async def _finish(self, rec: RequestRecord, output: DiffusionOutput) -> None:
        """Post-process ``output`` (the request's, here now) and hand the caller its result."""
        rid = rec.request_id
        assert self._scheduler is not None
        nbytes = _held_bytes(output.metrics)
        if nbytes:
            self._scheduler.observe_output(int(nbytes))
        self._fire(rec, SE.OUTPUT)
        self._postprocessing += 1
        try:
            assert self._post is not None and self._loop is not None
            try:
                value, post_at, post_s = await self._loop.run_in_executor(
                    self._post, functools.partial(self._postprocess, rec, output, not rec.ended())
                )
            finally:
                metrics = dict(output.metrics)
                del output  # the release took its views back; nothing of it is kept here
            # A format asked for: the encoder pool's files, awaited here (never on a thread).
            value, encode_s = await self._encoded(rec, value, metrics)
        except PostProcessFailed as exc:
            self._fail(rec, exc)
            return
        finally:
            self._postprocessing -= 1
        if rec.drop is not None:  # an abort raced the output's arrival: its drop found nothing left
            await self._await_drop(rec)
        if rec.ended() or rec.result.done():
            return
        finished = time.monotonic()
        pack_s = metrics.get("pack_s")
        forward_ended = forward_end(rec.compute_done_at, metrics.get(FORWARD_ENDED_AT))
        timings = RequestTimings(
            queued=rec.submitted_at - rec.enqueued_at,
            forward=forward_ended - rec.submitted_at,
            pack=pack_s,
            transfer_wait=max(0.0, rec.output_ready_at - forward_ended),
            postprocess=post_s,
            encode=encode_s,
            total=finished - rec.enqueued_at,
            enqueued_at=rec.enqueued_at,
            submitted_at=rec.submitted_at,
            compute_done_at=rec.compute_done_at,
            output_ready_at=rec.output_ready_at,
            finished_at=finished,
            postprocess_started_at=post_at,
            forward_started_at=metrics.get(FORWARD_STARTED_AT),
            forward_ended_at=metrics.get(FORWARD_ENDED_AT),
            forward_returned_at=metrics.get(FORWARD_RETURNED_AT),
            pack_started_at=metrics.get(PACK_STARTED_AT),
            pack_ended_at=metrics.get(PACK_ENDED_AT),
        )
        for stage in STAGES:
            seconds = getattr(timings, stage)
            if seconds is not None:
                self._latency[stage].observe(seconds)
        if pack_s is not None:
            self._pack_s_total += pack_s
            self._pack_bytes_total += _held_bytes(metrics) + metrics.get("pack_inline_bytes", 0.0)
        # A plain request is FINISHED here; a stream's consumer still decides (RESOLVED).
        self._fire(rec, SE.STREAM_RESULT if rec.streaming else SE.RESULT)
        rec.result.set_result(GenerationResult(rid, value, timings, metrics, rec.pipeline))

    async def _await_drop(self, rec: RequestRecord) -> None:
        """Until the executor acknowledged the drop of ``rec``'s output (nothing of it left)."""
        assert rec.drop is not None
        try:
            done = await rec.drop
            await asyncio.wrap_future(done)
        except Exception as exc:  # the executor shut down meanwhile: that released it
            log.debug("engine: dropping the output of %r: %s", rec.request_id, exc)
