"""Trace validation: TLC confirms that recorded traces are behaviours of the spec.

The implementation records protocol actions through ``omni_async.core.trace`` (a
``ListTracer`` per run).  ``check_traces`` turns any number of such traces into
one TLA+ module, ``TraceData``: the events of every trace one after the other,
each trace closed by an ``End`` event, as a sequence literal (this TLC has no
JSON module).  ``tla/TraceAsyncOutput.tla`` replays that log one event per step
from a fresh state per trace; every request-state change must be an entry of the
generated ``RequestTable`` and every event must be justified by the protocol (see
the spec).  One JVM start checks them all.

Output ids and RPC ids are renumbered per trace (1, 2, ...) in order of first
appearance, so TLC's state stays small and traces cannot interfere.

When an event is not a step of the spec, TLC reports a deadlock; the last state
of its error trace says how many events were consumed, and the result names the
trace, the event and its fields.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs

from omni_async.core.trace import FieldValue, TraceEvent
from omni_async.verify.locate import tla_dir
from omni_async.verify.tlc import TlcResult, Toolchain, run_tlc

__all__ = [
    "ACTIONS",
    "EncodedTraces",
    "TraceCheckResult",
    "TraceFailure",
    "TraceFormatError",
    "check_traces",
    "encode_traces",
]

TRACE_SPEC = "TraceAsyncOutput.tla"
END = "End"

# The actions the trace spec knows, with the fields each must carry.
ACTIONS: Mapping[str, frozenset[str]] = {
    "PumpRecv": frozenset({"kind", "rank", "rpc_id", "ids", "output_id", "ok"}),
    "Create": frozenset({"output_id"}),
    "Fire": frozenset({"output_id", "event", "src", "dst"}),
    "Remove": frozenset({"output_id", "state"}),
    "WaiterAdd": frozenset({"output_id"}),
    "WaiterResolve": frozenset({"output_id", "outcome"}),
    "PayloadDeliver": frozenset({"output_id"}),
    "PayloadRelease": frozenset({"output_id"}),
    "ProtocolError": frozenset({"output_id"}),
    "RpcSubmit": frozenset({"rpc_id", "ranks", "reply_rank"}),
    "RpcAnswer": frozenset({"rpc_id", "rank", "ok"}),
    "RpcResolve": frozenset({"rpc_id", "outcome"}),
    "Shutdown": frozenset(),
    "Late": frozenset({"output_id", "kind", "expected"}),
    "FailAll": frozenset({"outcome", "close"}),
    "Drop": frozenset({"output_id"}),
    "Cancel": frozenset({"output_id"}),
    "ReleaseConsumer": frozenset({"consumer"}),
    "Expire": frozenset({"count"}),
    "DispatchDrop": frozenset({"output_id", "rpc_id", "reason"}),
    "WorkerFire": frozenset({"output_id", "event", "src", "dst"}),
}


class TraceFormatError(ValueError):
    """A trace event the checker cannot encode (unknown action, missing or ill-typed field)."""


@attrs.frozen
class TraceFailure:
    """Where a replay stopped: the first event that is not a step of the spec."""

    trace: int  # index into the traces given to check_traces; -1: TLC itself failed
    event: int | None  # index in that trace; None: the end-of-trace check failed
    action: str
    fields: Mapping[str, FieldValue]
    detail: str

    def __str__(self) -> str:
        if self.trace < 0:
            return f"TLC failed before refusing any event ({self.detail})"
        where = f"event {self.event}" if self.event is not None else "its end"
        return f"trace {self.trace}, {where}: {self.action} {dict(self.fields)} is not a step of the spec ({self.detail})"


@attrs.frozen
class TraceCheckResult:
    ok: bool
    traces: int
    events: int
    seconds: float
    distinct_states: int | None
    failure: TraceFailure | None = None
    tlc: TlcResult | None = None

    def summary(self) -> str:
        verdict = "all behaviours of the spec" if self.ok else str(self.failure)
        return f"{self.traces} traces, {self.events} events, {self.seconds:.1f}s: {verdict}"


@attrs.frozen
class EncodedTraces:
    module: str  # the text of TraceData.tla
    # For each position of TraceLog (0-based): (trace index, event index or None for End).
    positions: tuple[tuple[int, int | None], ...]


# ----------------------------------------------------------------------------- encoding


def _s(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _set(values: Iterable[int]) -> str:
    return "{" + ", ".join(str(v) for v in sorted(set(values))) + "}"


class _Numbering:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.rpcs: dict[str, int] = {}

    def oid(self, value: FieldValue) -> int:
        if value is None:
            return 0
        return self.ids.setdefault(str(value), len(self.ids) + 1)

    def rpc(self, value: FieldValue) -> int:
        if value is None:
            return 0
        return self.rpcs.setdefault(str(value), len(self.rpcs) + 1)


def _str(ev: TraceEvent, name: str) -> str:
    value = ev.fields.get(name)
    if not isinstance(value, str):
        raise TraceFormatError(f"{ev.action}: field {name!r} must be a string, got {value!r}")
    return value


def _int(ev: TraceEvent, name: str, default: int) -> int:
    value = ev.fields.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{ev.action}: field {name!r} must be an int, got {value!r}")
    return value


def _bool(ev: TraceEvent, name: str) -> bool:
    value = ev.fields.get(name)
    if not isinstance(value, bool):
        raise TraceFormatError(f"{ev.action}: field {name!r} must be a bool, got {value!r}")
    return value


def _consumer(value: FieldValue) -> str:
    # None (no consumer) and every named consumer stay distinct, "" included.
    return "" if value is None else "=" + str(value)


def _csv(value: FieldValue) -> list[str]:
    if value is None or value == "":
        return []
    return [v for v in str(value).split(",") if v]


def _encode_event(ev: TraceEvent, num: _Numbering) -> tuple[str, int]:
    """One event as a TLA+ record, and the largest rank it mentions."""
    need = ACTIONS.get(ev.action)
    if need is None:
        raise TraceFormatError(f"unknown trace action {ev.action!r}")
    missing = need - ev.fields.keys()
    if missing:
        raise TraceFormatError(f"{ev.action} lacks field(s) {sorted(missing)}: {dict(ev.fields)}")
    f = ev.fields
    o = num.oid(f.get("output_id"))
    e = s = d = x = ""
    k = n = 0
    r = _int(ev, "rank", -1)
    ok = bool(f.get("ok", False))
    ids: list[int] = []
    ranks: list[int] = []
    match ev.action:
        case "PumpRecv":
            x = _str(ev, "kind")
            k = num.rpc(f.get("rpc_id"))
            ids = [num.oid(v) for v in _csv(f.get("ids"))]
        case "Fire" | "WorkerFire":
            e, s, d = _str(ev, "event"), _str(ev, "src"), _str(ev, "dst")
        case "Remove":
            d = _str(ev, "state")
        case "WaiterResolve":
            x = _str(ev, "outcome")
        case "RpcSubmit":
            k = num.rpc(f.get("rpc_id"))
            r = _int(ev, "reply_rank", -1)
            x = _consumer(f.get("consumer"))
            try:
                ranks = [int(v) for v in _csv(f.get("ranks"))]
            except ValueError:
                raise TraceFormatError(f"RpcSubmit: ranks must be comma-separated ints: {f.get('ranks')!r}") from None
        case "RpcAnswer":
            k = num.rpc(f.get("rpc_id"))
        case "RpcResolve":
            k = num.rpc(f.get("rpc_id"))
            x = _str(ev, "outcome")
        case "Late":
            x = _str(ev, "kind")
            if x not in ("cd", "out"):
                raise TraceFormatError(f"Late: kind must be 'cd' or 'out', got {x!r}")
            ok = _bool(ev, "expected")
        case "FailAll":
            x = _str(ev, "outcome")
            ok = _bool(ev, "close")
        case "ReleaseConsumer":
            x = _consumer(f.get("consumer"))
        case "Expire":
            n = _int(ev, "count", 0)
        case "DispatchDrop":
            k = num.rpc(f.get("rpc_id"))
            x = _str(ev, "reason")
        case _:
            pass
    top = max([r, *ranks, 0])
    rec = (
        f"[a |-> {_s(ev.action)}, o |-> {o}, e |-> {_s(e)}, s |-> {_s(s)}, d |-> {_s(d)}, x |-> {_s(x)}, "
        f"k |-> {k}, n |-> {n}, r |-> {r}, ok |-> {'TRUE' if ok else 'FALSE'}, ids |-> {_set(ids)}, rk |-> {_set(ranks)}]"
    )
    return rec, top


_END_RECORD = (
    f'[a |-> "{END}", o |-> 0, e |-> "", s |-> "", d |-> "", x |-> "", '
    "k |-> 0, n |-> 0, r |-> -1, ok |-> FALSE, ids |-> {}, rk |-> {}]"
)


def encode_traces(traces: Sequence[Sequence[TraceEvent]]) -> EncodedTraces:
    """The TraceData module for ``traces`` (see tla/TraceAsyncOutput.tla for its shape)."""
    records: list[str] = []
    positions: list[tuple[int, int | None]] = []
    num_ids = num_rpcs = 1
    max_rank = 0
    for t, trace in enumerate(traces):
        num = _Numbering()
        for n, ev in enumerate(trace):
            rec, top = _encode_event(ev, num)
            records.append(rec)
            positions.append((t, n))
            max_rank = max(max_rank, top)
        records.append(_END_RECORD)
        positions.append((t, None))
        num_ids = max(num_ids, len(num.ids))
        num_rpcs = max(num_rpcs, len(num.rpcs))
    body = ",\n    ".join(records)
    module = (
        "------------------------------ MODULE TraceData ------------------------------\n"
        "(* Written by omni_async.verify.tracecheck: recorded traces, one after the other. *)\n"
        "EXTENDS Integers\n"
        f"NumIds == {num_ids}\n"
        f"NumRpcs == {num_rpcs}\n"
        f"MaxRank == {max_rank}\n"
        f"TraceLog == <<\n    {body}\n  >>\n"
        "=============================================================================\n"
    )
    return EncodedTraces(module, tuple(positions))


# ----------------------------------------------------------------------------- checking

_CFG = """\\* Written by omni_async.tracecheck.  Deadlock checking stays on: a refused event is a deadlock.
SPECIFICATION Spec
INVARIANT TypeOK
"""


def _failure(res: TlcResult, traces: Sequence[Sequence[TraceEvent]], enc: EncodedTraces) -> TraceFailure:
    consumed: int | None = None
    if res.trace:
        raw = res.trace[-1].variables.get("i")
        if raw is not None and raw.strip().isdigit():
            consumed = int(raw.strip())
    detail = "; ".join(res.errors) or f"TLC exited with {res.returncode}"
    if consumed is None or consumed >= len(enc.positions):
        return TraceFailure(-1, None, "?", {}, detail)
    t, n = enc.positions[consumed]
    if n is None:
        return TraceFailure(t, None, END, {}, detail + "; the end-of-trace check failed")
    ev = traces[t][n]
    return TraceFailure(t, n, ev.action, dict(ev.fields), detail)


def check_traces(
    traces: Sequence[Sequence[TraceEvent]],
    *,
    toolchain: Toolchain | None = None,
    keep_dir: Path | None = None,
    timeout: float = 600.0,
) -> TraceCheckResult:
    """Have TLC replay every trace against tla/TraceAsyncOutput.tla in one run.

    ``keep_dir``: write the generated modules there (for a look at a failure)
    instead of a temporary directory.
    """
    enc = encode_traces(traces)
    events = sum(len(t) for t in traces)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="omni-tracecheck-") as tmp:
        work = keep_dir if keep_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in (TRACE_SPEC, "RequestTable.tla"):
            shutil.copyfile(tla_dir() / name, work / name)
        (work / "TraceData.tla").write_text(enc.module, encoding="utf-8")
        cfg = work / "TraceAsyncOutput.cfg"
        cfg.write_text(_CFG, encoding="utf-8")
        res = run_tlc(work / TRACE_SPEC, cfg, workers=1, deadlock=True, timeout=timeout, toolchain=toolchain)
    seconds = time.monotonic() - t0
    if res.ok:
        return TraceCheckResult(True, len(traces), events, seconds, res.distinct_states, None, res)
    return TraceCheckResult(False, len(traces), events, seconds, res.distinct_states, _failure(res, traces, enc), res)
