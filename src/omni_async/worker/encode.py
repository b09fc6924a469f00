"""JPEG on the worker's GPU (nvJPEG, through ``torchvision.io.encode_jpeg``), so only the
encoded bytes cross PCIe.

A request that asks for ``format="jpeg"`` (``DiffusionRequest``) reaches the worker with
its format; the packer then runs ``encode_on_device`` on its output after the
pipeline's device stage (which makes the uint8 pixels), on its side stream, ordered
after the forward's event like the device stage.  Where the pixels are is found by
``pixel_key``: an output's ``"frames"``, else its ``"image"``, uint8 and channel-last
(``[H, W]``, ``[H, W, C]`` or a batch ``[N, H, W, C]``; C is 1, 3 or 4, and JPEG drops
an alpha channel).  Several images are encoded in one batched call.

The pixels are replaced by a ``DeviceEncoded``: its ``parts`` (one 1-D uint8 tensor of
JPEG bytes per image) when the GPU encoded them, or, when it could not -- the pixels are
not on a CUDA device, torchvision is not importable, the pixels are not uint8, or the
encoder raised -- no parts, the ``pixels`` as they were and the ``reason``: the engine
then encodes them on the host and says so (``EncodedOutput.encoded_on``, ``.note``).
torchvision is imported here lazily, and only for pixels on CUDA.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import assert_never, cast

import attrs
import torch

from omni_async.core.encoding import Encoding, Format
from omni_async.core.messages import DiffusionOutput
from omni_async.transport.platform import CopyStream, DeviceEvent, wait_device_event

__all__ = ["DeviceEncoded", "encode_on_device", "encodes_on_device", "pixel_key", "run_device_encode"]

log = logging.getLogger(__name__)


@attrs.frozen
class DeviceEncoded:
    """What the worker ships in place of the pixels of a request that asked for a format
    its GPU encodes (see the module docstring).  ``parts``: the encoded images (1-D uint8
    tensors), empty when it could not encode them; then ``pixels`` holds them as they were,
    and ``reason`` says why."""

    media_type: str
    parts: tuple[torch.Tensor, ...] = ()
    width: int = 0
    height: int = 0
    pixels: torch.Tensor | None = None
    reason: str = ""
    batched: bool = False  # the pixels were a batch [N, H, W, C] (even of one)


def pixel_key(output: object) -> str | None:
    """Where an output keeps its pixels: ``"frames"``, else ``"image"`` (None: neither)."""
    if not isinstance(output, Mapping):
        return None
    for key in ("frames", "image"):
        if key in output:
            return key
    return None


def encodes_on_device(encoding: Encoding) -> bool:
    """Whether the worker's GPU encodes ``encoding``'s format (nvJPEG: JPEG only)."""
    fmt = encoding.format
    match fmt:
        case Format.JPEG:
            return True
        case Format.PNG | Format.WEBP | Format.MP4:
            return False
        case _:
            assert_never(fmt)


JpegEncoder = Callable[..., list[torch.Tensor]]


@functools.cache
def _encode_jpeg() -> JpegEncoder:
    """torchvision's ``encode_jpeg``, imported on first use (a CUDA worker asked for it)."""
    # Optional and CUDA only: torchvision is not a dependency (nor installed where
    # mypy runs, hence the ignore).
    from torchvision.io import encode_jpeg  # type: ignore[import-not-found,unused-ignore]

    return cast(JpegEncoder, encode_jpeg)


def _height_width(shape: torch.Size) -> tuple[int, int]:
    """An image's height and width from channel-last pixels ``[H, W]``, ``[H, W, C]``, ``[N, H, W, C]``."""
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    return int(shape[-3]), int(shape[-2])


