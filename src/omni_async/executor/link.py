"""Rank links: how an executor reaches its ranks.

A ``RankLink`` starts the ranks, delivers every RPC and cancel to them, hands the pump
its end of the result channel (``receiver``), reports a failure beside a dead rank
(``failure``) and stops them.  Links: threads of this process (``ThreadRanks``,
``executor/inprocess.py``), worker processes and pipes (``ProcessRanks``,
``executor/process_link.py``), Ray actors and their outboxes (``RayRanks``,
``executor/ray_link.py``).  The executors are siblings over ``DiffusionExecutor``, each
built with its link, as vLLM's ``MultiprocExecutor`` and ``RayDistributedExecutor`` are
over theirs; none overrides another.

What a link reports back goes to the ``RankEvents`` it is handed at ``start``: a rank's
death (every waiter failed, the registry closed, what the rank held in the pool given
back), the end of a dead rank's result channel (what it shipped and no message carried
given back), and the monitor's look at the budget of held outputs.  The link never
calls the executor itself: ``RankEvents`` holds what those need (the pump, the pool's
store, whether the executor is closed), handed to it by the executor.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable

from omni_async.core.errors import ExecutorShutdown, OmniAsyncError, WorkerDied
from omni_async.core.messages import CancelMessage, RpcRequest
from omni_async.executor.pool_store import PoolStore
from omni_async.executor.pump import ResultPump
from omni_async.transport.channel import ResultReceiver

__all__ = ["RankEvents", "RankLink", "shut_down_error"]

log = logging.getLogger(__name__)


def shut_down_error() -> ExecutorShutdown:
    """What a send to the ranks of a closed executor raises."""
    return ExecutorShutdown("the executor is shut down")


class RankEvents:
    """Where a rank link reports what happens to its ranks (module docstring).

    ``closed``: whether the executor is shut down (a death then is the shutdown's doing,
    and a send must not start); ``token``: the executor's id, for names the ranks get.
    """

    def __init__(self, pump: ResultPump, store: PoolStore, *, closed: Callable[[], bool], token: str) -> None:
        self._pump = pump
        self._store = store
        self._closed = closed
        self.token = token
        # The first rank death: every later call fails with it (``failure``).
        self._failure: WorkerDied | None = None

    @property
    def closed(self) -> bool:
        return self._closed()

    @property
    def failure(self) -> WorkerDied | None:
        """The death that failed the executor, or None while every rank lives."""
        return self._failure

    def rank_died(
        self,
        rank: int,
        error: WorkerDied,
        per_output: Callable[[str | None], WorkerDied],
        pid: int | None,
        *,
        reclaim_shipped: bool,
    ) -> None:
        """A rank is gone: the executor fails from now on, every waiter fails with
        ``per_output(id)``, and what the rank held in the pool goes back.  Its shipped
        segments go back too when ``reclaim_shipped`` (every message it sent was read);
        otherwise the link calls ``reclaim_shipped`` once they are."""
        if self.closed:
            return
        log.error("%s", error)
        if self._failure is None:
            self._failure = error
        if pid is not None:
            self._store.reclaim_owner(rank, pid)
        # Close the registry too (TLC's DeathKeepsOpen): a message the dead rank sent
        # before dying can still be in the channel; without the close it would create a
        # record (EARLY_READY, no deadline) that nobody ever claims.
        self._pump.fail_all(per_output, outcome="worker_died", close=True)
        if pid is not None and reclaim_shipped:
            self._store.reclaim_shipped(rank, pid)

    def reclaim_shipped(self, rank: int, pid: int) -> None:
        """The dead rank's death is handled and its channel read to the end: free what it
        shipped that no message carried (TLC's ``ReclaimSparesShipped``; ``PumpReachEof``)."""
        self._store.reclaim_shipped(rank, pid)

    def check_budget(self) -> None:
        """The link's monitor looks at the budget of held outputs (a warning when full)."""
        self._store.check_budget()


class RankLink(abc.ABC):
    """How an executor reaches its ranks (module docstring)."""

    receiver: ResultReceiver

    @abc.abstractmethod
    def start(self, events: RankEvents | None, deadline: float, start_timeout: float) -> None:
        """Start every rank and wait until each has built its model (before the pump starts);
        raise ``WorkerStartupFailed`` or ``ComputeTimeout`` otherwise.  ``events``: where
        the link reports deaths (None: a link whose ranks cannot die apart from it)."""

    def started(self) -> None:  # noqa: B027 (a hook most links leave empty)
        """The pump runs: start what needs it (a monitor that fails waiters)."""

    @abc.abstractmethod
    def broadcast(self, req: RpcRequest, wire: list[bytes] | None) -> None:
        """Deliver ``req`` to every rank (``ExecutorShutdown`` once the executor is closed)."""

    def encode(self, req: RpcRequest) -> list[bytes] | None:
        """``req`` as each rank gets it, for a link that pickles ahead (None: it does not);
        ``RequestNotSendable`` when it cannot travel, before any rank got any of it."""
        return None

    @abc.abstractmethod
    def deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        """Send ``cancels`` to every rank's control path; never blocks (the pump calls it)."""

    def failure(self) -> OmniAsyncError | None:
        """A dead rank, or a link-level failure (a torn frame); None while all is well."""
        return None

    @abc.abstractmethod
    def stop(self, deadline: float | None) -> None:
        """Stop every rank by ``deadline`` (idempotent; None: the link's own defaults); the
        executor closes its output store after."""
