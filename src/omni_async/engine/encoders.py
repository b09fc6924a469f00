"""The host's encoders: uint8 pixels to PNG, JPEG, WebP (Pillow) or MP4 (PyAV, H.264).

These functions run in the engine's encoder processes (``omni_async.engine.encode_pool``),
never on its event loop nor on its post-process threads: encoding a 1024x1024 PNG takes
a CPU core for 150 ms, under the GIL in Pillow's case.  So this module imports neither
torch nor the engine: a spawned encoder process imports numpy and Pillow (PyAV for a
video) and nothing else of weight.

The pixels arrive as a uint8 numpy array, channel-last: one image ``[H, W]`` or
``[H, W, C]``, or a sequence ``[N, H, W, C]`` (a batch of images, or a video's frames),
with C 1 (grey), 3 (RGB) or 4 (RGBA; JPEG drops the alpha channel).  An image format
encodes each image of a sequence on its own; ``mp4`` encodes a sequence as one video
(H.264 in yuv420p: even width and height; ``fps`` frames a second).

The pixels come either in the job itself (pickled: outputs without a shared-memory
segment, ``InProcessExecutor``'s) or as ``SharedPixels``: the name of the output's
segment and where in it they lie, which the encoder process maps read-only and reads in
place while the engine holds the output (``omni_async.engine.encode_pool``).

A video may also come in parts (``VideoPart``: frames as the model decodes them,
``AsyncDiffusionEngine.generate_video``): one encoder process keeps one ``VideoWriter``
open across the parts, encodes each part when it arrives and answers with the MP4's
bytes made so far (a fragmented MP4: a fragment per frame, written front to back), or,
for a plain MP4, the whole file after the last part (its index is written last).
"""

from __future__ import annotations

import io
import mmap
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, NoReturn, TypeAlias, assert_never

import attrs

from omni_async.core.encoding import Encoding, Format
from omni_async.transport.children import ignore_stop_signals

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    # Imported where pixels are handled: ``import omni_async`` (which reads
    # ``EncodedOutput`` through ``GenerationResult``) must not import numpy.
    import numpy as np
    import numpy.typing as npt

    Pixels: TypeAlias = npt.NDArray[np.uint8]

__all__ = [
    "EncodeJob",
    "EncodedOutput",
    "SharedPixels",
    "VideoBytes",
    "VideoPart",
    "VideoWriter",
    "encode",
    "encode_image",
    "encode_video",
    "serve",
]

# A segment's file: /dev/shm and a plain name (the engine made the path; checked again
# here, the process opens nothing else).
_SEGMENT_PATH = re.compile(r"^/dev/shm/[A-Za-z0-9_.-]+$")


@attrs.frozen
class EncodedOutput:
    """One encoded file of a request that asked for a format (``DiffusionRequest(...,
    format=...)``): ``data`` (the file's bytes) and its ``media_type``
    (``"image/png"``, ``"image/jpeg"``, ``"image/webp"``, ``"video/mp4"``), the image's
    ``width`` and ``height``, ``frames`` (a video's frame count; 1 for an image), where it
    was encoded (``encoded_on``: ``"host"``, the engine's encoder processes, or
    ``"cuda"``, the worker's GPU) and, when the request's format is one the GPU encodes
    but the host did, ``note``: why."""

    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    media_type: str
    width: int
    height: int
    frames: int = 1
    encoded_on: Literal["host", "cuda"] = "host"
    note: str = ""


@attrs.frozen
class VideoBytes:
    """Bytes of a request's fragmented MP4 as its encoder made them
    (``generate_video(..., fragmented=True)``): ``data``, which starts at byte ``offset``
    of the file, once ``frames`` frames had been encoded; the pieces in order are the file."""

    request_id: str
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    offset: int
    frames: int


