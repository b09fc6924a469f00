"""Video encoded while it decodes: ``AsyncDiffusionEngine.generate_video``.

A video model that decodes its frames in chunks ships each chunk as it is decoded
(``omni_async.worker.emit_frames``: a chunk of the request's stream marked as a part of
the final video); its final output carries the frames not shipped yet (or none).  The
request runs as a stream (``submit(stream=True)``), and ``VideoEncode`` (one per
request, on the event loop) hands each part to one encoder process as it arrives
(``EncoderPool.open_video``: the process keeps one ``VideoWriter`` open across the
parts), the final output's frames last, so the MP4's last byte follows the last frame
by the encoding of the frames x264 still holds, not of the whole video.

Bounds.  The frames handed to the encoder and not yet encoded ("in flight") never
exceed ``EngineConfig.video_bytes_in_flight`` bytes, one part excepted (a part larger
than the bound goes alone); in a fragmented MP4 the bytes made and not yet taken by the
caller count against the same bound.  While the bound is full the next part is not
taken from the stream: it waits in the executor's shared memory, within the budget of
held outputs, and a slow caller slows the worker, nothing piles up in the engine.

Where a part's frames are a view of its output's segment the encoder process reads them
there (``SharedPixels``) and the part's output is released when the process is done
with it (its future's end: encoded, failed, the process killed); otherwise they are
copied (off the loop) and the output goes back at once.

Containers: a fragmented MP4 (``fragmented=True``: an empty index, then a fragment per
frame) is written front to back, and its bytes reach the caller as ``VideoBytes`` while
the video is encoded, for a client that plays or stores them as they come; a plain MP4
(its index written at the end, for a file) comes whole.  Either way the result's
``EncodedOutput`` holds the whole file.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time

import attrs

from omni_async.core.messages import DiffusionOutput
from omni_async.engine.encode_pool import EncodeResult, EncoderPool, frames_of
from omni_async.engine.encoders import EncodedOutput, SharedPixels, VideoPart
from omni_async.engine.errors import EncodeFailed
from omni_async.engine.postprocessor import PostProcessed, PostProcessor
from omni_async.engine.record import RequestRecord
from omni_async.engine.streaming import StreamReader
from omni_async.worker.stream import VIDEO_PART

__all__ = ["VideoBytes", "VideoEncode"]


@attrs.frozen
class VideoBytes:
    """Bytes of a request's fragmented MP4 as its encoder made them
    (``generate_video(..., fragmented=True)``): ``data``, which starts at byte ``offset``
    of the file, once ``frames`` frames had been encoded; the pieces in order are the file."""

    request_id: str
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    offset: int
    frames: int


class VideoEncode:
    """One request's video, encoded part by part (see the module docstring)."""

    def __init__(
        self, rec: RequestRecord, pool: EncoderPool, post: PostProcessor, *, fragmented: bool, bound: int
    ) -> None:
        encoding = rec.request.encoding
        assert encoding is not None and encoding.is_video
        self._rec = rec
        self._encoding = encoding
        self._session = pool.open_video(rec.request_id)
        self._post = post
        self._loop = asyncio.get_running_loop()
        self.fragmented = fragmented
        self.bound = bound
        # Frames handed to the encoder and not yet encoded, and the most ever (bytes).
        self.in_flight = 0
        self.peak_in_flight = 0
        self._unread = 0  # fragmented bytes made and not taken by the caller
        self._changed = asyncio.Event()  # room, a piece, the end
        self._pieces: collections.deque[VideoBytes] = collections.deque()
        self._file: list[bytes] = []
        self._offset = 0
        self._fps = 24.0
        self._shape: tuple[int, ...] | None = None
        self.frames = 0  # handed to the encoder
        self._encoded = 0  # whose parts are done
        self._ended = False  # the file is whole (or the video failed)
        self._failure: BaseException | None = None
        # Set once every chunk of the stream was handed over (or the pump ended): the
        # final output goes last.
        self.chunks_fed = asyncio.Event()
        rec.result.add_done_callback(lambda _: self._changed.set())

    # ------------------------------------------------------------------ the parts

    async def pump(self, rec: RequestRecord, streams: StreamReader) -> None:
        """Hand the stream's frame parts to the encoder as they come (a task of ``generate_video``)."""
        try:
            while rec.stream is None and not rec.result.done() and not rec.ended():
                rec.changed.clear()
                if rec.stream is None and not rec.result.done() and not rec.ended():
                    await rec.changed.wait()
            while (chunk := await streams.next_chunk(rec)) is not None:
                try:
                    try:
                        output = await asyncio.wrap_future(chunk.output)
                    except asyncio.CancelledError:
                        self._post.discard(chunk.output)
                        raise
                    await self.feed(output, last=False)
                    del output
                finally:
                    rec.taking -= 1
                    rec.poke.set()
        except Exception as exc:  # the caller's iterator raises it (``failure``), which ends the request
            self._fail(exc)
        finally:
            self.chunks_fed.set()

    @property
    def failure(self) -> BaseException | None:
        """Why the video failed (a part's encode, its frames), if it did."""
        return self._failure

    async def feed(self, output: DiffusionOutput, *, last: bool) -> concurrent.futures.Future[EncodeResult] | None:
        """``output``'s frames (a part, or the final output: ``last``) to the encoder once
        there is room; the future of the bytes they made (None: a chunk that is no part)."""
        rid = self._rec.request_id
        mapping = output.output if isinstance(output.output, dict) else {}
        if not last and mapping.get(VIDEO_PART) is not True:
            self._post.release_later(output)  # a preview, say: not the video's
            return None
        fps = mapping.get("fps")
        if isinstance(fps, (int, float)) and not isinstance(fps, bool) and fps > 0:
            self._fps = float(fps)
        try:
            # Off the loop: without a segment the frames are copied.
            frames = await asyncio.to_thread(frames_of, output, rid, self._encoding)
        except BaseException:
            self._post.release_later(output)
            raise
        shared = isinstance(frames, SharedPixels)
        if not shared:
            self._post.release_later(output)  # copied (or none): the output goes back now
        nbytes = 0 if frames is None else int(frames.nbytes)
        try:
            if frames is not None:
                self._check_shape(tuple(frames.shape))
            await self._room(nbytes)
        except BaseException:
            if shared:
                self._post.release_later(output)
            raise
        if self._rec.ended() and not last:  # aborted while it waited for room: nothing more to encode
            if shared:
                self._post.release_later(output)
            return None
        part = VideoPart(frames, self._encoding, self._fps, self.fragmented, last, rid)
        future = self._session.put(part)
        if shared:
            future.add_done_callback(lambda _: self._post.release_quietly(output))
        count = 0 if frames is None else int(frames.shape[0])
        self.frames += count
        self.in_flight += nbytes
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        future.add_done_callback(lambda f: self._loop.call_soon_threadsafe(self._part_done, f, nbytes, count, last))
        return future

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        frame = shape[1:]
        if len(shape) != 4 or (self._shape is not None and frame != self._shape):
            raise EncodeFailed(
                f"request {self._rec.request_id!r}: a part of its video has frames {shape}, but a video's parts are "
                f"[T, H, W, C] of one size{'' if self._shape is None else f' ({self._shape})'}",
                request_id=self._rec.request_id,
                format=self._encoding.format,
            )
        self._shape = frame

    async def _room(self, nbytes: int) -> None:
        while (
            self._failure is None
            and not self._rec.ended()
            and ((self.in_flight and self.in_flight + nbytes > self.bound) or self._unread > self.bound)
        ):
            self._changed.clear()
            await self._changed.wait()
        if self._failure is not None:
            raise self._failure

    def _part_done(self, future: concurrent.futures.Future[EncodeResult], nbytes: int, count: int, last: bool) -> None:
        """On the loop, in the parts' order (one process answers them in turn)."""
        self.in_flight -= nbytes
        self._changed.set()
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            if self._failure is None:
                self._failure = exc
            return
        data = future.result()[0][0]
        self._encoded += count
        if last:
            self._ended = True
        if not data:
            return
        if self.fragmented:
            self._pieces.append(VideoBytes(self._rec.request_id, data, self._offset, self._encoded))
            self._offset += len(data)
            self._unread += len(data)
        self._file.append(data)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._changed.set()

    # ------------------------------------------------------------------ the caller's side

    async def next_piece(self) -> VideoBytes | None:
        """The next bytes of the fragmented MP4; None once the file is whole or the request ended."""
        while True:
            if self._pieces:
                piece = self._pieces.popleft()
                self._unread -= len(piece.data)
                self._changed.set()
                return piece
            if self._ended or self._failure is not None or self._rec.result.done() or self._rec.ended():
                return None
            self._changed.clear()
            await self._changed.wait()

    async def finish(self, output: DiffusionOutput) -> PostProcessed:
        """The final output (the driver's post-process): after every part, its frames as
        the last part; the whole MP4 as the request's ``EncodedOutput``."""
        started = time.monotonic()
        t0 = time.perf_counter()
        try:
            await self.chunks_fed.wait()
            if self._failure is not None:
                raise self._failure
        except BaseException:
            self._post.release_later(output)
            raise
        future = await self.feed(output, last=True)
        del output
        assert future is not None
        try:
            await asyncio.wrap_future(future)
        except EncodeFailed:
            raise
        except Exception as exc:
            raise EncodeFailed(
                f"request {self._rec.request_id!r}: encoding its video failed: {type(exc).__name__}: {exc}",
                request_id=self._rec.request_id,
                format=self._encoding.format,
            ) from exc
        while not self._ended and self._failure is None:  # its callback is on its way to the loop
            self._changed.clear()
            await self._changed.wait()
        if self._failure is not None:
            raise self._failure
        assert self._shape is not None
        height, width = int(self._shape[0]), int(self._shape[1])
        value = EncodedOutput(b"".join(self._file), self._encoding.media_type, width, height, frames=self.frames)
        seconds = time.perf_counter() - t0
        return PostProcessed(value, started, seconds, seconds)

    def abandon(self) -> None:
        """The request ended before its last part: the process drops the video."""
        if self._session.started and not self._session.ended:
            part = VideoPart(None, self._encoding, self._fps, self.fragmented, True, self._rec.request_id)
            self._session.put(part)
