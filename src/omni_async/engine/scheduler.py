"""The engine's scheduler: admission control over a bounded queue, sans-IO.

Theory of operation
-------------------
A request the engine accepted is in one of three places:

* **waiting**: in the engine's FIFO queue, not sent to any worker.  The queue is
  bounded (``max_waiting``, beyond the running slots free now, which the next
  ``schedule`` fills); ``add`` on a full queue raises ``EngineOverloaded`` at the
  call.  Refusing, not waiting for room, is deliberate: a serving front end turns it
  into "try again later" (HTTP 503) at once, where a caller parked on a full queue
  would hide the overload behind latency.
* **running**: sent to the executor, its forward queued on the worker or running.  At
  most ``max_running`` at once.  With ``max_running >= 2`` the next request is already
  in the worker's RPC pipe while a forward runs, so the worker starts it the moment
  it sends COMPUTE_DONE, without waiting for the round trip to the engine.
* **holding**: COMPUTE_DONE arrived ("compute done, output pending" is finished for
  the scheduler: the running slot is free at once), and the output is being packed,
  transferred or post-processed.  It holds one output of the executor's budget of
  held outputs until the engine released it.
* **lent** (not a request's phase): an output lent to its caller (``sink="segment"``)
  after its request ended; it holds one output of the budget like a holding request,
  until its lease is released or expires (``lent``, counted in ``in_flight``).

The budget: every running or holding request will hold (or holds) one output in the
executor's shared memory until the engine releases it, so admission keeps
``running + holding <= in_flight_limit``, where the limit is the executor's budget
(``OutputBudget``: its ``max_outputs`` and, once the size of an output is known, as
many outputs as fit into its ``max_bytes``).  The byte estimate is the budget's own
(``OutputBudget.outputs_that_fit``, with the pool's size classes): deliberately
pessimistic, an output of ``n`` bytes counts as twice its class.  So "submit many, consume later" waits
here, in the engine's queue, instead of inside a worker's packer waiting for room in
shared memory while the output deadlines run.  A request refused by the budget alone
(a running slot was free) is a *budget wait*: counted, and timed, in ``stats``.

Batches: with ``max_batch_size > 1`` a request carries a *batch key* (``add(...,
key=...)``; None: never batched), and ``schedule`` admits groups: the oldest waiting
request with every later waiting request of the same key, oldest first, up to
``max_batch_size`` members and as many as the limits leave room for.  Members count
as requests everywhere (``max_running``, ``max_in_flight``, the budget).  A group
smaller than it could be waits for more members for at most ``batch_wait_s`` after
its oldest member arrived (``held_until`` says until when: the engine wakes then);
while it waits nothing behind it is admitted (first come, first served: the wait is
short, and a request behind it must not take the room the group waits to fill).
``batch_wait_s=0`` takes what is waiting now.  ``max_batch_size=1`` admits one request
at a time, as before batching existed.

Sans-IO: no clocks, no threads, no asyncio.  The engine passes ``now`` and calls
every method from its event loop; a test drives it directly.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable

import attrs

from omni_async.core.errors import UsageError
from omni_async.engine.errors import EngineOverloaded
from omni_async.transport.budget import OutputBudget

__all__ = ["SchedulerPhase", "Scheduler", "SchedulerStats"]


class SchedulerPhase(enum.Enum):
    """Where an accepted request is, for the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    HOLDING = "holding"

    def __repr__(self) -> str:
        return self.name


@attrs.define
class SchedulerStats:
    admitted: int = 0
    rejected: int = 0
    # Episodes in which a waiting request could have run (a running slot was free) but
    # the budget of held outputs was full, and their total length in seconds.
    budget_waits: int = 0
    budget_wait_s: float = 0.0
    # Groups admitted together (a single request is a group of one), those of two or
    # more members, and the largest.
    batches: int = 0
    batched: int = 0
    max_batch: int = 0


