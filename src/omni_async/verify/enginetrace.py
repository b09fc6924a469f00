"""Trace validation of engine runs: TLC confirms that recorded engine traces are behaviours of the spec.

An engine built with a tracer records, on its event-loop thread and in order, one event
per machine transition (``omni_async.core.engine_trace.trace_observers`` gives the
observers that do it):

* ``EngineFire``: event, src, dst (names of ``EngineEvent`` / ``EngineState`` members);
* ``StageFire``: request, event, src, dst (the request id; ``StageEvent`` / ``StageState``).

``check_engine_traces(traces)`` turns any number of such traces into one TLA+ module,
``TraceEngineData`` (the events one after the other, each trace closed by an ``End``
event), and has TLC replay them against ``tla/TraceEngine.tla`` in one JVM run: every
event must be the machine step of an action of ``tla/EngineLifecycle.tla`` (the
model-checked spec itself, with its unrecorded steps searched for), which implies an
entry of the generated tables.  Request ids are renumbered per trace ("1", "2", ...) in
order of first appearance, so that traces cannot interfere and TLC's state stays small.

When a trace is refused, the result names the trace, the event and its fields, and says
whether the table itself refuses it (an illegal transition, or a source state that is
not the machine's) or only the model does (a legal transition that no behaviour of
EngineLifecycle takes there, e.g. ADMIT while the engine is CLOSING).

The search is exhaustive over the model's unrecorded steps: keep traces short (a few
requests each); many traces cost little, one TLC run checks them all.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from omni_async.core.engine_states import (
    ENGINE_INITIAL,
    ENGINE_TABLE,
    STAGE_INITIAL,
    STAGE_TABLE,
    EngineEvent,
    EngineState,
    StageEvent,
    StageState,
)
from omni_async.core.trace import TraceEvent
from omni_async.verify.locate import tla_dir
from omni_async.verify.tlc import QUICK_JAVA_OPTS, TlcResult, Toolchain, run_tlc
from omni_async.verify.tracecheck import TraceCheckResult, TraceFailure

__all__ = [
    "ENGINE_ACTIONS",
    "EncodedEngineTraces",
    "EngineTraceFailure",
    "EngineTraceResult",
    "check_engine_traces",
    "encode_engine_traces",
]

TRACE_SPEC = "TraceEngine.tla"
END = "End"
_MODULES = (TRACE_SPEC, "EngineLifecycle.tla", "EngineTable.tla")

# The actions the engine records, with the fields each must carry.
ENGINE_ACTIONS: Mapping[str, frozenset[str]] = {
    "EngineFire": frozenset({"event", "src", "dst"}),
    "StageFire": frozenset({"request", "event", "src", "dst"}),
}


class EngineTraceFormatError(ValueError):
    """A trace event the checker cannot encode (unknown action, missing or ill-typed field)."""


# A replay's verdict and where it stopped: the same classes as the executor's trace
# check (``omni_async.verify.tracecheck``), under the names this module exports.
EngineTraceFailure = TraceFailure
EngineTraceResult = TraceCheckResult


@attrs.frozen
class EncodedEngineTraces:
    module: str  # the text of TraceEngineData.tla
    # For each position of TraceLog (0-based): (trace index, event index or None for End).
    positions: tuple[tuple[int, int | None], ...]


# ----------------------------------------------------------------------------- encoding


def _s(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _name(ev: TraceEvent, field: str, allowed: type[EngineState | EngineEvent | StageState | StageEvent]) -> str:
    value = ev.fields.get(field)
    if not isinstance(value, str) or value not in allowed.__members__:
        raise EngineTraceFormatError(
            f"{ev.action}: field {field!r} must name a {allowed.__name__} member, got {value!r}"
        )
    return value


def _record(ev: TraceEvent, req: str) -> str:
    need = ENGINE_ACTIONS.get(ev.action)
    if need is None:
        raise EngineTraceFormatError(f"unknown engine trace action {ev.action!r}")
    missing = need - ev.fields.keys()
    if missing:
        raise EngineTraceFormatError(f"{ev.action} lacks field(s) {sorted(missing)}: {dict(ev.fields)}")
    if ev.action == "EngineFire":
        e, s, d = _name(ev, "event", EngineEvent), _name(ev, "src", EngineState), _name(ev, "dst", EngineState)
    else:
        e, s, d = _name(ev, "event", StageEvent), _name(ev, "src", StageState), _name(ev, "dst", StageState)
    return f"[a |-> {_s(ev.action)}, r |-> {_s(req)}, e |-> {_s(e)}, s |-> {_s(s)}, d |-> {_s(d)}]"


def _request(ev: TraceEvent) -> str:
    value = ev.fields.get("request")
    if value is None or isinstance(value, bool):
        raise EngineTraceFormatError(f"StageFire: field 'request' must be a request id, got {value!r}")
    return str(value)


_END_RECORD = f'[a |-> "{END}", r |-> "-", e |-> "", s |-> "", d |-> ""]'


def encode_engine_traces(traces: Sequence[Sequence[TraceEvent]]) -> EncodedEngineTraces:
    """The TraceEngineData module for ``traces`` (see tla/TraceEngine.tla for its shape)."""
    records: list[str] = []
    positions: list[tuple[int, int | None]] = []
    num_reqs: list[int] = []
    streams: list[set[int]] = []
    closes: list[int] = []
    for t, trace in enumerate(traces):
        ids: dict[str, int] = {}
        streamed: set[int] = set()
        n_close = 0
        for n, ev in enumerate(trace):
            req = "-"
            if ev.action == "StageFire":
                num = ids.setdefault(_request(ev), len(ids) + 1)
                req = str(num)
                if ev.fields.get("event") == StageEvent.STREAM_RESULT.name:
                    streamed.add(num)
            elif ev.action == "EngineFire" and ev.fields.get("event") == EngineEvent.CLOSE.name:
                n_close += 1
            records.append(_record(ev, req))
            positions.append((t, n))
        records.append(_END_RECORD)
        positions.append((t, None))
        num_reqs.append(len(ids))
        streams.append(streamed)
        closes.append(n_close)
    if not traces:  # keep the replay's definitions total: one empty trace's constants
        num_reqs, streams, closes = [0], [set()], [0]
    body = ",\n    ".join(records)
    module = (
        "---------------------------- MODULE TraceEngineData ----------------------------\n"
        "(* Written by omni_async.verify.enginetrace: recorded engine traces, one after the other. *)\n"
        f"NumTraces == {max(len(traces), 1)}\n"
        f"TNumReqs == <<{', '.join(str(n) for n in num_reqs)}>>\n"
        f"TStreams == <<{', '.join('{' + ', '.join(str(i) for i in sorted(s)) + '}' for s in streams)}>>\n"
        f"TCloses == <<{', '.join(str(n) for n in closes)}>>\n"
        f"TraceLog == <<\n    {body}\n  >>\n"
        "=============================================================================\n"
    )
    return EncodedEngineTraces(module, tuple(positions))


# ----------------------------------------------------------------------------- checking

_CFG = """\\* Written by omni_async.verify.enginetrace.  Unfinished violated: every trace was consumed.
SPECIFICATION Spec
INVARIANT Unfinished
"""


def _table_verdict(trace: Sequence[TraceEvent], upto: int) -> str:
    """Why the event at ``upto`` is refused, as far as the tables alone can tell."""
    eng: EngineState = ENGINE_INITIAL
    stages: dict[str, StageState] = {}
    for n, ev in enumerate(trace[: upto + 1]):
        f = ev.fields
        try:
            if ev.action == "EngineFire":
                e, s, d = EngineEvent[str(f["event"])], EngineState[str(f["src"])], EngineState[str(f["dst"])]
                cur: EngineState | StageState = eng
                legal = ENGINE_TABLE.get((s, e))
            else:
                req = str(f["request"])
                se, ss, sd = StageEvent[str(f["event"])], StageState[str(f["src"])], StageState[str(f["dst"])]
                cur = stages.get(req, STAGE_INITIAL)
                legal_stage = STAGE_TABLE.get((ss, se))
        except KeyError:
            return "a field names no member of the machine's enums"
        if ev.action == "EngineFire":
            if n == upto:
                if cur != s:
                    return f"the engine is {cur.name}, not {s.name}"
                if legal != d:
                    return f"({s.name}, {e.name}) -> {d.name} is not in ENGINE_TABLE"
                return "a legal transition that no behaviour of EngineLifecycle takes here"
            eng = d
        else:
            if n == upto:
                if cur != ss:
                    return f"request {req} is {cur.name}, not {ss.name}"
                if legal_stage != sd:
                    return f"({ss.name}, {se.name}) -> {sd.name} is not in STAGE_TABLE"
                return "a legal transition that no behaviour of EngineLifecycle takes here"
            stages[req] = sd
    return "?"


def _failure(res: TlcResult, traces: Sequence[Sequence[TraceEvent]], enc: EncodedEngineTraces) -> EngineTraceFailure:
    if not res.completed:
        return EngineTraceFailure(-1, None, "?", {}, "; ".join(res.errors) or f"TLC exited with {res.returncode}")
    consumed = 0
    for line in res.output.splitlines():
        if "TraceEngine reached" in line:
            digits = "".join(ch for ch in line.rsplit(",", 1)[-1] if ch.isdigit())
            if digits:
                consumed = max(consumed, int(digits))
    if consumed >= len(enc.positions):
        return EngineTraceFailure(-1, None, "?", {}, "TLC consumed every event yet reported no success")
    t, n = enc.positions[consumed]
    if n is None:
        return EngineTraceFailure(t, None, END, {}, "the end of the trace")
    ev = traces[t][n]
    return EngineTraceFailure(t, n, ev.action, dict(ev.fields), _table_verdict(traces[t], n))


def check_engine_traces(
    traces: Sequence[Sequence[TraceEvent]],
    *,
    toolchain: Toolchain | None = None,
    keep_dir: Path | None = None,
    timeout: float = 600.0,
) -> EngineTraceResult:
    """Have TLC replay every engine trace against tla/TraceEngine.tla in one run.

    ``traces``: each a sequence of ``TraceEvent`` (``ListTracer().events`` of one engine
    run).  ``keep_dir``: write the generated modules there instead of a temporary
    directory (for a look at a failure).  Raises ``EngineTraceFormatError`` for an event
    it cannot encode, ``TlcUnavailable`` without Java or tla2tools.jar.
    """
    enc = encode_engine_traces(traces)
    events = sum(len(t) for t in traces)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="omni-enginetrace-") as tmp:
        work = keep_dir if keep_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in _MODULES:
            shutil.copyfile(tla_dir() / name, work / name)
        (work / "TraceEngineData.tla").write_text(enc.module, encoding="utf-8")
        cfg = work / "TraceEngine.cfg"
        cfg.write_text(_CFG, encoding="utf-8")
        res = run_tlc(
            work / TRACE_SPEC, cfg, workers=1, deadlock=False, timeout=timeout, toolchain=toolchain,
            java_opts=QUICK_JAVA_OPTS,
        )  # fmt: skip
    seconds = time.monotonic() - t0
    if res.violated_invariant == "Unfinished":
        return EngineTraceResult(True, len(traces), events, seconds, res.distinct_states, None, res)
    return EngineTraceResult(False, len(traces), events, seconds, res.distinct_states, _failure(res, traces, enc), res)
