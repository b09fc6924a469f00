"""Trace validation of engine runs (tla/TraceEngine.tla against tla/EngineLifecycle.tla).

The engine being rewritten will record its machines' transitions (``tracer=``); until
then the traces here come from driving the two machines directly, with the observers
the engine will use (``core.engine_trace.trace_observers``) recording into a
``ListTracer``: sequences the engine's actors can produce are accepted, corrupted ones
are refused at the right event, whether the table refuses them or only the model does.
A test of real engine runs passes ``ListTracer().events`` of each run to
``check_engine_traces`` the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from helpers.tlc import require_tlc
from omni_async.core.engine_states import EngineEvent, StageEvent, StageState, engine_machine, stage_machine
from omni_async.core.engine_trace import trace_observers
from omni_async.core.states import Machine
from omni_async.core.trace import TraceEvent
from omni_async.verify.enginetrace import EngineTraceFormatError, check_engine_traces, encode_engine_traces
from omni_async.verify.recorder import ListTracer

E, S = EngineEvent, StageEvent
Step = EngineEvent | tuple[str, StageEvent]


def run(script: Sequence[Step]) -> list[TraceEvent]:
    """Fire ``script`` on an engine machine and per-request stage machines; the recorded trace."""
    tracer = ListTracer()
    eng_obs, stage_obs = trace_observers(tracer)
    eng = engine_machine("engine", eng_obs)
    stages: dict[str, Machine[StageState, StageEvent]] = {}
    for item in script:
        if isinstance(item, EngineEvent):
            eng.fire(item)
        else:
            req, ev = item
            stages.setdefault(req, stage_machine(req, stage_obs)).fire(ev)
    return tracer.snapshot()


def ef(event: str, src: str, dst: str) -> TraceEvent:
    return TraceEvent("EngineFire", {"event": event, "src": src, "dst": dst})


def sf(req: str, event: str, src: str, dst: str) -> TraceEvent:
    return TraceEvent("StageFire", {"request": req, "event": event, "src": src, "dst": dst})


UP = [E.START, E.STARTED]


def served(r: str) -> list[Step]:
    return [(r, S.ADMIT), (r, S.SENT), (r, S.COMPUTE_DONE), (r, S.OUTPUT), (r, S.RESULT)]


VALID: dict[str, list[Step]] = {
    "generate then close": [*UP, *served("x"), E.CLOSE, E.CLOSED],
    "two requests interleaved": [
        *UP,
        ("x", S.ADMIT),
        ("y", S.ADMIT),
        ("x", S.SENT),
        ("y", S.SENT),
        ("y", S.COMPUTE_DONE),
        ("x", S.COMPUTE_DONE),
        ("x", S.OUTPUT),
        ("y", S.OUTPUT),
        ("y", S.RESULT),
        ("x", S.RESULT),
        E.CLOSE,
        E.CLOSED,
    ],
    "a stream, taken": [*UP, *served("s")[:4], ("s", S.STREAM_RESULT), ("s", S.GONE)],
    "a stream, its consumer leaves": [*UP, *served("s")[:4], ("s", S.STREAM_RESULT), ("s", S.CANCEL), ("s", S.GONE)],
    "abort while waiting": [*UP, ("x", S.ABORT)],
    "abort while queued": [*UP, ("x", S.ADMIT), ("x", S.ABORT), ("x", S.GONE)],
    "abort while computing": [*UP, ("x", S.ADMIT), ("x", S.SENT), ("x", S.ABORT), ("x", S.GONE)],
    "abort, the forward ends anyway": [
        *UP,
        ("x", S.ADMIT),
        ("x", S.SENT),
        ("x", S.ABORT),
        ("x", S.COMPUTE_DONE),
        ("x", S.OUTPUT),
        ("x", S.GONE),
    ],
    "abort behind a blocked send": [
        *UP,
        ("x", S.ADMIT),
        ("x", S.SENT),
        ("y", S.ADMIT),
        ("x", S.ABORT),
        ("x", S.GONE),
        E.CLOSE,
        ("y", S.CLOSE),
        ("y", S.FAIL),
        ("y", S.GONE),
        E.CLOSED,
    ],
    "the forward fails": [*UP, ("x", S.ADMIT), ("x", S.SENT), ("x", S.FAIL), ("x", S.GONE)],
    "the caller leaves": [*UP, ("x", S.ADMIT), ("x", S.SENT), ("x", S.CANCEL), ("x", S.GONE)],
    "close with requests in flight": [
        *UP,
        ("x", S.ADMIT),
        ("x", S.SENT),
        ("y", S.ADMIT),
        E.CLOSE,
        ("x", S.CLOSE),
        ("y", S.CLOSE),
        ("z", S.CLOSE),
        ("y", S.GONE),
        ("x", S.GONE),
        E.CLOSED,
    ],
    "close also on an aborting request": [
        *UP,
        ("x", S.ADMIT),
        ("x", S.SENT),
        ("x", S.ABORT),
        E.CLOSE,
        ("x", S.CLOSE),
        ("x", S.GONE),
        E.CLOSED,
    ],
    "close twice": [*UP, E.CLOSE, E.CLOSE, E.CLOSED],
    "close before start": [E.CLOSE],
    "a failed start": [E.START, E.START_FAILED],
    "close during start": [E.START, E.CLOSE, E.START_FAILED, E.CLOSED],
    "close twice during start": [E.START, E.CLOSE, E.CLOSE, E.START_FAILED, E.CLOSED],
}

# (name, trace, index of the event that must be refused, what the verdict says)
CORRUPTED: list[tuple[str, list[TraceEvent], int, str]] = [
    (
        "STARTED after CLOSE",
        [ef("START", "NEW", "STARTING"), ef("CLOSE", "STARTING", "CLOSING"), ef("STARTED", "CLOSING", "RUNNING")],
        2,
        "not in ENGINE_TABLE",
    ),
    (
        "two terminal stages",
        [*run([*UP, *served("x")]), sf("x", "GONE", "FINISHED", "FINISHED")],
        7,
        "not in STAGE_TABLE",
    ),
    (
        "a source that is not the machine's",
        [
            ef("START", "NEW", "STARTING"),
            ef("STARTED", "STARTING", "RUNNING"),
            sf("x", "SENT", "SUBMITTED", "COMPUTING"),
        ],
        2,
        "request x is WAITING",
    ),
    (
        "admitted after close",
        [*run([*UP, E.CLOSE]), sf("x", "ADMIT", "WAITING", "SUBMITTED")],
        3,
        "no behaviour of EngineLifecycle",
    ),
    (
        "CLOSED with a request at work",
        [*run([*UP, ("x", S.ADMIT), E.CLOSE]), ef("CLOSED", "CLOSING", "CLOSED")],
        4,
        "no behaviour of EngineLifecycle",
    ),
    (
        "COMPUTE_DONE of a request never sent",
        [*run([*UP, ("x", S.ADMIT), ("x", S.ABORT)]), sf("x", "COMPUTE_DONE", "ABORTING", "ABORTING")],
        4,
        "no behaviour of EngineLifecycle",
    ),
    (
        "STARTED with no START",
        [ef("CLOSE", "NEW", "CLOSED"), ef("START", "CLOSED", "STARTING")],
        1,
        "not in ENGINE_TABLE",
    ),
]


def test_encoder_renumbers_requests_per_trace_and_counts_closes() -> None:
    a = run([*UP, ("p", S.ADMIT), ("q", S.ADMIT), E.CLOSE])
    b = run([*UP, *served("q")[:4], ("q", S.STREAM_RESULT), E.CLOSE, E.CLOSE])
    enc = encode_engine_traces([a, b])
    assert "TNumReqs == <<2, 1>>" in enc.module
    assert "TStreams == <<{}, {1}>>" in enc.module
    assert "TCloses == <<1, 2>>" in enc.module
    assert 'r |-> "2", e |-> "ADMIT"' in enc.module  # q is request 2 of the first trace, 1 of the second
    assert enc.positions[len(a)] == (0, None) and enc.positions[-1] == (1, None)


@pytest.mark.parametrize(
    "event",
    [
        TraceEvent("Nope", {}),
        TraceEvent("EngineFire", {"event": "START", "src": "NEW"}),
        TraceEvent("EngineFire", {"event": "BOOT", "src": "NEW", "dst": "STARTING"}),
        TraceEvent("StageFire", {"request": None, "event": "ADMIT", "src": "WAITING", "dst": "SUBMITTED"}),
    ],
)
def test_encoder_refuses_what_it_cannot_encode(event: TraceEvent) -> None:
    with pytest.raises(EngineTraceFormatError):
        encode_engine_traces([[event]])


@pytest.mark.tlc
def test_valid_engine_traces_are_behaviours_of_the_model() -> None:
    tc = require_tlc()
    traces = [run(script) for script in VALID.values()]
    res = check_engine_traces(traces, toolchain=tc)
    assert res.ok, res.summary() + "\n" + (res.tlc.output[-2000:] if res.tlc else "")
    assert res.traces == len(VALID)


@pytest.mark.tlc
@pytest.mark.parametrize("name, bad, index, why", CORRUPTED, ids=[c[0] for c in CORRUPTED])
@pytest.mark.slow
def test_corrupted_engine_trace_is_refused_at_its_event(name: str, bad: list[TraceEvent], index: int, why: str) -> None:
    tc = require_tlc()
    good = run(VALID["generate then close"])
    res = check_engine_traces([good, bad], toolchain=tc)
    assert not res.ok and res.failure is not None, name
    assert (res.failure.trace, res.failure.event) == (1, index), str(res.failure)
    assert res.failure.fields == dict(bad[index].fields)
    assert why in res.failure.detail, str(res.failure)
