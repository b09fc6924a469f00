"""``RayDiffusionExecutor`` on a real local Ray cluster of two nodes: actors, placement groups,
the pool on the executor's node, the object store across nodes, a node lost.

The session's cluster (tests/conftest.py: two raylets, two object stores; its start is
the dear part); every test ends with no segment of ours left in /dev/shm, every executor
with no actor and no placement group left, and the session with no actor of ours alive
and nothing in the object stores.  Skipped where Ray is not installed (CI installs it
with ``.[dev]``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers.executor_harness import exc_of, wait_until
from helpers.executors import HEAD_NODE, OTHER_NODE, leftover_actors, plasma_objects
from helpers.leaks import LONG_LIVED, with_prefix
from helpers.mp_workers import expected_image
from omni_async.core.config import Deadlines
from omni_async.core.errors import (
    ActorDied,
    RemoteError,
    RequestAborted,
    RpcFailed,
    WorkerDied,
    WorkerStartupFailed,
)
from omni_async.core.messages import DiffusionOutput, DiffusionRequest, RunnerOutput
from omni_async.executor.multiproc import WorkerOptions, WorkerSpec
from omni_async.transport.errors import HeldOutputsFull, OutputStillViewed

ray = pytest.importorskip("ray")

from omni_async.executor.ray_executor import RayDiffusionExecutor  # noqa: E402  # after the skip

# The fast tier leaves Ray out: the session's two-node cluster takes seconds to start, and
# every test here seconds more (the executor layer's fast tests run MultiprocDiffusionExecutor).
pytestmark = pytest.mark.slow

SPEC = WorkerSpec("helpers.mp_workers:ScriptedWorker", pass_rank=True)
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60, cancel_grace=1.0)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_session: object) -> None:
    """The session's Ray instance (tests/conftest.py)."""


def _gone(ex: RayDiffusionExecutor) -> None:
    """After shutdown: no actor answers, the placement group is removed, no segment is left."""
    from ray.util import placement_group_table

    for actor in ex.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ready.remote(1.0), timeout=30)
    assert placement_group_table(ex.placement_group)["state"] == "REMOVED"
    assert not with_prefix(ex.pool.prefix), with_prefix(ex.pool.prefix)


@pytest.fixture(scope="module")
def ex2() -> Iterator[RayDiffusionExecutor]:
    """Two ranks, reply rank 0, shared by the tests that leave it healthy."""
    ex = RayDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES)
    LONG_LIVED.add(ex.pool.prefix)
    try:
        yield ex
    finally:
        ex.shutdown()
        LONG_LIVED.discard(ex.pool.prefix)
    _gone(ex)


def _quiet(ex: RayDiffusionExecutor) -> bool:
    m = ex.metrics()
    return (
        m.pending_outputs == 0
        and m.pending_rpcs == 0
        and m.held_payloads == 0
        and m.held_outputs == 0  # the pool's and the object store's
        and ex.pool.stats().outstanding == 0
    )


def _req(rid: str, **params: object) -> DiffusionRequest:
    return DiffusionRequest(rid, params)


def _take(ex: RayDiffusionExecutor, ro: RunnerOutput, params: dict[str, Any]) -> None:
    """Wait for the output, check it bit for bit, release it."""
    assert ro.async_output_id is not None and not ro.aborted
    out = ex.wait_output_ready(ro.async_output_id).result(timeout=30)
    assert out.request_id == ro.request_id
    _check(ex, out, params)


def _check(ex: RayDiffusionExecutor, out: DiffusionOutput, params: dict[str, Any]) -> None:
    """A delivered output: bit for bit what ``params`` make; released."""
    exp = expected_image(params)
    got = out.output["image"]
    assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
    del got  # no view may outlive the release
    assert ex.release_output(out) == 1  # it travelled in a pooled segment


def test_end_to_end_two_phase(ex2: RayDiffusionExecutor) -> None:
    assert len(ex2.actors) == 2 and len(set(ex2.pids)) == 2
    params = {"numel": 1 << 18, "seed": 7}
    ro = ex2.execute_request(_req("r1", **params))  # COMPUTE_DONE
    _take(ex2, ro, params)
    wait_until(lambda: _quiet(ex2), timeout=10)
    assert [i.rank for i in ex2.worker_metrics()] == [0, 1]


