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
import functools
import time
from collections.abc import Callable

from omni_async.core.encoding import Encoding
from omni_async.core.messages import DiffusionOutput
from omni_async.engine.encode_pool import EncodeResult, EncoderPool, frames_of
from omni_async.engine.encoders import EncodedOutput, SharedPixels, VideoBytes, VideoPart
from omni_async.engine.errors import EncodeFailed
from omni_async.worker.stream import VIDEO_PART

__all__ = ["VideoBytes", "VideoEncode"]


Release = Callable[[DiffusionOutput], None]


def _release_part(release: Release, output: DiffusionOutput, _: object) -> None:
    release(output)  # a part's output, as its encode ends: on the thread that ends it


class VideoEncode:
    """One request's video, encoded part by part (see the module docstring).  Handed its
    collaborators: the encoder ``pool``, ``release`` (an output back to the executor, off
    the loop), ``release_now`` (the same on the calling thread: a part's output, as its
    encode ends) and ``ended`` (whether the request's end was decided)."""

    def __init__(
        self,
        request_id: str,
        encoding: Encoding,
        pool: EncoderPool,
        *,
        release: Release,
        release_now: Release,
        ended: Callable[[], bool],
        fragmented: bool,
        bound: int,
    ) -> None:
        assert encoding.is_video
        self.request_id = request_id
        self._encoding = encoding
        self._session = pool.open_video(request_id)
        self._release, self._release_now, self._ended_early = release, release_now, ended
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

    def wake(self) -> None:
        """Something the waits here look at changed (the request's result, say)."""
        self._changed.set()

    # ------------------------------------------------------------------ the parts

    @property
    def failure(self) -> BaseException | None:
        """Why the video failed (a part's encode, its frames), if it did."""
        return self._failure

    async def feed(self, output: DiffusionOutput, *, last: bool) -> concurrent.futures.Future[EncodeResult] | None:
        """``output``'s frames (a part, or the final output: ``last``) to the encoder once
        there is room; the future of the bytes they made (None: a chunk that is no part).
        ``output`` is the part's: released here, or when its encode ends."""
        hold = [output]  # the one reference of this frame: dropped before an error leaves it
        del output
        try:
            return await self._feed(hold, last)
        except BaseException:
            # The error's traceback keeps this frame: it must not keep the output's views
            # (they would hold its segment as long as the caller keeps the error).
            if hold:
                self._release(hold.pop())
            raise

    async def _feed(self, hold: list[DiffusionOutput], last: bool) -> concurrent.futures.Future[EncodeResult] | None:
        rid = self.request_id
        mapping = hold[0].output if isinstance(hold[0].output, dict) else {}
        if not last and mapping.get(VIDEO_PART) is not True:
            self._release(hold.pop())  # a preview, say: not the video's
            return None
        fps = mapping.get("fps")
        del mapping
        if isinstance(fps, (int, float)) and not isinstance(fps, bool) and fps > 0:
            self._fps = float(fps)
        # Off the loop: without a segment the frames are copied.
        frames = await asyncio.to_thread(frames_of, hold[0], rid, self._encoding)
        shared = isinstance(frames, SharedPixels)
        if not shared:
            self._release(hold.pop())  # copied (or none): the output goes back now
        nbytes = 0 if frames is None else int(frames.nbytes)
        if frames is not None:
            self._check_shape(tuple(frames.shape))
        await self._room(nbytes)
        if self._ended_early() and not last:  # aborted while it waited for room: nothing more to encode
            if hold:
                self._release(hold.pop())
            return None
        part = VideoPart(frames, self._encoding, self._fps, self.fragmented, last, rid)
        future = self._session.put(part)
        if hold:
            future.add_done_callback(functools.partial(_release_part, self._release_now, hold.pop()))
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
                f"request {self.request_id!r}: a part of its video has frames {shape}, but a video's parts are "
                f"[T, H, W, C] of one size{'' if self._shape is None else f' ({self._shape})'}",
                request_id=self.request_id,
                format=self._encoding.format,
            )
        self._shape = frame

    async def _room(self, nbytes: int) -> None:
        while (
            self._failure is None
            and not self._ended_early()
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
            self._pieces.append(VideoBytes(self.request_id, data, self._offset, self._encoded))
            self._offset += len(data)
            self._unread += len(data)
        self._file.append(data)

    def fail(self, exc: BaseException) -> None:
        """The video cannot be made (a part's frames, the stream): the waits here end with ``exc``."""
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
            if self._ended or self._failure is not None or self._ended_early():
                return None
            self._changed.clear()
            await self._changed.wait()

    async def finish(self, output: DiffusionOutput) -> tuple[EncodedOutput, float]:
        """The final output (the driver's post-process): after every part, its frames as
        the last part; the whole MP4 as the request's ``EncodedOutput``, and the seconds
        from the final output to it."""
        t0 = time.perf_counter()
        hold = [output]
        del output
        try:
            await self.chunks_fed.wait()
            if self._failure is not None:
                raise self._failure
        except BaseException:
            self._release(hold.pop())
            raise
        future = await self.feed(hold.pop(), last=True)
        assert future is not None
        try:
            await asyncio.wrap_future(future)
        except EncodeFailed:
            raise
        except Exception as exc:
            raise EncodeFailed(
                f"request {self.request_id!r}: encoding its video failed: {type(exc).__name__}: {exc}",
                request_id=self.request_id,
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
        return value, time.perf_counter() - t0

    def abandon(self) -> None:
        """The request ended before its last part: the process drops the video."""
        if self._session.started and not self._session.ended:
            part = VideoPart(None, self._encoding, self._fps, self.fragmented, True, self.request_id)
            self._session.put(part)
