"""``RayDiffusionExecutor``: one Ray actor per rank, the same two-phase protocol.

Only the transport differs from ``MultiprocDiffusionExecutor``: both are a
``RankedExecutor`` (the registry, the dispatcher, the pump, the pool and its budget,
deaths, outputs), this one over ``RayRanks``, the other over ``ProcessRanks``; each
actor hosts the same ``WorkerLoop`` and ``Packer`` built from a ``WorkerSpec``
(``omni_async.worker.host``; the actor's side is ``omni_async.executor.ray_actor``).  Ray is imported here
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
* The executor's pump reads the results (``RayReceiver``, ``omni_async.executor.ray_receiver``): for every rank exactly one
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

import logging
import pickle
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Final, Unpack, cast

import attrs

from omni_async.core.config import Deadlines
from omni_async.core.errors import (
    ActorDied,
    ComputeTimeout,
    OutputUnpackFailed,
    UsageError,
    WorkerStartupFailed,
)
from omni_async.core.messages import CancelMessage, DiffusionOutput, Failure, RpcRequest
from omni_async.executor.api import stop_budget
from omni_async.executor.config import ExecutorConfig, ExecutorOptions, InvalidConfig, check_ray_arguments
from omni_async.executor.dist import GroupRendezvous, check_process_group
from omni_async.executor.ranked import RankedExecutor, RankHost, RankTransport, prewarm_pool, shut_down_error
from omni_async.executor.ray_actor import Buffer, OutboxLimits, RankActor, RankActorHandle, StoreBudget
from omni_async.executor.ray_receiver import Credits, RayReceiver
from omni_async.transport.channel import (
    DEFAULT_CAPACITY_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_PUT_TIMEOUT,
)
from omni_async.transport.packing import StoredPayload, unpack_diffusion_output_host
from omni_async.transport.shm import SegmentPool
from omni_async.worker.host import WorkerOptions, WorkerSpec

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.util.placement_group import PlacementGroup

__all__ = ["RayDiffusionExecutor", "RayRanks"]

log = logging.getLogger(__name__)

# Threads of a threaded actor: the long polls, rpc and cancel calls, stop.
_ACTOR_CONCURRENCY: Final = 8
_TRANSPORTS: Final = ("auto", "shm", "object_store")


def _get_stored(ref: ObjectRef[Buffer], timeout: float | None) -> Buffer:
    import ray

    return ray.get(ref, timeout=timeout)


# ------------------------------------------------------------------------- executor side


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


@attrs.frozen
class _Placement:
    """Where the actors go: each rank's resources, and the group (None: the executor makes one)."""

    bundle: dict[str, float]
    num_cpus: float
    num_gpus: float
    strategy: str
    group: PlacementGroup | None


