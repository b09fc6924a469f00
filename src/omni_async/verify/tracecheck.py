"""Trace validation: TLC confirms that recorded traces are behaviours of the spec.

The implementation records protocol actions through ``omni_async.core.trace`` (a
``ListTracer`` per run).  ``check_traces`` turns any number of such traces into
one TLA+ module, ``TraceData``: the events of every trace one after the other,
each trace closed by an ``End`` event, as a sequence literal (this TLC has no
JSON module).  ``tla/TraceAsyncOutput.tla`` replays that log one event per step
from a fresh state per trace, against the model-checked ``tla/AsyncOutput.tla``
itself (an ``INSTANCE`` per trace): every registry or dispatcher call recorded
(a message handled, a wait, a drop, an expiry, ...) must be the matching step of
AsyncOutput from the current state, and the events inside it must say what that
step did (every request-state change an entry of the generated ``RequestTable``,
every event justified; see the spec).  One JVM start checks them all.

Output ids are renumbered per trace (1, 2, ...) in order of first appearance;
RPCs too, the submitted calls first, in submit order (AsyncOutput's engine
submits call ``submitted + 1``), so TLC's state stays small and traces cannot
interfere.  For each trace the encoder also works out what AsyncOutput needs as
constants (``Batch``: the ids each call announced; ``Chunks``: the chunks each
streamed; ``Steps``: the steps of step mode; ``Consumer``; the ranks and the reply
rank) and marks the first event of each call with the step it opens
(see ``_steps``).

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
from omni_async.verify.tlc import QUICK_JAVA_OPTS, TlcResult, Toolchain, run_tlc

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
    "RpcCancel": frozenset({"rpc_id"}),
    "StreamClose": frozenset({"rpc_id"}),
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
        return (
            f"trace {self.trace}, {where}: {self.action} {dict(self.fields)} is not a step of the spec ({self.detail})"
        )


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
    # Steps of AsyncOutput that no event records, which the replay takes itself: the
    # engine cancelling a waiter's or a call's Future (one TLC state each).
    silent_steps: int = 0


# ----------------------------------------------------------------------------- encoding


def _s(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _set(values: Iterable[int]) -> str:
    return "{" + ", ".join(str(v) for v in sorted(set(values))) + "}"


class _Numbering:
    def __init__(self, trace: Sequence[TraceEvent] = ()) -> None:
        self.ids: dict[str, int] = {}
        self.rpcs: dict[str, int] = {}
        # The submitted calls first, in submit order: AsyncOutput's engine submits
        # call ``submitted + 1``.
        for ev in trace:
            if ev.action == "RpcSubmit" and ev.fields.get("rpc_id") is not None:
                self.rpc(ev.fields.get("rpc_id"))

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


@attrs.define
class _Step:
    """The step of AsyncOutput a call makes: marked on the call's first event.

    kind: submit | abort | closestream | recv | wait | cancel | drop | expire | rpcexpire | unsent | release
    | failall.  ids: the records an expiry ends; cw / cr: the waiters (ids) and calls
    (rpc numbers) whose Future the engine cancelled before the call (the replay takes
    AsyncOutput's CancelWait / CancelRpc for them first); key: the consumer of a
    release, the outcome of a fail_all; via: the dispatcher's call (not the
    registry's alone); close: a fail_all that closes.
    """

    kind: str
    key: str = ""
    ids: set[int] = attrs.field(factory=set)
    cw: set[int] = attrs.field(factory=set)
    cr: set[int] = attrs.field(factory=set)
    via: bool = False
    close: bool = False
    saw_registry: bool = False  # the registry's part (ReleaseConsumer / FailAll) began


_INSIDE_CALL = frozenset({"ok", "failed", "cancelled", "aborted"})


def _steps(trace: Sequence[TraceEvent], num: _Numbering) -> dict[int, _Step]:
    """Split a trace into the calls of the registry and the dispatcher, each one step of
    AsyncOutput: {index of the call's first event: its step}.

    The boundaries are those the implementation records (tla/TraceAsyncOutput.tla):
    a handled message (PumpRecv), a submit, a wait, a cancel, a drop (the engine's: the
    dispatcher's own drops follow its DispatchDrop inside a call), an expiry, each
    call a compute deadline fails or a forget drops, a consumer's release and a
    fail_all (the dispatcher's part, its RpcResolve events, comes first).
    Worker events (WorkerFire) belong to no call.
    """
    consumer_of: dict[int, str] = {}
    for ev in trace:
        if ev.action == "RpcSubmit":
            consumer_of[num.rpc(ev.fields.get("rpc_id"))] = _consumer(ev.fields.get("consumer"))
    steps: dict[int, _Step] = {}
    cur: _Step | None = None
    prev: TraceEvent | None = None
    for n, ev in enumerate(trace):
        a, f = ev.action, ev.fields
        if a == "WorkerFire":
            continue
        new: _Step | None = None
        if a == "PumpRecv":
            new = _Step("recv")
        elif a == "RpcSubmit":
            new = _Step("submit")
        elif a == "RpcCancel":
            new = _Step("abort")
        elif a == "StreamClose":
            new = _Step("closestream")
        elif a == "WaiterAdd":
            new = _Step("wait")
        elif a == "Cancel":
            new = _Step("cancel")
        elif a == "Expire":
            new = _Step("expire")
        elif a == "Drop":
            after_dispatch = (
                prev is not None
                and prev.action == "DispatchDrop"
                and prev.fields.get("output_id") == f.get("output_id")
            )
            if not after_dispatch:
                new = _Step("drop")
        elif a in ("DispatchDrop", "RpcResolve"):
            why = str(f.get("reason") if a == "DispatchDrop" else f.get("outcome"))
            key = str(num.rpc(f.get("rpc_id")))
            if why in ("timeout", "unsent"):
                kind = "rpcexpire" if why == "timeout" else "unsent"
                if cur is None or cur.kind != kind or cur.key != key:
                    new = _Step(kind, key)
            elif a == "RpcResolve" and why == "consumer_gone":
                c = consumer_of.get(num.rpc(f.get("rpc_id")), "")
                if cur is None or cur.kind != "release" or cur.key != c or cur.saw_registry:
                    new = _Step("release", c, via=True)
            elif a == "RpcResolve" and why not in _INSIDE_CALL:
                if cur is None or cur.kind != "failall" or cur.key != why or cur.saw_registry:
                    new = _Step("failall", why, via=True)
        elif a == "ReleaseConsumer":
            c = _consumer(f.get("consumer"))
            if cur is None or cur.kind != "release" or cur.key != c or cur.saw_registry:
                new = _Step("release", c)
        elif a == "FailAll":
            why = str(f.get("outcome"))
            if cur is None or cur.kind != "failall" or cur.key != why or cur.saw_registry:
                new = _Step("failall", why)
        if new is not None:
            cur = new
            steps[n] = cur
        prev = ev
        if cur is None:
            continue
        if a in ("ReleaseConsumer", "FailAll"):
            cur.saw_registry = True
            if a == "FailAll":
                cur.close = bool(f.get("close"))
        elif a == "WaiterResolve" and f.get("outcome") == "cancelled":
            cur.cw.add(num.oid(f.get("output_id")))
        elif (a == "RpcResolve" and f.get("outcome") == "cancelled") or (
            a == "DispatchDrop" and f.get("reason") == "cancelled"
        ):
            # The call's Future was cancelled (a chunk dropped on arrival for it says so too).
            cur.cr.add(num.rpc(f.get("rpc_id")))
        elif a == "Fire" and cur.kind == "expire" and f.get("event") in ("ABANDON", "FORCE_RELEASE"):
            cur.ids.add(num.oid(f.get("output_id")))
    return steps


@attrs.frozen
class _TraceConstants:
    """What one trace's INSTANCE of AsyncOutput takes as constants."""

    batch: tuple[tuple[int, ...], ...]  # per rpc number: the ids it announced, in request order
    consumer: tuple[str, ...]  # per rpc number
    chunks: tuple[tuple[int, ...], ...]  # per rpc number: the chunk ids its CHUNKs named, in order
    steps: frozenset[int]  # the rpc numbers submitted as steps of step mode
    ranks: frozenset[int]
    reply_rank: int
    num_ids: int


def _trace_constants(trace: Sequence[TraceEvent], num: _Numbering) -> _TraceConstants:
    """Batch: each id belongs to the call whose COMPUTE_DONE (or the failure naming it)
    the registry accepted it from; an id no such message named goes to the first call
    that named it, or to a call of its own that was never submitted (an output nobody
    announced); a chunk id (a CHUNK named it) belongs to that CHUNK's call, in its
    Chunks; ids are numbered 1..num_ids, rpcs 1..len(batch)."""
    batch: dict[int, list[int]] = {}
    chunks: dict[int, list[int]] = {}
    chunk_of: dict[int, int] = {}
    steps: set[int] = set()
    owner: dict[int, int] = {}
    named_by: dict[int, int] = {}
    ranks: set[int] = set()
    reply: int | None = None
    msg_rpc: int | None = None
    seen_rank = 0
    for ev in trace:
        f = ev.fields
        if ev.action == "RpcSubmit":
            if reply is None:
                reply = _int(ev, "reply_rank", 0)
            ranks.update(int(v) for v in _csv(f.get("ranks")))
            if f.get("step") is True:
                steps.add(num.rpc(f.get("rpc_id")))
        elif ev.action == "PumpRecv" and f.get("kind") == "CHUNK":
            seen_rank = max(seen_rank, _int(ev, "rank", 0))
            msg_rpc = None
            o = num.oid(f.get("output_id"))
            if o not in chunk_of:
                chunk_of[o] = num.rpc(f.get("rpc_id"))
                chunks.setdefault(chunk_of[o], []).append(o)
        elif ev.action == "PumpRecv":
            seen_rank = max(seen_rank, _int(ev, "rank", 0))
            ids = [num.oid(v) for v in _csv(f.get("ids"))]
            msg_rpc = num.rpc(f.get("rpc_id")) if ids else None
            for o in ids:
                named_by.setdefault(o, num.rpc(f.get("rpc_id")))
        elif ev.action == "Fire" and f.get("event") == "COMPUTE_DONE" and msg_rpc is not None:
            o = num.oid(f.get("output_id"))
            if o not in owner:
                owner[o] = msg_rpc
                batch.setdefault(msg_rpc, []).append(o)
    num_rpcs = len(num.rpcs)
    for o in range(1, len(num.ids) + 1):
        if o in owner or o in chunk_of:
            continue
        if o in named_by:
            owner[o] = named_by[o]
        else:
            num_rpcs += 1
            owner[o] = num_rpcs
        batch.setdefault(owner[o], []).append(o)
    num_rpcs = max([num_rpcs, len(num.rpcs), *batch.keys(), *chunks.keys()] or [0])
    consumer = ["" for _ in range(num_rpcs)]
    for ev in trace:
        if ev.action == "RpcSubmit":
            k = num.rpc(ev.fields.get("rpc_id"))
            if k <= num_rpcs:
                consumer[k - 1] = _consumer(ev.fields.get("consumer"))
    if not ranks:
        ranks = set(range(seen_rank + 1))
    return _TraceConstants(
        tuple(tuple(batch.get(k, ())) for k in range(1, num_rpcs + 1)),
        tuple(consumer),
        tuple(tuple(chunks.get(k, ())) for k in range(1, num_rpcs + 1)),
        frozenset(steps),
        frozenset(ranks),
        0 if reply is None else reply,
        len(num.ids),
    )


def _encode_event(ev: TraceEvent, num: _Numbering, step: _Step | None = None) -> tuple[str, int]:
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
    unknown = False  # PumpRecv: a message of a call the executor never made
    ids: list[int] = []
    ranks: list[int] = []
    match ev.action:
        case "PumpRecv":
            x = _str(ev, "kind")
            k = num.rpc(f.get("rpc_id"))
            ids = [num.oid(v) for v in _csv(f.get("ids"))]
            # Recorded by Dispatcher.handle; traces written without it know every call.
            known = f.get("known", True)
            if not isinstance(known, bool):
                raise TraceFormatError(f"PumpRecv: field 'known' must be a bool, got {known!r}")
            unknown = not known
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
        case "RpcAnswer" | "RpcCancel" | "StreamClose":
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
    st = step if step is not None else _Step("")
    rec = (
        f"[a |-> {_s(ev.action)}, o |-> {o}, e |-> {_s(e)}, s |-> {_s(s)}, d |-> {_s(d)}, x |-> {_s(x)}, "
        f"k |-> {k}, n |-> {n}, r |-> {r}, ok |-> {_b(ok)}, ids |-> {_set(ids)}, rk |-> {_set(ranks)}, u |-> {_b(unknown)}, "
        f"g |-> {_s(st.kind)}, gs |-> {_set(st.ids)}, cw |-> {_set(st.cw)}, cr |-> {_set(st.cr)}, "
        f"gx |-> {_s(st.key)}, gv |-> {_b(st.via)}, gc |-> {_b(st.close)}]"
    )
    return rec, top


def _b(value: bool) -> str:
    return "TRUE" if value else "FALSE"


_END_RECORD = (
    f'[a |-> "{END}", o |-> 0, e |-> "", s |-> "", d |-> "", x |-> "", '
    "k |-> 0, n |-> 0, r |-> -1, ok |-> FALSE, ids |-> {}, rk |-> {}, u |-> FALSE, "
    'g |-> "", gs |-> {}, cw |-> {}, cr |-> {}, gx |-> "", gv |-> FALSE, gc |-> FALSE]'
)


def _seq(values: Iterable[str]) -> str:
    return "<<" + ", ".join(values) + ">>"


def _constants_module(consts: Sequence[_TraceConstants]) -> str:
    """The per-trace constants of AsyncOutput, as functions of the trace number."""
    if not consts:  # no trace: one empty one, so that the replay's definitions stay total
        consts = [_TraceConstants((), (), (), frozenset(), frozenset({0}), 0, 0)]
    batches = _seq(_seq(_seq(_s(str(o)) for o in b) for b in c.batch) for c in consts)
    chunks = _seq(_seq(_seq(_s(str(o)) for o in b) for b in c.chunks) for c in consts)
    steps = _seq(_set(c.steps) for c in consts)
    cons = _seq(_seq(_s(x) for x in c.consumer) for c in consts)
    ranks = _seq(_set(c.ranks) for c in consts)
    reply = _seq(str(c.reply_rank) for c in consts)
    nids = _seq(str(c.num_ids) for c in consts)
    return (
        f"NumTraces == {len(consts)}\n"
        f"TBatch == {batches}\n"
        f"TChunks == {chunks}\n"
        f"TSteps == {steps}\n"
        f"TCons == {cons}\n"
        f"TRanks == {ranks}\n"
        f"TReply == {reply}\n"
        f"TNumIds == {nids}\n"
    )


def encode_traces(traces: Sequence[Sequence[TraceEvent]]) -> EncodedTraces:
    """The TraceData module for ``traces`` (see tla/TraceAsyncOutput.tla for its shape)."""
    records: list[str] = []
    positions: list[tuple[int, int | None]] = []
    consts: list[_TraceConstants] = []
    num_ids = num_rpcs = 1
    max_rank = 0
    silent = 0
    for t, trace in enumerate(traces):
        num = _Numbering(trace)
        steps = _steps(trace, num)
        for n, ev in enumerate(trace):
            rec, top = _encode_event(ev, num, steps.get(n))
            records.append(rec)
            positions.append((t, n))
            max_rank = max(max_rank, top)
        records.append(_END_RECORD)
        positions.append((t, None))
        c = _trace_constants(trace, num)
        consts.append(c)
        silent += sum(len(s.cw) + len(s.cr) for s in steps.values())
        num_ids = max(num_ids, len(num.ids))
        num_rpcs = max(num_rpcs, len(num.rpcs), len(c.batch))
    body = ",\n    ".join(records)
    module = (
        "------------------------------ MODULE TraceData ------------------------------\n"
        "(* Written by omni_async.verify.tracecheck: recorded traces, one after the other. *)\n"
        "EXTENDS Integers\n"
        f"NumIds == {num_ids}\n"
        f"NumRpcs == {num_rpcs}\n"
        f"MaxRank == {max_rank}\n" + _constants_module(consts) + f"TraceLog == <<\n    {body}\n  >>\n"
        "=============================================================================\n"
    )
    return EncodedTraces(module, tuple(positions), silent)


# ----------------------------------------------------------------------------- checking

_CFG = """\\* Written by omni_async.tracecheck.  Deadlock checking stays on: a refused event is a deadlock.
SPECIFICATION Spec
INVARIANT TypeOK
"""


def _failure(res: TlcResult, traces: Sequence[Sequence[TraceEvent]], enc: EncodedTraces) -> TraceFailure:
    consumed: int | None = None
    if res.trace:
        raw = res.trace[-1].variables.get("l")
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
        # AsyncOutput.tla and the modules it extends (AsyncOutputState.tla, ...).
        spec_modules = sorted(p.name for p in tla_dir().glob("AsyncOutput*.tla"))
        for name in (TRACE_SPEC, *spec_modules, "RequestTable.tla"):
            shutil.copyfile(tla_dir() / name, work / name)
        (work / "TraceData.tla").write_text(enc.module, encoding="utf-8")
        cfg = work / "TraceAsyncOutput.cfg"
        cfg.write_text(_CFG, encoding="utf-8")
        res = run_tlc(
            work / TRACE_SPEC, cfg, workers=1, deadlock=True, timeout=timeout, toolchain=toolchain,
            java_opts=QUICK_JAVA_OPTS,
        )  # fmt: skip
    seconds = time.monotonic() - t0
    if res.ok:
        return TraceCheckResult(True, len(traces), events, seconds, res.distinct_states, None, res)
    return TraceCheckResult(False, len(traces), events, seconds, res.distinct_states, _failure(res, traces, enc), res)
