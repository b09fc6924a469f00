"""Encoded outputs: the formats a request may ask for, and their checks (sans-IO).

A request that names a ``format`` (``DiffusionRequest(..., format="png", quality=...)``)
gets its pixels as encoded bytes instead of the pipeline's host stage's result: PNG,
JPEG and WebP for images, MP4 (H.264) for frames.  This module only knows the names,
their media types and what ``quality`` means for each; the encoders live where they
run (``omni_async.worker.encode``: JPEG on the GPU; ``omni_async.engine.encoders``:
the host's, in a process pool).

``quality`` per format (None: the format's default):

* ``jpeg``: 1..100 (default 90);
* ``webp``: None is lossless; 1..100 is lossy at that quality;
* ``png``: always lossless; ``quality`` is the zlib compression level 0..9 (default 6,
  Pillow's; 1 is several times faster for files a little larger);
* ``mp4``: 1..100, mapped to H.264's constant rate factor (``crf = round(51 * (100 -
  quality) / 100)``; default crf 23, libx264's own).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final, assert_never

import attrs

from omni_async.core.errors import InvalidRequest

__all__ = [
    "FORMATS",
    "MEDIA_TYPES",
    "SPECS",
    "Encoding",
    "Format",
    "FormatSpec",
    "InvalidEncoding",
    "check_encoding",
    "format_spec",
]


class Format(enum.StrEnum):
    """The formats a request may ask for.  A ``str`` (``Format.PNG == "png"``), so a
    request names one by its string.  Every place that acts on a format matches it with
    ``typing.assert_never`` in its last case: a member added here that a dispatch misses
    is a ``mypy --strict`` error, and an ``AssertionError`` at run time, never an empty file."""

    PNG = "png"
    JPEG = "jpeg"
    WEBP = "webp"
    MP4 = "mp4"


@attrs.frozen
class FormatSpec:
    """What a format is: its ``media_type``, what ``quality`` may be (``quality_min`` ..
    ``quality_max``, inclusive) and means, and whether it encodes a sequence of frames
    as one file (``video``)."""

    media_type: str
    quality_min: int
    quality_max: int
    quality_meaning: str
    video: bool = False


def format_spec(fmt: Format) -> FormatSpec:
    """The one table of formats (``SPECS`` is this function over ``Format``)."""
    match fmt:
        case Format.PNG:
            return FormatSpec("image/png", 0, 9, "the zlib compression level (PNG is lossless; default 6)")
        case Format.JPEG:
            return FormatSpec("image/jpeg", 1, 100, "the JPEG quality (default 90)")
        case Format.WEBP:
            return FormatSpec("image/webp", 1, 100, "the lossy WebP quality (None: lossless)")
        case Format.MP4:
            return FormatSpec(
                "video/mp4", 1, 100, "the video quality, mapped to H.264's crf (default crf 23)", video=True
            )
        case _:
            assert_never(fmt)


SPECS: Final[Mapping[Format, FormatSpec]] = {fmt: format_spec(fmt) for fmt in Format}
#: The formats a request may ask for, and the media type of what each gives.
MEDIA_TYPES: Final[Mapping[str, str]] = {fmt.value: spec.media_type for fmt, spec in SPECS.items()}
FORMATS: Final[tuple[str, ...]] = tuple(fmt.value for fmt in Format)
DEFAULT_JPEG_QUALITY: Final = 90
DEFAULT_PNG_LEVEL: Final = 6
DEFAULT_MP4_CRF: Final = 23


def _as_format(value: Format | str) -> Format:
    return Format(value)


class InvalidEncoding(InvalidRequest):
    """A request's ``format`` or ``quality`` that no encoder takes; raised when the request
    is built, before it reaches an engine.  Names the request (``request_id``), the
    parameter (``parameter``: ``"format"`` or ``"quality"``), the value (``value``) and
    what it may be (``choices``)."""

    def __init__(self, request_id: str, parameter: str, value: object, choices: str) -> None:
        super().__init__(request_id, parameter, f"is {value!r:.60}; {choices}")
        self.value = value
        self.choices = choices


@attrs.frozen
class Encoding:
    """What a request asked for: a ``Format`` (its string is taken too) and its ``quality``
    (None: the format's default).  Built by ``check_encoding``, which checks both."""

    format: Format = attrs.field(converter=_as_format)
    quality: int | None = None

    @property
    def spec(self) -> FormatSpec:
        return SPECS[self.format]

    @property
    def media_type(self) -> str:
        return self.spec.media_type

    @property
    def is_video(self) -> bool:
        return self.spec.video

    def jpeg_quality(self) -> int:
        return DEFAULT_JPEG_QUALITY if self.quality is None else self.quality

    def png_level(self) -> int:
        return DEFAULT_PNG_LEVEL if self.quality is None else self.quality

    def mp4_crf(self) -> int:
        return DEFAULT_MP4_CRF if self.quality is None else round(51 * (100 - self.quality) / 100)


def check_encoding(request_id: str, format: object, quality: object) -> Encoding | None:
    """The ``Encoding`` of a request's ``format`` and ``quality`` (None: no format asked
    for); ``InvalidEncoding`` naming the request, the value and the choices otherwise."""
    if format is None:
        if quality is not None:
            raise InvalidEncoding(
                request_id, "quality", quality, f"quality needs a format: pass format= one of {list(FORMATS)} too"
            )
        return None
    if not isinstance(format, str) or format not in MEDIA_TYPES:
        hint = " ('jpg' is spelt 'jpeg')" if format == "jpg" else ""
        raise InvalidEncoding(request_id, "format", format, f"the formats are {list(FORMATS)}{hint}")
    fmt = Format(format)
    if quality is not None:
        spec = SPECS[fmt]
        lo, hi, meaning = spec.quality_min, spec.quality_max, spec.quality_meaning
        if isinstance(quality, bool) or not isinstance(quality, int) or not lo <= quality <= hi:
            raise InvalidEncoding(
                request_id, "quality", quality, f"for {format} it is an int {lo}..{hi}, {meaning}, or None"
            )
    return Encoding(fmt, quality)
