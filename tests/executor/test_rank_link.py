"""Rank links and what they report: ``RankEvents`` (a rank's death, through a real pump,
registry and pool) and ``ThreadRanks`` (the in-process link, real threads)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from helpers.executor_harness import exc_of
from helpers.executor_rig import Rig
from helpers.executor_rig import rig as make_rig
from omni_async.core.errors import ExecutorShutdown, WorkerDied
from omni_async.core.messages import CancelMessage, OutputReady, RpcRequest, RpcResult
from omni_async.executor.inprocess import ThreadRanks
from omni_async.executor.link import RankEvents
from omni_async.executor.pool_store import PoolStore
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.shm import SegmentPool
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.packer import Packer


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield from make_rig()


@pytest.fixture
def pool_store() -> Iterator[PoolStore]:
    store = PoolStore(SegmentPool(max_bytes=4 << 20, max_segments=4), copy_outputs=False, lease_timeout=None, owner="T")
    try:
        yield store
    finally:
        store.close()


def _died(rank: int, oid: str | None = None) -> WorkerDied:
    return WorkerDied(rank, -9, output_id=oid)


def test_a_rank_death_fails_every_waiter_closes_the_registry_and_reclaims_its_segments(
    rig: Rig, pool_store: PoolStore
) -> None:
    closed = [False]
    events = RankEvents(rig.pump, pool_store, closed=lambda: closed[0], token="tok")
    rig.pump.call(lambda d: d.registry.on_compute_done(["o"], now=0.0, request_ids=["r"]))
    waiter = rig.desk.wait_output_ready("o")
    pool_store.pool.lease(1 << 20)  # what the dead rank held (this process plays it)
    events.rank_died(1, _died(1), lambda oid: _died(1, oid), os.getpid(), reclaim_shipped=True)
    err = exc_of(waiter)
    assert isinstance(err, WorkerDied) and err.rank == 1 and err.output_id == "o"
    assert events.failure is not None and events.failure.rank == 1
    assert pool_store.pool.stats().outstanding == 0
    # A message the dead rank sent before dying is released on arrival, never held.
    rig.play(OutputReady("late", rig.output("late", "r")))
    assert rig.store.released == ["late"] and len(rig.registry) == 0


def test_a_death_after_shutdown_is_the_shutdowns_doing(rig: Rig, pool_store: PoolStore) -> None:
    events = RankEvents(rig.pump, pool_store, closed=lambda: True, token="tok")
    events.rank_died(0, _died(0), lambda oid: _died(0, oid), None, reclaim_shipped=False)
    assert events.failure is None and not rig.registry.closed


def test_the_first_death_is_the_one_the_executor_fails_with(rig: Rig, pool_store: PoolStore) -> None:
    events = RankEvents(rig.pump, pool_store, closed=lambda: False, token="tok")
    events.rank_died(0, _died(0), lambda oid: _died(0, oid), None, reclaim_shipped=False)
    events.rank_died(1, _died(1), lambda oid: _died(1, oid), None, reclaim_shipped=False)
    assert events.failure is not None and events.failure.rank == 0


class _Echo:
    """A model that answers every RPC with its rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def whoami(self) -> int:
        return self.rank


def _thread_ranks(world: int = 2) -> ThreadRanks:
    channel = InProcessChannel()
    packers = [Packer(r, channel) for r in range(world)]
    loops = [WorkerLoop(r, _Echo(r), channel, packer=packers[r]) for r in range(world)]
    return ThreadRanks(channel, loops, packers)


def test_thread_ranks_deliver_every_rpc_and_cancel_and_refuse_after_stop() -> None:
    ranks = _thread_ranks()
    ranks.start(None, time.monotonic() + 5, 5.0)
    ranks.started()
    try:
        ranks.broadcast(RpcRequest("t-0", "whoami", async_output=False), None)
        got = [ranks.receiver.get(5.0), ranks.receiver.get(5.0)]
        assert sorted(m.result for m in got if isinstance(m, RpcResult) and isinstance(m.result, int)) == [0, 1]
        ranks.deliver_cancels([CancelMessage("t-9", ("r",))])  # never blocks: straight into the tables
        assert ranks.failure() is None
    finally:
        ranks.stop(time.monotonic() + 5)
    with pytest.raises(ExecutorShutdown):
        ranks.broadcast(RpcRequest("t-1", "whoami"), None)
    assert isinstance(ranks.failure(), ExecutorShutdown), "its threads are gone"
    ranks.stop(None)  # idempotent
