"""A stream's consumer (``generate_stream``): the chunks taken one at a time, as the
caller asks for them, each awaited, post-processed and released before it is yielded;
and the stream's end, which the request's driver awaits before it forgets it."""

from __future__ import annotations

import asyncio
import functools
import time

from omni_async.core.engine_states import StageEvent
from omni_async.engine.base import EngineBase, log
from omni_async.engine.metrics import GenerationChunk
from omni_async.engine.record import RequestRecord
from omni_async.executor.stream import OutputChunk

__all__ = ["EngineStreams"]

SE = StageEvent


class EngineStreams(EngineBase):
    """The consumer side of ``generate_stream`` (see ``engine``'s module docstring)."""

    def _consumed(self, rec: RequestRecord) -> None:
        rec.consumed = True
        rec.poke.set()

    def _stop_stream(self, rec: RequestRecord) -> None:
        """The consumer of ``rec``'s stream went away (or failed): abort what is left."""
        self._end_early(rec, SE.CANCEL)
        self._close_stream(rec)
        self._consumed(rec)

    async def _next_chunk(self, rec: RequestRecord) -> OutputChunk | None:
        """The next chunk of ``rec``'s stream, claimed; None at its end (or the request's)."""
        stream = rec.stream
        while stream is not None and not rec.ended() and rec.close is None:
            rec.changed.clear()
            # A short look under the executor's lock (as wait_output_ready), not a wait.
            chunk = stream.poll()
            if chunk is not None:
                rec.taking += 1
                return chunk
            if stream.finished:
                return None
            await rec.changed.wait()
        return None

    async def _chunk_item(self, rec: RequestRecord, chunk: OutputChunk) -> GenerationChunk:
        """``chunk``'s output, awaited and post-processed (then released), as a ``GenerationChunk``."""
        try:
            try:
                output = await asyncio.wrap_future(chunk.output)
            except asyncio.CancelledError:
                self._discard_chunk(chunk)
                raise
            arrived = time.monotonic()
            assert self._post is not None and self._loop is not None
            self._postprocessing += 1
            try:
                metrics = dict(output.metrics)
                value, _, post_s = await self._loop.run_in_executor(
                    self._post, functools.partial(self._postprocess, rec, output, True)
                )
                value, encode_s = await self._encoded(rec, value, metrics)
                post_s += encode_s or 0.0
            finally:
                self._postprocessing -= 1
                del output
        finally:
            rec.taking -= 1
            rec.poke.set()
        self._chunks += 1
        return GenerationChunk(rec.request_id, chunk.seq, value, metrics, rec.pipeline, arrived, post_s)

    def _discard_chunk(self, chunk: OutputChunk) -> None:
        """A chunk taken but not consumed (its consumer was cancelled): give it back."""
        fut = chunk.output
        if not fut.cancel() and fut.done() and not fut.cancelled() and fut.exception() is None:
            assert self._post is not None
            self._post.submit(self._release_quietly, fut.result())

    async def _finish_stream(self, rec: RequestRecord) -> None:
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
