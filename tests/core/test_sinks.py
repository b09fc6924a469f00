"""A request's sink and its ttl, checked when the request is made (``omni_async.core.sinks``):
``InvalidSink`` (a ``MessageValidationError``) naming the request, the parameter, the
value and the choices."""

from __future__ import annotations

import math

import pytest

from omni_async.core.errors import MessageValidationError
from omni_async.core.messages import DiffusionRequest
from omni_async.core.sinks import SINKS, InvalidSink, Sink, sink_needs


@pytest.mark.parametrize("sink", ["files", "", "FILE", None, 1, b"file"])
def test_a_sink_no_engine_has_is_refused_naming_the_choices(sink: object) -> None:
    with pytest.raises(InvalidSink) as err:
        DiffusionRequest("r1", sink=sink)  # type: ignore[arg-type]  # wrong on purpose
    e = err.value
    assert isinstance(e, MessageValidationError)
    assert (e.request_id, e.parameter, e.value) == ("r1", "sink", sink)
    assert "request 'r1'" in str(e) and "['value', 'file', 'segment']" in str(e)


@pytest.mark.parametrize("ttl", [0, -1.0, math.nan, math.inf, True, "60"])
def test_a_ttl_is_a_finite_positive_number_of_seconds(ttl: object) -> None:
    with pytest.raises(InvalidSink) as err:
        DiffusionRequest("r2", sink="file", format="png", sink_ttl_s=ttl)  # type: ignore[arg-type]
    assert err.value.parameter == "sink_ttl_s" and "finite number of seconds > 0" in str(err.value)


def test_a_ttl_needs_a_sink_that_keeps_something() -> None:
    with pytest.raises(InvalidSink, match="a ttl needs sink='file' or sink='segment'"):
        DiffusionRequest("r3", sink_ttl_s=5.0)


def test_the_sinks_are_strings() -> None:
    assert SINKS == ("value", "file", "segment") and str(Sink.FILE) == "file" and Sink("file") is Sink.FILE
    req = DiffusionRequest("r4", sink="segment", sink_ttl_s=2)
    assert req.sink_kind is Sink.SEGMENT and req.sink_ttl_s == 2
    assert DiffusionRequest("r5").sink_kind is Sink.VALUE


def test_what_a_sink_needs_of_the_request() -> None:
    with pytest.raises(InvalidSink, match="add format="):
        sink_needs("r6", Sink.FILE, None)
    with pytest.raises(InvalidSink, match="drop format='mp4'"):
        sink_needs("r7", Sink.SEGMENT, "mp4")
    sink_needs("r8", Sink.FILE, "png")
    sink_needs("r9", Sink.SEGMENT, None)