class RayRanks(RankTransport):
    """Ranks in Ray actors: RPCs and cancels as actor calls, results by polling each
    actor's outbox (``RayReceiver``, ``omni_async.executor.ray_receiver``), stored outputs read on fetch threads, their room
    given back by ``Credits``."""

    def __init__(
        self,
        spec: WorkerSpec,
        opts: WorkerOptions,
        cfg: ExecutorConfig,
        pool: SegmentPool,
        placement: _Placement,
        transport: str,
        fetch_threads: int,
        group: GroupRendezvous | None = None,
    ) -> None:
        self._spec = spec
        self._group = group  # the ranks' process group's rendezvous (on this node), closed by ``stop``
        self._opts = opts
        self._cfg = cfg
        self._pool = pool
        self._placement = placement
        self.transport = transport
        self._lease_timeout = opts.lease_timeout if opts.lease_timeout is not None else pool.lease_timeout
        self._receiver = RayReceiver(pool)
        self.receiver = self._receiver
        self._credits = Credits()
        self._fetchers = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="omni-fetch")
        self._rpc_lock = threading.Lock()
        self._actor_seq = [0] * cfg.world_size
        self.actors: list[RankActorHandle] = []
        self.nodes: list[str] = []  # per rank: "node id (address)"
        self.pids: list[int] = []
        self.via_store: list[bool] = []  # per rank: outputs through Ray's object store
        self._stopped = False
        self._own_placement = placement.group is None
        self.placement_group: PlacementGroup | None = placement.group
        self._host: RankHost | None = None

    @property
    def host(self) -> RankHost:
        assert self._host is not None, "RayRanks.start sets the host"
        return self._host

    def start(self, host: RankHost, deadline: float, start_timeout: float) -> None:
        import ray
        from ray.util.placement_group import placement_group as make_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._host = host
        self._receiver.on_death = self._on_actor_death
        p = self._placement
        world_size = self._cfg.world_size
        if self.placement_group is None:
            self.placement_group = make_placement_group(
                [dict(p.bundle) for _ in range(world_size)], strategy=p.strategy
            )
        group = self.placement_group
        try:
            ray.get(group.ready(), timeout=start_timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise ComputeTimeout(
                f"Ray could not place {world_size} bundle(s) of {p.bundle} in {start_timeout} s "
                f"(strategy {p.strategy}): not enough resources in the cluster"
            ) from exc
        actor_cls = ray.remote(RankActor)
        here = ray.get_runtime_context().get_node_id()
        state = pickle.dumps(self._pool)
        outbox = OutboxLimits(
            DEFAULT_MAX_MESSAGES, DEFAULT_CAPACITY_BYTES, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_PUT_TIMEOUT
        )
        budget = self._cfg.budget
        for rank in range(world_size):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            actor = actor_cls.options(
                num_cpus=p.num_cpus,
                num_gpus=p.num_gpus,
                scheduling_strategy=strategy,
                max_concurrency=_ACTOR_CONCURRENCY,
                max_restarts=0,
                max_task_retries=0,
                name=f"omni-worker-{host.token}-{rank}",
            ).remote(
                rank,
                self._spec,
                self._opts,
                state,
                outbox,
                list(sys.path),
                here,
                self.transport,
                StoreBudget(budget, self._lease_timeout, rank),
                None if self._group is None else self._group.rendezvous,
            )
            # Ray types a handle's methods as it cannot know them: ours, named.
            self.actors.append(cast("RankActorHandle", actor))
        self._await_actors(deadline, start_timeout)
        self._receiver.start(self.actors)
        self._credits.start(self.actors)

    def _await_actors(self, deadline: float, start_timeout: float) -> None:
        import ray

        here = ray.get_runtime_context().get_node_id()
        refs = [a.ready.remote(max(1.0, deadline - time.monotonic())) for a in self.actors]
        for rank, ref in enumerate(refs):
            try:
                failure, pid, node_id, address, via_store = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
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

    # ----------------------------------------------------------------- sending

    def broadcast(self, req: RpcRequest, wire: list[bytes] | None) -> None:
        # Ray serializes each actor call itself (cloudpickle: a lambda travels, a lock
        # does not), so nothing is pickled ahead (``encode`` stays None), unlike the
        # worker processes' pipes.
        with self._rpc_lock:
            if self.host.closed:
                raise shut_down_error()
            for rank, actor in enumerate(self.actors):
                seq = self._actor_seq[rank]
                self._actor_seq[rank] += 1
                actor.rpc.remote(seq, req)  # a dead actor: its poll reports the death

    def deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        for actor in self.actors:
            actor.cancel.remote(cancels)  # returns at once

    # ------------------------------------------------------- object-store outputs

    def run_unpack(self, packed: DiffusionOutput, finish: Callable[[], None]) -> None:
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

    def unpack(self, packed: DiffusionOutput, copy: bool) -> DiffusionOutput | None:
        payload = packed.output
        if not isinstance(payload, StoredPayload):
            return None
        try:
            if payload.key:
                ref = self._receiver.take_stored(payload.key)  # freed once: the views hold the buffer now
                if ref is None:
                    raise UsageError(f"stored buffer {payload.key} is gone (released, or the executor shut down)")
                try:
                    buf = _get_stored(ref, self.host.deadlines.output_timeout)
                except BaseException:
                    self._credits.give(payload.key)
                    raise
                key = payload.key
                return unpack_diffusion_output_host(packed, buf, copy=copy, on_gone=lambda: self._credits.give(key))
            return unpack_diffusion_output_host(packed, None, copy=copy)
        except Exception as exc:
            raise OutputUnpackFailed(packed.async_output_id, packed.request_id, exc) from exc

    def release(self, packed: DiffusionOutput) -> bool:
        if isinstance(packed.output, StoredPayload):
            if packed.output.key and self._receiver.take_stored(packed.output.key) is not None:
                self._credits.give(packed.output.key)
            return True
        return False

    def held_elsewhere(self) -> int:
        """Stored outputs received and not yet released (unread, or read and some view alive)."""
        with self._receiver.stored_lock:
            received = self._receiver.received_stored
        return max(0, received - self._credits.given)

    def stored_outputs(self) -> int:
        with self._receiver.stored_lock:
            return len(self._receiver.stored)

    def _on_actor_death(self, rank: int, cause: str) -> None:
        """Pump thread: rank's poll failed, after every message it sent before was received
        (so what it shipped and no message carried can be reclaimed at once)."""
        if self.host.closed:
            return
        node = self.nodes[rank] if rank < len(self.nodes) else "?"
        self.host.rank_died(
            rank,
            ActorDied(rank, node, cause=cause),
            lambda oid: ActorDied(rank, node, output_id=oid, cause=cause),
            self.pids[rank] if rank < len(self.pids) else None,
            reclaim_shipped=True,
        )

    # ------------------------------------------------------------------ shutdown

    def stop(self, deadline: float | None) -> None:
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
                ray.kill(cast("ray.actor.ActorHandle[RankActor]", actor), no_restart=True)
            except Exception:  # noqa: BLE001  # already gone
                log.debug("killing an actor failed", exc_info=True)
        if self.placement_group is not None and self._own_placement:
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                log.warning("removing the placement group failed", exc_info=True)
        self._fetchers.shutdown(wait=False)
        self._credits.close()  # what is queued still runs, and fails at once: the table is empty
        if self._group is not None:
            self._group.close()  # every actor is killed: nobody meets there any more


class RayDiffusionExecutor(RankedExecutor[RayRanks]):
    """``world_size`` Ray actors built from ``spec`` (one per rank, in a placement group).

    The settings shared with ``MultiprocDiffusionExecutor`` are the same
    ``ExecutorConfig`` (``config=``, or its fields as keyword arguments: ``options``,
    ``max_held_outputs``/``max_held_bytes``: the budget of held outputs,
    ``copy_outputs``, ``start_timeout``, ...), plus:

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

    ``prewarm`` (``Prewarm``) fills the shared-memory pool before the actors start (the
    ranks on the executor's node use it; refused with ``transport="object_store"``).

    Ray must be initialised (``ray.init``) or it is started here with its defaults.
    See the module docstring.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        config: ExecutorConfig | None = None,
        *,
        num_cpus_per_rank: float = 1.0,
        num_gpus_per_rank: float | None = None,
        placement_strategy: str = "PACK",
        placement_group: PlacementGroup | None = None,
        transport: str = "auto",
        fetch_threads: int = 4,
        **options: Unpack[ExecutorOptions],
    ) -> None:
        check_ray_arguments(
            spec,
            config,
            num_cpus_per_rank=num_cpus_per_rank,
            num_gpus_per_rank=num_gpus_per_rank,
            placement_strategy=placement_strategy,
            transport=transport,
            fetch_threads=fetch_threads,
        )
        try:
            import ray
            from ray.util.placement_group import PlacementGroup as RayPlacementGroup
        except ImportError as exc:
            raise UsageError("RayDiffusionExecutor needs Ray: pip install 'omni_async[ray]'") from exc
        if not isinstance(spec, WorkerSpec):
            raise UsageError(f"spec must be a WorkerSpec, got {type(spec).__name__} {spec!r}")
        cfg = (config if config is not None else ExecutorConfig()).with_options(options)
        opts = cfg.worker_options
        if opts.output_path != "omni":
            raise InvalidConfig(
                "options",
                "is refused: RayDiffusionExecutor ships outputs on the 'omni' path only (WorkerOptions.output_path)",
            )
        if isinstance(fetch_threads, bool) or not isinstance(fetch_threads, int) or fetch_threads < 1:
            raise InvalidConfig("fetch_threads", f"must be a positive int, got {fetch_threads!r}")
        if transport not in _TRANSPORTS:
            raise InvalidConfig("transport", f"must be one of {', '.join(map(repr, _TRANSPORTS))}, got {transport!r}")
        if cfg.prewarm is not None and transport == "object_store":
            raise InvalidConfig(
                "prewarm",
                "is refused with transport='object_store': every output goes through Ray's object store, none "
                "through the shared-memory pool it would fill; drop prewarm= or use transport='auto'",
            )
        gpus = num_gpus_per_rank if num_gpus_per_rank is not None else float(opts.device.startswith("cuda"))
        if num_cpus_per_rank < 0 or gpus < 0:
            raise UsageError(f"num_cpus_per_rank/num_gpus_per_rank must be >= 0, got {num_cpus_per_rank}/{gpus}")
        bundle = {"CPU": float(num_cpus_per_rank), **({"GPU": float(gpus)} if gpus else {})}
        if placement_group is not None:
            if not isinstance(placement_group, RayPlacementGroup):
                raise UsageError(f"placement_group must be a Ray PlacementGroup, got {type(placement_group).__name__}")
            _check_bundles(placement_group.bundle_specs, cfg.world_size, bundle)
        validator = spec.request_validator()
        pg = check_process_group(spec, cfg)
        keyer = spec.batch_keyer()
        if not ray.is_initialized():
            ray.init()
        pool = cfg.budget.make_pool(attach_by_name=True)
        # In the executor's process, before the actors start: an actor on this node maps
        # (and on CUDA pins) what it made while starting, as a worker process does.
        prewarm_pool(pool, cfg, owned=True)
        # The rendezvous is served from the driver's node, at the address the actors reach it by.
        group = None
        if pg is not None:
            try:
                host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
                group = GroupRendezvous(pg, cfg, cfg.deadlines or Deadlines.from_env(), host=host)
            except BaseException:
                pool.close()  # a constructor that raises leaves nothing in /dev/shm
                raise
        placement = _Placement(bundle, num_cpus_per_rank, gpus, placement_strategy, placement_group)
        ranks = RayRanks(spec, opts, cfg, pool, placement, transport, fetch_threads, group)
        super().__init__(ranks, pool, cfg, validator, keyer)
        self._start()

    @property
    def transport(self) -> str:
        """``"auto"``, ``"shm"`` or ``"object_store"`` (see the class docstring)."""
        return self.ranks.transport

    @property
    def actors(self) -> list[RankActorHandle]:
        """The actor of each rank."""
        return self.ranks.actors

    @property
    def nodes(self) -> list[str]:
        """Per rank: its node, as "node id (address)"."""
        return self.ranks.nodes

    @property
    def pids(self) -> list[int]:
        return self.ranks.pids

    @property
    def via_store(self) -> list[bool]:
        """Per rank: whether its outputs go through Ray's object store."""
        return self.ranks.via_store

    @property
    def placement_group(self) -> PlacementGroup | None:
        return self.ranks.placement_group

    def stored_outputs(self) -> int:
        """How many received outputs' buffers in Ray's object store the executor still
        references (neither unpacked for a waiter nor released)."""
        return self.ranks.stored_outputs()
