"""What a pipeline takes, read from its config: the request parameters, their checks, and
which requests can share one forward.

``PipelineProfile`` is the config a check needs (plain data, made once from the
pipeline -- in the executor from its config alone, ``PipelineSource.load_config_only``);
``validate_request(profile, request)`` raises ``InvalidRequest`` naming the request, the
parameter, what was wrong and what to do.  ``batch_key(request)`` needs no profile:
requests with equal keys give equal pipeline calls but for their conditioning and seed.

The parameters (each optional unless said; one request is one image or one video):

=========================  =====================================================================
``class_labels``           int, a class of the transformer (``num_embeds_ada_norm``); required
                           by a class-conditional pipeline (DiT)
``prompt``                 str, for a pipeline with a text encoder; or ``prompt_embeds``
``negative_prompt``        str (with ``prompt``)
``prompt_embeds``          a float tensor ``[seq, text_dim]`` (or ``[1, seq, text_dim]``):
                           the text encoder's output, precomputed
``negative_prompt_embeds`` the same, for classifier-free guidance without a text encoder
``height``, ``width``      int, a multiple of the VAE's scale factor times the patch size
``num_frames``             int of the form ``k * temporal_factor + 1`` (Wan: 4k + 1)
``num_inference_steps``    int in 1..10000
``guidance_scale``         a number >= 0 (classifier-free guidance when > 1)
``seed``                   int in 0..2**64-1: the request's own ``torch.Generator``
``output_type``            ``"pt"`` (pixels in [0, 1], the default) or ``"latent"`` where the
                           pipeline supports it
``preview_every``          int >= 1: a streamed request gets a preview every k steps
=========================  =====================================================================
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from numbers import Integral, Real

import attrs
import torch

from omni_async.core.errors import InvalidRequest
from omni_async.core.messages import DiffusionRequest
from omni_async.integrations.diffusers.edge import PipelineHandle, int_or_none

__all__ = ["PipelineProfile", "batch_key", "profile_of", "validate_request"]

#: The request parameters that map onto a pipeline's ``__call__`` argument of the same name.
CALL_PARAMETERS = (
    "class_labels",
    "prompt",
    "negative_prompt",
    "prompt_embeds",
    "negative_prompt_embeds",
    "height",
    "width",
    "num_frames",
    "num_inference_steps",
    "guidance_scale",
)
#: The parameters this package handles itself.
OWN_PARAMETERS = ("seed", "output_type", "preview_every")
MAX_SIDE = 16384
MAX_STEPS = 10000
# DiTPipeline's classifier-free guidance feeds this label as "no class" (hard-coded there).
DIT_NULL_CLASS = 1000


@attrs.frozen
class PipelineProfile:
    """The parts of a pipeline's config that decide which requests it can take."""

    pipeline: str
    call_parameters: frozenset[str]
    # class_labels: 0..num_classes-1; None when the pipeline is not class-conditional.
    num_classes: int | None = None
    # height and width: multiples of this (VAE scale factor x patch size); None: no height/width.
    spatial_multiple: int | None = None
    # num_frames: k * temporal_factor + 1; None when the pipeline takes no num_frames.
    temporal_factor: int | None = None
    # prompt_embeds' last dimension; None when the pipeline takes no embeddings.
    text_dim: int | None = None
    has_text_encoder: bool = False
    # __call__ has callback_on_step_end (else the scheduler's step is hooked).
    step_callback: bool = False
    # output_type="latent" returns the latents (checked in __call__'s source).
    latent_output: bool = False
    # __call__'s default num_inference_steps.
    default_steps: int = 50

    def parameters(self) -> list[str]:
        """The request parameters this pipeline takes."""
        names = [p for p in CALL_PARAMETERS if p in self.call_parameters]
        if not self.has_text_encoder:
            names = [p for p in names if p not in ("prompt", "negative_prompt")]
        return sorted([*names, *OWN_PARAMETERS])

    def output_types(self) -> tuple[str, ...]:
        return ("pt", "latent") if self.latent_output else ("pt",)


