"""Traces recorded by integration tests, for the trace validation run (test_trace_validation).

Tests that record a trace append it here; pytest runs test_trace_validation.py after
them (file order), which checks every collected trace with TLC.
"""

from __future__ import annotations

from omni_async.core.trace import TraceEvent
from omni_async.verify.recorder import ListTracer

COLLECTED: dict[str, list[list[TraceEvent]]] = {}
MAX_PER_SOURCE = 500


def keep(source: str, tracer: ListTracer) -> None:
    traces = COLLECTED.setdefault(source, [])
    events = tracer.snapshot()
    if events and len(traces) < MAX_PER_SOURCE:
        traces.append(events)
