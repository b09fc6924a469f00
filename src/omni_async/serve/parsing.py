"""Request bodies to typed requests: every OpenAI field checked, the rest the model's parameters.

``parse_image_body`` and ``parse_video_body`` take the decoded body (JSON, or a multipart
form's fields) and return an ``ImageGeneration`` / ``VideoCreation`` whose ``params`` are
the model's parameters (the reserved ones derived from the OpenAI fields, ``models.RESERVED``).
A field of the wrong type or out of range is a 400 naming it, before anything reaches the
engine; the model's own parameters are checked next by its ``validate_request`` (through
the engine's ``generate``, still in this process).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Final, Literal

import attrs

from omni_async.core.encoding import Format
from omni_async.serve.errors import bad_request
from omni_async.serve.models import RESERVED, ServedModel, check_model_name

__all__ = [
    "MAX_N",
    "MAX_PARTIAL_IMAGES",
    "ImageGeneration",
    "VideoCreation",
    "form_value",
    "parse_image_body",
    "parse_video_body",
]

MAX_N: Final = 10
MAX_PARTIAL_IMAGES: Final = 3
_IMAGE_FORMATS: Final = ("png", "jpeg", "webp")
# OpenAI fields with no meaning for these models: taken and ignored, so that a client
# written for OpenAI's API works unmodified.
_IGNORED: Final = frozenset({"user", "moderation", "quality", "style", "safety_identifier"})
_IMAGE_FIELDS: Final = frozenset(
    {
        "model",
        "prompt",
        "n",
        "size",
        "response_format",
        "output_format",
        "output_compression",
        "seed",
        "stream",
        "partial_images",
        "background",
    }
)
_VIDEO_FIELDS: Final = frozenset({"model", "prompt", "seconds", "size", "seed"})


@attrs.frozen
class ImageGeneration:
    """A checked ``POST /v1/images/generations``: ``params`` per image (its seed among them),
    the encoding, how to answer (``response_format``, ``stream`` with ``partial_images``)."""

    prompt: str
    params: tuple[dict[str, object], ...]
    size: str
    response_format: Literal["b64_json", "url"]
    output_format: str
    quality: int | None
    stream: bool
    partial_images: int

    @property
    def n(self) -> int:
        return len(self.params)


@attrs.frozen
class VideoCreation:
    """A checked ``POST /v1/videos``: the model's ``params`` (frames from ``seconds``)."""

    prompt: str
    seconds: str
    size: str
    params: dict[str, object]


def _int(body: Mapping[str, object], name: str, low: int, high: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(name, f"{name} must be an int in {low}..{high}, got {value!r:.40}")
    return value


def _choice(body: Mapping[str, object], name: str, choices: tuple[str, ...], default: str) -> str:
    value = body.get(name)
    if value is None:
        return default
    if value not in choices:
        hint = " ('jpg' is spelt 'jpeg')" if value == "jpg" else ""
        raise bad_request(name, f"{name} must be one of {list(choices)}, got {value!r:.40}{hint}")
    return str(value)


def _prompt(body: Mapping[str, object]) -> str:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("prompt", f"prompt must be a non-empty string, got {prompt!r:.40}", code="missing_required")
    return prompt


def _model_params(body: Mapping[str, object], known: frozenset[str], model: ServedModel) -> dict[str, object]:
    """The fields that are not OpenAI's: the model's own parameters."""
    params: dict[str, object] = {}
    for name, value in body.items():
        if name in known or name in _IGNORED:
            continue
        if name in RESERVED:
            raise bad_request(name, f"{name!r} is set by the request's {RESERVED[name]!r} field; send that instead")
        params[name] = value
    if model.prompt_param is not None and "prompt" in body:
        params[model.prompt_param] = body["prompt"]
    return params


def quality_of(output_format: str, compression: int | None) -> int | None:
    """OpenAI's ``output_compression`` (0..100, for JPEG and WebP) as the encoder's quality:
    JPEG and WebP at that quality (0 is taken as 1); PNG is lossless and ignores it; WebP
    without it is lossless."""
    if compression is None or output_format == Format.PNG:
        return None
    return max(1, compression)


def parse_image_body(body: object, model: ServedModel) -> ImageGeneration:
    if not isinstance(body, Mapping):
        raise bad_request(None, "the body must be a JSON object")
    check_model_name(model, body.get("model"))
    prompt = _prompt(body)
    n = _int(body, "n", 1, MAX_N, 1)
    assert n is not None
    size = body.get("size")
    sized = model.size_params(size)
    response_format = _choice(body, "response_format", ("b64_json", "url"), "b64_json")
    output_format = _choice(body, "output_format", _IMAGE_FORMATS, "png")
    compression = _int(body, "output_compression", 0, 100, None)
    seed = _int(body, "seed", 0, 2**63 - 1, None)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream", f"stream must be a bool, got {stream!r:.40}")
    partial = _int(body, "partial_images", 0, MAX_PARTIAL_IMAGES, 0)
    assert partial is not None
    if stream and response_format == "url":
        raise bad_request("response_format", "a streamed generation sends its images in its events: use b64_json")
    if stream and n > 1:
        raise bad_request("n", "a streamed generation makes one image: send n=1 with stream=true")
    background = body.get("background")
    if background not in (None, "auto", "opaque"):
        raise bad_request(
            "background", f"background must be 'auto' or 'opaque' (no transparency), got {background!r:.40}"
        )
    extra = _model_params(body, _IMAGE_FIELDS, model)
    base = {**extra, **sized}
    if stream and partial:
        base["preview_every"] = model.preview_every(partial, base)
    first = secrets.randbits(31) if seed is None else seed
    per_image = tuple({**base, "seed": (first + i) % 2**63} for i in range(n))
    return ImageGeneration(
        prompt=prompt,
        params=per_image,
        size=_size_text(sized),
        response_format="url" if response_format == "url" else "b64_json",
        output_format=output_format,
        quality=quality_of(output_format, compression),
        stream=bool(stream),
        partial_images=partial if stream else 0,
    )


def _size_text(sized: Mapping[str, int]) -> str:
    return f"{sized['width']}x{sized['height']}" if sized else "auto"


def form_value(text: str) -> object:
    """A multipart field's value: JSON where it parses (``"3"`` -> 3, ``"true"`` -> True),
    else the string itself (a form carries only strings; the model's parameters are typed)."""
    try:
        value: object = json.loads(text)
    except ValueError:
        return text
    return value


def parse_video_body(body: object, model: ServedModel) -> VideoCreation:
    if not isinstance(body, Mapping):
        raise bad_request(None, "the body must be a JSON object or a multipart form")
    check_model_name(model, body.get("model"))
    prompt = _prompt(body)
    seconds = body.get("seconds", "4")
    frames = model.frames_for(seconds)
    sized = model.size_params(body.get("size"))
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise bad_request("seed", f"seed must be an int in 0..2**63-1, got {seed!r:.40}")
    params: dict[str, object] = {
        **_model_params(body, _VIDEO_FIELDS, model),
        **sized,
        "num_frames": frames,
        "seed": secrets.randbits(31) if seed is None else seed,
    }
    return VideoCreation(prompt=prompt, seconds=str(seconds), size=_size_text(sized), params=params)
