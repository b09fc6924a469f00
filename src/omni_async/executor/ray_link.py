"""``RayRanks``: the rank link of ``RayDiffusionExecutor`` -- one Ray actor per rank in a
placement group, RPCs and cancels as actor calls, results by polling each actor's outbox
(``RayReceiver``, ``omni_async.executor.ray_receiver``), an actor's death reported to
``RankEvents``.  ``omni_async.executor.ray_executor``'s docstring has the whole design;
the actor itself is ``omni_async.worker.ray_actor``.
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time
from typing import TYPE_CHECKING, Final, cast

import attrs

from omni_async.core.errors import ActorDied, ComputeTimeout, OmniAsyncError, UsageError, WorkerStartupFailed
from omni_async.core.messages import CancelMessage, Failure, RpcRequest
from omni_async.executor.checks import stop_budget
from omni_async.executor.config import ExecutorConfig
from omni_async.executor.dist import GroupRendezvous
from omni_async.executor.link import RankEvents, RankLink, shut_down_error
from omni_async.executor.ray_receiver import RayReceiver
from omni_async.executor.ray_store import Credits, StoredBuffers
from omni_async.transport.channel import (
    DEFAULT_CAPACITY_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_PUT_TIMEOUT,
)
from omni_async.transport.shm import SegmentPool
from omni_async.worker.host import WorkerOptions, WorkerSpec
from omni_async.worker.ray_actor import OutboxLimits, RankActor, RankActorHandle, StoreBudget

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

__all__ = ["RayRanks", "check_bundles", "Placement"]

log = logging.getLogger(__name__)

# Threads of a threaded actor: the long polls, rpc and cancel calls, stop.
_ACTOR_CONCURRENCY: Final = 8
# How long the live actors get to stop when asked, once one of them died.
_ASK_AFTER_DEATH_S: Final = 1.0


def check_bundles(bundles: list[dict[str, float]], world_size: int, need: dict[str, float]) -> None:
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
class Placement:
    """Where the actors go: each rank's resources, and the group (None: the executor makes one)."""

    bundle: dict[str, float]
    num_cpus: float
    num_gpus: float
    strategy: str
    group: PlacementGroup | None


class RayRanks(RankLink):
    """Ranks in Ray actors: RPCs and cancels as actor calls, results by polling each
    actor's outbox (``RayReceiver``, ``omni_async.executor.ray_receiver``).  ``stored`` and
    ``credits`` are the output store's (``ObjectStore``): the receiver files the refs that
    arrive into ``stored``; ``credits`` starts once the actors are up."""

    def __init__(
        self,
        spec: WorkerSpec,
        opts: WorkerOptions,
        cfg: ExecutorConfig,
        pool: SegmentPool,
        placement: Placement,
        transport: str,
        stored: StoredBuffers,
        credits: Credits,
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
        self._receiver = RayReceiver(pool, stored)
        self.receiver = self._receiver
        self._credits = credits
        self._rpc_lock = threading.Lock()
        self._actor_seq = [0] * cfg.world_size
        self.actors: list[RankActorHandle] = []
        self.nodes: list[str] = []  # per rank: "node id (address)"
        self.pids: list[int] = []
        self.via_store: list[bool] = []  # per rank: outputs through Ray's object store
        self._stopped = False
        self._own_placement = placement.group is None
        self.placement_group: PlacementGroup | None = placement.group
        self._events: RankEvents | None = None

    @property
    def events(self) -> RankEvents:
        assert self._events is not None, "RayRanks.start sets the events"
        return self._events

    def start(self, events: RankEvents | None, deadline: float, start_timeout: float) -> None:
        import ray
        from ray.util.placement_group import placement_group as make_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert events is not None, "actors can die: their link reports to RankEvents"
        self._events = events
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
                name=f"omni-worker-{events.token}-{rank}",
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
            if self.events.closed:
                raise shut_down_error()
            for rank, actor in enumerate(self.actors):
                seq = self._actor_seq[rank]
                self._actor_seq[rank] += 1
                actor.rpc.remote(seq, req)  # a dead actor: its poll reports the death

    def deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        for actor in self.actors:
            actor.cancel.remote(cancels)  # returns at once

    def failure(self) -> OmniAsyncError | None:
        return None if self._events is None else self._events.failure

    def _on_actor_death(self, rank: int, cause: str) -> None:
        """Pump thread: rank's poll failed, after every message it sent before was received
        (so what it shipped and no message carried can be reclaimed at once)."""
        if self.events.closed:
            return
        node = self.nodes[rank] if rank < len(self.nodes) else "?"
        self.events.rank_died(
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
        if self._events is not None and self._events.failure is not None:
            # An actor died: every call in flight failed with it, so what the others still
            # compute is for nobody (as ProcessRanks: a second, not the deadline).
            asked = min(asked, _ASK_AFTER_DEATH_S)
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
        if self._group is not None:
            self._group.close()  # every actor is killed: nobody meets there any more
