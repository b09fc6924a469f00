"""``RayDiffusionExecutor``: one Ray actor per rank, the same two-phase protocol.

Only the transport differs from ``MultiprocDiffusionExecutor``: the registry, the
dispatcher, the pump and the spec are the same, and each actor hosts the same
``WorkerLoop`` and ``Packer`` built from a ``WorkerSpec``.  Ray is imported here
only, when the executor is built (``pip install 'omni_async[ray]'``).

Placement: a placement group of ``world_size`` bundles (``{"CPU": 1}``, plus
``{"GPU": 1}`` when ``WorkerOptions.device`` is a CUDA device), one actor per bundle;
shutdown kills every actor and removes the group.  Or the caller's group
(``placement_group=``): rank r in its bundle r, the group left to its owner.

Who runs what:

* Each actor (a threaded actor) runs the worker loop on a thread of its own
  (``omni-worker-<rank>``), fed from an inbox; its packer on another.  Both put their
  messages into the actor's *outbox*, which pickles each message in the caller's
  thread (``dumps_message``: the result channel's contract, F5), numbers it and keeps
  it, bounded, until the executor takes it (a full outbox blocks ``put``, and raises
  ``ChannelFull`` after ``put_timeout``; back-pressure as on a pipe).
* The executor's pump reads the results (``_RayReceiver``): for every rank exactly one
  ``poll`` call is outstanding at any time; ``poll`` returns everything the outbox holds
  (waiting up to a second for something), in outbox order, with the number of the
  first message.  The pump takes whichever poll finished (``ray.wait``), queues its
  messages in order, and issues that rank's next poll.

Why per-rank FIFO holds (spec/PROTOCOL.md): a rank's messages enter its outbox in
``put`` order (one lock), a poll takes a prefix of the outbox in that order, and the
next poll of that rank is issued only after the previous one was received, so the
batches of a rank reach the pump one after another, in order.  The numbers make it
checked, not assumed: a batch that does not start where the previous one ended is a
``ProtocolError``.  Messages of different ranks interleave freely, as on the pipes.
RPCs travel the other way the same way round: every ``rpc`` call carries a per-rank
sequence number and the actor's inbox hands them to the loop in that order, whatever
order Ray runs the (concurrent) calls of a threaded actor in.

Outputs, two paths, chosen per actor at start-up (``transport``): an actor on the
executor's node (``ray.get_runtime_context().get_node_id()`` of actor and driver equal)
packs into the executor's ``SegmentPool`` exactly as worker processes do -- the pool is
made with ``attach_by_name`` so that the actor, not a child of ours, can attach to it --
and the engine gets zero-copy views, released as today. An actor on another node cannot
reach the pool (``transport="auto"``, the default) or is told not to
(``transport="object_store"``, which tests the path on one machine): its packer copies
each output into one host buffer (``pack_diffusion_output_host``: the same skeleton,
inline leaves and ordering after the forward's event on the side stream as the pool's
pack; pinned when the output is on a GPU) and puts it with ``ray.put``; the actor owns
the ref in a table until a message carrying the output is put in the outbox, which takes
the ref along *beside* the message bytes: a poll returns ``(bytes, {key: ref})`` pairs.
The refs never travel pickled inside the message, where Ray's reference counting would
pin them forever. The receiver puts them into the executor's table (``stored_outputs()``
counts it) before queueing the message; the unpack for a waiter takes the ref out and
reads the buffer with ``ray.get`` (zero-copy views on the executor's node: they keep it
alive; a transfer across nodes), and every other end -- dropped, expired, waiter gone,
an unpack answer discarded -- takes it out through the registry's release hook; shutdown
empties the table. One table entry, taken out once: each buffer is freed exactly once. A
pack that is never sent (the packer abandoned it) drops the actor's ref; ``stop`` drops
what is left. ``release_output`` takes the delivered output's views back, as for a
pooled one (1; ``OutputStillViewed`` while another view is alive). ``transport="shm"``
refuses a rank placed on another node (``UsageError``).

Back-pressure, worker-side as with the pool: each actor counts its stored buffers that
the executor has not released yet, and its packer waits for room before it puts one
more (``max_held_outputs``/``max_held_bytes``, per rank); an output still without room
after ``lease_timeout`` fails with ``HeldOutputsFull``.  The executor gives room back
(``released``, from its ``omni-credit`` thread) when it drops a buffer unread, or when
the last view of a read one is gone (a finalizer on the unpack's anchor, as for the
pool's segments); ``held_outputs`` in ``metrics()`` counts both paths.

Reads: the ``ray.get`` of a stored output (a transfer across nodes: seconds for a large
video) runs on one of the executor's fetch threads (``omni-fetch``, ``fetch_threads`` of
them), never on the pump's: a slow transfer holds up only its own waiter, not the
messages of the other requests and ranks.  It is bounded by ``output_timeout``.

Death: an actor that dies (``ray.kill``, a crash, its node lost) fails its outstanding
poll with ``RayActorError``; the pump first handles every message of that rank it
received before (they came before the failed poll), then fails every pending waiter
with ``ActorDied`` naming the rank and node, closes the registry (what still arrives
is released), reclaims the segments the actor held or shipped without a message that
arrived (every message it sent was received by then), and ``check_health`` raises it
from then on.  The actors are not detached: Ray kills them with the driver, and what
they left in /dev/shm is swept by the next executor (its pid is in the names).
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final

import attrs

from omni_async.core.config import Deadlines
from omni_async.core.errors import (
    ActorDied,
    ComputeTimeout,
    ExecutorShutdown,
    OmniAsyncError,
    OutputUnpackFailed,
    ProtocolError,
    UsageError,
    WorkerStartupFailed,
)
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    CancelMessage,
    DiffusionOutput,
    Failure,
    RpcRequest,
)
from omni_async.core.trace import Tracer
from omni_async.executor.api import DiffusionExecutor, check_final_step_async, stop_budget
from omni_async.executor.futures import map_future
from omni_async.executor.multiproc import (
    DEFAULT_MAX_HELD_OUTPUTS,
    MultiprocDiffusionExecutor,
    WorkerOptions,
    WorkerSpec,
    _build_worker,
)
from omni_async.transport.channel import (
    DEFAULT_CAPACITY_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_PUT_TIMEOUT,
    dumps_message,
    loads_message,
)
from omni_async.transport.errors import ChannelClosed, ChannelFull, HeldOutputsFull
from omni_async.transport.packing import (
    StoredPayload,
    carried_leases,
    carried_stored_keys,
    pack_diffusion_output_host,
    unpack_diffusion_output_host,
)
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.transport.shm import SegmentPool, unlink_all_with_prefix
from omni_async.worker.baselines import check_output_path

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from omni_async.worker.loop import WorkerLoop
    from omni_async.worker.packer import Packer, PackFn

__all__ = ["RayDiffusionExecutor"]

log = logging.getLogger(__name__)

# How long an actor's poll waits for a message before it answers with none.
_POLL_WAIT_S: Final = 1.0
# Threads of a threaded actor: the long polls, rpc and cancel calls, stop.
_ACTOR_CONCURRENCY: Final = 8
_TRANSPORTS: Final = ("auto", "shm", "object_store")


def _get_stored(ref: Any, timeout: float | None) -> Any:
    import ray

    return ray.get(ref, timeout=timeout)


# ---------------------------------------------------------------------------- actor side


@attrs.frozen
class _StoreBudget:
    """Per rank, the budget of its buffers in Ray's object store: put by its packer and not
    yet released by the executor (dropped unread, or read and every view of it gone),
    as the pool's budget of held outputs is for shared memory."""

    max_outputs: int
    max_bytes: int | None
    timeout: float
    rank: int

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


