"""The engine's machines: its lifecycle, and the stages of each request it serves.

Theory of operation
-------------------
``AsyncDiffusionEngine`` keeps no state of its own outside these two machines; every
change goes through ``Machine.fire``, so a transition the tables do not list raises
``IllegalTransition`` (naming the engine or the request, the state and the event) and
leaves the state as it was.  The tables are pure data, read by the engine, the TLA+
generator (``tla/EngineTable.tla``), the diagrams and the tests.

**Lifecycle.**  ``NEW -START-> STARTING -STARTED-> RUNNING -CLOSE-> CLOSING -CLOSED->
CLOSED``.  A start that fails (the factory raised, the executor is in step mode, the
caller cancelled ``start``) fires ``START_FAILED`` only once everything it built is shut
down, so FAILED never has a live executor; FAILED and CLOSED are terminal (no event
leaves them) and ``close()`` returns at once in both.  ``close()`` during STARTING moves to CLOSING: the
start, when its awaits return, sees CLOSING, shuts down what it built and fires
``START_FAILED`` (CLOSING stays CLOSING); it can never reach RUNNING afterwards, because
``(CLOSING, STARTED)`` is not in the table.

**A request.**  A request moves forward through the stages a request in request mode
takes (WAITING, SUBMITTED: its driver is sending it; COMPUTING; COMPUTED: COMPUTE_DONE
came, its output has not; POSTPROCESSING; RESOLVED: a stream's result is set but its
consumer still reads).  An end decided early (``ABORT``: ``engine.abort``; ``CANCEL``: the
caller went away; ``CLOSE``: ``engine.close``; ``FAIL``: an error of the executor, the
host stage or a chunk) moves it to the matching *-ING* state from any stage but WAITING
(where nothing is on a worker, so it ends at once); the first end decided is the one
that counts, later ones change nothing, and the driver's remaining steps
(``SENT``, ``COMPUTE_DONE``, ``OUTPUT``, ``RESULT``) only release what they find.  ``GONE``
(nothing of the request left in the executor or on a worker) takes it to the terminal
state of its outcome, which is what ``metrics()['requests']`` counts: exactly one
outcome per request.  A plain ``generate`` ends FINISHED at ``RESULT``; a stream's
``STREAM_RESULT`` only sets the result (RESOLVED), and its consumer decides: it takes the result
(``GONE``: FINISHED), a chunk fails (``FAIL``) or it leaves (``CANCEL``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from omni_async.core.states import Machine, _NamedEnum

__all__ = [
    "ENDING_OF",
    "EngineObserver",
    "StageObserver",
    "ENGINE_INITIAL",
    "ENGINE_TABLE",
    "ENGINE_TERMINAL",
    "OUTCOME_OF",
    "STAGE_INITIAL",
    "STAGE_TABLE",
    "STAGE_TERMINAL",
    "EngineEvent",
    "EngineState",
    "StageEvent",
    "StageState",
    "engine_machine",
    "stage_machine",
]


class EngineState(_NamedEnum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"  # a start that failed, with everything it built shut down


class EngineEvent(_NamedEnum):
    START = "start"
    STARTED = "started"
    START_FAILED = "start_failed"
    CLOSE = "close"
    CLOSED = "closed"


ES = EngineState
EE = EngineEvent

ENGINE_TABLE: Final[Mapping[tuple[EngineState, EngineEvent], EngineState]] = {
    (ES.NEW, EE.START): ES.STARTING,
    (ES.NEW, EE.CLOSE): ES.CLOSED,  # never started: nothing to release
    (ES.STARTING, EE.STARTED): ES.RUNNING,
    (ES.STARTING, EE.START_FAILED): ES.FAILED,
    (ES.STARTING, EE.CLOSE): ES.CLOSING,
    (ES.RUNNING, EE.CLOSE): ES.CLOSING,
    (ES.CLOSING, EE.START_FAILED): ES.CLOSING,  # a start overtaken by close gave up
    (ES.CLOSING, EE.CLOSE): ES.CLOSING,  # a second close waits for the first
    (ES.CLOSING, EE.CLOSED): ES.CLOSED,
}
ENGINE_INITIAL: Final = ES.NEW
ENGINE_TERMINAL: Final[frozenset[EngineState]] = frozenset({ES.CLOSED, ES.FAILED})


class StageState(_NamedEnum):
    WAITING = "waiting"
    SUBMITTED = "submitted"
    COMPUTING = "computing"
    COMPUTED = "computed"
    POSTPROCESSING = "postprocessing"
    RESOLVED = "resolved"
    ABORTING = "aborting"
    CANCELLING = "cancelling"
    CLOSING = "closing"
    FAILING = "failing"
    FINISHED = "finished"
    ABORTED = "aborted"
    CANCELLED = "cancelled"
    CLOSED = "closed"
    FAILED = "failed"


class StageEvent(_NamedEnum):
    ADMIT = "admit"  # the scheduler let it run; its driver starts
    SENT = "sent"  # the executor took it (its forward is queued or running)
    COMPUTE_DONE = "compute_done"
    OUTPUT = "output"  # its output is here
    RESULT = "result"  # the host stage's value is the caller's result (generate)
    STREAM_RESULT = "stream_result"  # a stream's result is set; its consumer still reads
    ABORT = "abort"
    CANCEL = "cancel"
    CLOSE = "close"
    FAIL = "fail"
    GONE = "gone"  # nothing of it is left anywhere


SS = StageState
SE = StageEvent

# The end an early event decides, from a stage that has work on a worker, and the
# terminal state each *-ING state reaches once nothing is left.
ENDING_OF: Final[Mapping[StageEvent, StageState]] = {
    SE.ABORT: SS.ABORTING,
    SE.CANCEL: SS.CANCELLING,
    SE.CLOSE: SS.CLOSING,
    SE.FAIL: SS.FAILING,
}
OUTCOME_OF: Final[Mapping[StageState, StageState]] = {
    SS.ABORTING: SS.ABORTED,
    SS.CANCELLING: SS.CANCELLED,
    SS.CLOSING: SS.CLOSED,
    SS.FAILING: SS.FAILED,
}
_FORWARD: Final[Mapping[tuple[StageState, StageEvent], StageState]] = {
    (SS.WAITING, SE.ADMIT): SS.SUBMITTED,
    (SS.SUBMITTED, SE.SENT): SS.COMPUTING,
    (SS.COMPUTING, SE.COMPUTE_DONE): SS.COMPUTED,
    (SS.COMPUTED, SE.OUTPUT): SS.POSTPROCESSING,
    (SS.POSTPROCESSING, SE.RESULT): SS.FINISHED,  # generate: the caller has its result
    (SS.POSTPROCESSING, SE.STREAM_RESULT): SS.RESOLVED,  # a stream: its consumer decides
    (SS.RESOLVED, SE.GONE): SS.FINISHED,  # a stream's consumer took its result
}
_AT_WORK: Final = (SS.SUBMITTED, SS.COMPUTING, SS.COMPUTED, SS.POSTPROCESSING, SS.RESOLVED)
_PROGRESS: Final = (SE.SENT, SE.COMPUTE_DONE, SE.OUTPUT, SE.RESULT, SE.STREAM_RESULT)

STAGE_TABLE: Final[Mapping[tuple[StageState, StageEvent], StageState]] = {
    **_FORWARD,
    # Nothing is on a worker yet: an end is final at once.
    (SS.WAITING, SE.ABORT): SS.ABORTED,
    (SS.WAITING, SE.CANCEL): SS.CANCELLED,
    (SS.WAITING, SE.CLOSE): SS.CLOSED,
    (SS.WAITING, SE.FAIL): SS.FAILED,
    # At work: the first end decided counts; the driver releases what is left.
    **{(s, e): ending for s in _AT_WORK for e, ending in ENDING_OF.items()},
    # Ending: later ends change nothing; the driver's steps only release; GONE ends it.
    **{(s, e): s for s in OUTCOME_OF for e in (*ENDING_OF, *_PROGRESS)},
    **{(s, SE.GONE): outcome for s, outcome in OUTCOME_OF.items()},
}
STAGE_INITIAL: Final = SS.WAITING
STAGE_TERMINAL: Final[frozenset[StageState]] = frozenset({SS.FINISHED, SS.ABORTED, SS.CANCELLED, SS.CLOSED, SS.FAILED})


EngineObserver = Callable[[str, EngineEvent, EngineState, EngineState], None]
StageObserver = Callable[[str, StageEvent, StageState, StageState], None]


def engine_machine(name: str, observer: EngineObserver | None = None) -> Machine[EngineState, EngineEvent]:
    return Machine("engine", name, ENGINE_TABLE, ENGINE_INITIAL, ENGINE_TERMINAL, observer)


def stage_machine(request_id: str, observer: StageObserver | None = None) -> Machine[StageState, StageEvent]:
    return Machine("engine request", request_id, STAGE_TABLE, STAGE_INITIAL, STAGE_TERMINAL, observer)
