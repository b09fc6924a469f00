"""What a pipeline takes, read from the pipeline itself: the request parameters (its
``__call__``'s own arguments), their checks, and which requests can share one forward.

``PipelineProfile`` is plain data, made once from the pipeline (in the executor from
its config alone, ``PipelineSource.load_config_only``): the arguments ``__call__``
accepts, with their types and defaults (``schema()``: what a server publishes), and the
config fields the pipeline's own code checks its tensors against.
``validate_request(profile, request)`` raises ``InvalidRequest`` naming the request,
the parameter, what was wrong and what to do.  ``batch_key(request)`` needs no profile.

A request may carry any argument of ``__call__`` but those this package sets itself
(``generator``, ``return_dict``, the step callbacks, ``num_images_per_prompt``: one
request is one image or one video), plus its own:

=========================  =====================================================================
``seed``                   int in 0..2**64-1: the request's own ``torch.Generator``
``output_type``            ``"pt"`` (pixels in [0, 1], the default) or ``"latent"`` where the
                           pipeline supports it
``preview_every``          int >= 1: a streamed request gets a preview every k steps
=========================  =====================================================================

Checked where the pipeline's own code says how: ``class_labels`` against the
transformer's classes; ``height``/``width`` against the VAE's scale factor times the
patch size; ``num_frames`` against the VAE's temporal factor; ``prompt_embeds`` (and
the pooled embeddings and attention masks that go with it) against the config field the
pipeline's family reads (``TEXT_FIELDS``).  An argument with no known check goes
through as it is: the pipeline's own error then reaches the caller (``RpcFailed``).
Tensors are per request: ``[seq, dim]`` or ``[1, seq, dim]`` (pooled ``[dim]`` or
``[1, dim]``, masks ``[seq]`` or ``[1, seq]``).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Hashable, Mapping
from numbers import Integral, Real

import attrs
import torch

from omni_async.core.errors import InvalidRequest
from omni_async.core.messages import DiffusionRequest
from omni_async.integrations.diffusers.decode import decode_of
from omni_async.integrations.diffusers.edge import PipelineHandle, int_or_none

__all__ = ["CallParameter", "PipelineProfile", "batch_key", "profile_of", "validate_request"]

#: The parameters this package handles itself.
OWN_PARAMETERS = ("seed", "output_type", "preview_every")
#: ``__call__`` arguments this package sets: a request cannot carry them.
SET_HERE = frozenset(
    {
        "self",
        "generator",
        "return_dict",
        "callback",
        "callback_steps",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "num_images_per_prompt",
        "num_videos_per_prompt",
        "batch_size",
    }
)
MAX_SIDE = 16384
MAX_STEPS = 10000
# DiTPipeline's classifier-free guidance feeds this label as "no class" (hard-coded there).
DIT_NULL_CLASS = 1000

#: Per denoiser class: the config field its pipelines check ``prompt_embeds``' last
#: dimension against, and the one for ``pooled_prompt_embeds`` (read from the pipelines'
#: code: the projection each feeds the embeddings to).
TEXT_FIELDS: Mapping[str, tuple[str, str | None]] = {
    "PixArtTransformer2DModel": ("caption_channels", None),
    "SanaTransformer2DModel": ("caption_channels", None),
    "LTXVideoTransformer3DModel": ("caption_channels", None),
    "CogVideoXTransformer3DModel": ("text_embed_dim", None),
    "SD3Transformer2DModel": ("joint_attention_dim", "pooled_projection_dim"),
    "FluxTransformer2DModel": ("joint_attention_dim", "pooled_projection_dim"),
    "WanTransformer3DModel": ("text_dim", None),
    "UNet2DConditionModel": ("cross_attention_dim", None),
}
#: The tensors that come with ``prompt_embeds`` (and its negative) when ``__call__`` takes them.
COMPANIONS = ("pooled_prompt_embeds", "prompt_attention_mask")


@attrs.frozen
class CallParameter:
    """One request parameter: its name, its type as ``__call__`` declares it (text), its
    default (``repr``; '' when required or unset) and whether this package checks it."""

    name: str
    annotation: str
    default: str
    checked: bool

    def as_json(self) -> dict[str, object]:
        return {"type": self.annotation, "default": self.default, "checked": self.checked}


@attrs.frozen
class PipelineProfile:
    """The parts of a pipeline (its ``__call__`` and its config) that decide which requests it can take."""

    pipeline: str
    call_parameters: frozenset[str]
    # The request parameters: __call__'s arguments less SET_HERE, plus OWN_PARAMETERS.
    accepted: tuple[CallParameter, ...] = ()
    # class_labels: 0..num_classes-1; None when the pipeline is not class-conditional.
    num_classes: int | None = None
    # height and width: multiples of this (VAE scale factor x patch size); None: no height/width.
    spatial_multiple: int | None = None
    # num_frames: k * temporal_factor + 1; None when the pipeline takes no num_frames.
    temporal_factor: int | None = None
    # prompt_embeds' last dimension and the config field it is; None: not checked.
    text_dim: int | None = None
    text_field: str = ""
    # pooled_prompt_embeds' last dimension; None: not checked.
    pooled_dim: int | None = None
    has_text_encoder: bool = False
    # guidance_scale > 1 means classifier-free guidance (the pipeline says so), which needs a
    # negative conditioning: the text encoder's empty prompt, or negative_prompt_embeds.
    cfg_guidance: bool = False
    default_guidance: float | None = None
    # The pipeline guides against zeros when no negative prompt is given (SDXL's
    # force_zeros_for_empty_prompt): no text encoder is needed for it.
    zero_negative: bool = False
    # __call__ has callback_on_step_end (else the scheduler's step is hooked).
    step_callback: bool = False
    # output_type="latent" returns the latents (checked in __call__'s source).
    latent_output: bool = False
    # __call__'s default num_inference_steps.
    default_steps: int = 50
    # No conditioning at all, a batch is __call__'s batch_size (DDIM, DDPM).
    unconditional: bool = False
    # The family's decode is known (decode.DECODES): previews; with latent_output, decode="device".
    decode_known: bool = False
    # The pipeline's own code takes gradients inside its call (``torch.enable_grad``,
    # ``torch.autograd.grad``: Attend-and-Excite, DiffEdit, Pix2Pix-Zero): the worker runs
    # its call outside the worker's inference mode (``WorkerOptions.inference_mode``).
    needs_autograd: bool = False

    @property
    def device_decode(self) -> bool:
        """``decode="device"`` works: the pipeline returns latents and its decode is known."""
        return self.latent_output and self.decode_known

    def parameters(self) -> list[str]:
        """The request parameters this pipeline takes."""
        return sorted(p.name for p in self.accepted)

    def schema(self) -> dict[str, object]:
        """The accepted parameters as JSON-able data: ``{"pipeline": ..., "parameters":
        {name: {"type", "default", "checked"}}}`` (what a server publishes)."""
        return {"pipeline": self.pipeline, "parameters": {p.name: p.as_json() for p in self.accepted}}

    def output_types(self) -> tuple[str, ...]:
        return ("pt", "latent") if self.latent_output else ("pt",)


_CHECKED = frozenset(
    {
        "class_labels",
        "prompt",
        "negative_prompt",
        "prompt_embeds",
        "negative_prompt_embeds",
        "pooled_prompt_embeds",
        "negative_pooled_prompt_embeds",
        "prompt_attention_mask",
        "negative_prompt_attention_mask",
        "height",
        "width",
        "num_frames",
        "num_inference_steps",
        "guidance_scale",
        *OWN_PARAMETERS,
    }
)
_OWN_TYPES = {"seed": "int", "output_type": "str ('pt' or 'latent')", "preview_every": "int"}


def _accepted(handle: PipelineHandle, latent: bool, previews: bool) -> tuple[CallParameter, ...]:
    found: list[CallParameter] = []
    for param in handle.call_signature().parameters.values():
        if param.name in SET_HERE or param.name in OWN_PARAMETERS:
            continue
        if param.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            continue
        annotation = "" if param.annotation is inspect.Parameter.empty else inspect.formatannotation(param.annotation)
        default = "" if param.default is inspect.Parameter.empty else repr(param.default)
        found.append(CallParameter(param.name, annotation, default, param.name in _CHECKED))
    own_defaults = {"seed": "", "output_type": "'pt'", "preview_every": "None"}
    for name in OWN_PARAMETERS:
        if name == "preview_every" and not previews:
            continue  # no known decode for previews (decode.DECODES)
        annotation = _OWN_TYPES[name] if name != "output_type" or latent else "str ('pt')"
        found.append(CallParameter(name, annotation, own_defaults[name], True))
    return tuple(sorted(found, key=lambda p: p.name))


def _cfg_guidance(handle: PipelineHandle, params: frozenset[str]) -> bool:
    """Whether the pipeline's own code makes ``guidance_scale > 1`` classifier-free guidance
    (its ``do_classifier_free_guidance``; Flux's guidance_scale is a distilled embedding, not CFG)."""
    if "guidance_scale" not in params:
        return False
    prop = handle.class_source("do_classifier_free_guidance")
    if "guidance_scale" in prop:
        return True
    return "do_classifier_free_guidance = guidance_scale >" in handle.call_source()


def profile_of(handle: PipelineHandle) -> PipelineProfile:
    """The profile of a pipeline (built, or with its parameters left uninitialised)."""
    params = handle.call_parameters()
    denoiser_name = handle.denoiser_name()
    transformer = handle.config(denoiser_name)
    denoiser_class = type(handle.component(denoiser_name)).__name__
    num_classes = None
    if "class_labels" in params:
        num_classes = int_or_none(transformer.get("num_embeds_ada_norm")) or int_or_none(transformer.get("num_classes"))
    spatial = None
    if "height" in params:
        vae_scale = (
            int_or_none(handle.attribute("vae_scale_factor_spatial"))
            or int_or_none(handle.attribute("vae_scale_factor"))
            or int_or_none(handle.attribute("vae_spatial_compression_ratio"))
        )
        patch = int_or_none(transformer.get("patch_size")) or 1
        spatial = (vae_scale or 8) * patch
        if denoiser_class == "FluxTransformer2DModel":
            spatial = (vae_scale or 8) * 2  # Flux packs 2x2 latent patches (its check_inputs)
        # A pipeline's check_inputs may ask for more (LTX: 32, SD: 8): its own number wins.
        literal = re.search(r"height % (\d+) != 0", handle.class_source("check_inputs"))
        if literal is not None:
            spatial = max(spatial, int(literal.group(1)))
    temporal = None
    if "num_frames" in params:
        temporal = int_or_none(handle.attribute("vae_scale_factor_temporal")) or int_or_none(
            handle.attribute("vae_temporal_compression_ratio")
        )
    text_dim = pooled_dim = None
    text_field = ""
    fields = TEXT_FIELDS.get(denoiser_class)
    if "prompt_embeds" in params and fields is not None:
        text_field, pooled_field = fields
        text_dim = int_or_none(transformer.get(text_field))
        if pooled_field is not None:
            pooled_dim = int_or_none(transformer.get(pooled_field))
        elif "pooled_prompt_embeds" in params and transformer.get("addition_embed_type") == "text_time":
            # SDXL: the UNet's added embedding is the pooled text (projection_dim) then 6 time ids.
            total = int_or_none(transformer.get("projection_class_embeddings_input_dim"))
            per_id = int_or_none(transformer.get("addition_time_embed_dim"))
            if total is not None and per_id is not None:
                pooled_dim = total - 6 * per_id
    latent = "output_type" in params and '"latent"' in handle.call_source()
    guidance_default = handle.call_default("guidance_scale")
    return PipelineProfile(
        pipeline=handle.class_name,
        call_parameters=params,
        accepted=_accepted(handle, latent, decode_of(handle) is not None),
        num_classes=num_classes,
        spatial_multiple=spatial,
        temporal_factor=temporal,
        text_dim=text_dim,
        text_field=f"{denoiser_name}.config.{text_field}" if text_field else "",
        pooled_dim=pooled_dim,
        has_text_encoder=handle.component("text_encoder") is not None,
        cfg_guidance=_cfg_guidance(handle, params),
        default_guidance=_number(guidance_default),
        zero_negative=handle.pipeline_config().get("force_zeros_for_empty_prompt") is True,
        step_callback="callback_on_step_end" in params,
        latent_output=latent,
        default_steps=_int(handle.call_default("num_inference_steps")) or 50,
        decode_known=decode_of(handle) is not None,
        unconditional="batch_size" in params and not params & {"prompt", "prompt_embeds", "class_labels"},
        needs_autograd=takes_gradients(handle.module_source()),
    )


def takes_gradients(source: str) -> bool:
    """Whether a pipeline module's source takes gradients (autograd inside its no_grad call)."""
    return re.search(r"\btorch\.enable_grad\b|\bautograd\.grad\b|\bset_grad_enabled\(\s*True", source) is not None


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
    unknown = [name for name in p if name not in known]
    if unknown:
        hint = ""
        set_here = [name for name in unknown if name in SET_HERE]
        if set_here:
            hint = f"; {set_here} are set by the integration (one request is one image or video, seeded by 'seed')"
        raise InvalidRequest(
            rid,
            ", ".join(unknown),
            f"{'is' if len(unknown) == 1 else 'are'} not accepted by {profile.pipeline}.__call__ "
            f"(it takes {known}){hint}",
        )
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
    texts = [name for name in p if _is_prompt_text(name)]
    if not profile.has_text_encoder and texts:
        raise InvalidRequest(
            rid,
            texts[0],
            f"needs a text encoder, and this {profile.pipeline} has none: send prompt_embeds (the text encoder's "
            "output) instead",
        )
    if "prompt" in p and "prompt_embeds" in p:
        raise InvalidRequest(rid, "prompt_embeds", "cannot come with prompt: send one of the two")
    if "prompt" not in p and "prompt_embeds" not in p:
        what = "prompt (a str) or prompt_embeds" if profile.has_text_encoder else "prompt_embeds (no text encoder here)"
        raise InvalidRequest(rid, "prompt_embeds", f"is required by {profile.pipeline}: send {what}")
    for name in texts:
        if not isinstance(p[name], str):
            raise InvalidRequest(rid, name, f"must be a str, got {type(p[name]).__name__}")
    for prefix in ("", "negative_"):
        if f"{prefix}prompt_embeds" in p:
            _check_embeds(profile, request, prefix)
    guidance = guidance_of(p)
    guidance = profile.default_guidance if guidance is None else guidance
    cfg = profile.cfg_guidance and not profile.zero_negative and (guidance is None or guidance > 1)
    if cfg and "prompt_embeds" in p and "negative_prompt_embeds" not in p and not profile.has_text_encoder:
        raise InvalidRequest(
            rid,
            "negative_prompt_embeds",
            f"is required with prompt_embeds when guidance_scale > 1 (the default is {profile.default_guidance}): "
            f"this {profile.pipeline} has no text encoder to encode the empty negative prompt; send "
            "negative_prompt_embeds, or guidance_scale <= 1",
        )


def _is_prompt_text(name: str) -> bool:
    """``prompt``, ``prompt_2``, ``negative_prompt_3``...: text for a text encoder."""
    base = name.removeprefix("negative_")
    return base == "prompt" or (base.startswith("prompt_") and base[len("prompt_") :].isdigit())


def _check_embeds(profile: PipelineProfile, request: DiffusionRequest, prefix: str) -> None:
    """``{prefix}prompt_embeds`` and the tensors that go with it in this pipeline: each
    present where the pipeline requires it, each of its shape."""
    rid = request.request_id
    p = request.params
    name = f"{prefix}prompt_embeds"
    embeds = _tensor(rid, name, p[name], 3, f"[seq, {profile.text_dim or 'dim'}]")
    if profile.text_dim is not None and embeds.shape[-1] != profile.text_dim:
        raise InvalidRequest(
            rid,
            name,
            f"must have shape [seq, {profile.text_dim}] or [1, seq, {profile.text_dim}] ({profile.text_field} of "
            f"{profile.pipeline} is {profile.text_dim}), got {list(p[name].shape)}",
        )
    for companion in COMPANIONS:
        other = f"{prefix}{companion}"
        if other not in profile.call_parameters:
            continue
        if other not in p:
            raise InvalidRequest(
                rid, other, f"is required with {name} by {profile.pipeline} (its check_inputs): send it too"
            )
        if companion == "pooled_prompt_embeds":
            pooled = _tensor(rid, other, p[other], 2, f"[{profile.pooled_dim or 'dim'}]")
            if profile.pooled_dim is not None and pooled.shape[-1] != profile.pooled_dim:
                raise InvalidRequest(
                    rid,
                    other,
                    f"must have shape [{profile.pooled_dim}] or [1, {profile.pooled_dim}] (the pooled text "
                    f"dimension of {profile.pipeline}), got {list(p[other].shape)}",
                )
        else:
            mask = p[other]
            if not isinstance(mask, torch.Tensor):
                raise InvalidRequest(rid, other, f"must be a tensor [seq] of 0/1, got {type(mask).__name__}")
            mask = per_request(mask, 2)
            if mask.dim() != 2 or mask.shape[0] != 1 or mask.shape[1] != embeds.shape[1]:
                raise InvalidRequest(
                    rid,
                    other,
                    f"must have shape [{embeds.shape[1]}] or [1, {embeds.shape[1]}] (one entry per token of {name}), "
                    f"got {list(mask.shape)}",
                )
    for companion in COMPANIONS:
        other = f"{prefix}{companion}"
        if other in p and name not in p:
            raise InvalidRequest(rid, other, f"comes with {name}: send {name} too, or neither")


def _tensor(rid: str, name: str, value: object, dims: int, shape: str) -> torch.Tensor:
    """``value`` as one request's float tensor of ``dims`` dimensions (batch dimension 1)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise InvalidRequest(rid, name, f"must be a float tensor {shape}, got {type(value).__name__}")
    found = per_request(value, dims)
    if found.dim() != dims or found.shape[0] != 1 or any(s < 1 for s in found.shape):
        raise InvalidRequest(rid, name, f"must have shape {shape} or [1, ...] (one request), got {list(value.shape)}")
    return found


def per_request(value: torch.Tensor, dims: int) -> torch.Tensor:
    """One request's tensor with its batch dimension of 1 (``[seq, dim]`` as ``[1, seq, dim]``)."""
    return value[None] if value.dim() == dims - 1 else value


def stack_dims(name: str) -> int | None:
    """How many dimensions a per-request tensor parameter has with its batch dimension
    (embeddings 3, pooled embeddings and masks 2); None: not one stacked per member."""
    base = name.removeprefix("negative_")
    if base == "prompt_embeds":
        return 3
    if base in COMPANIONS:
        return 2
    return None


#: Parameters that differ per member of one batched call (the rest must be equal).
_PER_MEMBER = frozenset({"seed", "preview_every", "class_labels"})


def is_per_member(name: str) -> bool:
    return name in _PER_MEMBER or _is_prompt_text(name) or stack_dims(name) is not None


def batch_key(request: DiffusionRequest) -> Hashable | None:
    """Requests with equal keys can share one pipeline call: the same values of every
    shared parameter (size, frames, steps, guidance, output type, any other argument)
    and the same kind of conditioning (which of the class label, prompts and tensors
    they carry, tensors of one shape and dtype).  Their labels, prompts, tensors and
    seeds differ per member.  None for a request it cannot key (an unhashable value)."""
    p: Mapping[str, object] = request.params
    try:
        members: list[Hashable] = []
        shared: list[Hashable] = []
        for name in sorted(p):
            value = p[name]
            if name in ("seed", "preview_every"):
                continue
            if is_per_member(name):
                dims = stack_dims(name)
                if dims is not None and isinstance(value, torch.Tensor):
                    members.append((name, tuple(per_request(value, dims).shape), str(value.dtype)))
                else:
                    members.append((name, type(value).__name__))
            elif isinstance(value, torch.Tensor):
                return None  # a tensor argument shared by a batch: compared by value, never batched
            elif name != "output_type":
                shared.append((name, value))
        key = (tuple(members), tuple(shared), p.get("output_type", "pt"))
        hash(key)
    except TypeError:
        return None
    return key