@attrs.frozen
class SharedPixels:
    """uint8 pixels, C-contiguous, of ``shape``, at byte ``offset`` of the shared-memory
    segment at ``path`` (a file under /dev/shm of ``size`` bytes): what an encoder process
    maps and reads in place, instead of a pickled copy.  The engine holds the output the
    segment belongs to until the encode ends."""

    path: str
    size: int
    offset: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @contextmanager
    def mapped(self) -> Iterator[Pixels]:
        """The pixels, mapped read-only for the block (only the pages they lie on, faulted
        in at once: ``MAP_POPULATE``)."""
        import numpy as np

        if not _SEGMENT_PATH.match(self.path):
            raise ValueError(f"not a shared-memory segment of this host: {self.path!r}")
        end = self.offset + self.nbytes
        if self.offset < 0 or end > self.size:
            raise ValueError(f"pixels {self.shape} at offset {self.offset} overrun segment {self.path} ({self.size} B)")
        start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
        fd = os.open(self.path, os.O_RDONLY)
        try:
            mm = mmap.mmap(
                fd, end - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ,
                offset=start,
            )  # fmt: skip
        finally:
            os.close(fd)
        try:
            yield np.frombuffer(mm, np.uint8, count=self.nbytes, offset=self.offset - start).reshape(self.shape)
        finally:
            try:
                mm.close()
            except BufferError:  # a view of it outlived the encode (a failure's traceback): unmapped when it goes
                pass


@attrs.frozen
class EncodeJob:
    """What an encoder process gets: the pixels (uint8, channel-last, in the job or in
    shared memory; see the module docstring), the format and quality, whether the pixels
    are a sequence, a video's frame rate, and the request they are for (``request_id``:
    for the errors)."""

    pixels: Pixels | SharedPixels = attrs.field(repr=lambda p: f"<uint8 {p.shape}>")
    encoding: Encoding
    sequence: bool
    fps: float = 24.0
    request_id: str = ""


def _image_mode(image: Pixels) -> tuple[Pixels, str]:
    if image.ndim == 2:
        return image, "L"
    channels = image.shape[-1]
    if channels == 1:
        return image[..., 0], "L"
    if channels == 3:
        return image, "RGB"
    if channels == 4:
        return image, "RGBA"
    raise ValueError(f"an image has 1, 3 or 4 channels (channel-last), got shape {image.shape}")


def encode_image(image: Pixels, encoding: Encoding) -> bytes:
    """One image (``[H, W]`` or ``[H, W, C]``, uint8) in ``encoding``'s image format."""
    import numpy as np
    from PIL import Image

    array, mode = _image_mode(image)
    fmt = encoding.format
    if fmt is Format.JPEG and mode == "RGBA":
        array, mode = np.ascontiguousarray(array[..., :3]), "RGB"
    pil = Image.fromarray(np.ascontiguousarray(array), mode=mode)
    buf = io.BytesIO()
    match fmt:
        case Format.PNG:
            pil.save(buf, "PNG", compress_level=encoding.png_level())
        case Format.JPEG:
            pil.save(buf, "JPEG", quality=encoding.jpeg_quality())
        case Format.WEBP:
            if encoding.quality is None:
                pil.save(buf, "WEBP", lossless=True, exact=True)
            else:
                pil.save(buf, "WEBP", quality=encoding.quality)
        case Format.MP4:
            raise ValueError("mp4 encodes a sequence of frames [T, H, W, C], not one image")
        case _:
            assert_never(fmt)
    return buf.getvalue()