def _as_chw(images: torch.Tensor) -> list[torch.Tensor] | str:
    """The images of ``images`` (uint8, channel-last) as the CHW tensors nvJPEG takes,
    or why they cannot be."""
    if images.dtype != torch.uint8:
        return (
            f"the pixels are {images.dtype}, not uint8 (no device stage converted them: name the pipeline's "
            "post-process in WorkerSpec(postprocess=...))"
        )
    batch = images if images.dim() == 4 else images.unsqueeze(0)
    if images.dim() == 2:
        batch = images.unsqueeze(0).unsqueeze(-1)
    if batch.dim() != 4 or batch.shape[-1] not in (1, 3, 4):
        return f"the pixels' shape {tuple(images.shape)} is not [H, W], [H, W, C] or [N, H, W, C] with C 1, 3 or 4"
    batch = batch[..., :3]  # JPEG has no alpha
    return [img.permute(2, 0, 1).contiguous() for img in batch]


def encode_on_device(output: DiffusionOutput, encoding: Encoding) -> DiffusionOutput:
    """``output`` with its pixels JPEG-encoded on their CUDA device, or wrapped with the
    reason it could not be (see the module docstring).  Other outputs are returned as
    they are."""
    key = pixel_key(output.output)
    if key is None or not encodes_on_device(encoding):
        return output
    pixels = output.output[key]
    if not isinstance(pixels, torch.Tensor):
        return output
    batched = pixels.dim() == 4
    reason = ""
    parts: tuple[torch.Tensor, ...] = ()
    if pixels.device.type != "cuda":
        reason = f"the pixels are on {pixels.device.type}: JPEG on the GPU needs CUDA"
    else:
        chw = _as_chw(pixels)
        if isinstance(chw, str):
            reason = chw
        else:
            try:
                encode = _encode_jpeg()
            except ImportError as exc:
                reason = f"torchvision is not importable here ({exc}); install torchvision beside torch for nvJPEG"
            else:
                try:
                    parts = tuple(encode(chw, quality=encoding.jpeg_quality()))
                except Exception as exc:  # noqa: BLE001  # an encoder failure falls back to the host's
                    reason = f"torchvision.io.encode_jpeg raised {type(exc).__name__}: {exc}"
    if reason:
        log.debug("request %r: JPEG on the host: %s", output.request_id, reason)
        value = DeviceEncoded(encoding.media_type, pixels=pixels, reason=reason, batched=batched)
    else:
        h, w = _height_width(pixels.shape)
        value = DeviceEncoded(encoding.media_type, parts, width=w, height=h, batched=batched)
    return attrs.evolve(output, output={**output.output, key: value})


def run_device_encode(
    output: DiffusionOutput, encoding: Encoding, stream: CopyStream = None, event: DeviceEvent | None = None
) -> DiffusionOutput:
    """``encode_on_device`` ordered after ``event`` (the forward's) and after what
    ``stream`` (the packer's side stream: the device stage) queued; its seconds (the wait
    for the pixels and the encoder's) go to ``metrics.device_encode_s`` with the bytes in
    and out.

    torchvision's nvJPEG does not follow the caller's streams: it encodes on a stream of
    its own, which waits for no stream of ours, and hands the bytes over on the device's
    default stream -- the one the worker's next forward is queued on.  So the host waits
    for ``stream`` (itself behind ``event``) before the encoder reads the pixels, and
    ``stream`` then waits for the default stream before anything reads the bytes (they
    are complete once the work queued there before them is: at worst the next forward).
    Without the first wait the encoder reads pixels the forward has not written yet;
    without the second the packer may copy bytes not yet written."""
    t0 = time.perf_counter()
    wait_device_event(event, stream)
    if stream is not None:
        stream.synchronize()  # the pixels are written (the forward's event, the device stage)
        with torch.cuda.stream(stream):
            out = encode_on_device(output, encoding)
            stream.wait_stream(torch.cuda.default_stream(stream.device))
    else:
        out = encode_on_device(output, encoding)
    key = pixel_key(out.output)
    value = None if key is None else out.output[key]
    if not isinstance(value, DeviceEncoded) or not value.parts:
        return out
    pixels = output.output[key] if key is not None else None
    in_bytes = pixels.numel() if isinstance(pixels, torch.Tensor) else 0
    metrics = out.metrics.set(
        device_encode_s=time.perf_counter() - t0,
        device_encode_in_bytes=float(in_bytes),
        device_encode_out_bytes=float(sum(p.numel() for p in value.parts)),
    )
    return attrs.evolve(out, metrics=metrics)
