"""State machines: one pure-data table per machine, read by everything.

Theory of operation
-------------------
Each output id lives through one *request machine*.  The worker drives its
first half (QUEUED -> COMPUTING -> COMPUTE_DONE -> PACKING -> READY/FAILED, the
last two meaning "OUTPUT_READY sent"); the executor's registry drives the
second half, from the first message that names the id to a terminal state.

The registry can see OUTPUT_READY before COMPUTE_DONE, because the worker's
main thread and its packer thread write to the channel independently.  It keeps
a record until *both* messages have arrived, so a late or duplicate message is
always told apart from a new one without remembering finished ids:

* ``EARLY_READY`` / ``EARLY_FAILED``: the output (or its failure) arrived, the
  COMPUTE_DONE that announces the id has not.  Nothing is delivered before it.
* ``DROPPING`` / ``RELEASING``: nobody wants the output any more (dropped, or
  its waiter was cancelled / timed out / the consumer left); the payload is
  released the moment it arrives (F9, F10).  The ``_EARLY`` variants wait for
  the COMPUTE_DONE instead (the payload was already released).

Terminal states: DELIVERED (a waiter got the output or its failure), RELEASED
(never claimed: abandoned, timed out, shutdown, worker death), DROPPED (an
explicit drop/abort).  A record is removed the moment it enters one.

The tables are plain dicts so that the TLA+ generator, the Mermaid diagrams,
the Hypothesis tests and the ``transitions`` oracle all read the same data.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Final, Generic, TypeVar

from omni_async.core.errors import IllegalTransition


class _NamedEnum(enum.Enum):
    def __repr__(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name


class RequestState(_NamedEnum):
    QUEUED = "queued"
    COMPUTING = "computing"
    COMPUTE_DONE = "compute_done"
    PACKING = "packing"
    READY = "ready"
    FAILED = "failed"
    EARLY_READY = "early_ready"
    EARLY_FAILED = "early_failed"
    DROPPING = "dropping"
    DROPPING_EARLY = "dropping_early"
    RELEASING = "releasing"
    RELEASING_EARLY = "releasing_early"
    DELIVERED = "delivered"
    RELEASED = "released"
    DROPPED = "dropped"


class RequestEvent(_NamedEnum):
    FORWARD = "forward"  # worker: the forward starts
    COMPUTE_DONE = "compute_done"  # the forward finished (worker sends / registry receives)
    PACK = "pack"  # worker: the packer starts copying
    OUTPUT_READY = "output_ready"  # the output is packed (packer sends / registry receives)
    OUTPUT_FAILED = "output_failed"  # packing (or the output) failed; carries a Failure
    DELIVER = "deliver"  # registry: the waiter gets the output or its failure
    DROP = "drop"  # engine: drop/abort the output
    ABANDON = "abandon"  # the waiter was cancelled, timed out, or its consumer left
    FORCE_RELEASE = "force_release"  # shutdown, worker death, failed RPC: nothing more will arrive


S = RequestState
E = RequestEvent

REQUEST_TABLE: Final[Mapping[tuple[RequestState, RequestEvent], RequestState]] = {
    # worker side
    (S.QUEUED, E.FORWARD): S.COMPUTING,
    (S.QUEUED, E.DROP): S.DROPPED,
    (S.QUEUED, E.FORCE_RELEASE): S.RELEASED,
    (S.COMPUTING, E.COMPUTE_DONE): S.COMPUTE_DONE,
    # registry: a record is created in COMPUTING when the first message naming its id arrives;
    # OUTPUT_READY can be that first message (early arrival).
    (S.COMPUTING, E.OUTPUT_READY): S.EARLY_READY,
    (S.COMPUTING, E.OUTPUT_FAILED): S.EARLY_FAILED,
    (S.COMPUTING, E.DROP): S.DROPPING,
    (S.COMPUTING, E.ABANDON): S.RELEASING,
    (S.COMPUTING, E.FORCE_RELEASE): S.RELEASED,
    (S.COMPUTE_DONE, E.PACK): S.PACKING,
    (S.COMPUTE_DONE, E.OUTPUT_READY): S.READY,
    (S.COMPUTE_DONE, E.OUTPUT_FAILED): S.FAILED,
    (S.COMPUTE_DONE, E.DROP): S.DROPPING,
    (S.COMPUTE_DONE, E.ABANDON): S.RELEASING,
    (S.COMPUTE_DONE, E.FORCE_RELEASE): S.RELEASED,
    (S.PACKING, E.OUTPUT_READY): S.READY,
    (S.PACKING, E.OUTPUT_FAILED): S.FAILED,
    (S.PACKING, E.DROP): S.DROPPING,
    (S.PACKING, E.ABANDON): S.RELEASING,
    (S.PACKING, E.FORCE_RELEASE): S.RELEASED,
    (S.READY, E.DELIVER): S.DELIVERED,
    (S.READY, E.DROP): S.DROPPED,
    (S.READY, E.ABANDON): S.RELEASED,
    (S.READY, E.FORCE_RELEASE): S.RELEASED,
    (S.FAILED, E.DELIVER): S.DELIVERED,
    (S.FAILED, E.DROP): S.DROPPED,
    (S.FAILED, E.ABANDON): S.RELEASED,
    (S.FAILED, E.FORCE_RELEASE): S.RELEASED,
    (S.EARLY_READY, E.COMPUTE_DONE): S.READY,
    (S.EARLY_READY, E.DROP): S.DROPPING_EARLY,
    (S.EARLY_READY, E.ABANDON): S.RELEASING_EARLY,
    (S.EARLY_READY, E.FORCE_RELEASE): S.RELEASED,
    (S.EARLY_FAILED, E.COMPUTE_DONE): S.FAILED,
    (S.EARLY_FAILED, E.DROP): S.DROPPING_EARLY,
    (S.EARLY_FAILED, E.ABANDON): S.RELEASING_EARLY,
    (S.EARLY_FAILED, E.FORCE_RELEASE): S.RELEASED,
    # nobody wants the output: wait for the outstanding message, then end.
    (S.DROPPING, E.COMPUTE_DONE): S.DROPPING,
    (S.DROPPING, E.OUTPUT_READY): S.DROPPED,
    (S.DROPPING, E.OUTPUT_FAILED): S.DROPPED,
    (S.DROPPING, E.DROP): S.DROPPING,
    (S.DROPPING, E.ABANDON): S.DROPPING,
    (S.DROPPING, E.FORCE_RELEASE): S.DROPPED,
    (S.DROPPING_EARLY, E.COMPUTE_DONE): S.DROPPED,
    (S.DROPPING_EARLY, E.DROP): S.DROPPING_EARLY,
    (S.DROPPING_EARLY, E.ABANDON): S.DROPPING_EARLY,
    (S.DROPPING_EARLY, E.FORCE_RELEASE): S.DROPPED,
    (S.RELEASING, E.COMPUTE_DONE): S.RELEASING,
    (S.RELEASING, E.OUTPUT_READY): S.RELEASED,
    (S.RELEASING, E.OUTPUT_FAILED): S.RELEASED,
    (S.RELEASING, E.DROP): S.DROPPING,
    (S.RELEASING, E.ABANDON): S.RELEASING,
    (S.RELEASING, E.FORCE_RELEASE): S.RELEASED,
    (S.RELEASING_EARLY, E.COMPUTE_DONE): S.RELEASED,
    (S.RELEASING_EARLY, E.DROP): S.DROPPING_EARLY,
    (S.RELEASING_EARLY, E.ABANDON): S.RELEASING_EARLY,
    (S.RELEASING_EARLY, E.FORCE_RELEASE): S.RELEASED,
}

REQUEST_INITIAL: Final = S.QUEUED
# Where the executor's registry creates a record: it does not see the worker's QUEUED.
REGISTRY_INITIAL: Final = S.COMPUTING
REQUEST_TERMINAL: Final[frozenset[RequestState]] = frozenset({S.DELIVERED, S.RELEASED, S.DROPPED})
# States in which the registry holds a payload (an output or a failure) that must be released.
HOLDING: Final[frozenset[RequestState]] = frozenset({S.READY, S.FAILED, S.EARLY_READY, S.EARLY_FAILED})
# States in which the id's COMPUTE_DONE has not been seen by the registry yet.
AWAITING_COMPUTE_DONE: Final[frozenset[RequestState]] = frozenset(
    {S.COMPUTING, S.EARLY_READY, S.EARLY_FAILED, S.DROPPING_EARLY, S.RELEASING_EARLY}
)


class LifecycleState(_NamedEnum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class LifecycleEvent(_NamedEnum):
    STARTED = "started"
    DRAIN = "drain"
    STOPPED = "stopped"
    CRASH = "crash"


L = LifecycleState
LE = LifecycleEvent

LIFECYCLE_TABLE: Final[Mapping[tuple[LifecycleState, LifecycleEvent], LifecycleState]] = {
    (L.STARTING, LE.STARTED): L.RUNNING,
    (L.STARTING, LE.STOPPED): L.STOPPED,
    (L.STARTING, LE.CRASH): L.FAILED,
    (L.RUNNING, LE.DRAIN): L.DRAINING,
    (L.RUNNING, LE.STOPPED): L.STOPPED,
    (L.RUNNING, LE.CRASH): L.FAILED,
    (L.DRAINING, LE.DRAIN): L.DRAINING,
    (L.DRAINING, LE.STOPPED): L.STOPPED,
    (L.DRAINING, LE.CRASH): L.FAILED,
}
LIFECYCLE_INITIAL: Final = L.STARTING
LIFECYCLE_TERMINAL: Final[frozenset[LifecycleState]] = frozenset({L.STOPPED, L.FAILED})

StateT = TypeVar("StateT", bound=enum.Enum)
EventT = TypeVar("EventT", bound=enum.Enum)


class Machine(Generic[StateT, EventT]):
    """A table-driven state machine for one key (an output id, a thread name).

    A dict lookup per event.  ``bench/transitions_cost.py`` measured (2-core CPU
    machine, ``bench/results/transitions_cost.json``): 0.36 us per trigger here
    against 7.7-8.6 us for a ``transitions.Machine`` built from the same table
    (~22x), and one request's life (create + 3 events) at 1.1 us against 80-266 us
    (73-240x), since the registry makes a machine per output id.  So ``transitions``
    is the independent oracle in the tests, not the runtime engine.
    """

    __slots__ = ("_kind", "_key", "_observer", "_state", "_table", "_terminal")

    def __init__(
        self,
        kind: str,
        key: str,
        table: Mapping[tuple[StateT, EventT], StateT],
        initial: StateT,
        terminal: frozenset[StateT],
        observer: Callable[[str, EventT, StateT, StateT], None] | None = None,
    ) -> None:
        self._kind = kind
        self._key = key
        self._table = table
        self._state = initial
        self._terminal = terminal
        # Called after each transition with (key, event, src, dst): how a component
        # records its machine's steps for trace validation (off when None).
        self._observer = observer

    @property
    def state(self) -> StateT:
        return self._state

    @property
    def key(self) -> str:
        return self._key

    @property
    def terminal(self) -> bool:
        return self._state in self._terminal

    def can(self, event: EventT) -> bool:
        return (self._state, event) in self._table

    def fire(self, event: EventT) -> StateT:
        try:
            nxt = self._table[(self._state, event)]
        except KeyError:
            raise IllegalTransition(self._kind, self._key, self._state, event) from None
        src, self._state = self._state, nxt
        if self._observer is not None:
            self._observer(self._key, event, src, nxt)
        return nxt


def request_machine(output_id: str, initial: RequestState = REQUEST_INITIAL) -> Machine[RequestState, RequestEvent]:
    return Machine("request", output_id, REQUEST_TABLE, initial, REQUEST_TERMINAL)


def lifecycle_machine(name: str) -> Machine[LifecycleState, LifecycleEvent]:
    return Machine("lifecycle", name, LIFECYCLE_TABLE, LIFECYCLE_INITIAL, LIFECYCLE_TERMINAL)


def reachable(table: Mapping[tuple[StateT, EventT], StateT], start: StateT) -> frozenset[StateT]:
    """States reachable from ``start`` through ``table`` (used by tests and the spec generator)."""
    seen = {start}
    frontier = [start]
    while frontier:
        s = frontier.pop()
        for (src, _), dst in table.items():
            if src == s and dst not in seen:
                seen.add(dst)
                frontier.append(dst)
    return frozenset(seen)