def encode_video(frames: Pixels, encoding: Encoding, fps: float = 24.0) -> bytes:
    """Frames ``[T, H, W]`` or ``[T, H, W, C]`` (uint8) as an MP4 (H.264, yuv420p; even
    width and height), at ``fps`` frames a second."""
    import numpy as np

    try:
        import av
    except ImportError as exc:
        raise ValueError(f"mp4 needs PyAV: pip install 'omni_async[encode]' ({exc})") from exc
    if frames.ndim not in (3, 4) or len(frames) == 0:
        raise ValueError(f"mp4 takes frames [T, H, W] or [T, H, W, C] (T >= 1), got shape {frames.shape}")
    height, width = int(frames.shape[1]), int(frames.shape[2])
    if height % 2 or width % 2:
        raise ValueError(f"mp4 (H.264, yuv420p) needs an even width and height, got {width}x{height}")
    _, mode = _image_mode(frames[0])
    pix = {"L": "gray", "RGB": "rgb24", "RGBA": "rgba"}[mode]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=round(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(encoding.mp4_crf())}
        for frame in frames:
            array = frame[..., 0] if frame.ndim == 3 and frame.shape[-1] == 1 else frame
            video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format=pix)
            container.mux(stream.encode(video_frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


@contextmanager
def _pixels_of(pixels: Pixels | SharedPixels) -> Iterator[Pixels]:
    if isinstance(pixels, SharedPixels):
        with pixels.mapped() as array:
            yield array
    else:
        yield pixels


def encode(job: EncodeJob) -> tuple[list[bytes], float]:
    """Run in an encoder process: ``job``'s files (one per image, or the one video) and
    the seconds the encoding took there."""
    t0 = time.perf_counter()
    with _pixels_of(job.pixels) as pixels:
        files = _encode(attrs.evolve(job, pixels=pixels))
    return files, time.perf_counter() - t0


def _encode(job: EncodeJob) -> list[bytes]:
    assert not isinstance(job.pixels, SharedPixels)
    fmt = job.encoding.format
    match fmt:
        case Format.MP4:
            if not job.sequence:
                raise ValueError(
                    f"mp4 encodes frames [T, H, W, C]; this output is one image of shape {job.pixels.shape}: "
                    "ask for an image format (png, jpeg, webp)"
                )
            files = [encode_video(job.pixels, job.encoding, job.fps)]
        case Format.PNG | Format.JPEG | Format.WEBP:
            images = job.pixels if job.sequence else job.pixels[None]
            files = [encode_image(image, job.encoding) for image in images]
        case _:
            assert_never(fmt)
    if not all(files):
        # An encoder that wrote nothing is a defect here, not a file to hand a client.
        raise ValueError(f"the {fmt} encoder wrote an empty file for pixels {job.pixels.shape}")
    return files


@attrs.frozen
class VideoPart:
    """One part of a video encoded as it arrives (see the module docstring): its frames
    ``[T, H, W, C]`` (None: none, only the end), the request's encoding, frame rate and
    container (``fragmented``), and whether it is the ``last`` part."""

    frames: Pixels | SharedPixels | None = attrs.field(repr=lambda p: "None" if p is None else f"<uint8 {p.shape}>")
    encoding: Encoding
    fps: float
    fragmented: bool
    last: bool
    request_id: str = ""


#: The frames x264 looks ahead in a video encoded in parts (see ``VideoWriter``).
PART_LOOKAHEAD = 8


class _Sink(io.RawIOBase):
    """Where a fragmented MP4 is written: front to back, taken as it grows."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        data = bytes(b)  # type: ignore[call-overload]  # a buffer from the muxer
        self._parts.append(data)
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return False  # the muxer must write in order: a client reads the bytes as they come

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class VideoWriter:
    """One video's MP4 (H.264, yuv420p) made part by part, in an encoder process.

    Fragmented (``fragmented=True``): a fragment per frame after an empty index
    (``movflags=frag_every_frame+empty_moov+default_base_moof``), so ``add`` returns the
    bytes made for the frames encoded so far, to be sent on as they are; x264 keeps a
    few frames (its lookahead) until ``close``.  Plain: a seekable buffer whose index is
    written at ``close``, which returns the whole file.  x264 uses its own threads."""

    def __init__(self, encoding: Encoding, fps: float, fragmented: bool, first: Pixels) -> None:
        try:
            import av
        except ImportError as exc:
            raise ValueError(f"mp4 needs PyAV: pip install 'omni_async[encode]' ({exc})") from exc
        if first.ndim not in (3, 4):
            raise ValueError(f"mp4 takes frames [T, H, W] or [T, H, W, C], got shape {first.shape}")
        self.height, self.width = int(first.shape[1]), int(first.shape[2])
        if self.height % 2 or self.width % 2:
            raise ValueError(f"mp4 (H.264, yuv420p) needs an even width and height, got {self.width}x{self.height}")
        _, mode = _image_mode(first[0])
        self._pix = {"L": "gray", "RGB": "rgb24", "RGBA": "rgba"}[mode]
        self.fragmented = fragmented
        self._out: _Sink | io.BytesIO = _Sink() if fragmented else io.BytesIO()
        options = {"movflags": "frag_every_frame+empty_moov+default_base_moof"} if fragmented else {}
        self._container = av.open(self._out, mode="w", format="mp4", options=options)
        self._stream = self._container.add_stream("libx264", rate=round(fps))
        self._stream.width, self._stream.height, self._stream.pix_fmt = self.width, self.height, "yuv420p"
        # x264 holds up to rc-lookahead frames (40 at its default preset) before it encodes
        # them: what it still holds when the last part comes is encoded after it.  A short
        # lookahead keeps that tail short, at a small cost in size (PART_LOOKAHEAD).
        self._stream.options = {"crf": str(encoding.mp4_crf()), "rc-lookahead": str(PART_LOOKAHEAD)}
        self._stream.thread_count = 0  # x264's own choice: its frame threads over the cores
        self.frames = 0
        self.seconds = 0.0

    def add(self, frames: Pixels) -> bytes:
        """Encode ``frames`` (their shape after the first part's); the bytes made since the
        last call (fragmented; always empty for a plain MP4)."""
        import av
        import numpy as np

        t0 = time.perf_counter()
        if frames.ndim not in (3, 4) or tuple(frames.shape[1:3]) != (self.height, self.width):
            raise ValueError(f"a part's frames {frames.shape} do not match the video's {self.width}x{self.height}")
        for frame in frames:
            array = frame[..., 0] if frame.ndim == 3 and frame.shape[-1] == 1 else frame
            video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format=self._pix)
            self._container.mux(self._stream.encode(video_frame))
        self.frames += len(frames)
        self.seconds += time.perf_counter() - t0
        return self._out.take() if isinstance(self._out, _Sink) else b""

    def close(self) -> bytes:
        """Flush the encoder and close the file: its last bytes (fragmented), or the whole file."""
        t0 = time.perf_counter()
        if self.frames == 0:
            raise ValueError("the video has no frames: the model emitted no frame parts and its output has none")
        self._container.mux(self._stream.encode(None))
        self._container.close()
        self.seconds += time.perf_counter() - t0
        return self._out.take() if isinstance(self._out, _Sink) else self._out.getvalue()


def _video_part(writer: VideoWriter | None, part: VideoPart) -> tuple[VideoWriter | None, tuple[str, object]]:
    """One part into the process's open video: (the writer still open, the reply)."""
    t0 = time.perf_counter()
    data = b""
    if part.frames is not None:
        with _pixels_of(part.frames) as frames:
            if frames.ndim == 3:  # grey [T, H, W]
                frames = frames[..., None]
            if writer is None:
                writer = VideoWriter(part.encoding, part.fps, part.fragmented, frames)
            data = writer.add(frames)
    if not part.last:
        return writer, ("files", ([data], time.perf_counter() - t0))
    if writer is None:
        raise ValueError("the video has no frames: the model emitted no frame parts and its output has none")
    data += writer.close()
    return None, ("files", ([data], time.perf_counter() - t0))


def serve(conn: Connection) -> NoReturn:
    """An encoder process's loop (``omni_async.engine.encode_pool``): a job in, ``("files",
    encode(job))`` or ``("failed", why)`` out, until ``None`` or the engine's end of the pipe closes."""
    # Ctrl-C and a service manager's stop reach the whole process group: the engine's close
    # stops its encoders, so neither may fail the encode under way first (``transport.children``).
    ignore_stop_signals()
    writer: VideoWriter | None = None  # the video whose parts this process encodes
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            break
        if job is None:
            break
        reply: tuple[str, object]
        try:
            if isinstance(job, VideoPart):
                writer, reply = _video_part(writer, job)
            else:
                reply = ("files", encode(job))
        except Exception as exc:  # noqa: BLE001  # any encoder failure is the job's, told to the engine
            writer = None  # a failed video ends here: the engine sends no more of its parts
            reply = ("failed", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except OSError:  # the engine's process is gone (a broken pipe): nobody to tell
            break
    # Leave at once: every reply is written, and nothing else is ours to flush.  A normal
    # exit finalizes the interpreter (numpy, Pillow), which took an idle encoder over 2 s
    # on a loaded 2-core machine: longer than the close gives it (IDLE_EXIT_S).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
