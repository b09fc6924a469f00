"""``emit``: the one way the components record a trace event."""

from __future__ import annotations

from omni_async.core.trace import TraceEvent, emit
from omni_async.verify.recorder import ListTracer


def test_emit_records_the_action_and_its_fields_in_order() -> None:
    tracer = ListTracer()
    emit(tracer, "Fire", output_id="o1", event="DROP", src="COMPUTING", dst="DROPPING")
    emit(tracer, "Shutdown")
    # ``tracer`` and ``action`` are positional-only: fields of those names are fields.
    emit(tracer, "Odd", action="a", tracer=None, n=3, ok=False)
    assert tracer.snapshot() == [
        TraceEvent("Fire", {"output_id": "o1", "event": "DROP", "src": "COMPUTING", "dst": "DROPPING"}),
        TraceEvent("Shutdown", {}),
        TraceEvent("Odd", {"action": "a", "tracer": None, "n": 3, "ok": False}),
    ]
    assert list(tracer.snapshot()[0].fields) == ["output_id", "event", "src", "dst"]


def test_emit_without_a_tracer_does_nothing() -> None:
    emit(None, "Fire", output_id="o1")  # tracing off: no call, no error
