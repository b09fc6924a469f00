"""The pixels a client receives: diffusers' ``output_type="np"``/``"pil"`` as uint8, off the GPU path.

A worker returns ``output_type="pt"`` pixels in [0, 1] on the device.  The post-process
registered here under ``"diffusers"`` turns them into what diffusers' own
``VaeImageProcessor.postprocess(..., output_type="np")`` gives, scaled to uint8 the way
its ``numpy_to_pil`` does (``(x * 255).round()``), channel-last: bit-identical to the
pixels of the ``"pil"`` path.

* ``host`` (engine side, ``AsyncDiffusionEngine(..., pipeline="diffusers")``): the
  pipeline's output object with numpy uint8 arrays in place of its tensors (images
  ``[B, H, W, 3]``, videos ``[B, F, H, W, 3]``); a chunk (preview) likewise, as a dict;
  ``latents`` as an owned tensor copy.  It never writes its input (a view of shared memory).
* ``device`` (worker side, ``DiffusersPipelineWorker.spec(..., postprocess="diffusers")``):
  the same conversion on the worker's device before the copy (4x fewer bytes than float32,
  2x fewer than bfloat16); the host stage then only copies.  Float32 multiply and
  round-half-even are exact IEEE operations, so the pixels are the same either way.
  For a worker with ``decode="device"``, whose forward stops at the latents, the device
  stage first decodes them with the pipeline's VAE (the output's ``DECODE_LATER``
  entry, a ``LatentDecoder`` that never leaves the worker's process): the output is then
  ``{"images": ...}`` or ``{"frames": ...}`` as the pipeline's own decode gives them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs
import torch

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput
from omni_async.worker.postprocess import PostProcess, register_postprocess

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "DECODE_LATER",
    "ENCODE_LATER",
    "PIPELINE",
    "POSTPROCESS",
    "device_stage",
    "encodable",
    "host_stage",
    "to_uint8",
]

#: The pipeline name of the post-process (``get_postprocess("diffusers")``).
PIPELINE = "diffusers"
_PIXELS = ("images", "frames")
#: The key under which a ``decode="device"`` worker's output carries its decoder to the device stage.
DECODE_LATER = "omni_async.decode_later"
#: Beside it: whether the request asked for a format (the decoded pixels then become ``encodable``).
ENCODE_LATER = "omni_async.encode_later"


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Pixels ``[..., 3, H, W]`` in [0, 1] (any float dtype, any device) to uint8
    ``[..., H, W, 3]``: diffusers' ``(x.float() * 255).round()``, channel-last, out of place."""
    if pixels.dtype == torch.uint8:
        return pixels
    scaled = (pixels.to(torch.float32) * 255.0).round()  # a new tensor: the input is never written
    return scaled.to(torch.uint8).movedim(-3, -1).contiguous()


def _convert(value: object, *, to_host: bool) -> object:
    """A pixel tensor (float ``[..., 3, H, W]``, or uint8 from the device stage) as uint8
    channel-last: on the host a numpy array of its own."""
    if not isinstance(value, torch.Tensor):
        return value
    px = value
    if px.dtype != torch.uint8:
        if not px.is_floating_point() or px.dim() < 3 or px.shape[-3] != 3:
            return value
        px = to_uint8(px)
    if not to_host:
        return px
    host: npt.NDArray[np.uint8] = px.cpu().numpy()
    # A uint8 input views the output's shared memory: copy it; a converted one is ours.
    return host.copy() if px is value else host


def _map_pixels(output: object, *, to_host: bool) -> object:
    """``output`` with its ``images``/``frames`` converted (a BaseOutput stays its own class)."""
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        changes = {
            f.name: _convert(getattr(output, f.name), to_host=to_host)
            for f in dataclasses.fields(output)
            if f.name in _PIXELS
        }
        return dataclasses.replace(output, **changes)
    if isinstance(output, Mapping):
        mapped: dict[str, object] = {}
        for key, value in output.items():
            if key in _PIXELS:
                mapped[key] = _convert(value, to_host=to_host)
            elif key == "latents" and to_host and isinstance(value, torch.Tensor):
                mapped[key] = value.clone()
            else:
                mapped[key] = value
        return mapped
    if isinstance(output, torch.Tensor):
        return _convert(output, to_host=to_host)
    return output


def encodable(output: object, request_id: str) -> dict[str, object]:
    """One request's pipeline output (``images`` ``[1, 3, H, W]`` or ``frames`` ``[1, F, 3,
    H, W]``, in [0, 1]) as the engine's encoder reads it: ``{"image": uint8 [H, W, 3]}`` or
    ``{"frames": uint8 [F, H, W, 3]}``, made on the output's device."""
    fields = output if isinstance(output, Mapping) else {}
    for key, single in (("frames", "frames"), ("images", "image")):
        value = fields.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 4 and value.shape[0] == 1:
            return {single: to_uint8(value[0])}
    raise UsageError(
        f"request {request_id!r} asked for a format, but its pipeline output ({type(output).__name__}) has no "
        "'images' [1, 3, H, W] or 'frames' [1, F, 3, H, W] tensor to encode"
    )


def host_stage(output: DiffusionOutput) -> object:
    """The engine-side stage: uint8 channel-last numpy pixels that own their memory."""
    return _map_pixels(output.output, to_host=True)


def device_stage(output: DiffusionOutput) -> DiffusionOutput:
    """The worker-side stage: the latents decoded when the forward left them
    (``DECODE_LATER``), then uint8 channel-last pixels on the device, before the copy."""
    value = output.output
    if isinstance(value, Mapping) and DECODE_LATER in value:
        decode = value[DECODE_LATER]
        encode = bool(value.get(ENCODE_LATER))
        value = dict(decode(value["latents"]))
        if encode:
            value = encodable(value, output.request_id)
    return attrs.evolve(output, output=_map_pixels(value, to_host=False))


POSTPROCESS = register_postprocess(PostProcess(PIPELINE, host=host_stage, device=device_stage))
