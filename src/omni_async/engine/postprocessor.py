"""``PostProcessor``: an output's way from shared memory to the caller's value, off the loop.

On an ``omni-postprocess`` thread: the request's host stage (``PostProcess.host``), or
an owned copy of the output's tensors, or the pixels taken for an encode; then the
release of the output (the segment goes back to the pool before the result reaches the
caller).  An encode runs in the encoder pool's processes (``EncoderPool``), awaited on
the event loop; where the pixels are a view of the output's segment the encoder process
reads them there, and the output is released when the encode ends instead (``HostEncode.shared``).
The final output of a video encoded in parts (``generate_video``) is its last part
(``omni_async.engine.video``).  The host stage never writes into shared memory: it gets an owned copy
(the segment goes back first), or, declared ``host_reads_only``, the views, checked for
in-place writes afterwards (``omni_async.worker.postprocess``).

Whether a request still wants its value is decided on the thread, when the job starts,
not when it was queued: a request aborted while its output waited for a busy thread
only has its output released, its host stage never runs.

The request's sink (``omni_async.engine.sinks``) takes the result where it is made: a
``sink="segment"`` output is lent instead of copied and released (``SegmentLeases``,
on the thread), a ``sink="file"`` request's encoded files are written on a thread
(``OutputFiles``) once the encode is done; a stream's chunks are always values.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import attrs

from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.core.sinks import Sink
from omni_async.engine.config import EngineConfig
from omni_async.engine.encode_pool import EncoderPool, HostEncode, PendingEncode, encoded_value, take_for_encoding
from omni_async.engine.encoders import EncodedOutput
from omni_async.engine.errors import EncodeFailed, PostProcessFailed
from omni_async.engine.owned import Guarded, HostBuffers, guard_input, owned_copy, written
from omni_async.engine.record import RequestRecord
from omni_async.engine.sinks import OutputFiles, SegmentLeases
from omni_async.transport.errors import OutputStillViewed
from omni_async.worker.postprocess import PostProcess, get_postprocess

__all__ = ["PostProcessed", "PostProcessor"]

log = logging.getLogger("omni_async.engine.engine")


@attrs.frozen
class PostProcessed:
    """What post-processing made of an output: the caller's value, when its host stage
    started (``time.monotonic()``), its seconds, and the encode's (None: no encode)."""

    value: object
    started: float
    seconds: float
    encode_s: float | None


