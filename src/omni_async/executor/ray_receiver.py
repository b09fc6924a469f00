"""The executor's end of the Ray ranks' result channel (``RayDiffusionExecutor``).

``RayReceiver``: the pump reads the actors' outboxes through it, one outstanding
``poll`` per rank, each rank's batches queued in its order (per-rank FIFO: see
``omni_async.executor.ray_executor``'s docstring); an actor lost while polled becomes a
death the ranks report.  ``Credits``: the room of stored buffers the executor is done
with, given back to their actors' budgets on a thread of its own.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import attrs

from omni_async.core.errors import ProtocolError
from omni_async.core.messages import AsyncDiffusionOutput
from omni_async.executor.ray_actor import Buffer, PollBatch, RankActorHandle
from omni_async.transport.channel import loads_message
from omni_async.transport.errors import ChannelClosed
from omni_async.transport.packing import carried_leases
from omni_async.transport.shm import SegmentPool

if TYPE_CHECKING:
    from ray import ObjectRef

__all__ = ["POLL_WAIT_S", "Credits", "Death", "RayReceiver"]

log = logging.getLogger(__name__)

# How long an actor's poll waits for a message before it answers with none.
POLL_WAIT_S: Final = 1.0


@attrs.frozen
class Death:
    rank: int
    cause: str


class RayReceiver:
    """The pump's end: one outstanding poll per rank, batches queued in order (module docstring)."""

    def __init__(self, pool: SegmentPool) -> None:
        self._pool = pool
        self.on_death: Callable[[int, str], None] | None = None  # set by RayRanks.start
        # Object-store path: key -> ObjectRef of each received output's stored buffer, until
        # its unpack or its release (the executor's); emptied at shutdown.
        self.stored: dict[str, ObjectRef[Buffer]] = {}
        self.stored_lock = threading.Lock()
        self.received_stored = 0  # stored buffers received in all (the held count's one side)
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
            with self.stored_lock:
                if not self._closed:
                    self.stored.update(refs)  # before the message: its release finds them
                    self.received_stored += len(refs)
            try:
                msg = loads_message(data)
            except ProtocolError as exc:
                with self.stored_lock:
                    for key in refs:
                        self.stored.pop(key, None)
                self._queue.append(exc)
                continue
            for lease in carried_leases(msg):  # as _ReceivingEnd: received before dispatch
                try:
                    self._pool.receive(lease)
                except Exception:  # noqa: BLE001  # the pool closed at shutdown
                    log.debug("marking %s received failed", lease.name, exc_info=True)
            self._queue.append(msg)

    def close(self) -> None:
        with self.stored_lock:
            self._closed = True
            self.stored.clear()  # every stored buffer still referenced goes

    def take_stored(self, key: str) -> ObjectRef[Buffer] | None:
        """The ref of a stored buffer, out of the table (None when already taken): once."""
        with self.stored_lock:
            return self.stored.pop(key, None)


class Credits:
    """Room given back to the actors' budgets (``_StoreBudget``): keys of stored buffers the
    executor is done with, sent to their rank's actor (``released``) by a thread of its own
    (``omni-credit``): ``give`` may run in a finalizer, inside a garbage collection."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # put() is reentrant
        self._actors: list[RankActorHandle] = []
        # Keys given back in all, counted at once (``metrics()``' held outputs): under a
        # reentrant lock, since ``give`` may run in a finalizer on a thread inside it.
        self.given = 0
        self._count_lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, name="omni-credit", daemon=True)

    def start(self, actors: list[RankActorHandle]) -> None:
        self._actors = actors
        self._thread.start()

    def give(self, key: str) -> None:
        with self._count_lock:
            self.given += 1
        self._queue.put(key)

    def _run(self) -> None:
        stop = False
        while not stop:
            keys: list[str] = []
            item = self._queue.get()
            while item is not None:  # everything queued, in one call per rank
                keys.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            stop = item is None
            per_rank: dict[int, list[str]] = collections.defaultdict(list)
            for k in keys:
                prefix = k.partition(".")[0]
                if prefix.isdigit() and int(prefix) < len(self._actors):
                    per_rank[int(prefix)].append(k)
            for rank, ks in per_rank.items():
                try:
                    self._actors[rank].released.remote(ks)  # returns at once; a dead actor: nothing to give
                except Exception:  # noqa: BLE001  # Ray shut down
                    log.debug("giving %d stored buffer(s) back to rank %d failed", len(ks), rank, exc_info=True)

    def close(self) -> None:
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(5.0)