def test_a_batch(ex2: RayDiffusionExecutor) -> None:
    params = [{"numel": (1 << 17) + i, "seed": i} for i in range(4)]
    ros = ex2.execute_batch([_req(f"b{i}", **p) for i, p in enumerate(params)])
    assert [ro.request_id for ro in ros] == ["b0", "b1", "b2", "b3"]
    for ro, p in zip(ros, params, strict=True):
        _take(ex2, ro, p)
    wait_until(lambda: _quiet(ex2), timeout=10)


def test_many_requests_keep_each_ranks_order(ex2: RayDiffusionExecutor) -> None:
    """Twenty calls in flight at once: every COMPUTE_DONE and OUTPUT_READY of a rank in put
    order through the polls (a gap or reorder would fail the dispatcher or the numbers)."""
    params = [{"numel": 1 << 17, "seed": 100 + i} for i in range(20)]
    handles = [ex2.submit(_req(f"m{i}", **p)) for i, p in enumerate(params)]
    for h, p in zip(handles, params, strict=True):
        out = h.output.result(timeout=60)
        assert out.request_id == h.request_id
        _check(ex2, out, p)
    wait_until(lambda: _quiet(ex2), timeout=10)
    m = ex2.metrics()
    assert m.protocol_errors == 0 and m.dispatch_errors == 0, m


def test_a_failing_forward_is_a_typed_error(ex2: RayDiffusionExecutor) -> None:
    with pytest.raises(RpcFailed) as err:
        ex2.execute_request(_req("boom", **{"raise": True}))
    assert err.value.failures[0].type_name == "RuntimeError"
    assert "forward of boom failed" in err.value.failures[0].traceback
    wait_until(lambda: _quiet(ex2), timeout=10)
    ex2.check_health()


def test_abort_of_a_running_forward(ex2: RayDiffusionExecutor) -> None:
    fut = ex2.submit(_req("long", sleep=1.5)).computed
    time.sleep(0.3)
    ex2.cancel_requests(["long"])
    err = exc_of(fut)
    assert isinstance(err, RequestAborted) and err.request_id == "long", err
    wait_until(lambda: _quiet(ex2), timeout=10)
    params = {"numel": 1 << 16, "seed": 1}
    _take(ex2, ex2.execute_request(_req("after", **params)), params)


def test_an_actor_killed_mid_forward_fails_its_waiters_naming_rank_and_node() -> None:
    ex = RayDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES)
    try:
        done = ex.execute_request(_req("ok", numel=1 << 17))
        assert done.async_output_id is not None
        waiter = ex.wait_output_ready(done.async_output_id).result(timeout=30)  # delivered before the death
        running = ex.submit(_req("victim", sleep=30)).computed
        time.sleep(0.3)
        ray.kill(ex.actors[1], no_restart=True)
        err = exc_of(running)
        assert isinstance(err, ActorDied) and isinstance(err, WorkerDied), err
        assert err.rank == 1 and ex.nodes[1] in str(err) and "rank 1" in str(err), err
        with pytest.raises(ActorDied):
            ex.check_health()
        del waiter
    finally:
        ex.shutdown()
    _gone(ex)


def test_a_model_that_fails_to_build_fails_the_constructor_and_leaves_nothing() -> None:
    spec = WorkerSpec("helpers.mp_workers:BrokenWorker", {"fail_rank": 1}, pass_rank=True)
    with pytest.raises(WorkerStartupFailed) as err:
        RayDiffusionExecutor(spec, world_size=2, deadlines=DEADLINES, start_timeout=60)
    assert err.value.rank == 1 and err.value.failure is not None
    assert err.value.failure.type_name == "FileNotFoundError"
    assert err.value.actor and err.value.exitcode is None
    # An actor has no exit code of ours: the message says what it is instead of "exit code None".
    assert str(err.value).startswith("worker rank 1 (a Ray actor) failed to start: FileNotFoundError"), err.value
    assert "exit code" not in str(err.value)


