"""The output registry: one record per output id on the executor side.

Sans-IO: no threads, no queues, no clocks, no torch.  Callers pass ``now`` (a
monotonic time in seconds) and hold one lock around every call; the pump
(``omni_async.executor.pump``) is that caller.

The registry owns everything about an id -- its request-machine state, its
waiter, its payload or failure, its output deadline -- in one ``OutputRecord``,
where the reference implementation spread it over four dictionaries.

Waiter resolution is split in two so that it is atomic against cancellation
(F3) and never runs user callbacks under the caller's lock:

1. Under the lock the registry *claims* the waiter with
   ``Future.set_running_or_notify_cancel()``.  If the waiter was cancelled
   first, the claim fails and the output is released instead (F9).  A claimed
   future can no longer be cancelled.
2. The claimed future and its result go to the outbox; the caller sets them
   with ``apply_resolutions`` after releasing its lock, so a done-callback that
   calls back into the executor cannot deadlock.

Every id ends in exactly one terminal state, after which its record is removed;
a payload that arrives for nobody is released through ``release_hook`` the
moment it arrives.  ``len(registry) == 0`` whenever nothing is in flight.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import attrs

from omni_async.core.errors import (
    ExecutorShutdown,
    IllegalTransition,
    OutputAlreadyClaimed,
    OutputDropped,
    OutputError,
    OutputOrphaned,
    OutputTimeout,
    ProtocolError,
    RemoteError,
)
from omni_async.core.messages import DiffusionOutput, Failure
from omni_async.core.states import (
    AWAITING_COMPUTE_DONE,
    HOLDING,
    REGISTRY_INITIAL,
    Machine,
    RequestEvent,
    RequestState,
    request_machine,
)
from omni_async.core.trace import Tracer, emit

log = logging.getLogger(__name__)

ReleaseHook = Callable[[DiffusionOutput], None]

S = RequestState
E = RequestEvent


class IdMessage(enum.Enum):
    """One of the two messages a worker sends about an output id.

    The values are the ``kind`` of a ``Late`` trace event, as the trace spec spells them.
    """

    COMPUTE_DONE = "cd"
    OUTPUT_READY = "out"


class _Default(enum.Enum):
    """The type of ``DEFAULT``: "the registry's own setting" where None means "none"."""

    DEFAULT = "default"


DEFAULT = _Default.DEFAULT


def no_release(_: DiffusionOutput) -> None:
    """The default release hook: nothing to give back (no shared memory behind outputs)."""
    return None


@attrs.define(eq=False)
class Resolution:
    """A claimed (RUNNING) future and what to set on it (see the module docstring)."""

    future: Future[Any]
    output: object = None
    error: BaseException | None = None

    def apply(self) -> None:
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.output)


@attrs.define(eq=False)
class Wake:
    """A listener to call after the caller's lock is released (a stream of chunks changed)."""

    listener: Callable[[], None]

    def apply(self) -> None:
        self.listener()


# What the outboxes hold: futures to set, and listeners to call, in order.
Settle = Resolution | Wake


def apply_resolutions(resolutions: Iterable[Settle]) -> None:
    for r in resolutions:
        r.apply()


@attrs.define(eq=False)
class OutputRecord:
    output_id: str
    machine: Machine[RequestState, RequestEvent]
    rank: int | None = None
    request_id: str | None = None
    consumer: str | None = None
    waiter: Future[DiffusionOutput] | None = None
    payload: DiffusionOutput | None = None
    failure: Failure | None = None
    # Output-delivery deadline, measured from COMPUTE_DONE (F4); None = no deadline.
    # Before COMPUTE_DONE (a record an early OUTPUT_READY created): the moment its
    # COMPUTE_DONE is given up on (``on_output``'s early_deadline, defect 3).
    deadline: float | None = None
    # The output timeout its deadline is measured with (its call's, or the registry's).
    output_timeout: float | None = None
    # Futures of acknowledged drops: resolved when the record is removed.
    gone: list[Future[None]] = attrs.field(factory=list)
    # Which of the id's two messages the registry has seen (see ``_finished``).
    seen: set[IdMessage] = attrs.field(factory=set)
    # DROPPING for a call never made (``give_up_dropping``): at its deadline the
    # registry stops waiting for its OUTPUT_READY (M6).
    given_up: bool = False
    # What became of the first claim of the id (``claim``): "waiting", "delivered",
    # "failed with <error>" or "cancelled"; None while nobody claimed it.
    claim: str | None = None

    @property
    def state(self) -> RequestState:
        return self.machine.state