def profile_of(handle: PipelineHandle) -> PipelineProfile:
    """The profile of a pipeline (built, or with its parameters left uninitialised)."""
    params = handle.call_parameters()
    transformer = handle.config("transformer") or handle.config("unet")
    num_classes = None
    if "class_labels" in params:
        num_classes = int_or_none(transformer.get("num_embeds_ada_norm")) or int_or_none(transformer.get("num_classes"))
    spatial = None
    if "height" in params:
        vae_scale = int_or_none(handle.attribute("vae_scale_factor_spatial")) or int_or_none(
            handle.attribute("vae_scale_factor")
        )
        patch = int_or_none(transformer.get("patch_size")) or 1
        spatial = (vae_scale or 8) * patch
    temporal = int_or_none(handle.attribute("vae_scale_factor_temporal")) if "num_frames" in params else None
    text_dim = None
    if "prompt_embeds" in params:
        for key in ("text_dim", "joint_attention_dim", "cross_attention_dim", "caption_channels"):
            text_dim = int_or_none(transformer.get(key))
            if text_dim is not None:
                break
    return PipelineProfile(
        pipeline=handle.class_name,
        call_parameters=params,
        num_classes=num_classes,
        spatial_multiple=spatial,
        temporal_factor=temporal,
        text_dim=text_dim,
        has_text_encoder=handle.component("text_encoder") is not None,
        step_callback="callback_on_step_end" in params,
        latent_output="output_type" in params and '"latent"' in handle.call_source(),
        default_steps=_int(handle.call_default("num_inference_steps")) or 50,
    )


def _int(value: object) -> int | None:
    """``value`` as an int when it is one (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        return None
    return int(value)


def _number(value: object) -> float | None:
    """``value`` as a float when it is a finite real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        return None
    return float(value)


def guidance_of(params: Mapping[str, object]) -> float | None:
    """The request's guidance scale (None: the pipeline's default)."""
    return _number(params.get("guidance_scale"))


def validate_request(profile: PipelineProfile, request: DiffusionRequest) -> None:
    """Raise ``InvalidRequest`` for the first parameter of ``request`` that ``profile``'s
    pipeline cannot take; it names the request, the parameter, the problem and the fix."""
    rid = request.request_id
    p = request.params
    known = profile.parameters()
    for name in p:
        if name not in known:
            hint = ""
            if name in ("prompt", "negative_prompt") and "prompt_embeds" in known:
                hint = "; this pipeline has no text encoder: send prompt_embeds (the text encoder's output) instead"
            raise InvalidRequest(rid, name, f"is not a parameter of this {profile.pipeline} (it takes {known}){hint}")
    _check_ranges(profile, request)
    _check_conditioning(profile, request)
    guidance = guidance_of(p)
    if (
        profile.num_classes is not None
        and profile.num_classes < DIT_NULL_CLASS
        and profile.pipeline == "DiTPipeline"
        and (guidance is None or guidance > 1)
    ):
        raise InvalidRequest(
            rid,
            "guidance_scale",
            f"> 1 (the default is 4.0) makes {profile.pipeline} use class {DIT_NULL_CLASS} as the unconditional "
            f"label, and this transformer has {profile.num_classes} classes: send guidance_scale <= 1",
        )