class _Outbox:
    """The actor's end of the result channel: numbered pickled messages, bounded, in put order."""

    def __init__(self, max_messages: int, max_bytes: int, max_message_bytes: int, put_timeout: float | None) -> None:
        self._cond = threading.Condition()
        self._items: collections.deque[tuple[bytes, dict[str, Any]]] = collections.deque()
        # Object-store path: key -> ObjectRef of each stored buffer not yet in a message
        # (``ray.put`` by the packer); a message takes its refs along, out of band.
        self.stored: dict[str, Any] = {}
        self._bytes = 0
        self._first = 0  # the number of _items[0]
        self._max_messages = max_messages
        self._max_bytes = max_bytes
        self._max_message_bytes = max_message_bytes
        self._put_timeout = put_timeout
        self._closed = False
        # The budget of stored buffers (``_StoreBudget``): key -> bytes of each buffer put
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

    def store(self, ref: Any, key: str) -> None:
        with self._cond:
            self.stored[key] = ref

    def drop(self, key: str) -> None:
        with self._cond:
            self.stored.pop(key, None)
            self.held.pop(key, None)
            self._cond.notify_all()

    def hold(self, key: str, nbytes: int, budget: _StoreBudget, output: DiffusionOutput) -> None:
        """Room for one more stored buffer of ``nbytes`` (the packer's thread): waits while
        the budget is full; ``HeldOutputsFull`` after its timeout."""
        deadline = time.monotonic() + budget.timeout
        with self._cond:
            self.waiting += 1
            try:
                while not self._closed and (
                    len(self.held) >= budget.max_outputs
                    or (budget.max_bytes is not None and self.held and sum(self.held.values()) + nbytes > budget.max_bytes)
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

    def take(self, wait: float) -> tuple[int, list[tuple[bytes, dict[str, Any]]]]:
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


class _OrderedInbox:
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
        outbox: dict[str, Any],
        driver_path: list[str] | None = None,
        driver_node: str = "",
        transport: str = "auto",
        budget: _StoreBudget | None = None,
    ):
        # The driver's import path, as a spawned worker process inherits it: a factory the
        # driver can import (its own package, a test's helpers) is importable here too.
        for entry in reversed(driver_path or []):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
        self._rank = rank
        self._outbox = _Outbox(**outbox)
        self._inbox = _OrderedInbox()
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
        self._budget = budget or _StoreBudget(DEFAULT_MAX_HELD_OUTPUTS, None, 30.0, rank)
        self._thread = threading.Thread(
            target=self._main, args=(spec, opts, pool_state), name=f"omni-worker-{rank}", daemon=True
        )
        self._thread.start()

    def _main(self, spec: WorkerSpec, opts: WorkerOptions, pool_state: bytes) -> None:
        # Built on this thread: a CUDA worker's current device is set per thread.
        try:
            if self._via_store:
                packer, loop = _build_worker(
                    self._rank, spec, opts, None, self._outbox, packing=(self._pack_stored(opts), self._release_stored)
                )
            elif self._remote:
                raise UsageError("transport='shm' on another node than the executor's")  # the executor says more
            else:
                pool = pickle.loads(pool_state)
                packer, loop = _build_worker(self._rank, spec, opts, pool, self._outbox)
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

    def _pack_stored(self, opts: WorkerOptions) -> PackFn:
        import ray

        def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
            def put(buf: Any) -> str:
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

    def ready(self, timeout: float) -> tuple[Failure | None, int, str, str, bool]:
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
        """This actor's budget of stored buffers (``_StoreBudget``) now: how many are held,
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

    def poll(self, wait: float) -> tuple[int, list[tuple[bytes, dict[str, Any]]]]:
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


# ------------------------------------------------------------------------- executor side


@attrs.frozen
class _Death:
    rank: int
    cause: str


class _RayReceiver:
    """The pump's end: one outstanding poll per rank, batches queued in order (module docstring)."""

    def __init__(self, pool: SegmentPool) -> None:
        self._pool = pool
        # Object-store path: key -> ObjectRef of each received output's stored buffer, until
        # its unpack or its release (the executor's); emptied at shutdown.
        self.stored: dict[str, Any] = {}
        self.stored_lock = threading.Lock()
        self.received_stored = 0  # stored buffers received in all (the held count's one side)
        self._queue: collections.deque[AsyncDiffusionOutput | _Death | ProtocolError] = collections.deque()
        self._pending: dict[Any, int] = {}  # poll ObjectRef -> rank
        self._actors: list[Any] = []
        self._next: list[int] = []
        self._closed = False
        self.on_death: Any = None  # (rank, cause) -> None, set by the executor

    def start(self, actors: list[Any]) -> None:
        self._actors = actors
        self._next = [0] * len(actors)
        for rank in range(len(actors)):
            self._poll(rank)

    def _poll(self, rank: int) -> None:
        self._pending[self._actors[rank].poll.remote(_POLL_WAIT_S)] = rank

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
                    self._queue.append(_Death(rank, f"{type(exc).__name__}: {exc}".splitlines()[0]))
                    continue  # no next poll: the rank is gone
                self._take(rank, first, batch)
                self._poll(rank)
        if not self._queue:
            return None
        item = self._queue.popleft()
        if isinstance(item, _Death):
            if self.on_death is not None:
                self.on_death(item.rank, item.cause)
            return None
        if isinstance(item, ProtocolError):
            raise item  # the pump counts it and reads on
        return item

    def _take(self, rank: int, first: int, batch: list[tuple[bytes, dict[str, Any]]]) -> None:
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

    def take_stored(self, key: str) -> Any:
        """The ref of a stored buffer, out of the table (None when already taken): once."""
        with self.stored_lock:
            return self.stored.pop(key, None)