@attrs.define
class Finished:
    """What the registry remembers of a finished id (see ``OutputRegistry._finished``)."""

    # The messages of the id still to come (late ones, released quietly).
    expected: set[IdMessage]
    # How its claim ended (``OutputRecord.claim``), for a later ``claim`` to say.
    claim: str | None


@attrs.define
class RegistryStats:
    """Counters an engine can export as metrics."""

    received_outputs: int = 0
    received_failures: int = 0
    delivered: int = 0
    released: int = 0
    protocol_errors: int = 0
    timeouts: int = 0
    # Records an early OUTPUT_READY created whose COMPUTE_DONE never came in time:
    # force-released by ``expire`` (their payload released), see ``OutputOrphaned``.
    orphaned: int = 0
    # DROPPING records of a COMPUTE_DONE of an unknown call whose OUTPUT_READY did not
    # come by their deadline: force-released by ``expire`` (M6).
    orphan_drops_expired: int = 0
    # Release-hook calls that raised (the payload counts as released; see _release_payload).
    release_errors: int = 0
    terminal: Counter[RequestState] = attrs.field(factory=Counter)


class OutputRegistry:
    def __init__(
        self,
        *,
        output_timeout: float | None = None,
        release_hook: ReleaseHook = no_release,
        tracer: Tracer | None = None,
        max_error_log: int = 64,
        max_finished: int = 4096,
    ) -> None:
        self._records: dict[str, OutputRecord] = {}
        self._output_timeout = output_timeout
        self._release_hook = release_hook
        self._trace = tracer
        self._outbox: list[Resolution] = []
        self._closed: Callable[[str | None], OutputError] | None = None
        self.stats = RegistryStats()
        self.errors: deque[ProtocolError] = deque(maxlen=max_error_log)
        # The typed outcome of each orphaned record (the most recent ones).
        self.orphans: deque[OutputOrphaned] = deque(maxlen=max_error_log)
        # A record is removed when it ends, so a message for an id that already
        # finished (a repeated COMPUTE_DONE/OUTPUT_READY, or the late one of a
        # force-released id) would otherwise create a fresh record holding a payload
        # for nobody (F9).  A bounded memory of recently finished ids, each with the
        # messages it still expects, tells them apart: an expected late message is
        # released quietly, any other is a counted protocol error; neither creates a record.
        self._finished: OrderedDict[str, Finished] = OrderedDict()
        self._max_finished = max_finished
        # Tombstones of expired ids (as bounded): a later wait says the output expired,
        # and how long it had waited, not "unknown id" or "abandoned by its waiter".
        self._expired: OrderedDict[str, str] = OrderedDict()

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, output_id: object) -> bool:
        return output_id in self._records

    def __iter__(self) -> Iterator[OutputRecord]:
        return iter(list(self._records.values()))

    def state_of(self, output_id: str) -> RequestState | None:
        rec = self._records.get(output_id)
        return None if rec is None else rec.state

    @property
    def output_timeout(self) -> float | None:
        """The output deadline of ids whose call sets none of its own."""
        return self._output_timeout

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def pending_waiters(self) -> int:
        return sum(1 for r in self._records.values() if r.waiter is not None)

    def held_payloads(self) -> int:
        return sum(1 for r in self._records.values() if r.state in HOLDING)

    def take_resolutions(self) -> list[Resolution]:
        out, self._outbox = self._outbox, []
        return out

    # ------------------------------------------------------------ peer messages

    def on_compute_done(
        self,
        output_ids: Iterable[str],
        *,
        now: float,
        rank: int | None = None,
        request_ids: Iterable[str] | None = None,
        consumer: str | None = None,
        output_timeout: float | None | _Default = DEFAULT,
    ) -> list[str]:
        """The reply rank's COMPUTE_DONE named these ids (one per request).

        Returns the ids it announced for the first time; a duplicate is counted as a
        protocol error and left out, so a caller that drops the returned ids never
        drops an output that an earlier COMPUTE_DONE announced.  ``output_timeout``:
        their call's output deadline (None: none), instead of the registry's.
        """
        timeout = self._output_timeout if isinstance(output_timeout, _Default) else output_timeout
        rids: list[str | None] = list(request_ids) if request_ids is not None else []
        accepted: list[str] = []
        for i, oid in enumerate(output_ids):
            if self._late_message(oid, IdMessage.COMPUTE_DONE):
                continue
            rec = self._get_or_create(oid, rank)
            if rec is None:
                continue
            if rec.state not in AWAITING_COMPUTE_DONE:
                self._protocol_error(oid, f"duplicate COMPUTE_DONE in state {rec.state}")
                continue
            accepted.append(oid)
            rec.seen.add(IdMessage.COMPUTE_DONE)
            if i < len(rids):
                rec.request_id = rids[i]
            rec.consumer = consumer
            # From here the output deadline (an early record's deadline no longer applies).
            rec.output_timeout = timeout
            rec.deadline = None if timeout is None else now + timeout
            self._fire(rec, E.COMPUTE_DONE)
            self._after_change(rec)
        return accepted

    def on_output(
        self,
        output_id: str,
        *,
        output: DiffusionOutput | None = None,
        failure: Failure | None = None,
        rank: int | None = None,
        early_deadline: float | None = None,
    ) -> None:
        """An OUTPUT_READY arrived: an output, or a failure (exactly one of the two).

        ``early_deadline``: when the message arrives before the id's COMPUTE_DONE (it
        creates the record), the moment that COMPUTE_DONE is given up on: ``expire``
        then force-releases the record and counts it as orphaned.  The dispatcher
        passes one no earlier than every pending call's compute deadline; None: the
        record waits for its COMPUTE_DONE without a bound.
        """
        if (output is None) == (failure is None):
            raise ValueError("on_output takes exactly one of output or failure")
        if output is not None:
            self.stats.received_outputs += 1
        else:
            self.stats.received_failures += 1
        if self._late_message(output_id, IdMessage.OUTPUT_READY):
            if output is not None:
                self._release_payload(output_id, output)
            return
        created = output_id not in self._records
        rec = self._get_or_create(output_id, rank)
        if rec is None:
            # Closed registry: nobody will ever claim it.
            if output is not None:
                self._release_payload(output_id, output)
            return
        if created:
            rec.deadline = early_deadline
        event = E.OUTPUT_READY if output is not None else E.OUTPUT_FAILED
        if not rec.machine.can(event):
            self._protocol_error(output_id, f"duplicate OUTPUT_READY in state {rec.state}")
            if output is not None:
                self._release_payload(output_id, output)
            return
        rec.seen.add(IdMessage.OUTPUT_READY)
        self._fire(rec, event)
        if rec.state in HOLDING:
            rec.payload, rec.failure = output, failure
        elif output is not None:
            # DROPPING/RELEASING -> terminal: nobody wants it, release at once (F9, F10).
            self._release_payload(output_id, output)
        self._after_change(rec)

    # ------------------------------------------------------------ caller actions

    def wait(self, output_id: str) -> Future[DiffusionOutput]:
        """The future of ``output_id``'s output; the same future on repeated calls."""
        fut: Future[DiffusionOutput] = Future()
        rec = self._records.get(output_id)
        if self._closed is not None:
            fut.set_exception(self._closed(output_id))
            return fut
        expired = self._expired.get(output_id)
        if expired is not None:
            fut.set_exception(OutputTimeout(expired, output_id=output_id))
            return fut
        if rec is None:
            fut.set_exception(
                OutputError(
                    f"unknown output id {output_id!r} (never announced, or already finished)", output_id=output_id
                )
            )
            return fut
        if rec.state in (S.DROPPING, S.DROPPING_EARLY):
            fut.set_exception(OutputDropped(f"output {output_id!r} was dropped", output_id=output_id))
            return fut
        if rec.state in (S.RELEASING, S.RELEASING_EARLY):
            fut.set_exception(OutputDropped(f"output {output_id!r} was abandoned by its waiter", output_id=output_id))
            return fut
        if rec.waiter is not None:
            return rec.waiter
        rec.waiter = fut
        rec.claim = "waiting"
        emit(self._trace, "WaiterAdd", output_id=output_id)
        self._after_change(rec)
        return fut

    def claim(self, output_id: str) -> Future[DiffusionOutput]:
        """``wait``, for exactly one taker: the first claim of an id gets its output; a
        later one gets ``OutputAlreadyClaimed`` naming what became of the first (waiting,
        delivered, failed, cancelled), decided from the id's record while it lives and
        from what the registry remembers of it once it finished (``_finished``, bounded:
        an id older than that is "unknown" again).  A claim that fails at once for another
        reason (an id never announced, dropped, a closed registry) claims nothing."""
        rec = self._records.get(output_id)
        done = self._finished.get(output_id) if rec is None else None
        first = rec.claim if rec is not None else (done.claim if done is not None else None)
        if first is not None and self._closed is None:  # closed: that error says more
            refused: Future[DiffusionOutput] = Future()
            refused.set_exception(
                OutputAlreadyClaimed(
                    f"output {output_id!r} was already claimed by an earlier wait_output_ready or request "
                    f"handle ({first}): an output is delivered to exactly one waiter; share that future or "
                    "the output it delivered (copy what you keep)",
                    output_id=output_id,
                )
            )
            return refused
        return self.wait(output_id)

    def cancel(self, output_id: str, future: Future[DiffusionOutput] | None = None) -> None:
        """The waiter of ``output_id`` was cancelled: the output is no longer wanted (F9)."""
        emit(self._trace, "Cancel", output_id=output_id)
        rec = self._records.get(output_id)
        if rec is None or rec.waiter is None or (future is not None and rec.waiter is not future):
            return
        rec.waiter = None
        rec.claim = "cancelled"
        emit(self._trace, "WaiterResolve", output_id=output_id, outcome="cancelled")
        self._abandon(rec)

    def drop(self, output_id: str) -> Future[None]:
        """Drop/abort ``output_id`` in any state (F10).

        Returns a future resolved when nothing of the id remains (the acknowledged
        abort); already resolved if the id is unknown or gone at once, otherwise
        resolved through the outbox like every other future.
        """
        emit(self._trace, "Drop", output_id=output_id)
        done: Future[None] = Future()
        rec = self._records.get(output_id)
        if rec is None:
            done.set_result(None)
            return done
        self._fail_waiter(rec, OutputDropped(f"output {output_id!r} was dropped", output_id=output_id), "dropped")
        self._fire(rec, E.DROP)
        self._discard_payload(rec)
        self._after_change(rec)
        if rec.machine.terminal:
            # Gone at once: nobody can have added a callback to ``done`` yet, so setting
            # it here (under the caller's lock) runs no user code.
            done.set_result(None)
        else:
            rec.gone.append(done)
        return done

    def release_consumer(self, consumer: str) -> int:
        """The consumer went away without aborting (F11): abandon every record it owns."""
        emit(self._trace, "ReleaseConsumer", consumer=consumer)
        mine = [r for r in self._records.values() if r.consumer == consumer]
        for rec in mine:
            self._fail_waiter(
                rec, OutputDropped(f"consumer {consumer!r} went away", output_id=rec.output_id), "dropped"
            )
            self._abandon(rec)
        return len(mine)

    def expire(self, now: float) -> int:
        """Fail or release every record whose deadline has passed (F4, F11, defect 3).

        A record whose COMPUTE_DONE arrived is abandoned (its output deadline).  A
        record still waiting for its COMPUTE_DONE (an early OUTPUT_READY created it)
        is orphaned: the COMPUTE_DONE is given up on, the record force-released and
        its tombstone swallows that COMPUTE_DONE should it still come.
        """
        due = [r for r in self._records.values() if r.deadline is not None and r.deadline <= now]
        if due:
            emit(self._trace, "Expire", count=len(due))
        for rec in due:
            if rec.given_up and rec.state is S.DROPPING:
                rec.deadline = None
                self._give_up(rec)
                continue
            if rec.state in AWAITING_COMPUTE_DONE:
                rec.deadline = None
                self._orphan(rec)
                continue
            assert rec.deadline is not None and rec.output_timeout is not None
            reason = self._expiry_reason(rec, now - (rec.deadline - rec.output_timeout))
            rec.deadline = None
            self.stats.timeouts += 1
            self._expired[rec.output_id] = reason
            while len(self._expired) > self._max_finished:
                self._expired.popitem(last=False)
            self._fail_waiter(rec, OutputTimeout(reason, output_id=rec.output_id), "timeout")
            self._abandon(rec)
        return len(due)

    def _expiry_reason(self, rec: OutputRecord, waited: float) -> str:
        """Why ``rec`` expired, for its waiter and for any later wait (its tombstone)."""
        of = f" of request {rec.request_id!r}" if rec.request_id is not None else ""
        how = "undelivered" if rec.waiter is not None else "unclaimed"
        arrived = "" if rec.state in HOLDING else "; it had not arrived from the worker (still packing)"
        return (
            f"output {rec.output_id!r}{of} expired {how} after {waited:.1f} s "
            f"(output_timeout={rec.output_timeout}){arrived}"
        )

    def give_up_dropping(self, output_ids: Iterable[str], deadline: float | None) -> None:
        """These DROPPING ids were announced by a COMPUTE_DONE of a call never made: no
        worker packs them, so their OUTPUT_READY may never come.  At ``deadline`` (or
        their output deadline, when None) ``expire`` force-releases them (M6); their
        tombstone still swallows an OUTPUT_READY that comes later (its payload released)."""
        for oid in output_ids:
            rec = self._records.get(oid)
            if rec is None or rec.state is not S.DROPPING:
                continue
            rec.given_up = True
            if deadline is not None:
                rec.deadline = deadline if rec.deadline is None else min(rec.deadline, deadline)

    def _give_up(self, rec: OutputRecord) -> None:
        self.stats.orphan_drops_expired += 1
        log.warning(
            "registry: output %r (announced by a COMPUTE_DONE of no call) never arrived; given up", rec.output_id
        )
        self._fire(rec, E.FORCE_RELEASE)
        self._discard_payload(rec)
        self._after_change(rec)

    def _orphan(self, rec: OutputRecord) -> None:
        self.stats.orphaned += 1
        err = OutputOrphaned(
            f"output {rec.output_id!r}: no COMPUTE_DONE named it in time (its call ended); released",
            output_id=rec.output_id,
        )
        self.orphans.append(err)
        log.warning("registry: %s", err)
        self._fail_waiter(rec, err, "orphaned")
        self._fire(rec, E.FORCE_RELEASE)
        self._discard_payload(rec)
        self._after_change(rec)

    def rearm_deadlines(self, output_ids: Iterable[str], now: float) -> None:
        """Measure the output deadline of these ids from ``now`` (their call resolved)."""
        for oid in output_ids:
            rec = self._records.get(oid)
            if rec is not None and rec.deadline is not None and rec.output_timeout is not None:
                rec.deadline = now + rec.output_timeout

    def next_deadline(self) -> float | None:
        deadlines = [r.deadline for r in self._records.values() if r.deadline is not None]
        return min(deadlines) if deadlines else None

    def fail_all(
        self, make_error: Callable[[str | None], OutputError], *, outcome: str = "shutdown", close: bool = False
    ) -> int:
        """Nothing more will arrive (shutdown, worker death): fail every waiter, release everything.

        With ``close=True`` the registry also refuses new work (F16): later waits fail
        with ``make_error(None)`` and later payloads are released on arrival.
        """
        emit(self._trace, "FailAll", outcome=outcome, close=close)
        if close:
            self._closed = make_error
            emit(self._trace, "Shutdown")
        recs = list(self._records.values())
        for rec in recs:
            self._fail_waiter(rec, make_error(rec.output_id), outcome)
            self._fire(rec, E.FORCE_RELEASE)
            self._discard_payload(rec)
            self._after_change(rec)
        return len(recs)

    def shutdown(self) -> int:
        return self.fail_all(
            lambda oid: ExecutorShutdown("the executor shut down", output_id=oid), outcome="shutdown", close=True
        )

    # ---------------------------------------------------------------- internals

    def _get_or_create(self, output_id: str, rank: int | None) -> OutputRecord | None:
        rec = self._records.get(output_id)
        if rec is not None:
            return rec
        if self._closed is not None:
            return None
        rec = OutputRecord(output_id, request_machine(output_id, REGISTRY_INITIAL), rank=rank)
        self._records[output_id] = rec
        emit(self._trace, "Create", output_id=output_id)
        return rec

    def _fire(self, rec: OutputRecord, event: RequestEvent) -> None:
        src = rec.state
        try:
            dst = rec.machine.fire(event)
        except IllegalTransition as exc:
            # Every caller checks legality first; reaching this is a bug in the registry.
            raise AssertionError(str(exc)) from exc
        emit(self._trace, "Fire", output_id=rec.output_id, event=event.name, src=src.name, dst=dst.name)

    def _abandon(self, rec: OutputRecord) -> None:
        self._fire(rec, E.ABANDON)
        self._discard_payload(rec)
        self._after_change(rec)

    def _after_change(self, rec: OutputRecord) -> None:
        """Deliver if a waiter and a result meet; remove the record once terminal."""
        if rec.waiter is not None and rec.state in (S.READY, S.FAILED):
            fut = rec.waiter
            rec.waiter = None
            if fut.set_running_or_notify_cancel():
                payload, failure = rec.payload, rec.failure
                rec.payload = rec.failure = None
                self._fire(rec, E.DELIVER)
                rec.claim = "delivered" if payload is not None else f"failed with {RemoteError.__name__}"
                if payload is not None:
                    self.stats.delivered += 1
                    emit(self._trace, "PayloadDeliver", output_id=rec.output_id)
                    emit(self._trace, "WaiterResolve", output_id=rec.output_id, outcome="output")
                    self._outbox.append(Resolution(fut, output=attrs.evolve(payload, async_output_id=rec.output_id)))
                else:
                    assert failure is not None
                    emit(self._trace, "WaiterResolve", output_id=rec.output_id, outcome="failure")
                    self._outbox.append(
                        Resolution(fut, error=RemoteError(failure, output_id=rec.output_id, rank=rec.rank))
                    )
            else:
                # Cancelled between the caller's check and our claim (F3): treat as abandoned.
                rec.claim = "cancelled"
                emit(self._trace, "WaiterResolve", output_id=rec.output_id, outcome="cancelled")
                self._fire(rec, E.ABANDON)
                self._discard_payload(rec)
        if rec.machine.terminal:
            del self._records[rec.output_id]
            self.stats.terminal[rec.state] += 1
            emit(self._trace, "Remove", output_id=rec.output_id, state=rec.state.name)
            self._remember_finished(rec)
            # Like waiters, acknowledged-drop futures are claimed here and set after the
            # caller's lock is released: a done-callback that calls back into the
            # executor (drop_output(...).add_done_callback(lambda f: ex.metrics()))
            # would otherwise deadlock the pump.
            for g in rec.gone:
                if g.set_running_or_notify_cancel():
                    self._outbox.append(Resolution(g, output=None))
            rec.gone.clear()

    def _fail_waiter(self, rec: OutputRecord, error: BaseException, outcome: str) -> None:
        fut = rec.waiter
        if fut is None:
            return
        rec.waiter = None
        claimed = fut.set_running_or_notify_cancel()
        rec.claim = f"failed with {type(error).__name__}" if claimed else "cancelled"
        emit(self._trace, "WaiterResolve", output_id=rec.output_id, outcome=outcome if claimed else "cancelled")
        if claimed:
            self._outbox.append(Resolution(fut, error=error))

    def _discard_payload(self, rec: OutputRecord) -> None:
        payload, rec.payload, rec.failure = rec.payload, None, None
        if payload is not None:
            self._release_payload(rec.output_id, payload)

    def _release_payload(self, output_id: str, payload: DiffusionOutput) -> None:
        self.stats.released += 1
        emit(self._trace, "PayloadRelease", output_id=output_id)
        # A hook error must not escape in the middle of a state change: the record of a
        # terminal id would never be removed, a shutdown would stop failing waiters at
        # the first bad payload, a claimed waiter could stay RUNNING forever.  Count
        # and log it instead.
        try:
            self._release_hook(payload)
        except Exception:
            self.stats.release_errors += 1
            log.exception("registry: releasing the payload of %r failed", output_id)

    def _late_message(self, output_id: str, kind: IdMessage) -> bool:
        """True if ``output_id`` already finished: the message is late or repeated (see ``_finished``)."""
        if output_id in self._records:
            return False
        done = self._finished.get(output_id)
        if done is None:
            return False
        expected = done.expected
        emit(self._trace, "Late", output_id=output_id, kind=kind.value, expected=kind in expected)
        if kind in expected:
            expected.discard(kind)
        else:
            self._protocol_error(output_id, f"{kind.name} for an output that already finished")
        return True

    def _remember_finished(self, rec: OutputRecord) -> None:
        self._finished[rec.output_id] = Finished(set(IdMessage) - rec.seen, rec.claim)
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)

    def _protocol_error(self, output_id: str, reason: str) -> None:
        self.stats.protocol_errors += 1
        self.errors.append(ProtocolError(f"output {output_id!r}: {reason}", output_id=output_id))
        emit(self._trace, "ProtocolError", output_id=output_id, reason=reason)
