"""The engine's scheduler: admission control over a bounded queue, sans-IO.

Theory of operation
-------------------
A request the engine accepted is in one of three places:

* **waiting**: in the engine's FIFO queue, not sent to any worker.  The queue is
  bounded (``max_waiting``); ``add`` on a full queue raises ``EngineOverloaded`` at the
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

Sans-IO: no clocks, no threads, no asyncio.  The engine passes ``now`` and calls
every method from its event loop; a test drives it directly.
"""

from __future__ import annotations

import enum
from collections import OrderedDict

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
    ) -> None:
        """``max_in_flight``: the engine's own cap on running + holding requests;
        ``budget``: the executor's budget of held outputs (None: none)."""
        _positive("max_waiting", max_waiting)
        _positive("max_running", max_running)
        _positive("max_in_flight", max_in_flight, optional=True)
        if budget is not None and not isinstance(budget, OutputBudget):
            raise UsageError(f"budget must be an OutputBudget or None, got {type(budget).__name__}")
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.max_in_flight = max_in_flight
        self.budget = budget
        self._waiting: OrderedDict[str, None] = OrderedDict()
        self._running: set[str] = set()
        self._holding: set[str] = set()
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
        return len(self._running) + len(self._holding)

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

    def waiting_ids(self) -> list[str]:
        return list(self._waiting)

    # ------------------------------------------------------------------ events

    def add(self, request_id: str) -> None:
        """Queue a request (FIFO); ``EngineOverloaded`` when ``max_waiting`` already wait."""
        if request_id in self:
            raise UsageError(f"request id {request_id!r} is already in the engine; request ids must be unique")
        if len(self._waiting) >= self.max_waiting:
            self.stats.rejected += 1
            raise EngineOverloaded(
                f"request {request_id!r} refused: the engine's waiting queue is full "
                f"({self.max_waiting} requests wait, max_waiting={self.max_waiting}); retry later "
                "or raise max_waiting",
                request_id=request_id,
                max_waiting=self.max_waiting,
            )
        self._waiting[request_id] = None

    def schedule(self, now: float) -> list[str]:
        """Move waiting requests to running, oldest first, as far as the limits allow;
        returns them in order (the engine sends them in this order)."""
        admitted: list[str] = []
        limit = self.in_flight_limit
        while self._waiting and len(self._running) < self.max_running:
            if limit is not None and self.in_flight >= limit:
                break
            rid, _ = self._waiting.popitem(last=False)
            self._running.add(rid)
            admitted.append(rid)
        self.stats.admitted += len(admitted)
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
        return admitted

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
