"""The engine's machine observers that record trace events (trace validation of engine runs).

An engine built with ``tracer: Tracer | None`` passes these observers to its machines
(``engine_machine(name, observer=...)``, ``stage_machine(request_id, observer=...)``): each
transition is recorded, on the thread that fires it (the engine's event loop), as

* ``EngineFire``: event, src, dst (names of ``EngineEvent`` / ``EngineState`` members);
* ``StageFire``: request, event, src, dst (the request id; ``StageEvent`` / ``StageState``).

``omni_async.verify.enginetrace.check_engine_traces`` checks such traces against
``tla/EngineLifecycle.tla``.  With ``tracer=None`` there is no observer at all (no cost).
"""

from __future__ import annotations

from omni_async.core.engine_states import (
    EngineEvent,
    EngineObserver,
    EngineState,
    StageEvent,
    StageObserver,
    StageState,
)
from omni_async.core.trace import Tracer

__all__ = ["trace_observers"]


def trace_observers(tracer: Tracer | None) -> tuple[EngineObserver | None, StageObserver | None]:
    """(engine observer, stage observer) recording into ``tracer``; (None, None) when it is None."""
    if tracer is None:
        return None, None
    rec = tracer

    def engine(_key: str, event: EngineEvent, src: EngineState, dst: EngineState) -> None:
        rec("EngineFire", {"event": event.name, "src": src.name, "dst": dst.name})

    def stage(key: str, event: StageEvent, src: StageState, dst: StageState) -> None:
        rec("StageFire", {"request": key, "event": event.name, "src": src.name, "dst": dst.name})

    return engine, stage