def _check_bundles(bundles: list[dict[str, float]], world_size: int, need: dict[str, float]) -> None:
    """A caller's placement group: a bundle per rank, each with room for the rank's actor."""
    if len(bundles) < world_size:
        raise UsageError(
            f"placement_group has {len(bundles)} bundle(s), world_size={world_size} needs one per rank "
            "(rank r runs in bundle r)"
        )
    for rank, b in enumerate(bundles[:world_size]):
        short = {k: v for k, v in need.items() if v and b.get(k, 0.0) < v}
        if short:
            raise UsageError(
                f"placement_group bundle {rank} ({b}) has no room for worker rank {rank}'s actor, which needs "
                f"{need}: make the bundles larger, or lower num_cpus_per_rank/num_gpus_per_rank"
            )


class _Credits:
    """Room given back to the actors' budgets (``_StoreBudget``): keys of stored buffers the
    executor is done with, sent to their rank's actor (``released``) by a thread of its own
    (``omni-credit``): ``give`` may run in a finalizer, inside a garbage collection."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # put() is reentrant
        self._actors: list[Any] = []
        # Keys given back in all, counted at once (``metrics()``' held outputs): under a
        # reentrant lock, since ``give`` may run in a finalizer on a thread inside it.
        self.given = 0
        self._count_lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, name="omni-credit", daemon=True)

    def start(self, actors: list[Any]) -> None:
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


class RayDiffusionExecutor(MultiprocDiffusionExecutor):
    """``world_size`` Ray actors built from ``spec`` (one per rank, in a placement group).

    Same arguments as ``MultiprocDiffusionExecutor`` where they apply (``options``,
    ``max_held_outputs``/``max_held_bytes``: the budget of held outputs, ``copy_outputs``,
    ``start_timeout``), plus:

    * ``num_cpus_per_rank`` (each actor's CPUs, default 1) and ``num_gpus_per_rank``
      (default: 1 when ``options.device`` is a CUDA device, else 0);
    * ``placement_strategy`` (Ray's: ``"PACK"``, ``"SPREAD"``, ...) of the placement
      group the executor makes (one bundle per rank) and removes at shutdown; or
      ``placement_group``, one the caller made (and removes): rank r runs in its bundle
      r, which must hold the rank's CPUs and GPUs;
    * ``transport``: ``"auto"`` (the outputs of an actor on the executor's node through
      its shared-memory pool, of one on another node through Ray's object store),
      ``"shm"`` (the pool only: a rank on another node is a ``UsageError``) or
      ``"object_store"`` (every rank through the object store); ``via_store`` says per
      rank what was chosen.  ``max_held_outputs``/``max_held_bytes`` bound each rank's
      buffers in the object store as they bound the pool;
    * ``fetch_threads``: the threads that read stored outputs (default 4).

    Ray must be initialised (``ray.init``) or it is started here with its defaults.
    See the module docstring.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        world_size: int = 1,
        reply_rank: int = 0,
        step_mode: bool = False,
        deadlines: Deadlines | None = None,
        options: WorkerOptions | None = None,
        max_held_outputs: int | None = None,
        max_held_bytes: int | None = None,
        copy_outputs: bool = False,
        start_timeout: float = 120.0,
        tracer: Tracer | None = None,
        final_step_async: bool = False,
        num_cpus_per_rank: float = 1.0,
        num_gpus_per_rank: float | None = None,
        placement_strategy: str = "PACK",
        placement_group: PlacementGroup | None = None,
        transport: str = "auto",
        fetch_threads: int = 4,
    ) -> None:
        try:
            import ray
            from ray.util.placement_group import PlacementGroup as RayPlacementGroup
            from ray.util.placement_group import placement_group as make_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise UsageError("RayDiffusionExecutor needs Ray: pip install 'omni_async[ray]'") from exc
        if not isinstance(spec, WorkerSpec):
            raise UsageError(f"spec must be a WorkerSpec, got {type(spec).__name__} {spec!r}")
        opts = options if options is not None else WorkerOptions(reply_rank=reply_rank)
        check_output_path(opts.output_path, step_mode=step_mode)
        if opts.output_path != "omni":
            raise UsageError("RayDiffusionExecutor ships outputs on the 'omni' path only (WorkerOptions.output_path)")
        if opts.reply_rank != reply_rank:
            opts = attrs.evolve(opts, reply_rank=reply_rank)
        for name, value in (("max_held_outputs", max_held_outputs), ("max_held_bytes", max_held_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{name} must be a positive int, got {value!r}")
        check_final_step_async(final_step_async, step_mode)
        if isinstance(fetch_threads, bool) or not isinstance(fetch_threads, int) or fetch_threads < 1:
            raise UsageError(f"fetch_threads must be a positive int, got {fetch_threads!r}")
        if transport not in _TRANSPORTS:
            raise UsageError(f"transport must be one of {', '.join(map(repr, _TRANSPORTS))}, got {transport!r}")
        self.transport = transport
        gpus = num_gpus_per_rank if num_gpus_per_rank is not None else float(opts.device.startswith("cuda"))
        if num_cpus_per_rank < 0 or gpus < 0:
            raise UsageError(f"num_cpus_per_rank/num_gpus_per_rank must be >= 0, got {num_cpus_per_rank}/{gpus}")
        bundle = {"CPU": float(num_cpus_per_rank), **({"GPU": float(gpus)} if gpus else {})}
        if placement_group is not None:
            if not isinstance(placement_group, RayPlacementGroup):
                raise UsageError(f"placement_group must be a Ray PlacementGroup, got {type(placement_group).__name__}")
            _check_bundles(placement_group.bundle_specs, world_size, bundle)
        if not ray.is_initialized():
            ray.init()
        self.pool = SegmentPool(
            max_bytes=max_held_bytes,
            max_segments=max_held_outputs if max_held_outputs is not None else DEFAULT_MAX_HELD_OUTPUTS,
            attach_by_name=True,
        )
        self._lease_timeout = opts.lease_timeout if opts.lease_timeout is not None else self.pool.lease_timeout
        self._budget_full_logged = False
        self._copy_outputs = copy_outputs
        self._receiver = _RayReceiver(self.pool)
        self._credits = _Credits()
        self._fetchers = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="omni-fetch")
        self._receiver.on_death = self._on_actor_death
        DiffusionExecutor.__init__(
            self,
            self._receiver,
            world_size=world_size,
            reply_rank=reply_rank,
            step_mode=step_mode,
            deadlines=deadlines,
            release_hook=self._release_packed,
            tracer=tracer,
            validate_request=spec.request_validator(),
            final_step_async=final_step_async,
        )
        self._rpc_lock = threading.Lock()
        self._actor_seq = [0] * world_size
        self._failure: ActorDied | None = None
        self.actors: list[Any] = []
        self.nodes: list[str] = []  # per rank: "node id (address)"
        self.pids: list[int] = []
        self.via_store: list[bool] = []  # per rank: outputs through Ray's object store
        self._stopped = False
        self._own_placement = placement_group is None
        if placement_group is None:
            placement_group = make_placement_group([dict(bundle) for _ in range(world_size)], strategy=placement_strategy)
        self.placement_group = placement_group
        try:
            deadline = time.monotonic() + start_timeout
            try:
                ray.get(self.placement_group.ready(), timeout=start_timeout)
            except ray.exceptions.GetTimeoutError as exc:
                raise ComputeTimeout(
                    f"Ray could not place {world_size} bundle(s) of {bundle} in {start_timeout} s "
                    f"(strategy {placement_strategy}): not enough resources in the cluster"
                ) from exc
            actor_cls = ray.remote(RankActor)
            here = ray.get_runtime_context().get_node_id()
            state = pickle.dumps(self.pool)
            outbox = {
                "max_messages": DEFAULT_MAX_MESSAGES,
                "max_bytes": DEFAULT_CAPACITY_BYTES,
                "max_message_bytes": DEFAULT_MAX_MESSAGE_BYTES,
                "put_timeout": DEFAULT_PUT_TIMEOUT,
            }
            held_outputs = max_held_outputs if max_held_outputs is not None else DEFAULT_MAX_HELD_OUTPUTS

            def budget(rank: int) -> _StoreBudget:
                return _StoreBudget(held_outputs, max_held_bytes, self._lease_timeout, rank)

            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
                actor = actor_cls.options(
                    num_cpus=num_cpus_per_rank,
                    num_gpus=gpus,
                    scheduling_strategy=strategy,
                    max_concurrency=_ACTOR_CONCURRENCY,
                    max_restarts=0,
                    max_task_retries=0,
                    name=f"omni-worker-{self.token}-{rank}",
                ).remote(rank, spec, opts, state, outbox, list(sys.path), here, transport, budget(rank))
                self.actors.append(actor)
            self._await_actors(deadline, start_timeout)
            self._receiver.start(self.actors)
            self._credits.start(self.actors)
            self.pump.start()
            self.collective_rpc("loop_info", timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.shutdown("the executor failed to start")
            raise

    def _await_actors(self, deadline: float, start_timeout: float) -> None:
        import ray

        here = ray.get_runtime_context().get_node_id()
        refs = [a.ready.remote(max(1.0, deadline - time.monotonic())) for a in self.actors]
        for rank, ref in enumerate(refs):
            try:
                failure, pid, node_id, address, via_store = ray.get(
                    ref, timeout=max(1.0, deadline - time.monotonic())
                )
            except ray.exceptions.GetTimeoutError as exc:
                raise ComputeTimeout(f"worker rank {rank} did not build its model in {start_timeout} s") from exc
            except ray.exceptions.RayActorError as exc:
                raise WorkerStartupFailed(rank, None, failure=Failure.from_exception(exc), actor=True) from exc
            if node_id and node_id != here and not via_store and failure is None:
                raise UsageError(
                    f"worker rank {rank} was placed on node {node_id} ({address}), not on the executor's node "
                    f"{here}: transport='shm' ships outputs through this node's shared memory, which another "
                    "node cannot reach; use transport='auto' (the object store for remote ranks), or "
                    "placement_strategy='STRICT_PACK'"
                )
            if failure is not None:
                raise WorkerStartupFailed(rank, None, failure=failure, actor=True)
            self.pids.append(pid)
            self.nodes.append(f"{node_id} ({address})")
            self.via_store.append(via_store)

    # ----------------------------------------------------------------- transport

    def _encode(self, req: RpcRequest) -> list[bytes] | None:
        # Ray serializes each actor call itself (cloudpickle: a lambda travels, a lock
        # does not), so nothing is pickled ahead here -- not the worker processes' pipes.
        return None

    def _broadcast(self, req: RpcRequest, wire: list[bytes] | None = None) -> None:
        with self._rpc_lock:
            if self._closed:
                raise ExecutorShutdown("the executor is shut down")
            for rank, actor in enumerate(self.actors):
                seq = self._actor_seq[rank]
                self._actor_seq[rank] += 1
                actor.rpc.remote(seq, req)  # a dead actor: its poll reports the death

    def _deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        for actor in self.actors:
            actor.cancel.remote(cancels)  # returns at once

    def _worker_failure(self) -> OmniAsyncError | None:
        return self._failure

    # ------------------------------------------------------- object-store outputs

    def _deliver(self, packed: Future[DiffusionOutput]) -> Future[DiffusionOutput]:
        return map_future(packed, self._receive, discard=self._discard, run=self._run_unpack)

    def _run_unpack(self, packed: DiffusionOutput, finish: Callable[[], None]) -> None:
        """The pump's thread: a stored output's unpack goes to a fetch thread (its
        ``ray.get`` is a transfer); a pooled one is unpacked here, as by the multiprocess
        executor."""
        if not (isinstance(packed.output, StoredPayload) and packed.output.key):
            finish()
            return
        try:
            self._fetchers.submit(finish)
        except RuntimeError:  # shut down: unpack here (the table is empty, it fails at once)
            finish()

    def _receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        payload = packed.output
        if not isinstance(payload, StoredPayload):
            return super()._receive(packed)
        try:
            buf = None
            if payload.key:
                ref = self._receiver.take_stored(payload.key)  # freed once: the views hold the buffer now
                if ref is None:
                    raise UsageError(f"stored buffer {payload.key} is gone (released, or the executor shut down)")
                try:
                    buf = _get_stored(ref, self.deadlines.output_timeout)
                except BaseException:
                    self._credits.give(payload.key)
                    raise
                key = payload.key
                return unpack_diffusion_output_host(
                    packed, buf, copy=self._copy_outputs, on_gone=lambda: self._credits.give(key)
                )
            return unpack_diffusion_output_host(packed, None, copy=self._copy_outputs)
        except Exception as exc:
            raise OutputUnpackFailed(packed.async_output_id, packed.request_id, exc) from exc

    def _release_stored(self, packed: DiffusionOutput) -> bool:
        if isinstance(packed.output, StoredPayload):
            if packed.output.key and self._receiver.take_stored(packed.output.key) is not None:
                self._credits.give(packed.output.key)
            return True
        return False

    def _release_packed(self, packed: DiffusionOutput) -> None:
        if not self._release_stored(packed):
            super()._release_packed(packed)

    def _release_failed_unpack(self, packed: DiffusionOutput) -> None:
        if not self._release_stored(packed):
            super()._release_failed_unpack(packed)

    def metrics(self) -> dict[str, float]:
        """``MultiprocDiffusionExecutor.metrics``, where ``held_outputs`` also counts the
        outputs held in Ray's object store (received and not yet released: unread, or read
        and some view of them still alive); ``stored_outputs`` counts the unread ones."""
        m = super().metrics()
        with self._receiver.stored_lock:
            received, unread = self._receiver.received_stored, len(self._receiver.stored)
        m["held_outputs"] = m.get("held_outputs", 0.0) + float(max(0, received - self._credits.given))
        m["stored_outputs"] = float(unread)
        return m

    def stored_outputs(self) -> int:
        """How many received outputs' buffers in Ray's object store the executor still
        references (neither unpacked for a waiter nor released)."""
        with self._receiver.stored_lock:
            return len(self._receiver.stored)

    def _on_actor_death(self, rank: int, cause: str) -> None:
        """Pump thread: rank's poll failed, after every message it sent before was received."""
        if self._closed:
            return
        node = self.nodes[rank] if rank < len(self.nodes) else "?"
        err = ActorDied(rank, node, cause=cause)
        log.error("%s", err)
        if self._failure is None:
            self._failure = err
        self.pump.fail_all(lambda oid: ActorDied(rank, node, output_id=oid, cause=cause), outcome="worker_died", close=True)
        if rank < len(self.pids):
            pid = self.pids[rank]
            try:
                n = self.pool.reclaim_owner(pid) + self.pool.reclaim_shipped(pid)
            except Exception:
                log.exception("reclaiming the segments of dead worker rank %d failed", rank)
            else:
                if n:
                    log.warning("worker rank %d died holding %d segment(s); they went back to the pool", rank, n)

    # ------------------------------------------------------------------ shutdown

    def _stop_workers(self, deadline: float | None) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._stopped:
            return
        self._stopped = True
        self._receiver.close()
        # Every actor asked at once, then killed: the kill is immediate, so the asking
        # gets most of the deadline (10 s without one).
        asked = stop_budget(deadline, 10.0, 0.8)
        stops = []
        if self._rpc_lock.acquire(timeout=min(1.0, asked)):
            try:
                for rank, actor in enumerate(self.actors):
                    stops.append(actor.stop.remote(self._actor_seq[rank], min(5.0, asked)))
                    self._actor_seq[rank] += 1
            finally:
                self._rpc_lock.release()
        try:
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=asked)
        except Exception:  # noqa: BLE001  # dead actors: killed below all the same
            log.debug("stopping the actors failed", exc_info=True)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  # already gone
                log.debug("killing an actor failed", exc_info=True)
        if hasattr(self, "placement_group") and self._own_placement:
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                log.warning("removing the placement group failed", exc_info=True)
        self._fetchers.shutdown(wait=False)
        self._credits.close()  # what is queued still runs, and fails at once: the table is empty
        self.pool.close()
        unlink_all_with_prefix(self.pool.prefix)