def test_an_actor_imports_what_the_driver_can(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A factory importable in the driver through ``sys.path`` alone (not ``PYTHONPATH``, which
    Ray's workers inherit) is importable in the actors too, as in a spawned worker process:
    the executor hands the driver's import path to each actor.  Without it every actor failed
    to start in CI (``No module named 'helpers'``: pytest puts ``tests/`` on sys.path only)."""
    (tmp_path / "only_on_the_drivers_path.py").write_text(
        "from omni_async.models.tiny import TinyDiffusionWorker\n"
        "def make(rank: int = 0) -> TinyDiffusionWorker:\n"
        "    return TinyDiffusionWorker(width=64, steps=1)\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = WorkerSpec("only_on_the_drivers_path:make")
    with RayDiffusionExecutor(spec, deadlines=DEADLINES) as ex:
        ro = ex.execute_request(DiffusionRequest("p", {"height": 64}))
        assert ro.async_output_id is not None
        out = ex.wait_output_ready(ro.async_output_id).result(timeout=30)
        assert tuple(out.output["image"].shape) == (64, 64)
        del out.output["image"]
        ex.release_output(out)
    _gone(ex)


# ------------------------------------------------------------ the object-store path (issue 11)


def _stored_everywhere(ex: RayDiffusionExecutor) -> int:
    """Refs to stored output buffers still held: the executor's table and every actor's."""
    held: list[int] = ray.get([a.stored_refs.remote() for a in ex.actors], timeout=30)
    return ex.stored_outputs() + sum(held)


@pytest.fixture(scope="module")
def ex_store() -> Iterator[RayDiffusionExecutor]:
    """Two ranks forced onto the object-store path (as ranks on another node would be)."""
    # Half a CPU per rank: with ex2 up too, the session's 4 logical CPUs leave room for one more executor.
    ex = RayDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES, transport="object_store", num_cpus_per_rank=0.5)
    try:
        yield ex
    finally:
        ex.shutdown()
    assert ex.stored_outputs() == 0
    _gone(ex)


def _take_stored(ex: RayDiffusionExecutor, ro: RunnerOutput, params: dict[str, Any]) -> None:
    """Wait for the output, check it bit for bit, release it: 1 when it viewed a stored buffer."""
    assert ro.async_output_id is not None and not ro.aborted
    out = ex.wait_output_ready(ro.async_output_id).result(timeout=30)
    assert out.request_id == ro.request_id and out.output["note"] == ro.request_id
    got: torch.Tensor = out.output["image"]
    assert torch.equal(got.view(torch.uint8), expected_image(params).view(torch.uint8))
    del got  # no view may outlive the release
    stored = out.metrics.get("pack_stored_bytes", 0.0) > 0
    assert ex.release_output(out) == int(stored)  # its views, taken back (none for an inline-only output)


def test_object_store_outputs_are_bit_exact_and_their_refs_go(ex_store: RayDiffusionExecutor) -> None:
    assert ex_store.via_store == [True, True]
    params: list[dict[str, Any]] = [
        {"numel": (1 << 18) + 3, "seed": 5, "dtype": "bfloat16"},
        {"numel": 1 << 20, "seed": 6},
        {"numel": 100, "seed": 7, "dtype": "int8"},  # inline only: nothing stored
    ]
    for i, p in enumerate(params):
        _take_stored(ex_store, ex_store.execute_request(_req(f"s{i}", **p)), p)
    ros = ex_store.execute_batch([_req(f"sb{i}", **p) for i, p in enumerate(params)])
    for ro, p in zip(ros, params, strict=True):
        _take_stored(ex_store, ro, p)
    wait_until(lambda: _quiet(ex_store) and _stored_everywhere(ex_store) == 0, timeout=10)
    assert ex_store.pool.stats().leased == 0  # the pool was never used


def test_a_stored_output_viewed_past_its_release_stays_intact_and_held(ex_store: RayDiffusionExecutor) -> None:
    """As with a pooled segment: release_output with a view still alive raises
    OutputStillViewed; the view keeps reading its bytes, the buffer counts as held, and
    dropping the view gives the room back."""
    p: dict[str, Any] = {"numel": 1 << 20, "seed": 8}
    ro = ex_store.execute_request(_req("kept", **p))
    assert ro.async_output_id is not None
    out = ex_store.wait_output_ready(ro.async_output_id).result(timeout=30)
    kept: torch.Tensor = out.output["image"][1:]
    with pytest.raises(OutputStillViewed):
        ex_store.release_output(out)
    _take_stored(ex_store, ex_store.execute_request(_req("other", **p)), p)
    assert torch.equal(kept.view(torch.uint8), expected_image(p)[1:].view(torch.uint8))
    wait_until(lambda: ex_store.metrics().held_outputs == 1, timeout=10)
    del kept
    wait_until(lambda: _quiet(ex_store) and _stored_everywhere(ex_store) == 0, timeout=10)

    def budgets() -> list[tuple[int, int]]:
        return list(ray.get([a.store_budget.remote() for a in ex_store.actors], timeout=30))

    # The room reaches the actor's budget by its credit thread, after the object is gone
    # from the store: waited for, not read at once (it lagged once under a loaded suite).
    wait_until(lambda: budgets() == [(0, 0), (0, 0)], timeout=10)


@pytest.mark.slow
def test_a_slow_transfer_holds_up_only_its_own_waiter(
    ex_store: RayDiffusionExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read of a stored output (``ray.get``: a transfer across nodes, seconds for a
    large video) runs on a fetch thread: while one takes 3 s, the pump goes on routing
    the other requests' messages.  On the pump's thread, the next request's COMPUTE_DONE
    would wait behind it."""
    import omni_async.executor.ray_store as rx

    started = threading.Event()
    real = rx._get_stored

    def slow_first(ref: Any, timeout: float | None) -> Any:
        if not started.is_set():
            started.set()
            time.sleep(3.0)  # a slow link, injected in front of the real read
        return real(ref, timeout)

    monkeypatch.setattr(rx, "_get_stored", slow_first)
    p: dict[str, Any] = {"numel": 1 << 18, "seed": 3}
    slow = ex_store.execute_request(_req("slow", **p))
    assert slow.async_output_id is not None
    slow_out = ex_store.wait_output_ready(slow.async_output_id)
    assert started.wait(10)
    t0 = time.monotonic()
    _take_stored(ex_store, ex_store.execute_request(_req("fast", **p)), p)
    assert time.monotonic() - t0 < 2.0, "the pump waited for another output's transfer"
    assert not slow_out.done()
    out = slow_out.result(timeout=30)
    assert torch.equal(out.output["image"].view(torch.uint8), expected_image(p).view(torch.uint8))
    assert ex_store.release_output(out) == 1
    wait_until(lambda: _quiet(ex_store) and _stored_everywhere(ex_store) == 0, timeout=10)


@pytest.mark.slow
def test_the_object_store_budget_holds_the_packer_until_room() -> None:
    """Back-pressure on the object-store path, worker-side as with the pool: with
    max_held_outputs=1 the next output's pack waits while one is held (its views alive),
    fails with HeldOutputsFull after lease_timeout, and goes on the moment the held one
    is released."""
    with RayDiffusionExecutor(
        SPEC,
        deadlines=DEADLINES,
        transport="object_store",
        num_cpus_per_rank=0.5,
        max_held_outputs=1,
        options=WorkerOptions(lease_timeout=2.0),
    ) as ex:
        (actor,) = ex.actors
        p: dict[str, Any] = {"numel": 1 << 18, "seed": 4}

        def budget() -> tuple[int, int]:
            got: tuple[int, int] = ray.get(actor.store_budget.remote(), timeout=30)
            return got

        first = ex.execute_request(_req("held", **p))
        assert first.async_output_id is not None
        held = ex.wait_output_ready(first.async_output_id).result(timeout=30)
        assert budget() == (1, 0) and ex.metrics().held_outputs == 1
        # No room: the next pack waits, then fails typed, naming the budget.
        late = ex.execute_request(_req("late", **p))
        assert late.async_output_id is not None
        err = exc_of(ex.wait_output_ready(late.async_output_id))
        assert isinstance(err, RemoteError) and err.failure.type_name == HeldOutputsFull.__name__, err
        assert "max_held_outputs=1" in str(err) and "object store" in str(err), err
        # Room comes back with the release: the waiting pack goes on.
        third = ex.execute_request(_req("third", **p))
        assert third.async_output_id is not None
        wait_until(lambda: budget() == (1, 1), timeout=10)
        assert ex.release_output(held) == 1
        _take_stored(ex, third, p)
        wait_until(lambda: budget() == (0, 0) and ex.metrics().held_outputs == 0, timeout=10)
    _gone(ex)


@pytest.mark.slow
def test_a_node_lost_with_outputs_in_every_stage_fails_its_waiters_and_leaves_nothing(local_cluster: Any) -> None:
    """A whole node lost (its raylet and the actor with it: ``Cluster.remove_node``) while
    its rank has an output delivered and held, one arrived and unclaimed, one waiting
    for room in its budget and a forward running: every waiter fails with ``ActorDied``
    naming the rank, the unclaimed ref is dropped, the held output stays intact (its
    bytes were fetched to this node) and releasable, and nothing is left after shutdown."""
    from ray.util.placement_group import placement_group, remove_placement_group

    node = local_cluster.add_node(num_cpus=1, resources={"omni_test_doomed": 4}, object_store_memory=128 << 20)
    local_cluster.wait_for_nodes()
    pg = placement_group([{"CPU": 0.5, "omni_test_doomed": 1.0}])
    ray.get(pg.ready(), timeout=60)
    ex = RayDiffusionExecutor(
        SPEC,
        deadlines=DEADLINES,
        placement_group=pg,
        num_cpus_per_rank=0.5,
        max_held_outputs=2,
        options=WorkerOptions(lease_timeout=60),
    )
    try:
        assert ex.via_store == [True]
        p: dict[str, Any] = {"numel": 1 << 18, "seed": 40}
        first = ex.execute_request(_req("kept", **p))
        assert first.async_output_id is not None
        kept = ex.wait_output_ready(first.async_output_id).result(timeout=30)
        ready = ex.execute_request(_req("ready", **p))
        wait_until(lambda: ex.stored_outputs() == 1, timeout=10)  # arrived, unclaimed
        packing = ex.execute_request(_req("packing", **p))
        assert packing.async_output_id is not None
        packing_out = ex.wait_output_ready(packing.async_output_id)
        wait_until(lambda: ray.get(ex.actors[0].store_budget.remote(), timeout=30) == (2, 1), timeout=10)
        forward = ex.submit(_req("forward", sleep=5.0)).computed
        time.sleep(0.5)
        local_cluster.remove_node(node)
        for stage, fut in (("while packing", packing_out), ("during the forward", forward)):
            err = fut.exception(timeout=60)
            assert isinstance(err, ActorDied) and err.rank == 0, (stage, err)
            assert "worker rank 0 (a Ray actor on node" in str(err), err
        assert ready.async_output_id is not None
        assert isinstance(ex.wait_output_ready(ready.async_output_id).exception(timeout=30), WorkerDied)
        wait_until(lambda: ex.stored_outputs() == 0, timeout=10)
        assert torch.equal(kept.output["image"].view(torch.uint8), expected_image(p).view(torch.uint8))
        assert ex.release_output(kept) == 1
        wait_until(lambda: ex.metrics().held_outputs == 0, timeout=10)
    finally:
        ex.shutdown()
        remove_placement_group(pg)
    assert ex.stored_outputs() == 0


def test_object_store_outputs_dropped_or_aborted_in_flight_free_their_refs(ex_store: RayDiffusionExecutor) -> None:
    big: dict[str, Any] = {"numel": 1 << 22, "seed": 9}
    before = plasma_objects()
    ros = [ex_store.execute_request(_req(f"d{i}", **big)) for i in range(4)]
    ids = [ro.async_output_id for ro in ros]
    assert all(ids)
    for oid in ids[:2]:
        assert oid is not None
        ex_store.drop_output(oid).result(timeout=30)  # in flight, or arrived and undelivered
    ex_store.abort_outputs([oid for oid in ids[2:] if oid is not None], timeout=30)
    wait_until(lambda: _quiet(ex_store) and _stored_everywhere(ex_store) == 0, timeout=20)
    # A waiter cancelled before delivery: the registry's release drops the ref.
    ro = ex_store.execute_request(_req("w", **big))
    assert ro.async_output_id is not None
    fut = ex_store.wait_output_ready(ro.async_output_id)
    fut.cancel()
    wait_until(lambda: _quiet(ex_store) and _stored_everywhere(ex_store) == 0, timeout=20)
    wait_until(lambda: plasma_objects() <= before, timeout=20)  # Ray freed every buffer


def test_object_store_outputs_undelivered_at_shutdown_are_freed() -> None:
    before = plasma_objects()
    ex = RayDiffusionExecutor(SPEC, world_size=1, deadlines=DEADLINES, transport="object_store")
    try:
        for i in range(3):
            ex.execute_request(_req(f"u{i}", numel=1 << 20))
        wait_until(lambda: ex.stored_outputs() == 3, timeout=20)  # arrived, never waited for
        assert plasma_objects() >= 3
    finally:
        ex.shutdown()
    assert ex.stored_outputs() == 0
    wait_until(lambda: plasma_objects() <= before, timeout=20)
    _gone(ex)


def test_transport_is_checked() -> None:
    from omni_async.core.errors import UsageError

    with pytest.raises(UsageError, match="transport must be one of"):
        RayDiffusionExecutor(SPEC, transport="tcp")


def test_prewarm_fills_the_pool_before_the_actors_start() -> None:
    """``prewarm=`` with the budget: the segments exist before the first request, the
    packing actor mapped them while starting, and requests reuse them."""
    from ray.util.placement_group import remove_placement_group

    from omni_async.executor.config import Prewarm

    params = {"numel": 1 << 18, "seed": 5}
    # On the executor's node (the session cluster has two: on the other one the actor
    # would ship through the object store and map nothing).
    pg = _on_the_head_node()
    ex = RayDiffusionExecutor(SPEC, deadlines=DEADLINES, max_held_outputs=4, max_held_bytes=16 << 20,
                              prewarm=Prewarm.of_tensor((1 << 18,), torch.float32, count=2),
                              placement_group=pg, num_cpus_per_rank=0.5)  # fmt: skip
    try:
        assert ex.via_store == [False]
        assert ex.pool.stats().created == 2
        assert ex.worker_metrics()[0].mapped_segments == 2
        for i in range(3):
            _take(ex, ex.execute_request(_req(f"p{i}", **params)), params)
        assert ex.pool.stats().created == 2
    finally:
        ex.shutdown()
        remove_placement_group(pg)
    _gone(ex)


def _on_the_head_node() -> Any:
    """A placement group of one bundle on the session cluster's head node (the driver's
    and the executor's)."""
    from ray.util.placement_group import placement_group

    pg = placement_group([{"CPU": 0.5, HEAD_NODE: 1.0}])
    ray.get(pg.ready(), timeout=60)
    return pg


def test_prewarm_is_refused_without_the_pool() -> None:
    from omni_async.executor.config import InvalidConfig, Prewarm

    with pytest.raises(InvalidConfig, match="prewarm is refused with transport='object_store'"):
        RayDiffusionExecutor(SPEC, transport="object_store", prewarm=Prewarm.of_bytes(1 << 20))


def _on_the_other_node() -> Any:
    """A placement group of one bundle on the session cluster's other node (not the
    executor's: another raylet, another object store)."""
    from ray.util.placement_group import placement_group

    pg = placement_group([{"CPU": 0.5, OTHER_NODE: 1.0}])
    ray.get(pg.ready(), timeout=60)
    return pg


def test_a_rank_on_another_node_ships_its_outputs_through_the_object_store() -> None:
    """transport="auto": the actor on the other node finds it is not on the executor's and
    ships through the object store; its outputs cross between the raylets bit for bit."""
    from ray.util.placement_group import remove_placement_group

    pg = _on_the_other_node()
    try:
        with RayDiffusionExecutor(SPEC, deadlines=DEADLINES, placement_group=pg, num_cpus_per_rank=0.5) as ex:
            assert ex.via_store == [True]
            here = ray.get_runtime_context().get_node_id()
            assert not ex.nodes[0].startswith(here), (ex.nodes, here)
            for i, numel in enumerate((1 << 20, (1 << 16) + 5, 7)):
                p: dict[str, Any] = {"numel": numel, "seed": 30 + i}
                _take_stored(ex, ex.execute_request(_req(f"x{i}", **p)), p)
            wait_until(lambda: _quiet(ex) and _stored_everywhere(ex) == 0, timeout=10)
        assert ex.stored_outputs() == 0
    finally:
        remove_placement_group(pg)


def test_transport_shm_refuses_a_rank_on_another_node() -> None:
    from ray.util.placement_group import remove_placement_group

    from omni_async.core.errors import UsageError

    before = set(leftover_actors())  # the module's executors
    pg = _on_the_other_node()
    try:
        with pytest.raises(UsageError, match="transport='shm'"):
            RayDiffusionExecutor(SPEC, transport="shm", placement_group=pg, num_cpus_per_rank=0.5)
    finally:
        remove_placement_group(pg)
    wait_until(lambda: set(leftover_actors()) <= before, timeout=20)  # the refused actor too


def test_a_placement_group_of_the_caller_is_checked() -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    from omni_async.core.errors import UsageError

    pg = placement_group([{"CPU": 0.25}])
    try:
        with pytest.raises(UsageError, match="1 bundle"):
            RayDiffusionExecutor(SPEC, world_size=2, placement_group=pg)
        with pytest.raises(UsageError, match="no room for worker rank 0"):
            RayDiffusionExecutor(SPEC, placement_group=pg, num_cpus_per_rank=0.5)
        with pytest.raises(UsageError, match="must be a Ray PlacementGroup"):
            RayDiffusionExecutor(SPEC, placement_group="pg-1")  # type: ignore[arg-type]
    finally:
        remove_placement_group(pg)


def test_step_mode_answers_over_the_object_store() -> None:
    """Step mode packs on the worker's main thread and answers in the RPC result: the same
    object-store path, the refs beside the message, none left after the answers."""
    with RayDiffusionExecutor(
        SPEC, step_mode=True, deadlines=DEADLINES, transport="object_store", num_cpus_per_rank=0.5
    ) as ex:
        params: dict[str, Any] = {"seed": 21, "dtype": "bfloat16", "numel": 1 << 18}
        ro = ex.execute_request(_req("st", **params))
        assert ro.async_output_id is None and ro.result is not None
        assert torch.equal(ro.result.output["image"].view(torch.uint8), expected_image(params).view(torch.uint8))
        assert ex.release_output(ro.result) == 1
        ros = ex.execute_batch([_req("st1", seed=1, numel=1 << 18), _req("st2", seed=2, numel=1 << 18)])
        assert [r.request_id for r in ros] == ["st1", "st2"]
        for r in ros:
            assert r.result is not None
            exp = expected_image({"seed": int(r.request_id[-1]), "numel": 1 << 18})
            assert torch.equal(r.result.output["image"], exp)
        # Dropped before the shutdown: Ray frees a buffer when its owner (the actor) is told
        # the last reference is gone; dropped after the owner died, a fetched copy lingers in
        # the object store until Ray evicts it.
        del ros, r
        wait_until(lambda: _stored_everywhere(ex) == 0 and ex.metrics().held_outputs == 0, timeout=10)
    assert ex.stored_outputs() == 0
    _gone(ex)


@pytest.mark.slow
def test_the_guides_cross_node_example_runs() -> None:
    """docs/operators.md, "Running on Ray": the two-node block, as written, in a fresh
    interpreter (its own local cluster, beside the session's)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "operators.md").read_text(encoding="utf-8")
    section = page[page.index("## Running on Ray") :]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, re.S | re.M)
    (block,) = [b for b in blocks if "Cluster(" in b][:1]
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "through the object store: [True," in done.stdout, done.stdout
    assert "r1 (256, 256) 262144.0" in done.stdout, done.stdout  # the image went through the object store


def test_room_given_back_counts_at_once() -> None:
    """A stored output's release is counted when it happens (``metrics().held_outputs``
    falls to 0 before ``release_output`` returns, as with a pooled segment), not when the
    credit thread gets to it: the engine's abort test read 1 there now and then."""
    from omni_async.executor.ray_store import Credits

    credits = Credits()  # its thread not started: nothing sends, the count is already right
    credits.give("0.1")
    credits.give("0.2")
    assert credits.given == 2