def _check_ranges(profile: PipelineProfile, request: DiffusionRequest) -> None:
    rid = request.request_id
    p = request.params
    seed = _int(p.get("seed", 0))
    if seed is None or not 0 <= seed < 2**64:
        raise InvalidRequest(rid, "seed", f"must be an int in 0..2**64-1, got {p.get('seed')!r:.60}")
    steps = p.get("num_inference_steps")
    if steps is not None and not 1 <= (_int(steps) or 0) <= MAX_STEPS:
        raise InvalidRequest(rid, "num_inference_steps", f"must be an int in 1..{MAX_STEPS}, got {steps!r:.60}")
    guidance = p.get("guidance_scale")
    scale = _number(guidance)
    if guidance is not None and (scale is None or scale < 0):
        raise InvalidRequest(rid, "guidance_scale", f"must be a finite number >= 0, got {guidance!r:.60}")
    for side in ("height", "width"):
        value = p.get(side)
        if value is None:
            continue
        multiple = profile.spatial_multiple or 1
        size = _int(value)
        if size is None or not 0 < size <= MAX_SIDE:
            raise InvalidRequest(rid, side, f"must be an int in {multiple}..{MAX_SIDE}, got {value!r:.60}")
        if size % multiple:
            lower = max(multiple, size // multiple * multiple)
            raise InvalidRequest(
                rid,
                side,
                f"must be a multiple of {multiple} (the VAE's scale factor times the transformer's patch size), "
                f"got {value}: send {lower} or {lower + multiple}",
            )
    raw_frames = p.get("num_frames")
    frames = _int(raw_frames)
    factor = profile.temporal_factor or 1
    if raw_frames is not None and (frames is None or not 1 <= frames <= 100000):
        raise InvalidRequest(rid, "num_frames", f"must be a positive int, got {raw_frames!r:.60}")
    if frames is not None and (frames - 1) % factor:
        lower = (frames - 1) // factor * factor + 1
        raise InvalidRequest(
            rid,
            "num_frames",
            f"must be {factor}k + 1 (the VAE compresses {factor} frames into one after the first), got {frames}: "
            f"send {lower} or {lower + factor}",
        )
    output_type = p.get("output_type", "pt")
    if output_type not in profile.output_types():
        raise InvalidRequest(
            rid, "output_type", f"must be one of {list(profile.output_types())}, got {output_type!r:.60}"
        )
    every = p.get("preview_every")
    if every is not None and (_int(every) or 0) < 1:
        raise InvalidRequest(rid, "preview_every", f"must be an int >= 1 (a preview every k steps), got {every!r:.60}")


def _check_conditioning(profile: PipelineProfile, request: DiffusionRequest) -> None:
    rid = request.request_id
    p = request.params
    if profile.num_classes is not None:
        label = p.get("class_labels")
        if label is None:
            raise InvalidRequest(rid, "class_labels", f"is required by {profile.pipeline}: send one class as an int")
        index = _int(label)
        if index is None or not 0 <= index < profile.num_classes:
            raise InvalidRequest(
                rid,
                "class_labels",
                f"must be one class, an int in 0..{profile.num_classes - 1} (the transformer's num_embeds_ada_norm="
                f"{profile.num_classes}), got {label!r:.60}",
            )
    if "prompt_embeds" not in profile.call_parameters:
        return
    if "prompt" in p and "prompt_embeds" in p:
        raise InvalidRequest(rid, "prompt_embeds", "cannot come with prompt: send one of the two")
    if "prompt" not in p and "prompt_embeds" not in p:
        what = "prompt (a str) or prompt_embeds" if profile.has_text_encoder else "prompt_embeds (no text encoder here)"
        raise InvalidRequest(rid, "prompt_embeds", f"is required by {profile.pipeline}: send {what}")
    for name in ("prompt", "negative_prompt"):
        if name in p and not isinstance(p[name], str):
            raise InvalidRequest(rid, name, f"must be a str, got {type(p[name]).__name__}")
    for name in ("prompt_embeds", "negative_prompt_embeds"):
        if name in p:
            _check_embeds(profile, rid, name, p[name])
    guidance = guidance_of(p)
    cfg = guidance is None or guidance > 1
    if cfg and "prompt_embeds" in p and "negative_prompt_embeds" not in p and not profile.has_text_encoder:
        raise InvalidRequest(
            rid,
            "negative_prompt_embeds",
            f"is required with prompt_embeds when guidance_scale > 1 (the default is "
            f"{_default_guidance(profile)}): this {profile.pipeline} has no text encoder to encode the empty negative "
            "prompt; send negative_prompt_embeds, or guidance_scale <= 1",
        )


def _default_guidance(profile: PipelineProfile) -> str:
    return "5.0" if profile.pipeline.startswith("Wan") else "the pipeline's"


def _check_embeds(profile: PipelineProfile, rid: str, name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise InvalidRequest(rid, name, f"must be a float tensor [seq, {profile.text_dim}], got {type(value).__name__}")
    shape = tuple(value.shape)
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 2 or shape[0] < 1 or (profile.text_dim is not None and shape[1] != profile.text_dim):
        raise InvalidRequest(
            rid,
            name,
            f"must have shape [seq, {profile.text_dim}] or [1, seq, {profile.text_dim}] (the transformer's text "
            f"dimension is {profile.text_dim}), got {list(value.shape)}",
        )


def embeds_2d(value: torch.Tensor) -> torch.Tensor:
    """``[seq, dim]`` embeddings as the ``[1, seq, dim]`` a pipeline takes per request."""
    return value[None] if value.dim() == 2 else value


def batch_key(request: DiffusionRequest) -> Hashable | None:
    """Requests with equal keys can share one pipeline call: same size, frames, steps,
    guidance, output type and kind of conditioning (class label, prompt, or embeddings of
    one shape and dtype, with or without negative ones).  Their class labels, prompts,
    embeddings and seeds differ per member.  None for a request it cannot read."""
    p: Mapping[str, object] = request.params
    try:
        if "class_labels" in p:
            cond: Hashable = "class"
        elif "prompt" in p:
            cond = ("prompt",)
        elif isinstance(p.get("prompt_embeds"), torch.Tensor):
            cond = ("embeds", _shape_key(p["prompt_embeds"]), _shape_key(p.get("negative_prompt_embeds")))
        else:
            cond = None
        key = (
            cond,
            *(p.get(name) for name in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")),
            p.get("output_type", "pt"),
        )
        hash(key)
    except TypeError:
        return None
    return key


def _shape_key(value: object) -> Hashable:
    if not isinstance(value, torch.Tensor):
        return None
    return (tuple(embeds_2d(value).shape), str(value.dtype))
