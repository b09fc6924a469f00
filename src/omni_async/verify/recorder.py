"""Recording protocol traces in memory, for trace validation (``tracecheck``)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from omni_async.core.trace import FieldValue, TraceEvent

__all__ = ["ListTracer"]


class ListTracer:
    """Records events in memory, in order; safe to call from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[TraceEvent] = []

    def __call__(self, action: str, fields: Mapping[str, FieldValue]) -> None:
        with self._lock:
            self.events.append(TraceEvent(action, dict(fields)))

    def snapshot(self) -> list[TraceEvent]:
        with self._lock:
            return list(self.events)
