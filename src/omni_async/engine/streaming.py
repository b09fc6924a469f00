"""``StreamReader``: the consumer side of ``generate_stream``.

The chunks are taken one at a time, as the caller asks for them, each awaited,
post-processed and released before it is yielded; the stream's end is what the
request's driver awaits before it forgets the request.
"""

from __future__ import annotations

import asyncio
import logging
import time

from omni_async.core.engine_states import StageEvent
from omni_async.engine.ends import RequestEnds
from omni_async.engine.metrics import GenerationChunk
from omni_async.engine.postprocessor import PostProcessor
from omni_async.engine.record import RequestRecord
from omni_async.engine.video import VideoEncode
from omni_async.executor.stream import OutputChunk, RequestStream

__all__ = ["StreamReader"]

log = logging.getLogger("omni_async.engine.engine")

SE = StageEvent


class StreamReader:
    """A stream's consumer (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ends: RequestEnds, post: PostProcessor) -> None:
        self._loop = loop
        self._ends = ends
        self._post = post
        self.chunks = 0  # chunks handed to consumers

    def attach(self, rec: RequestRecord, stream: RequestStream) -> None:
        """``rec`` was sent as a stream: its consumer wakes at each chunk."""
        rec.stream = stream
        loop = self._loop

        def wake() -> None:  # on the pump's thread: only schedule
            try:
                loop.call_soon_threadsafe(rec.changed.set)
            except RuntimeError:  # the loop closed: nobody consumes the stream any more
                pass

        stream.add_listener(wake)
        rec.changed.set()

    def consumed(self, rec: RequestRecord) -> None:
        rec.consumed = True
        rec.poke.set()

    def stop(self, rec: RequestRecord) -> None:
        """The consumer of ``rec``'s stream went away (or failed): abort what is left."""
        self._ends.end_early(rec, SE.CANCEL)
        self._ends.close_stream(rec)
        self.consumed(rec)

    async def next_chunk(self, rec: RequestRecord) -> OutputChunk | None:
        """The next chunk of ``rec``'s stream, claimed; None at its end (or the request's)."""
        stream = rec.stream
        while stream is not None and not rec.ended() and rec.close is None:
            rec.changed.clear()
            # A short look under the executor's lock, not a wait.
            chunk = stream.poll()
            if chunk is not None:
                rec.taking += 1
                return chunk
            if stream.finished:
                return None
            await rec.changed.wait()
        return None

    async def item(self, rec: RequestRecord, chunk: OutputChunk) -> GenerationChunk:
        """``chunk``'s output, awaited and post-processed (then released), as a ``GenerationChunk``."""
        try:
            try:
                output = await asyncio.wrap_future(chunk.output)
            except asyncio.CancelledError:
                self._post.discard(chunk.output)
                raise
            arrived = time.monotonic()
            metrics = dict(output.metrics)
            done = await self._post.process(rec, output, chunk=True)
            del output
        finally:
            rec.taking -= 1
            rec.poke.set()
        self.chunks += 1
        return GenerationChunk(rec.request_id, chunk.seq, done.value, metrics, rec.pipeline, arrived, done.seconds)

    async def feed_video(self, rec: RequestRecord, video: VideoEncode) -> None:
        """``generate_video``'s task: the stream's chunks to ``video`` as they come (its
        frame parts to the encoder, anything else released), until the stream ends; a
        failure is the video's (``video.failure``: the caller's iterator raises it)."""
        try:
            while rec.stream is None and not rec.result.done() and not rec.ended():
                rec.changed.clear()
                if rec.stream is None and not rec.result.done() and not rec.ended():
                    await rec.changed.wait()
            while (chunk := await self.next_chunk(rec)) is not None:
                try:
                    try:
                        part = [await asyncio.wrap_future(chunk.output)]
                    except asyncio.CancelledError:
                        self._post.discard(chunk.output)
                        raise
                    # The part's only reference goes to the video: a failure's traceback keeps
                    # this frame, which must not keep the output's views (they hold its segment).
                    await video.feed(part.pop(), last=False)
                finally:
                    rec.taking -= 1
                    rec.poke.set()
        except Exception as exc:
            video.fail(exc)
        finally:
            video.chunks_fed.set()

    async def finish(self, rec: RequestRecord) -> None:
        """Before the driver forgets a streaming request: its consumer is done with the
        stream (or the stream is closed and the consumer holds no chunk of it), and what
        a close dropped is gone."""
        if rec.stream is None:
            return
        while not rec.consumed and not (rec.close is not None and rec.taking == 0):
            rec.poke.clear()
            await rec.poke.wait()
        if rec.close is not None:
            try:
                ack = await rec.close
                await asyncio.wrap_future(ack)
            except Exception as exc:  # the executor shut down meanwhile: that released it
                log.debug("engine: closing the stream of %r: %s", rec.request_id, exc)
