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
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Literal, NoReturn, TypeAlias, assert_never

import attrs

from omni_async.core.encoding import Encoding, Format

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    # Imported where pixels are handled: ``import omni_async`` (which reads
    # ``EncodedOutput`` through ``GenerationResult``) must not import numpy.
    import numpy as np
    import numpy.typing as npt

    Pixels: TypeAlias = npt.NDArray[np.uint8]

__all__ = ["EncodeJob", "EncodedOutput", "encode", "encode_image", "encode_video", "serve"]


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
class EncodeJob:
    """What an encoder process gets: the pixels (uint8, channel-last; see the module
    docstring), the format and quality, whether the pixels are a sequence, a video's
    frame rate, and the request they are for (``request_id``: for the errors)."""

    pixels: Pixels = attrs.field(repr=lambda p: f"<uint8 {p.shape}>")
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


def encode(job: EncodeJob) -> tuple[list[bytes], float]:
    """Run in an encoder process: ``job``'s files (one per image, or the one video) and
    the seconds the encoding took there."""
    t0 = time.perf_counter()
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
    return files, time.perf_counter() - t0


def serve(conn: Connection) -> NoReturn:
    """An encoder process's loop (``omni_async.engine.encode_pool``): a job in, ``("files",
    encode(job))`` or ``("failed", why)`` out, until ``None`` or the engine's end of the pipe closes."""
    # Ctrl-C reaches the whole process group: the engine's close stops its encoders, so a
    # terminal's SIGINT must not fail the encode under way first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            break
        if job is None:
            break
        reply: tuple[str, object]
        try:
            reply = ("files", encode(job))
        except Exception as exc:  # noqa: BLE001  # any encoder failure is the job's, told to the engine
            reply = ("failed", f"{type(exc).__name__}: {exc}")
        conn.send(reply)
    # Leave at once: every reply is written, and nothing else is ours to flush.  A normal
    # exit finalizes the interpreter (numpy, Pillow), which took an idle encoder over 2 s
    # on a loaded 2-core machine: longer than the close gives it (IDLE_EXIT_S).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
