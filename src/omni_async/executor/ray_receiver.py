"""The executor's end of the Ray ranks' result channel (``RayDiffusionExecutor``).

``RayReceiver``: the pump reads the actors' outboxes through it, one outstanding
``poll`` per rank, each rank's batches queued in its order (per-rank FIFO: see
``omni_async.executor.ray_executor``'s docstring); an actor lost while polled becomes a
death the ranks report.  The refs that arrive beside the messages go into the output
store's ``StoredBuffers`` (``omni_async.executor.ray_store``) before the message is queued.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import attrs

from omni_async.core.errors import ProtocolError
from omni_async.core.messages import AsyncDiffusionOutput
from omni_async.executor.ray_store import StoredBuffers
from omni_async.transport.channel import loads_message
from omni_async.transport.errors import ChannelClosed
from omni_async.transport.packing import carried_leases
from omni_async.transport.shm import SegmentPool
from omni_async.worker.ray_actor import Buffer, PollBatch, RankActorHandle

if TYPE_CHECKING:
    from ray import ObjectRef

__all__ = ["POLL_WAIT_S", "Death", "RayReceiver"]

log = logging.getLogger(__name__)

# How long an actor's poll waits for a message before it answers with none.
POLL_WAIT_S: Final = 1.0


@attrs.frozen
class Death:
    rank: int
    cause: str


class RayReceiver:
    """The pump's end: one outstanding poll per rank, batches queued in order (module docstring)."""

    def __init__(self, pool: SegmentPool, stored: StoredBuffers) -> None:
        self._pool = pool
        self._stored = stored
        self.on_death: Callable[[int, str], None] | None = None  # set by RayRanks.start
        self._queue: collections.deque[AsyncDiffusionOutput | Death | ProtocolError] = collections.deque()
        self._pending: dict[ObjectRef[PollBatch], int] = {}  # poll -> rank
        self._actors: list[RankActorHandle] = []
        self._next: list[int] = []
        self._closed = False

    def start(self, actors: list[RankActorHandle]) -> None:
        self._actors = actors
        self._next = [0] * len(actors)
        for rank in range(len(actors)):
            self._poll(rank)

    def _poll(self, rank: int) -> None:
        self._pending[self._actors[rank].poll.remote(POLL_WAIT_S)] = rank

    def get(self, timeout: float) -> AsyncDiffusionOutput | None:
        import ray

        if self._closed:
            raise ChannelClosed("the result channel is closed")
        if not self._queue:
            if not self._pending:
                time.sleep(timeout)
                return None
            done, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout)
            for ref in done:
                rank = self._pending.pop(ref)
                try:
                    first, batch = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._queue.append(Death(rank, f"{type(exc).__name__}: {exc}".splitlines()[0]))
                    continue  # no next poll: the rank is gone
                self._take(rank, first, batch)
                self._poll(rank)
        if not self._queue:
            return None
        item = self._queue.popleft()
        if isinstance(item, Death):
            if self.on_death is not None:
                self.on_death(item.rank, item.cause)
            return None
        if isinstance(item, ProtocolError):
            raise item  # the pump counts it and reads on
        return item

    def _take(self, rank: int, first: int, batch: list[tuple[bytes, dict[str, ObjectRef[Buffer]]]]) -> None:
        if first != self._next[rank]:
            self._queue.append(
                ProtocolError(f"rank {rank}: results {self._next[rank]}..{first - 1} never arrived (per-rank order)")
            )
        self._next[rank] = first + len(batch)
        for data, refs in batch:
            if not self._closed:
                self._stored.add(refs)  # before the message: its release finds them
            try:
                msg = loads_message(data)
            except ProtocolError as exc:
                for key in refs:
                    self._stored.take(key)
                self._queue.append(exc)
                continue
            for lease in carried_leases(msg):  # as _ReceivingEnd: received before dispatch
                try:
                    self._pool.receive(lease)
                except Exception:  # noqa: BLE001  # the pool closed at shutdown
                    log.debug("marking %s received failed", lease.name, exc_info=True)
            self._queue.append(msg)

    def close(self) -> None:
        self._closed = True
        self._stored.close()  # every stored buffer still referenced goes
