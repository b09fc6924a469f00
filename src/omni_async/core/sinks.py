"""Output sinks: where a request's result goes, and their checks (sans-IO).

A request names its sink (``DiffusionRequest(..., sink=..., sink_ttl_s=...)``):

* ``value`` (the default): the result carries the value itself (the host stage's
  result, an owned copy of the output, or the encoded bytes);
* ``file``: the engine writes the encoded file(s) under a directory it owns and the
  result names them (``OutputFile``); needs a ``format``;
* ``segment``: the result is a lease on the output's shared-memory segment, for a
  consumer on the same host that reads it by name (``SegmentLease``); the output stays
  held in the executor's budget of held outputs until the lease is released or expires.

``sink_ttl_s``: for ``file`` and ``segment``, the seconds after which the engine deletes
the file or releases the segment (None: the engine's ``output_ttl_s``).  This module only
knows the names and checks them; the sinks live in ``omni_async.engine.sinks``.
"""

from __future__ import annotations

import enum
import math
from typing import Final

from omni_async.core.errors import InvalidRequest

__all__ = ["SINKS", "InvalidSink", "Sink", "check_sink", "check_sink_ttl", "sink_needs"]


class Sink(enum.StrEnum):
    """Where a request's result goes (the module docstring says what each means).  A
    ``str``: a request names one by its string (``Sink.FILE == "file"``)."""

    VALUE = "value"
    FILE = "file"
    SEGMENT = "segment"


#: The sinks a request may name.
SINKS: Final[tuple[str, ...]] = tuple(s.value for s in Sink)


class InvalidSink(InvalidRequest):
    """A request's ``sink`` or ``sink_ttl_s`` that no sink takes, or a sink the request
    cannot use as asked (``file`` without a ``format``; ``segment`` with one).  Names the
    request (``request_id``), the parameter (``parameter``), the value (``value``) and
    what it may be (``choices``)."""

    def __init__(self, request_id: str, parameter: str, value: object, choices: str) -> None:
        super().__init__(request_id, parameter, f"is {value!r:.60}; {choices}")
        self.value = value
        self.choices = choices


def check_sink(request_id: str, sink: object) -> Sink:
    """The ``Sink`` a request named, or ``InvalidSink`` naming the request, the value and the choices."""
    if not isinstance(sink, str) or sink not in SINKS:
        raise InvalidSink(request_id, "sink", sink, f"the sinks are {list(SINKS)}")
    return Sink(sink)


def check_sink_ttl(request_id: str, sink: Sink, ttl_s: object) -> float | None:
    """``sink_ttl_s`` as a float (None: the engine's default), or ``InvalidSink``: a finite
    number of seconds > 0, and only for a sink that keeps something (``file``, ``segment``)."""
    if ttl_s is None:
        return None
    if sink is Sink.VALUE:
        raise InvalidSink(
            request_id, "sink_ttl_s", ttl_s, "a ttl needs sink='file' or sink='segment' (the value sink keeps nothing)"
        )
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise InvalidSink(request_id, "sink_ttl_s", ttl_s, "it is a finite number of seconds > 0, or None")
    return float(ttl_s)


def sink_needs(request_id: str, sink: Sink, format: str | None) -> None:
    """What a sink needs of the rest of the request (checked when the engine takes it, so
    that a later default format could lift it): ``file`` writes encoded files, so it needs
    a ``format``; ``segment`` lends the raw output, so it takes none."""
    if sink is Sink.FILE and format is None:
        raise InvalidSink(
            request_id,
            "sink",
            sink.value,
            "sink='file' writes the encoded file: add format=... (png, jpeg, webp or mp4)",
        )
    if sink is Sink.SEGMENT and format is not None:
        raise InvalidSink(
            request_id,
            "sink",
            sink.value,
            f"sink='segment' lends the raw output in shared memory, not an encoded file: drop format={format!r}, "
            "or use sink='file' or sink='value' for the encoded bytes",
        )