def _positive(name: str, value: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")


class Scheduler:
    """Admission control (see the module docstring).  Not thread safe: one caller."""

    def __init__(
        self,
        *,
        max_waiting: int,
        max_running: int,
        max_in_flight: int | None = None,
        budget: OutputBudget | None = None,
        max_batch_size: int = 1,
        batch_wait_s: float = 0.0,
    ) -> None:
        """``max_in_flight``: the engine's own cap on running + holding requests;
        ``budget``: the executor's budget of held outputs (None: none);
        ``max_batch_size``, ``batch_wait_s``: batching (see the module docstring)."""
        _positive("max_waiting", max_waiting)
        _positive("max_running", max_running)
        _positive("max_in_flight", max_in_flight, optional=True)
        _positive("max_batch_size", max_batch_size)
        if (
            isinstance(batch_wait_s, bool)
            or not isinstance(batch_wait_s, (int, float))
            or not 0 <= batch_wait_s < float("inf")
        ):
            raise UsageError(f"batch_wait_s must be a number of seconds >= 0, got {batch_wait_s!r}")
        if budget is not None and not isinstance(budget, OutputBudget):
            raise UsageError(f"budget must be an OutputBudget or None, got {type(budget).__name__}")
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.max_in_flight = max_in_flight
        self.budget = budget
        self.max_batch_size = max_batch_size
        self.batch_wait_s = float(batch_wait_s)
        # Waiting requests, oldest first: their batch key and when they arrived.
        self._waiting: OrderedDict[str, tuple[Hashable | None, float]] = OrderedDict()
        self._held_until: float | None = None
        self._running: set[str] = set()
        self._holding: set[str] = set()
        # Outputs lent to callers (sink="segment") after their requests ended: held in
        # the budget like a holding request's until their leases end (``lent``).
        self.lent = 0
        self._largest_output = 0
        self._budget_wait_since: float | None = None
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ queries

    def phase(self, request_id: str) -> SchedulerPhase | None:
        if request_id in self._waiting:
            return SchedulerPhase.WAITING
        if request_id in self._running:
            return SchedulerPhase.RUNNING
        if request_id in self._holding:
            return SchedulerPhase.HOLDING
        return None

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and self.phase(request_id) is not None

    def __len__(self) -> int:
        return len(self._waiting) + len(self._running) + len(self._holding)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def holding(self) -> int:
        return len(self._holding)

    @property
    def in_flight(self) -> int:
        """Requests running or holding an output, and outputs lent (each holds one)."""
        return len(self._running) + len(self._holding) + self.lent

    @property
    def largest_output(self) -> int:
        """The largest output seen so far, in bytes of shared memory (0: none yet)."""
        return self._largest_output

    @property
    def in_flight_limit(self) -> int | None:
        """How many requests may be running or holding at once (None: no limit but ``max_running``)."""
        limits = [] if self.max_in_flight is None else [self.max_in_flight]
        if self.budget is not None:
            limits.append(self.budget.in_flight_limit(self._largest_output))
        return min(limits) if limits else None

    @property
    def free_slots(self) -> int:
        """Running slots the next ``schedule`` could fill now: those ``max_running`` leaves,
        within the limit of requests in flight."""
        room = self.max_running - len(self._running)
        limit = self.in_flight_limit
        if limit is not None:
            room = min(room, limit - self.in_flight)
        return max(0, room)

    def waiting_ids(self) -> list[str]:
        return list(self._waiting)

    @property
    def held_until(self) -> float | None:
        """When the group the last ``schedule`` held back stops waiting for members (None:
        none held): call ``schedule`` again then."""
        return self._held_until

    # ------------------------------------------------------------------ events

    def add(self, request_id: str, *, key: Hashable | None = None, now: float = 0.0) -> None:
        """Queue a request (FIFO); ``EngineOverloaded`` when ``max_waiting`` already wait.
        ``key``: its batch key (None: never batched); ``now``: when it arrived (what
        ``batch_wait_s`` counts from)."""
        if request_id in self:
            raise UsageError(f"request id {request_id!r} is already in the engine; request ids must be unique")
        # Waiting requests that free running slots will take at the next ``schedule`` are
        # not in the queue's bound: requests started together on an idle engine fill the
        # running slots first, and only what is left over waits.
        if len(self._waiting) >= self.max_waiting + self.free_slots:
            self.stats.rejected += 1
            raise EngineOverloaded(
                f"request {request_id!r} refused: the engine's waiting queue is full "
                f"({len(self._waiting) - self.free_slots} requests wait, max_waiting={self.max_waiting}, every "
                "running slot taken); retry later or raise max_waiting",
                request_id=request_id,
                max_waiting=self.max_waiting,
            )
        self._waiting[request_id] = (key, now)

    def schedule(self, now: float) -> list[str]:
        """``schedule_batches``' requests, one after the other (oldest first)."""
        return [rid for group in self.schedule_batches(now) for rid in group]

    def schedule_batches(self, now: float) -> list[list[str]]:
        """Move waiting requests to running, oldest first, as far as the limits allow, in
        groups that go to the workers together (one request each with
        ``max_batch_size=1``); returns the groups in order, each oldest member first (the
        engine sends them in this order)."""
        groups: list[list[str]] = []
        limit = self.in_flight_limit
        self._held_until = None
        while self._waiting and len(self._running) < self.max_running:
            if limit is not None and self.in_flight >= limit:
                break
            room = self.max_running - len(self._running)
            if limit is not None:
                room = min(room, limit - self.in_flight)
            group = self._group(room)
            head_key, head_at = self._waiting[group[0]]
            if head_key is not None and len(group) < min(self.max_batch_size, room):
                until = head_at + self.batch_wait_s
                if now < until:
                    self._held_until = until  # wait for more members (nothing behind it goes first)
                    break
            for rid in group:
                del self._waiting[rid]
                self._running.add(rid)
            groups.append(group)
            self.stats.admitted += len(group)
            self.stats.batches += 1
            self.stats.batched += len(group) > 1
            self.stats.max_batch = max(self.stats.max_batch, len(group))
        held_by_budget = (
            bool(self._waiting)
            and len(self._running) < self.max_running
            and limit is not None
            and self.in_flight >= limit
        )
        if held_by_budget and self._budget_wait_since is None:
            self._budget_wait_since = now
            self.stats.budget_waits += 1
        elif not held_by_budget and self._budget_wait_since is not None:
            self.stats.budget_wait_s += max(0.0, now - self._budget_wait_since)
            self._budget_wait_since = None
        return groups

    def _group(self, room: int) -> list[str]:
        """The oldest waiting request and the later ones of its batch key, up to
        ``max_batch_size`` and ``room``."""
        it = iter(self._waiting.items())
        head, (key, _) = next(it)
        group = [head]
        if key is None:
            return group
        size = min(self.max_batch_size, room)
        for rid, (other, _) in it:
            if len(group) >= size:
                break
            if other == key:
                group.append(rid)
        return group

    def budget_wait_s(self, now: float) -> float:
        """Total time spent in budget waits, the current one included."""
        current = 0.0 if self._budget_wait_since is None else max(0.0, now - self._budget_wait_since)
        return self.stats.budget_wait_s + current

    def compute_done(self, request_id: str) -> None:
        """COMPUTE_DONE for a running request: its running slot is free, it holds an output."""
        if request_id not in self._running:
            raise UsageError(f"compute_done: request {request_id!r} is not running ({self.phase(request_id)})")
        self._running.discard(request_id)
        self._holding.add(request_id)

    def observe_output(self, nbytes: int) -> None:
        """An output of ``nbytes`` bytes of shared memory arrived (refines the byte budget)."""
        if nbytes > self._largest_output:
            self._largest_output = nbytes

    def remove(self, request_id: str) -> SchedulerPhase | None:
        """The request ended (finished, failed, aborted, and everything of it is released):
        it gives back whatever it held.  Returns the phase it was in (None: unknown)."""
        phase = self.phase(request_id)
        if phase is SchedulerPhase.WAITING:
            del self._waiting[request_id]
        elif phase is SchedulerPhase.RUNNING:
            self._running.discard(request_id)
        elif phase is SchedulerPhase.HOLDING:
            self._holding.discard(request_id)
        return phase
