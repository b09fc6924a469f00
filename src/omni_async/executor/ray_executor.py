"""``RayDiffusionExecutor``: one Ray actor per rank, the same two-phase protocol.

Only the rank link and the store differ from ``MultiprocDiffusionExecutor``: both are a
``DiffusionExecutor`` (the registry, the dispatcher, the pump, the desk, the
submitter), this one over ``RayRanks`` (``omni_async.executor.ray_link``) with an
``ObjectStore`` (``omni_async.executor.ray_store``, around a ``PoolStore``), the other
over ``ProcessRanks`` with a ``PoolStore``; each
actor hosts the same ``WorkerLoop`` and ``Packer`` built from a ``WorkerSpec``
(``omni_async.worker.host``; the actor's side is ``omni_async.worker.ray_actor``).  Ray is imported here
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
from typing import TYPE_CHECKING, Final, Unpack

from omni_async.core.config import Deadlines
from omni_async.core.errors import UsageError
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.config import ExecutorConfig, ExecutorOptions, InvalidConfig, check_ray_arguments
from omni_async.executor.dist import GroupRendezvous, check_process_group
from omni_async.executor.link import RankEvents
from omni_async.executor.metrics import HeldOutputMetrics
from omni_async.executor.pool_store import PoolStore, prewarm_pool
from omni_async.executor.ray_link import Placement, RayRanks, check_bundles
from omni_async.executor.ray_store import ObjectStore
from omni_async.transport.budget import OutputBudget
from omni_async.worker.host import WorkerSpec
from omni_async.worker.ray_actor import RankActorHandle

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

__all__ = ["RayDiffusionExecutor", "RayRanks"]

log = logging.getLogger(__name__)

_TRANSPORTS: Final = ("auto", "shm", "object_store")


class RayDiffusionExecutor(DiffusionExecutor):
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
            check_bundles(placement_group.bundle_specs, cfg.world_size, bundle)
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
        placement = Placement(bundle, num_cpus_per_rank, gpus, placement_strategy, placement_group)
        self.config = cfg
        self.pool = pool
        self._pool_store = PoolStore(
            pool, copy_outputs=cfg.copy_outputs, lease_timeout=opts.lease_timeout, owner=type(self).__name__
        )
        deadlines = cfg.deadlines if cfg.deadlines is not None else Deadlines.from_env()
        self._object_store = ObjectStore(
            self._pool_store,
            fetch_threads=fetch_threads,
            output_timeout=deadlines.output_timeout,
            copy=cfg.copy_outputs,
        )
        store = self._object_store
        self.ranks = RayRanks(spec, opts, cfg, pool, placement, transport, store.stored, store.credits, group)
        super().__init__(
            self.ranks,
            store,
            world_size=cfg.world_size,
            reply_rank=cfg.reply_rank,
            step_mode=cfg.step_mode,
            deadlines=deadlines,
            tracer=cfg.tracer,
            validate_request=validator,
            final_step_async=cfg.final_step_async,
            batch_key=keyer,
        )
        events = RankEvents(self.pump, self._pool_store, closed=lambda: self._closed, token=self.token)
        self._start(events, cfg.start_timeout, probe=True)

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

    @property
    def budget(self) -> OutputBudget:
        """The budget of held outputs in force: the pool's (each rank's, in the object store)."""
        return self._pool_store.budget

    def metrics(self) -> HeldOutputMetrics:
        """The executor's counters with the budget of held outputs (``HeldOutputMetrics``),
        ``held_outputs`` counting the outputs in the object store too."""
        return self._object_store.metrics(super().metrics())

    def stored_outputs(self) -> int:
        """How many received outputs' buffers in Ray's object store the executor still
        references (neither unpacked for a waiter nor released)."""
        return len(self._object_store.stored)
