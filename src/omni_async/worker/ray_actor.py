"""The actor side of ``RayDiffusionExecutor``: what runs inside each rank's Ray actor.

``RankActor`` hosts the rank's ``WorkerLoop`` and ``Packer`` (built by
``omni_async.worker.host.build_worker``, as a worker process builds them) on a thread
of its own, fed RPCs in sequence order by an ``OrderedInbox``; the loop and the packer
put their messages into the ``Outbox``, which the executor's pump polls.  An output
shipped through Ray's object store holds room in the rank's ``StoreBudget`` until the
executor releases it.  See ``omni_async.executor.ray_executor`` (the executor side) for the whole design.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

import attrs

from omni_async.core.errors import UsageError
from omni_async.core.messages import AsyncDiffusionOutput, CancelMessage, DiffusionOutput, Failure, RpcRequest
from omni_async.transport.budget import OutputBudget
from omni_async.transport.channel import dumps_message
from omni_async.transport.errors import ChannelClosed, ChannelFull, HeldOutputsFull
from omni_async.transport.packing import StoredPayload, carried_stored_keys, pack_diffusion_output_host
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.worker.dist import Rendezvous, leave_process_group
from omni_async.worker.host import WorkerOptions, WorkerSpec, build_worker

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from ray import ObjectRef

    from omni_async.worker.loop import WorkerLoop
    from omni_async.worker.packer import Packer, PackFn

__all__ = [
    "OrderedInbox",
    "Buffer",
    "Outbox",
    "OutboxLimits",
    "PollBatch",
    "RankActor",
    "RankActorHandle",
    "ReadyReport",
    "StoreBudget",
]

log = logging.getLogger(__name__)

R = TypeVar("R")

# A host copy of one output's tensors, put in Ray's object store (the object-store path).
Buffer: TypeAlias = "npt.NDArray[np.uint8]"
# What one poll returns: the number of the first message, and each message pickled,
# with the refs of the stored buffers it refers to (key -> ref), beside it.
PollBatch = tuple[int, list[tuple[bytes, dict[str, "ObjectRef[Buffer]"]]]]
# What ``ready`` returns: the start-up failure (None), pid, node id, address, via_store.
ReadyReport = tuple[Failure | None, int, str, str, bool]


class RemoteMethod(Protocol[R]):
    """One method of an actor handle: ``.remote(...)`` starts the call, a ref of its result."""

    def remote(self, *args: object) -> ObjectRef[R]: ...


class RankActorHandle(Protocol):
    """The executor's view of a ``RankActor`` handle (Ray types a handle's methods loosely)."""

    @property
    def ready(self) -> RemoteMethod[ReadyReport]: ...
    @property
    def rpc(self) -> RemoteMethod[None]: ...
    @property
    def cancel(self) -> RemoteMethod[None]: ...
    @property
    def poll(self) -> RemoteMethod[PollBatch]: ...
    @property
    def released(self) -> RemoteMethod[None]: ...
    @property
    def stop(self) -> RemoteMethod[bool]: ...
    @property
    def stored_refs(self) -> RemoteMethod[int]: ...
    @property
    def store_budget(self) -> RemoteMethod[tuple[int, int]]: ...


@attrs.frozen
class OutboxLimits:
    """The bounds of an actor's outbox (the result channel's defaults, see ``RayRanks``)."""

    max_messages: int
    max_bytes: int
    max_message_bytes: int
    put_timeout: float | None


@attrs.frozen
class StoreBudget:
    """Per rank, the budget of its buffers in Ray's object store: put by its packer and not
    yet released by the executor (dropped unread, or read and every view of it gone),
    as the pool's budget of held outputs is for shared memory: the same ``OutputBudget``,
    counted per rank."""

    budget: OutputBudget
    timeout: float
    rank: int

    @property
    def max_outputs(self) -> int:
        return self.budget.max_outputs

    @property
    def max_bytes(self) -> int | None:
        return self.budget.max_bytes

    def full(self, output: DiffusionOutput, held: int, held_bytes: int, nbytes: int) -> HeldOutputsFull:
        return HeldOutputsFull(
            f"output {output.async_output_id} of request {output.request_id!r} found no room in rank {self.rank}'s "
            f"budget of outputs in Ray's object store within lease_timeout={self.timeout} s: {held} of "
            f"max_held_outputs={self.max_outputs} outputs and {held_bytes} of max_held_bytes={self.max_bytes} bytes "
            f"are held (put, and not yet released: read by a waiter whose views are still alive, or not read yet); "
            f"it needs {nbytes} bytes.  Drop the views of delivered outputs sooner (or drop_output), or raise "
            "RayDiffusionExecutor(max_held_outputs=..., max_held_bytes=...)",
            nbytes=nbytes,
            timeout=self.timeout,
        )


class Outbox:
    """The actor's end of the result channel: numbered pickled messages, bounded, in put order."""

    def __init__(self, limits: OutboxLimits) -> None:
        max_messages, max_bytes = limits.max_messages, limits.max_bytes
        max_message_bytes, put_timeout = limits.max_message_bytes, limits.put_timeout
        self._cond = threading.Condition()
        self._items: collections.deque[tuple[bytes, dict[str, ObjectRef[Buffer]]]] = collections.deque()
        # Object-store path: key -> ObjectRef of each stored buffer not yet in a message
        # (``ray.put`` by the packer); a message takes its refs along, out of band.
        self.stored: dict[str, ObjectRef[Buffer]] = {}
        self._bytes = 0
        self._first = 0  # the number of _items[0]
        self._max_messages = max_messages
        self._max_bytes = max_bytes
        self._max_message_bytes = max_message_bytes
        self._put_timeout = put_timeout
        self._closed = False
        # The budget of stored buffers (``StoreBudget``): key -> bytes of each buffer put
        # and not yet released by the executor.
        self.held: dict[str, int] = {}
        self.waiting = 0  # packs waiting for room now

    def put(self, msg: AsyncDiffusionOutput, timeout: float | None = None) -> None:
        data = dumps_message(msg, self._max_message_bytes)  # the caller's thread (F5)
        keys = carried_stored_keys(msg)
        limit = self._put_timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        with self._cond:
            while not self._closed and (
                len(self._items) >= self._max_messages or (self._items and self._bytes + len(data) > self._max_bytes)
            ):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ChannelFull(
                        f"the result outbox is full ({len(self._items)} messages, {self._bytes} bytes): the "
                        "executor's pump takes nothing",
                        nbytes=len(data),
                        timeout=limit,
                    )
                self._cond.wait(left)
            if self._closed:
                raise ChannelClosed("the result outbox is closed (the executor shut down)")
            self._items.append((data, {k: self.stored.pop(k) for k in keys if k in self.stored}))
            self._bytes += len(data)
            self._cond.notify_all()

    def store(self, ref: ObjectRef[Buffer], key: str) -> None:
        with self._cond:
            self.stored[key] = ref

    def drop(self, key: str) -> None:
        with self._cond:
            self.stored.pop(key, None)
            self.held.pop(key, None)
            self._cond.notify_all()

    def hold(self, key: str, nbytes: int, budget: StoreBudget, output: DiffusionOutput) -> None:
        """Room for one more stored buffer of ``nbytes`` (the packer's thread): waits while
        the budget is full; ``HeldOutputsFull`` after its timeout."""
        deadline = time.monotonic() + budget.timeout
        with self._cond:
            self.waiting += 1
            try:
                while not self._closed and (
                    len(self.held) >= budget.max_outputs
                    or (
                        budget.max_bytes is not None
                        and self.held
                        and sum(self.held.values()) + nbytes > budget.max_bytes
                    )
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise budget.full(output, len(self.held), sum(self.held.values()), nbytes)
                    self._cond.wait(left)
            finally:
                self.waiting -= 1
            if self._closed:
                raise ChannelClosed("the result outbox is closed (the executor shut down)")
            self.held[key] = nbytes

    def released(self, keys: list[str]) -> None:
        with self._cond:
            for key in keys:
                self.held.pop(key, None)
            self._cond.notify_all()

    def take(self, wait: float) -> PollBatch:
        """Everything queued (waiting up to ``wait`` for something), and the number of the first:
        each message with the refs of the buffers it refers to (returned in band, never
        pickled inside the message, where Ray's reference counting would pin them forever)."""
        with self._cond:
            if not self._items and not self._closed:
                self._cond.wait(wait)
            first, batch = self._first, list(self._items)
            self._items.clear()
            self._bytes = 0
            self._first += len(batch)
            self._cond.notify_all()
            return first, batch

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class OrderedInbox:
    """RPCs in their sequence order, whatever order the actor's threads deliver them in."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: dict[int, RpcRequest | None] = {}
        self._next = 0

    def put(self, seq: int, req: RpcRequest | None) -> None:
        with self._cond:
            self._waiting[seq] = req
            self._cond.notify_all()

    def get(self) -> RpcRequest | None:
        with self._cond:
            while self._next not in self._waiting:
                self._cond.wait()
            self._next += 1
            return self._waiting.pop(self._next - 1)


class RankActor:
    """The body of one rank's Ray actor: the worker loop on a thread, fed in RPC order."""

    def __init__(
        self,
        rank: int,
        spec: WorkerSpec,
        opts: WorkerOptions,
        pool_state: bytes,
        outbox: OutboxLimits,
        driver_path: list[str] | None = None,
        driver_node: str = "",
        transport: str = "auto",
        budget: StoreBudget | None = None,
        rendezvous: Rendezvous | None = None,
    ):
        # The driver's import path, as a spawned worker process inherits it: a factory the
        # driver can import (its own package, a test's helpers) is importable here too.
        for entry in reversed(driver_path or []):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
        self._rank = rank
        self._outbox = Outbox(outbox)
        self._inbox = OrderedInbox()
        self._built = threading.Event()
        self._failure: Failure | None = None
        self._loop: WorkerLoop | None = None
        self._packer: Packer | None = None
        import ray

        self._node = ray.get_runtime_context().get_node_id()
        self._remote = self._node != driver_node
        # Decided once, here: the pool where the executor's node is ours, Ray's object store otherwise.
        self._via_store = transport == "object_store" or (transport == "auto" and self._remote)
        self._stored_n = 0
        self._budget = budget or StoreBudget(OutputBudget(), 30.0, rank)
        self._thread = threading.Thread(
            target=self._main, args=(spec, opts, pool_state, rendezvous), name=f"omni-worker-{rank}", daemon=True
        )
        self._thread.start()

    def _main(self, spec: WorkerSpec, opts: WorkerOptions, pool_state: bytes, rendezvous: Rendezvous | None) -> None:
        # Built on this thread: a CUDA worker's current device is set per thread.
        try:
            if self._via_store:
                packer, loop = build_worker(
                    self._rank,
                    spec,
                    opts,
                    None,
                    self._outbox,
                    packing=(self._pack_stored(opts), self._release_stored),
                    rendezvous=rendezvous,
                )
            elif self._remote:
                raise UsageError("transport='shm' on another node than the executor's")  # the executor says more
            else:
                pool = pickle.loads(pool_state)
                packer, loop = build_worker(self._rank, spec, opts, pool, self._outbox, rendezvous=rendezvous)
            packer.start()
        except BaseException as exc:
            self._failure = Failure.from_exception(exc)
            self._built.set()
            return
        self._packer, self._loop = packer, loop
        self._built.set()
        try:
            while (req := self._inbox.get()) is not None:
                try:
                    loop.handle_rpc(req)
                except Exception:
                    log.exception("worker rank %d: handling %s failed", self._rank, req.method)
        finally:
            packer.stop(timeout=10.0, abandon=True)  # exiting: a pack waiting for room must not hold it
            leave_process_group()  # the loop ended: no collective of ours is in flight

    def _pack_stored(self, opts: WorkerOptions) -> PackFn:
        import ray

        def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
            def put(buf: np.ndarray[Any, Any]) -> str:  # pack_diffusion_output_host's own type
                key = f"{self._rank}.{self._stored_n}"
                self._stored_n += 1  # the packer's thread, or the loop's in step mode: one at a time
                self._outbox.hold(key, int(buf.nbytes), self._budget, output)  # back-pressure: waits for room
                try:
                    ref = ray.put(buf)
                except BaseException:
                    self._outbox.released([key])
                    raise
                self._outbox.store(ref, key)
                return key

            return pack_diffusion_output_host(
                output, stream, put=put, inline_threshold=opts.inline_threshold, ready_event=event
            )

        return pack

    def _release_stored(self, packed: DiffusionOutput) -> None:
        if isinstance(packed.output, StoredPayload) and packed.output.key:
            self._outbox.drop(packed.output.key)  # never sent: the ref goes here

    def ready(self, timeout: float) -> ReadyReport:
        """Once the model is built: the failure that stopped it (None), pid, node id, address,
        and whether its outputs go through the object store."""
        import ray

        address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        if self._remote and not self._via_store:
            return None, os.getpid(), self._node, address, False  # the executor refuses it
        if not self._built.wait(timeout):
            return Failure("ComputeTimeout", f"no model in {timeout} s", ""), os.getpid(), "", "", False
        return self._failure, os.getpid(), self._node, address, self._via_store

    def stored_refs(self) -> int:
        """How many stored buffers this actor still holds a ref to (not yet in a polled message)."""
        with self._outbox._cond:
            return len(self._outbox.stored) + sum(len(refs) for _, refs in self._outbox._items)

    def store_budget(self) -> tuple[int, int]:
        """This actor's budget of stored buffers (``StoreBudget``) now: how many are held,
        and how many packs wait for room."""
        with self._outbox._cond:
            return len(self._outbox.held), self._outbox.waiting

    def released(self, keys: list[str]) -> None:
        """The executor is done with these stored buffers: room in the budget again."""
        self._outbox.released(keys)

    def rpc(self, seq: int, req: RpcRequest | None) -> None:
        self._inbox.put(seq, req)

    def cancel(self, cancels: list[CancelMessage]) -> None:
        if self._loop is not None:
            for msg in cancels:
                self._loop.cancel(msg)

    def poll(self, wait: float) -> PollBatch:
        return self._outbox.take(wait)

    def stop(self, seq: int, timeout: float) -> bool:
        """Finish the RPC in hand, stop the packer; True once the loop thread ended."""
        self._inbox.put(seq, None)
        self._outbox.close()  # nobody polls any more: a put fails at once
        self._thread.join(timeout)
        with self._outbox._cond:
            self._outbox.stored.clear()  # what was stored and never sent
            self._outbox.held.clear()
            self._outbox._items.clear()
        return not self._thread.is_alive()
