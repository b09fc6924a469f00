"""The executors a test can run over: ``MultiprocDiffusionExecutor`` and ``RayDiffusionExecutor``.

``executor_class(kind, request)``: the class for ``kind`` ("multiproc" or "ray"); for
"ray" it connects to the session's two-node Ray cluster (tests/conftest.py
``ray_session``), which skips the test where Ray is not installed.  Both take the same
arguments for what the tests use (spec, world_size, deadlines, options, the budget).

On "ray" the ranks are spread over the two nodes (``CrossNodeRayExecutor``): the reply
rank 0 on the *other* node, so every output the tests take crosses between raylets
through Ray's object store, and rank 1 on the head node (the executor's), through the
shared-memory pool.  ``worker_pids(ex)``: per rank, the pid of the worker process or of
the rank's actor.  ``leftover_actors()`` and ``plasma_objects()`` are the cluster-wide
checks: actors of ours still alive, objects in the object stores.
"""

from __future__ import annotations

import re
from typing import Any, cast

import pytest

from omni_async.executor.multiproc import MultiprocDiffusionExecutor

# For parametrize and fixture params: "ray" is left out of the fast tier (pytest -m "not
# slow"), since the session's Ray cluster takes seconds to start.
KINDS = (pytest.param("multiproc", id="multiproc"), pytest.param("ray", id="ray", marks=pytest.mark.slow))
# Custom resources of the session cluster's two nodes (tests/conftest.py).
HEAD_NODE = "omni_test_head"
OTHER_NODE = "omni_test_other"


def executor_class(kind: str, request: pytest.FixtureRequest) -> type[MultiprocDiffusionExecutor]:
    if kind == "ray":
        request.getfixturevalue("ray_session")  # skips where Ray is not installed
        return _cross_node_class()
    assert kind == "multiproc", kind
    return MultiprocDiffusionExecutor


def _cross_node_class() -> type[MultiprocDiffusionExecutor]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from omni_async.executor.ray_executor import RayDiffusionExecutor

    class CrossNodeRayExecutor(RayDiffusionExecutor):
        """Rank 0 on the other node (the object store), rank 1 on the head (the pool), and so
        on alternating: a placement group of its own, removed after shutdown."""

        def __init__(self, *args: Any, world_size: int = 1, **kwargs: Any) -> None:
            bundles = [{"CPU": 0.5, OTHER_NODE if r % 2 == 0 else HEAD_NODE: 1.0} for r in range(world_size)]
            self._test_pg = placement_group(bundles)
            ray.get(self._test_pg.ready(), timeout=60)
            try:
                super().__init__(
                    *args, world_size=world_size, placement_group=self._test_pg, num_cpus_per_rank=0.5, **kwargs
                )
            except BaseException:
                remove_placement_group(self._test_pg)
                raise
            assert self.via_store == [r % 2 == 0 for r in range(world_size)], self.via_store

        def shutdown(self, reason: str = "the executor shut down", *, timeout: float | None = None) -> None:
            super().shutdown(reason, timeout=timeout)
            if self._test_pg is not None:
                remove_placement_group(self._test_pg)
                self._test_pg = None

    # RayDiffusionExecutor does not subclass MultiprocDiffusionExecutor (siblings over
    # DiffusionExecutor); the tests drive both through the API they share, and the helpers
    # here that differ (worker_pids, waits_for_room) look the difference up at run time.
    return cast("type[MultiprocDiffusionExecutor]", CrossNodeRayExecutor)


def worker_pids(ex: MultiprocDiffusionExecutor) -> list[int]:
    pids: list[int] | None = getattr(ex, "pids", None)  # RayDiffusionExecutor's, one per actor
    if pids is not None:
        return list(pids)
    out = [p.pid for p in ex.procs]
    assert all(pid is not None for pid in out), out
    return [pid for pid in out if pid is not None]


def waits_for_room(ex: MultiprocDiffusionExecutor) -> bool:
    """Whether a pack waits for room in the budget of held outputs now: the pool's, or on
    the object-store path the budget of the rank's actor."""
    if ex.metrics().pool_full == 1.0:
        return True
    via_store: list[bool] = getattr(ex, "via_store", [])
    if not any(via_store):
        return False
    import ray

    actors: list[Any] = getattr(ex, "actors")  # noqa: B009  # RayDiffusionExecutor's
    budgets: list[tuple[int, int]] = ray.get([a.store_budget.remote() for a in actors], timeout=30)
    return any(waiting for _, waiting in budgets)


def leftover_actors() -> list[str]:
    """Our actors (``omni-worker-...``) Ray still lists as alive, in any namespace."""
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in named if str(a["name"]).startswith("omni-worker-")]


def plasma_objects() -> int:
    """Objects in the cluster's object stores now (Ray's own memory summary, every node)."""
    import ray
    from ray._private.internal_api import memory_summary

    # This session's Ray by its address: without one, Ray looks for running instances on
    # the machine and refuses when it finds more than one (another run's, a CI beside it).
    address = ray.get_runtime_context().gcs_address
    summary = memory_summary(address=address, stats_only=True)  # type: ignore[no-untyped-call]
    found = re.search(r"Plasma memory usage \S+ MiB, (\d+) objects", summary)
    assert found, "Ray's memory summary changed"
    return int(str(found.group(1)))
