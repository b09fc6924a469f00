"""``RayDiffusionExecutor`` on a real local Ray cluster: actors, placement group, the pool.

One Ray instance for the session (tests/conftest.py: its start is the dear part); every test ends with no
segment of ours left in /dev/shm, and every executor with no actor and no placement
group left.  Skipped where Ray is not installed (CI installs it with ``.[dev]``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.executor_harness import exc_of, wait_until
from helpers.leaks import LONG_LIVED, with_prefix
from helpers.mp_workers import expected_image

from omni_async.core.config import Deadlines
from omni_async.core.errors import (
    ActorDied,
    RequestAborted,
    RpcFailed,
    WorkerDied,
    WorkerStartupFailed,
)
from omni_async.core.messages import DiffusionRequest, RunnerOutput
from omni_async.executor.multiproc import WorkerSpec

ray = pytest.importorskip("ray")

from omni_async.executor.ray_executor import RayDiffusionExecutor  # noqa: E402  # after the skip

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
        m["pending_outputs"] == 0
        and m["pending_rpcs"] == 0
        and m["held_payloads"] == 0
        and ex.pool.stats().outstanding == 0
    )


def _req(rid: str, **params: object) -> DiffusionRequest:
    return DiffusionRequest(rid, params)


def _take(ex: RayDiffusionExecutor, ro: RunnerOutput, params: dict[str, Any]) -> None:
    """Wait for the output, check it bit for bit, release it."""
    assert ro.async_output_id is not None and not ro.aborted
    out = ex.wait_output_ready(ro.async_output_id).result(timeout=30)
    assert out.request_id == ro.request_id
    exp = expected_image(params)
    got = out.output["image"]
    assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
    del got  # no view may outlive the release
    assert ex.release_output(out) == 1  # it travelled in a pooled segment


def test_end_to_end_two_phase(ex2: RayDiffusionExecutor) -> None:
    assert len(ex2.actors) == 2 and len(set(ex2.pids)) == 2
    params = {"numel": 1 << 18, "seed": 7}
    ro = ex2.submit_request(_req("r1", **params)).result(timeout=30)  # COMPUTE_DONE
    _take(ex2, ro, params)
    wait_until(lambda: _quiet(ex2), timeout=10)
    assert [i["rank"] for i in ex2.worker_metrics()] == [0, 1]


def test_a_batch(ex2: RayDiffusionExecutor) -> None:
    params = [{"numel": (1 << 17) + i, "seed": i} for i in range(4)]
    ros = ex2.submit_batch([_req(f"b{i}", **p) for i, p in enumerate(params)]).result(timeout=30)
    assert [ro.request_id for ro in ros] == ["b0", "b1", "b2", "b3"]
    for ro, p in zip(ros, params, strict=True):
        _take(ex2, ro, p)
    wait_until(lambda: _quiet(ex2), timeout=10)


def test_many_requests_keep_each_ranks_order(ex2: RayDiffusionExecutor) -> None:
    """Twenty calls in flight at once: every COMPUTE_DONE and OUTPUT_READY of a rank in put
    order through the polls (a gap or reorder would fail the dispatcher or the numbers)."""
    params = [{"numel": 1 << 17, "seed": 100 + i} for i in range(20)]
    futs = [ex2.submit_request(_req(f"m{i}", **p)) for i, p in enumerate(params)]
    for fut, p in zip(futs, params, strict=True):
        _take(ex2, fut.result(timeout=60), p)
    wait_until(lambda: _quiet(ex2), timeout=10)
    m = ex2.metrics()
    assert m["protocol_errors"] == 0 and m["dispatch_errors"] == 0, m


def test_a_failing_forward_is_a_typed_error(ex2: RayDiffusionExecutor) -> None:
    with pytest.raises(RpcFailed) as err:
        ex2.execute_request(_req("boom", **{"raise": True}))
    assert err.value.failures[0].type_name == "RuntimeError"
    assert "forward of boom failed" in err.value.failures[0].traceback
    wait_until(lambda: _quiet(ex2), timeout=10)
    ex2.check_health()


def test_abort_of_a_running_forward(ex2: RayDiffusionExecutor) -> None:
    fut = ex2.submit_request(_req("long", sleep=1.5))
    time.sleep(0.3)
    ex2.cancel_requests(["long"])
    err = exc_of(fut)
    assert isinstance(err, RequestAborted) and err.request_id == "long", err
    wait_until(lambda: _quiet(ex2), timeout=10)
    params = {"numel": 1 << 16, "seed": 1}
    _take(ex2, ex2.submit_request(_req("after", **params)).result(timeout=30), params)


def test_an_actor_killed_mid_forward_fails_its_waiters_naming_rank_and_node() -> None:
    ex = RayDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES)
    try:
        done = ex.submit_request(_req("ok", numel=1 << 17)).result(timeout=30)
        assert done.async_output_id is not None
        waiter = ex.wait_output_ready(done.async_output_id).result(timeout=30)  # delivered before the death
        running = ex.submit_request(_req("victim", sleep=30))
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


def _plasma_objects() -> int:
    """Objects in this node's object store now (Ray's own memory summary)."""
    import re

    from ray._private.internal_api import memory_summary

    # This session's Ray by its address: without one, Ray looks for running instances on
    # the machine and refuses when it finds more than one (another run's, a CI beside it).
    address = ray.get_runtime_context().gcs_address
    summary = memory_summary(address=address, stats_only=True)  # type: ignore[no-untyped-call]
    found = re.search(r"Plasma memory usage \S+ MiB, (\d+) objects", summary)
    assert found, "Ray's memory summary changed"
    return int(str(found.group(1)))


def _stored_everywhere(ex: RayDiffusionExecutor) -> int:
    """Refs to stored output buffers still held: the executor's table and every actor's."""
    held: list[int] = ray.get([a.stored_refs.remote() for a in ex.actors], timeout=30)
    return ex.stored_outputs() + sum(held)


@pytest.fixture(scope="module")
def ex_store() -> Iterator[RayDiffusionExecutor]:
    """Two ranks forced onto the object-store path (as ranks on another node would be)."""
    # Half a CPU per rank: with ex2 up too, the session's 4 logical CPUs leave room for one more executor.
    ex = RayDiffusionExecutor(
        SPEC, world_size=2, deadlines=DEADLINES, transport="object_store", num_cpus_per_rank=0.5
    )
    try:
        yield ex
    finally:
        ex.shutdown()
    assert ex.stored_outputs() == 0
    _gone(ex)


def _take_stored(ex: RayDiffusionExecutor, ro: RunnerOutput, params: dict[str, Any]) -> torch.Tensor:
    assert ro.async_output_id is not None and not ro.aborted
    out = ex.wait_output_ready(ro.async_output_id).result(timeout=30)
    assert out.request_id == ro.request_id and out.output["note"] == ro.request_id
    got: torch.Tensor = out.output["image"]
    assert torch.equal(got.view(torch.uint8), expected_image(params).view(torch.uint8))
    assert ex.release_output(out) == 0  # no segment: the buffer went with the unpack
    return got


def test_object_store_outputs_are_bit_exact_and_their_refs_go(ex_store: RayDiffusionExecutor) -> None:
    assert ex_store.via_store == [True, True]
    params: list[dict[str, Any]] = [
        {"numel": (1 << 18) + 3, "seed": 5, "dtype": "bfloat16"},
        {"numel": 1 << 20, "seed": 6},
        {"numel": 100, "seed": 7, "dtype": "int8"},  # inline only: nothing stored
    ]
    kept = []
    for i, p in enumerate(params):
        kept.append(_take_stored(ex_store, ex_store.execute_request(_req(f"s{i}", **p)), p))
    ros = ex_store.submit_batch([_req(f"sb{i}", **p) for i, p in enumerate(params)]).result(timeout=30)
    for ro, p in zip(ros, params, strict=True):
        _take_stored(ex_store, ro, p)
    wait_until(lambda: _quiet(ex_store) and _stored_everywhere(ex_store) == 0, timeout=10)
    assert ex_store.pool.stats().leased == 0  # the pool was never used
    # The tensors kept past the release still read their bytes: they hold the buffer.
    for _ in range(3):
        _take_stored(ex_store, ex_store.execute_request(_req("more", **params[1])), params[1])
    for got, p in zip(kept, params, strict=True):
        assert torch.equal(got.view(torch.uint8), expected_image(p).view(torch.uint8))


def test_object_store_outputs_dropped_or_aborted_in_flight_free_their_refs(ex_store: RayDiffusionExecutor) -> None:
    big: dict[str, Any] = {"numel": 1 << 22, "seed": 9}
    before = _plasma_objects()
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
    wait_until(lambda: _plasma_objects() <= before, timeout=20)  # Ray freed every buffer


def test_object_store_outputs_undelivered_at_shutdown_are_freed() -> None:
    before = _plasma_objects()
    ex = RayDiffusionExecutor(SPEC, world_size=1, deadlines=DEADLINES, transport="object_store")
    try:
        for i in range(3):
            ex.execute_request(_req(f"u{i}", numel=1 << 20))
        wait_until(lambda: ex.stored_outputs() == 3, timeout=20)  # arrived, never waited for
        assert _plasma_objects() >= 3
    finally:
        ex.shutdown()
    assert ex.stored_outputs() == 0
    wait_until(lambda: _plasma_objects() <= before, timeout=20)
    _gone(ex)


def test_transport_is_checked() -> None:
    from omni_async.core.errors import UsageError

    with pytest.raises(UsageError, match="transport must be one of"):
        RayDiffusionExecutor(SPEC, transport="tcp")


_PROBE = Path(__file__).resolve().parents[2] / "bench" / "probes" / "ray_cross_node.py"


def _probe(*args: str) -> subprocess.CompletedProcess[str]:
    """bench/probes/ray_cross_node.py in a process of its own: a real two-node Ray cluster
    (two raylets, two object stores) needs its own Ray, beside the session's."""
    path = os.pathsep.join([str(_PROBE.parents[2] / "src"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, str(_PROBE), *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )


def test_a_rank_on_another_node_ships_its_outputs_through_the_object_store() -> None:
    done = _probe("--mib", "8", "--requests", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["remote"] == [True] and result["via_store"] == [True], result  # chosen at start-up
    assert result["bit_exact"] and result["all_sizes_ok"] and result["stored_outputs_after"] == 0, result


def test_transport_shm_refuses_a_rank_on_another_node() -> None:
    done = _probe("--mib", "1", "--requests", "1", "--transport", "shm")
    assert done.returncode != 0
    assert "UsageError" in done.stderr and "transport='shm'" in done.stderr, done.stderr[-3000:]


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
        assert ex.release_output(ro.result) == 0
        ros = ex.execute_batch([_req("st1", seed=1, numel=1 << 18), _req("st2", seed=2, numel=1 << 18)])
        assert [r.request_id for r in ros] == ["st1", "st2"]
        for r in ros:
            assert r.result is not None
            exp = expected_image({"seed": int(r.request_id[-1]), "numel": 1 << 18})
            assert torch.equal(r.result.output["image"], exp)
        wait_until(lambda: _stored_everywhere(ex) == 0, timeout=10)
    assert ex.stored_outputs() == 0
    _gone(ex)
