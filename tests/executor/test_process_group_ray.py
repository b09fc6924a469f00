"""Models split across ranks through ``RayDiffusionExecutor``: the ranks' process group
across its actors (gloo on the CPU), on the session's local two-node Ray cluster.

The rendezvous is served from the driver's node, its address handed to the actors; the
split DiT equals the unsplit one; only the reply rank ships; an actor killed inside a
collective fails every waiter with ``ActorDied`` naming its rank, and shutdown leaves
no actor and no segment.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from helpers.executor_harness import exc_of
from omni_async.core.config import Deadlines
from omni_async.core.errors import ActorDied, ComputeTimeout
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import WorkerSpec
from omni_async.models.dit import DiTPipelineWorker
from omni_async.models.parallel_dit import PARALLEL_ATOL

ray = pytest.importorskip("ray")

from omni_async.executor.ray_executor import RayDiffusionExecutor  # noqa: E402  # after the skip

# Ray's cluster takes seconds to start, each executor seconds more (as test_ray_executor.py).
pytestmark = pytest.mark.slow

DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)
DIT_KWARGS: dict[str, Any] = {"steps": 2, "depth": 2, "hidden_size": 64, "heads": 4, "decoder_width": 16}
COLLECTIVE = WorkerSpec("helpers.dist_workers:CollectiveWorker", pass_dist=True)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_session: object) -> None:
    """The session's Ray instance (tests/conftest.py)."""


# Both split modes, and a world of four, over Ray's actors; tensor at four ranks runs over
# worker processes (test_process_group.py): what Ray adds (the actors' rendezvous, the
# reply rank's object-store path) is the same for both modes.
@pytest.mark.parametrize(("mode", "world_size"), [("tensor", 2), ("sequence", 4)])
def test_split_dit_across_actors_equals_the_unsplit_model(mode: str, world_size: int) -> None:
    params = {"height": 64, "width": 64, "seed": 5}
    ref = DiTPipelineWorker(**DIT_KWARGS).execute_model(DiffusionRequest("ref", params)).output["image"]
    spec = WorkerSpec("omni_async.models.parallel_dit:make_worker", {"mode": mode, **DIT_KWARGS}, pass_dist=True)
    with RayDiffusionExecutor(
        spec, world_size=world_size, deadlines=DEADLINES, process_group=True, num_cpus_per_rank=0.5
    ) as ex:
        group = ex.ranks._group
        assert group is not None and group.address.startswith("tcp://")
        ro = ex.execute_request(DiffusionRequest("img", params))
        assert ro.async_output_id is not None
        out = ex.wait_output_ready(ro.async_output_id).result(timeout=60)
        got = out.output["image"]
        assert isinstance(ref, torch.Tensor) and got.shape == ref.shape
        assert (got - ref).abs().max().item() <= PARALLEL_ATOL
        del got
        ex.release_output(out)
        packed = [i.packer.packed for i in ex.worker_metrics()]
        assert packed == [1] + [0] * (world_size - 1)  # the reply rank (0) alone ships


def test_an_actor_killed_mid_collective_fails_every_waiter_naming_its_rank() -> None:
    compute_timeout = 30.0
    deadlines = Deadlines(compute_timeout=compute_timeout, output_timeout=30, rpc_timeout=30)
    ex = RayDiffusionExecutor(COLLECTIVE, world_size=2, deadlines=deadlines, process_group=True, num_cpus_per_rank=0.5)
    try:
        assert [i["group_size"] for i in ex.collective_rpc("dist_info")] == [2, 2]
        started = time.monotonic()
        dying = ex.submit(DiffusionRequest("dies", {"die_rank": 1, "enter_s": 0.5})).computed
        queued = ex.submit(DiffusionRequest("queued", {})).computed
        for fut in (dying, queued):
            err = exc_of(fut)
            assert isinstance(err, ActorDied) and not isinstance(err, ComputeTimeout), repr(err)
            assert err.rank == 1, err
        assert time.monotonic() - started < compute_timeout
        with pytest.raises(ActorDied, match="worker rank 1"):
            ex.check_health()
        survivor = ex.pids[0]
    finally:
        ex.shutdown()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(survivor, 0)  # does it still run?
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"rank 0's actor (pid {survivor}) still runs after shutdown")