class PostProcessor:
    """Host stages and the encoder pool (see the module docstring)."""

    def __init__(
        self, config: EngineConfig, files: OutputFiles | None = None, leases: SegmentLeases | None = None
    ) -> None:
        """``files``, ``leases``: the engine's sinks (None: ones of its own, made of ``config``)."""
        self.files = files if files is not None else OutputFiles(config.output_dir, config.output_ttl_s)
        self.leases = leases if leases is not None else SegmentLeases(config.output_ttl_s)
        # The engine's post-process: a request's own (DiffusionRequest.postprocess) wins.
        self._default = None if config.pipeline is None else get_postprocess(config.pipeline)
        self._workers = config.postprocess_workers
        # Requests that ask for a format are encoded in these processes (started on first use).
        self.encoders = EncoderPool(config.encode_workers)
        # Owned copies go into memory reused once the caller drops a result: fresh memory
        # faults in page by page, 3-18x slower than a copy into pages written before.
        self.buffers = HostBuffers()
        self._pool: ThreadPoolExecutor | None = None
        self._release: Callable[[DiffusionOutput], object] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Outputs being post-processed (metrics), and the host stages running on their
        # threads by request (what a close abandons).
        self.in_progress = 0
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}

    def post_of(self, request: DiffusionRequest) -> PostProcess | None:
        """The post-process ``request`` asks for (``UnknownPostProcess`` naming it and the
        registered names), or the engine's."""
        if request.postprocess is None:
            return self._default
        return get_postprocess(request.postprocess, request_id=request.request_id)

    def start(self, loop: asyncio.AbstractEventLoop, release: Callable[[DiffusionOutput], object]) -> None:
        """Start the threads; ``release`` gives an output back to the executor."""
        self._loop, self._release = loop, release
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="omni-postprocess")

    async def process(self, rec: RequestRecord, output: DiffusionOutput, *, chunk: bool = False) -> PostProcessed:
        """``output`` of ``rec`` post-processed and released (``PostProcessFailed``,
        ``EncodeFailed``).  A final output whose request ended before its thread took it
        is only released (value None); a stream's ``chunk`` is always post-processed (its
        consumer asked for it)."""
        assert self._pool is not None and self._loop is not None
        self.in_progress += 1
        try:
            if rec.video is not None and not chunk:
                # The last part of a video encoded while it decodes: the whole MP4.
                started = time.monotonic()
                encoded, video_s = await rec.video.finish(output)
                return PostProcessed(encoded, started, video_s, video_s)
            metrics = dict(output.metrics)
            job = functools.partial(self._on_thread, rec, output, chunk)
            del output  # the thread releases it; nothing of it is kept here
            value, started, seconds = await self._loop.run_in_executor(self._pool, job)
            del job
            # A format asked for: the encoder pool's files, awaited here (never on a thread).
            value, encode_s = await self._encoded(rec, value, metrics)
            if not chunk and rec.request.sink_kind is Sink.FILE and not rec.ended():
                value = await self._write_files(rec, value)
        finally:
            self.in_progress -= 1
        return PostProcessed(value, started, seconds + (encode_s or 0.0) if chunk else seconds, encode_s)

    def _on_thread(self, rec: RequestRecord, output: DiffusionOutput, chunk: bool) -> tuple[object, float, float]:
        # Decided here, as the thread takes the job: an abort that came while the job
        # waited for a busy thread means no host stage, only the release.
        wanted = chunk or not rec.ended()
        rid = rec.request_id
        with self._lock:
            self._running[rid] = self._running.get(rid, 0) + 1
        try:
            if wanted and not chunk and rec.request.sink_kind is Sink.SEGMENT:
                # Lent, not copied: the output stays held until the lease ends.
                started, t0 = time.monotonic(), time.perf_counter()
                lease = self.leases.lend(rid, output, rec.request.sink_ttl_s)
                return lease, started, time.perf_counter() - t0
            value, started, seconds = self._host_stage(rec, output, wanted)
            if isinstance(value, HostEncode):
                # The event loop awaits it.  Copied: the output went back already; shared:
                # the encoder process reads its segment, given back once the job is done
                # (files, failure, a killed process, a cancel: the future's one end).
                try:
                    future = self.encoders.submit(value.job)
                except BaseException:
                    if value.shared:
                        self.release_quietly(output)
                    raise
                if value.shared:
                    # On the thread that ends the job, before the event loop hears of it:
                    # the caller never sees a result whose output is still held.
                    future.add_done_callback(lambda _: self.release_quietly(output))
                value = PendingEncode(future, value)
            return value, started, seconds
        finally:
            with self._lock:
                left = self._running.pop(rid) - 1
                if left:
                    self._running[rid] = left

    def _host_stage(self, rec: RequestRecord, output: DiffusionOutput, wanted: bool) -> tuple[object, float, float]:
        rid, pipeline = rec.request_id, rec.pipeline
        post = rec.postprocess if wanted else None
        started = time.monotonic()
        t0 = time.perf_counter()
        value: object = None
        guarded: Guarded | None = None
        encoding = rec.request.encoding if wanted else None
        try:
            if encoding is not None:
                # A format asked for: the pixels are encoded instead of the host stage.
                value = take_for_encoding(output, rid, encoding)
                if isinstance(value, HostEncode) and value.shared:
                    return value, started, time.perf_counter() - t0  # held until its encode ends
            elif wanted and (post is None or post.host is None):
                value = owned_copy(output.output, self.buffers)
            elif post is not None and post.host_reads_only:
                guarded = guard_input(output.output)
                value = post.run_host(output, rec.request)
            elif post is not None:
                owned = attrs.evolve(output, output=owned_copy(output.output, self.buffers))
                self.release_quietly(output)  # the stage holds no view of it: back to the pool now
                value = post.run_host(owned, rec.request)
                return value, started, time.perf_counter() - t0
        except EncodeFailed:
            self.release_quietly(output)
            raise
        except Exception as exc:
            guarded = None
            self.release_quietly(output)
            # The traceback's frames may hold views of the segment: keep the text, free them.
            text = "".join(traceback.format_exception(exc))
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__)
            raise PostProcessFailed(
                f"request {rid!r}: the host stage of pipeline {pipeline!r} raised "
                f"{type(exc).__name__}: {exc}\n--- traceback ---\n{text}",
                request_id=rid,
                pipeline=pipeline,
            ) from exc
        wrote = [] if guarded is None else written(guarded)
        guarded = None  # it holds the input's tensors: views of the segment, which the release takes back
        if wrote:
            del value
            self.release_quietly(output)
            raise PostProcessFailed(
                f"request {rid!r}: the host stage of pipeline {pipeline!r} is declared host_reads_only=True but "
                f"wrote into its input in place ({', '.join(wrote[:5])}), which is the output's shared memory; "
                "copy before writing (t.clone(), t.to(torch.float32, copy=True)), or register the post-process "
                "without host_reads_only so that its stage gets an owned copy",
                request_id=rid,
                pipeline=pipeline,
            )
        assert self._release is not None
        try:
            self._release(output)
        except OutputStillViewed as exc:
            del value  # dropping the views gives the segment back
            raise PostProcessFailed(
                f"request {rid!r}: the result of pipeline {pipeline!r}'s host stage still views the output's "
                f"shared memory ({exc.views} view(s) alive); a result must own its memory: copy what it keeps "
                "(tensor.clone(), numpy.array(a, copy=True), bytes(...))",
                request_id=rid,
                pipeline=pipeline,
            ) from exc
        except Exception as exc:  # the pool closed under us (executor shut down): nothing to give back
            log.debug("engine: releasing the output of %r: %s", rid, exc)
        return value, started, time.perf_counter() - t0

    async def _encoded(
        self, rec: RequestRecord, value: object, metrics: Mapping[str, float]
    ) -> tuple[object, float | None]:
        """The result of a request that asked for a format, and the encode's seconds: the
        encoder pool's job awaited (from its submission to its files here), or the
        worker's GPU's time (``device_encode_s``).  Other results pass as they are."""
        if not isinstance(value, PendingEncode):
            if rec.request.format is not None and "device_encode_s" in metrics:
                return value, metrics["device_encode_s"]
            return value, None
        rid, fmt = rec.request_id, value.encoding.format
        try:
            files, _ = await asyncio.wrap_future(value.future)
        except EncodeFailed:
            raise
        except BrokenProcessPool as exc:
            raise EncodeFailed(
                f"request {rid!r}: the encoder process encoding it as {fmt} died ({exc}); the pool is replaced at "
                "the next encode: send the request again",
                request_id=rid,
                format=fmt,
            ) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the driver is cancelled (its future's cancel follows through wrap_future)
            # The pool cancelled the job: it shut down (the engine is closing).
            raise EncodeFailed(
                f"request {rid!r}: the engine's encoder pool shut down before its {fmt} encode ran",
                request_id=rid,
                format=fmt,
            ) from None
        except Exception as exc:
            raise EncodeFailed(
                f"request {rid!r}: encoding its pixels {tuple(value.shape)} as {fmt} failed: "
                f"{type(exc).__name__}: {exc}",
                request_id=rid,
                format=fmt,
            ) from exc
        return encoded_value(value, files), time.perf_counter() - value.submitted_at

    async def _write_files(self, rec: RequestRecord, value: object) -> object:
        """A ``sink="file"`` request's encoded files written on a thread: its ``OutputFile``
        (a tuple of them where the value was a tuple); deleted again if the request ended
        meanwhile (an abort while they were written leaves none)."""
        assert self._pool is not None and self._loop is not None
        encoded = value if isinstance(value, tuple) else (value,)
        if not all(isinstance(e, EncodedOutput) for e in encoded):
            raise PostProcessFailed(
                f"request {rec.request_id!r}: sink='file' got no encoded file", request_id=rec.request_id
            )
        write = functools.partial(self.files.write, rec.request_id, encoded, rec.request.sink_ttl_s)
        files = await self._loop.run_in_executor(self._pool, write)
        if rec.ended():
            self.files.discard(files)
        return files if isinstance(value, tuple) else files[0]

    def discard_result(self, value: object) -> None:
        """A result nobody takes (its request ended after it was made): its files are
        deleted, its lease released."""
        self.files.discard(value)
        self.leases.discard(value)

    def release_quietly(self, output: DiffusionOutput) -> None:
        if self._release is None:
            return
        try:
            self._release(output)
        except Exception as exc:  # views of a failed stage: they go back when its frames go
            log.debug("engine: releasing %s: %s", output.async_output_id, exc)

    def release_later(self, output: DiffusionOutput) -> None:
        """Give ``output`` back on a post-processing thread (here when they are gone)."""
        if self._pool is not None:
            try:
                self._pool.submit(self.release_quietly, output)
                return
            except RuntimeError:  # the threads are gone: release here
                pass
        self.release_quietly(output)

    def discard(self, fut: Future[DiffusionOutput]) -> None:
        """An output future taken but not consumed (its consumer was cancelled): give it back."""
        if not fut.cancel() and fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release_later(fut.result())

    def stop(self) -> None:
        """The threads, without waiting: a host stage still running is abandoned (its
        output is released when it returns), with a warning."""
        with self._lock:
            running = sorted(self._running)
        if running:
            log.warning(
                "engine close: the host stage of %d request(s) still running (%s); abandoned: their outputs are "
                "released when they return",
                len(running),
                running[:10],
            )
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=False)

    async def close_encoders(self, timeout: float) -> None:
        """No encoder process outlives the engine."""
        await asyncio.to_thread(self.encoders.shutdown, timeout)
