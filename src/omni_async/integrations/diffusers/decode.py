"""Each family's own decode, from latents mid-loop (a preview) or at the end of the loop
(``decode="device"``) to the pixels its ``output_type="pt"`` gives.

A diffusers pipeline decodes inside its ``__call__``, after the loop, with no method of
its own to call from outside.  Each entry of ``DECODES`` is that tail of the pipeline's
``__call__`` (diffusers 0.42.1), composed of the pipeline's own pieces where it has them
-- its ``_unpack_latents``, ``_denormalize_latents``, ``decode_latents``, its
``image_processor``/``video_processor`` and their ``resize_and_crop_tensor`` -- and its
own arithmetic (``scaling_factor``, ``shift_factor``, ``latents_mean``/``latents_std``)
where it has none.  Each is tested bit for bit against the pipeline's own output
(tests/integrations/test_diffusers_families.py).  A pipeline class not listed has no
known decode: ``decode="device"`` and previews are refused for it (``decode_of``).

A decode takes the latents as the pipeline's step callback (or its scheduler's step)
sees them, batch dimension 1, and the request's parameters (a size the latents do not
carry: Flux's and LTX's packed latents, PixArt's size before resolution binning).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from omni_async.integrations.diffusers.edge import PipelineHandle

__all__ = ["DECODES", "Decode", "decode_of"]

#: ``decode(pipeline, latents, request params)`` -> ``{"images": [B, 3, H, W]}`` or ``{"frames": [B, F, 3, H, W]}``.
Decode = Callable[[PipelineHandle, torch.Tensor, Mapping[str, object]], dict[str, torch.Tensor]]
# The entries of DECODES reach into the untyped pipeline (Any) here, and only here.
_Raw = Callable[[Any, torch.Tensor, Mapping[str, object]], dict[str, torch.Tensor]]


def _param(pipe: Any, params: Mapping[str, object], name: str, default: object) -> Any:
    """A request's ``name``, else ``__call__``'s default, else ``default`` (the pipeline's own expression)."""
    value = params.get(name)
    if value is not None:
        return value
    found = PipelineHandle(pipe).call_default(name)
    return default if found is None else found


def _vae_latents(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    return latents.to(next(pipe.vae.parameters()).device)


def _sd(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    # StableDiffusionPipeline: no safety checker here, so every image is denormalized.
    image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
    return {"images": pipe.image_processor.postprocess(image, output_type="pt", do_denormalize=[True] * len(image))}


def _sdxl(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    config = pipe.vae.config
    if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
        mean = torch.tensor(config.latents_mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(config.latents_std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
        latents = latents * std / config.scaling_factor + mean
    else:
        latents = latents / config.scaling_factor
    image = pipe.vae.decode(_vae_latents(pipe, latents), return_dict=False)[0]
    if pipe.watermark is not None:
        image = pipe.watermark.apply_watermark(image)
    return {"images": pipe.image_processor.postprocess(image, output_type="pt")}


def _sd3(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
    image = pipe.vae.decode(latents, return_dict=False)[0]
    return {"images": pipe.image_processor.postprocess(image, output_type="pt")}


def _flux(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    default = pipe.default_sample_size * pipe.vae_scale_factor
    height, width = _param(pipe, params, "height", default), _param(pipe, params, "width", default)
    latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
    image = pipe.vae.decode(_vae_latents(pipe, latents), return_dict=False)[0]
    return {"images": pipe.image_processor.postprocess(image, output_type="pt")}


def _pixart(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    default = pipe.transformer.config.sample_size * pipe.vae_scale_factor
    height, width = _param(pipe, params, "height", default), _param(pipe, params, "width", default)
    image = pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
    if _param(pipe, params, "use_resolution_binning", True):
        # The request's own size: the loop ran at the nearest aspect-ratio bin.
        image = pipe.image_processor.resize_and_crop_tensor(image, width, height)
    return {"images": pipe.image_processor.postprocess(image, output_type="pt")}


def _sana(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    # SanaPipeline: PixArt's tail, its size defaulting to __call__'s (1024), not the transformer's.
    height, width = _param(pipe, params, "height", 1024), _param(pipe, params, "width", 1024)
    image = pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
    if _param(pipe, params, "use_resolution_binning", True):
        image = pipe.image_processor.resize_and_crop_tensor(image, width, height)
    return {"images": pipe.image_processor.postprocess(image, output_type="pt")}


def _cogvideox(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    patch_size_t = pipe.transformer.config.patch_size_t
    if patch_size_t is not None:
        frames = _param(pipe, params, "num_frames", 49)
        latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        if latent_frames % patch_size_t:
            latents = latents[:, patch_size_t - latent_frames % patch_size_t :]
    video = pipe.decode_latents(latents)
    return {"frames": pipe.video_processor.postprocess_video(video=video, output_type="pt")}


def _ltx(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    height, width = _param(pipe, params, "height", 512), _param(pipe, params, "width", 704)
    frames = _param(pipe, params, "num_frames", 161)
    latents = pipe._unpack_latents(
        latents,
        (frames - 1) // pipe.vae_temporal_compression_ratio + 1,
        height // pipe.vae_spatial_compression_ratio,
        width // pipe.vae_spatial_compression_ratio,
        pipe.transformer_spatial_patch_size,
        pipe.transformer_temporal_patch_size,
    )
    latents = pipe._denormalize_latents(
        latents, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor
    )
    latents = latents.to(pipe.transformer.dtype).to(pipe.vae.dtype)
    video = pipe.vae.decode(latents, None, return_dict=False)[0]
    return {"frames": pipe.video_processor.postprocess_video(video, output_type="pt")}


def _wan(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    latents = _vae_latents(pipe, latents).to(dtype=pipe.vae.dtype)
    z_dim = pipe.vae.config.z_dim
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    video = pipe.vae.decode(latents / inv_std + mean, return_dict=False)[0]
    return {"frames": pipe.video_processor.postprocess_video(video, output_type="pt")}


def _dit(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    samples = pipe.vae.decode(1 / pipe.vae.config.scaling_factor * latents).sample
    return {"images": (samples / 2 + 0.5).clamp(0, 1)}


def _pixels(pipe: Any, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
    # DDIM, DDPM: no VAE, the loop runs on pixels in [-1, 1].
    return {"images": (latents / 2 + 0.5).clamp(0, 1)}


#: The pipeline classes whose decode is known, by class name.
DECODES: Mapping[str, _Raw] = {
    "StableDiffusionPipeline": _sd,
    "StableDiffusionXLPipeline": _sdxl,
    "StableDiffusion3Pipeline": _sd3,
    "FluxPipeline": _flux,
    "PixArtSigmaPipeline": _pixart,
    "PixArtAlphaPipeline": _pixart,
    "SanaPipeline": _sana,
    "CogVideoXPipeline": _cogvideox,
    "LTXPipeline": _ltx,
    "WanPipeline": _wan,
    "DiTPipeline": _dit,
    "DDIMPipeline": _pixels,
    "DDPMPipeline": _pixels,
}


def decode_of(handle: PipelineHandle) -> Decode | None:
    """The decode of ``handle``'s pipeline class, or None when it is not known (or, for
    LTX, when its VAE adds seeded noise while decoding: ``timestep_conditioning``)."""
    raw = DECODES.get(handle.class_name)
    if raw is None or handle.class_name == "LTXPipeline" and handle.config("vae").get("timestep_conditioning"):
        return None

    def decode(on: PipelineHandle, latents: torch.Tensor, params: Mapping[str, object]) -> dict[str, torch.Tensor]:
        return raw(on.pipeline, latents, params)

    return decode
