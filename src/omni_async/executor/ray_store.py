"""``ObjectStore``: the output store of ``RayDiffusionExecutor``.

The outputs of an actor on the executor's node live in the executor's shared-memory
pool (a ``PoolStore``, composed here); those of an actor on another node (or every
actor, ``transport="object_store"``) in Ray's object store: the actor puts each output's
host buffer with ``ray.put`` and ships its ref beside the message
(``omni_async.executor.ray_executor``'s docstring has the whole design).  This store owns
what follows on the executor's side:

* ``StoredBuffers``: key -> ref of every stored buffer received and not yet read or
  released, filled by the rank link's receiver before the message is queued; each ref
  is taken out exactly once (read for a waiter, or released), so each buffer is freed
  once; emptied at shutdown.
* ``Credits``: the room of the buffers the executor is done with, given back to their
  actors' budgets on a thread of its own (``omni-credit``; ``give`` may run in a
  finalizer, inside a garbage collection).
* the fetch threads (``omni-fetch``): the ``ray.get`` of a stored output (a transfer
  across nodes) runs there, never on the pump's thread, bounded by ``output_timeout``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from omni_async.core.errors import OutputUnpackFailed, UsageError
from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput
from omni_async.executor.metrics import ExecutorMetrics, HeldOutputMetrics
from omni_async.executor.pool_store import PoolStore
from omni_async.executor.store import OutputStore
from omni_async.transport.budget import OutputBudget
from omni_async.transport.packing import StoredPayload, unpack_diffusion_output_host
from omni_async.worker.ray_actor import Buffer, RankActorHandle

if TYPE_CHECKING:
    from ray import ObjectRef

__all__ = ["Credits", "ObjectStore", "StoredBuffers"]

log = logging.getLogger(__name__)


def _get_stored(ref: ObjectRef[Buffer], timeout: float | None) -> Buffer:
    import ray

    return ray.get(ref, timeout=timeout)


class StoredBuffers:
    """The refs of the stored buffers received and not yet taken (module docstring)."""

    def __init__(self) -> None:
        self._refs: dict[str, ObjectRef[Buffer]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.received = 0  # stored buffers received in all (the held count's one side)

    def add(self, refs: dict[str, ObjectRef[Buffer]]) -> None:
        """Refs that arrived beside a message, before the message is queued (its release finds them)."""
        with self._lock:
            if not self._closed:
                self._refs.update(refs)
                self.received += len(refs)

    def take(self, key: str) -> ObjectRef[Buffer] | None:
        """The ref of a stored buffer, out of the table (None when already taken): once."""
        with self._lock:
            return self._refs.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._refs)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._refs.clear()  # every stored buffer still referenced goes


class Credits:
    """Room given back to the actors' budgets (``StoreBudget``): keys of stored buffers the
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


class ObjectStore(OutputStore):
    """Outputs in Ray's object store, or in ``pooled``'s pool (module docstring)."""

    def __init__(self, pooled: PoolStore, *, fetch_threads: int, output_timeout: float | None, copy: bool) -> None:
        self.pooled = pooled
        self.stored = StoredBuffers()
        self.credits = Credits()
        self._fetchers = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="omni-fetch")
        self._output_timeout = output_timeout
        self._copy = copy

    @property
    def budget(self) -> OutputBudget:
        return self.pooled.budget

    @staticmethod
    def _stored(packed: DiffusionOutput) -> StoredPayload | None:
        return packed.output if isinstance(packed.output, StoredPayload) else None

    def run_unpack(self, packed: DiffusionOutput, finish: Callable[[], None]) -> None:
        """A stored output's unpack goes to a fetch thread (its ``ray.get`` is a transfer);
        a pooled one is unpacked here, on the pump's thread."""
        payload = self._stored(packed)
        if payload is None or not payload.key:
            finish()
            return
        try:
            self._fetchers.submit(finish)
        except RuntimeError:  # shut down: unpack here (the table is empty, it fails at once)
            finish()

    def receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        payload = self._stored(packed)
        if payload is None:
            return self.pooled.receive(packed)
        try:
            if not payload.key:
                return unpack_diffusion_output_host(packed, None, copy=self._copy)
            ref = self.stored.take(payload.key)  # freed once: the views hold the buffer now
            if ref is None:
                raise UsageError(f"stored buffer {payload.key} is gone (released, or the executor shut down)")
            key = payload.key
            try:
                buf = _get_stored(ref, self._output_timeout)
            except BaseException:
                self.credits.give(key)
                raise
            return unpack_diffusion_output_host(packed, buf, copy=self._copy, on_gone=lambda: self.credits.give(key))
        except Exception as exc:
            raise OutputUnpackFailed(packed.async_output_id, packed.request_id, exc) from exc

    def _release_stored(self, payload: StoredPayload) -> None:
        if payload.key and self.stored.take(payload.key) is not None:
            self.credits.give(payload.key)

    def release_packed(self, packed: DiffusionOutput) -> None:
        payload = self._stored(packed)
        if payload is None:
            self.pooled.release_packed(packed)
        else:
            self._release_stored(payload)

    def release(self, output: DiffusionOutput) -> int:
        return self.pooled.release(output)

    def discard_answer(self, result: object) -> None:
        outputs = result.per_request() if isinstance(result, BatchDiffusionOutput) else [result]
        for out in outputs:
            if isinstance(out, DiffusionOutput):
                payload = self._stored(out)
                if payload is None:
                    self.pooled.give_back(out)
                else:
                    self._release_stored(payload)

    def held_elsewhere(self) -> int:
        """Stored outputs received and not yet released (unread, or read and some view alive)."""
        return max(0, self.stored.received - self.credits.given)

    def metrics(self, base: ExecutorMetrics) -> HeldOutputMetrics:
        return self.pooled.metrics(base, held_elsewhere=self.held_elsewhere(), stored=len(self.stored))

    def close(self) -> None:
        self.stored.close()
        self._fetchers.shutdown(wait=False)
        self.credits.close()  # what is queued still runs, and fails at once: the table is empty
        self.pooled.close()
