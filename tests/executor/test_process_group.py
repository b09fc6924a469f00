"""Models split across ranks: the ranks' process group, through ``MultiprocDiffusionExecutor``
(real worker processes, gloo on the CPU, no mocks).

The executor owns a rendezvous per instance, every rank joins the group before its
model is built and gets a ``DistContext``; the reference DiT split by heads (tensor
parallel) or by tokens (sequence parallel) equals the unsplit model; only the reply
rank leases segments; a rank killed inside a collective fails every waiter with an
error naming it, and shutdown leaves no process and no segment (conftest's leak check).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers.executor_harness import exc_of, wait_until
from omni_async.core.config import Deadlines
from omni_async.core.errors import ComputeTimeout, WorkerDied, WorkerStuck
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.config import ExecutorConfig, InvalidConfig, ProcessGroupConfig
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.dit import DiTPipelineWorker
from omni_async.models.parallel_dit import PARALLEL_ATOL
from omni_async.transport.shm import pid_alive

COLLECTIVE = WorkerSpec("helpers.dist_workers:CollectiveWorker", pass_dist=True, pass_rank=True)
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)
DIT_KWARGS: dict[str, Any] = {"steps": 2, "depth": 2, "hidden_size": 64, "heads": 4, "decoder_width": 16}


def _parallel_spec(mode: str) -> WorkerSpec:
    return WorkerSpec("omni_async.models.parallel_dit:make_worker", {"mode": mode, **DIT_KWARGS}, pass_dist=True)


def _procs_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(pid_alive(p) for p in pids)


# -- configuration: refused before anything starts ---------------------------------------------


def test_process_group_is_off_by_default_and_refused_where_it_cannot_work() -> None:
    assert ExecutorConfig().process_group_config is None
    assert ExecutorConfig(process_group=True).process_group_config == ProcessGroupConfig()
    pg = ProcessGroupConfig(backend="gloo", rendezvous="file", timeout=5.0)
    assert ExecutorConfig(process_group=pg).process_group_config is pg
    with pytest.raises(InvalidConfig, match=r"^process_group\.backend"):
        ProcessGroupConfig(backend="mpi")  # type: ignore[arg-type]  # what a caller past the checker sends
    with pytest.raises(InvalidConfig, match=r"^process_group\.timeout"):
        ProcessGroupConfig(timeout=0)
    with pytest.raises(InvalidConfig, match=r"^process_group "):
        ExecutorConfig(process_group="yes")  # type: ignore[arg-type]
    # A factory that asks for dist= without a group, NCCL on CPU ranks: refused, nothing started.
    with pytest.raises(InvalidConfig, match=r"^process_group is off, but WorkerSpec.*pass_dist=True"):
        MultiprocDiffusionExecutor(COLLECTIVE, world_size=2)
    with pytest.raises(InvalidConfig, match=r"^process_group\.backend 'nccl' needs CUDA ranks"):
        MultiprocDiffusionExecutor(COLLECTIVE, world_size=2, process_group=ProcessGroupConfig(backend="nccl"))


# -- the group itself ---------------------------------------------------------------------------


def test_two_ranks_all_reduce_in_the_executors_group_and_leave_it_at_shutdown() -> None:
    """The fast tier's test of the feature: two processes, one all-reduce per forward."""
    with MultiprocDiffusionExecutor(COLLECTIVE, world_size=2, deadlines=DEADLINES, process_group=True) as ex:
        infos = ex.collective_rpc("dist_info")
        assert [(i["rank"], i["world_size"], i["group_size"], i["pass_rank"]) for i in infos] == [
            (0, 2, 2, 0),
            (1, 2, 2, 1),
        ]
        assert {i["backend"] for i in infos} == {"gloo"} and {i["device"] for i in infos} == {"cpu"}
        ro = ex.execute_request(DiffusionRequest("r1", {}))
        assert ro.async_output_id is not None
        out = ex.wait_output_ready(ro.async_output_id).result(timeout=60)
        assert out.output["sum"].tolist() == [3.0] * 4  # 1 + 2: both ranks took part
        ex.release_output(out)
        pids = [int(i["pid"]) for i in infos]
    assert _procs_gone(pids)


@pytest.mark.slow
def test_two_executors_with_process_groups_side_by_side() -> None:
    """Each executor owns its rendezvous (a store on a port the kernel picked, or a file in
    a private directory): two on one machine never meet each other's ranks."""
    tcp = MultiprocDiffusionExecutor(COLLECTIVE, world_size=2, deadlines=DEADLINES, process_group=True)
    try:
        file_pg = ProcessGroupConfig(rendezvous="file")
        with MultiprocDiffusionExecutor(COLLECTIVE, world_size=3, deadlines=DEADLINES, process_group=file_pg) as other:
            group = other.ranks._group
            assert group is not None and group.address.startswith("file://")
            rdzv_dir = os.path.dirname(group.address.removeprefix("file://"))
            assert tcp.ranks._group is not None and tcp.ranks._group.address.startswith("tcp://127.0.0.1:")
            handles = [(ex, ex.submit(DiffusionRequest(f"r{i}", {}))) for i in range(3) for ex in (tcp, other)]
            sums = []
            for ex, h in handles:
                out = h.output.result(timeout=60)
                sums.append(out.output["sum"][0].item())
                ex.release_output(out)
            assert sums == [3.0, 6.0] * 3  # 1+2 in one group, 1+2+3 in the other
        assert not os.path.exists(rdzv_dir)  # the private directory went with its executor
    finally:
        tcp.shutdown()


# -- the reference DiT split across ranks ------------------------------------------------------


def _reference(params: dict[str, object]) -> torch.Tensor:
    out = DiTPipelineWorker(**DIT_KWARGS).execute_model(DiffusionRequest("ref", params)).output
    px = out.get("image", out.get("frames"))
    assert isinstance(px, torch.Tensor)
    return px


@pytest.fixture(scope="module")
def references() -> Iterator[dict[str, torch.Tensor]]:
    yield {
        "image": _reference({"height": 64, "width": 64, "seed": 3}),
        "video": _reference({"height": 32, "width": 64, "num_frames": 3, "seed": 4}),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", ["tensor", "sequence"])
def test_split_dit_equals_the_unsplit_model_and_only_the_reply_rank_leases(
    mode: str, world_size: int, references: dict[str, torch.Tensor]
) -> None:
    reply = world_size - 1  # not rank 0: the reply rank is the one that ships, whichever it is
    with MultiprocDiffusionExecutor(
        _parallel_spec(mode),
        world_size=world_size,
        reply_rank=reply,
        deadlines=DEADLINES,
        process_group=True,
        options=WorkerOptions(inline_threshold=1024),  # every output through a segment
    ) as ex:
        image = ex.submit(DiffusionRequest("img", {"height": 64, "width": 64, "seed": 3}))
        video = ex.submit(DiffusionRequest("vid", {"height": 32, "width": 64, "num_frames": 3, "seed": 4}))
        for name, h, key in (("image", image, "image"), ("video", video, "frames")):
            out = h.output.result(timeout=120)
            got = out.output[key]
            assert got.shape == references[name].shape
            diff = (got - references[name]).abs().max().item()
            assert diff <= PARALLEL_ATOL, f"{mode} x{world_size} {name}: max |diff| {diff}"
            del got
            ex.release_output(out)
        want = {r: (2 if r == reply else 0) for r in range(world_size)}
        infos: list[Any] = []

        def shipped() -> dict[int, int]:
            # The packer counts an output once its OUTPUT_READY is sent: a moment after
            # the output can be in hand here.
            infos[:] = ex.worker_metrics()
            return {i.rank: i.packer.packed for i in infos}

        wait_until(lambda: shipped() == want, timeout=10)
        packed = {i.rank: i.packer.packed for i in infos}
        mapped = {i.rank: i.mapped_segments for i in infos}
        assert packed == want, packed
        assert all(mapped[r] == 0 for r in range(world_size) if r != reply), mapped
        assert ex.pool.stats().leased == 2  # one segment per output, every one the reply rank's


# -- a rank dies inside a collective -------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_killed_mid_collective_fails_every_waiter_naming_it_and_leaves_nothing() -> None:
    """Rank 1 is SIGKILLed while ranks 0 and 2 wait in the all-reduce: the call and the one
    queued behind it fail with ``WorkerDied`` naming rank 1 -- within the compute deadline,
    not at it -- the executor stays failed, and shutdown reaps the survivors (stuck or not)."""
    compute_timeout = 30.0
    deadlines = Deadlines(compute_timeout=compute_timeout, output_timeout=30, rpc_timeout=30)
    ex = MultiprocDiffusionExecutor(COLLECTIVE, world_size=3, deadlines=deadlines, process_group=True)
    try:
        pids = [p.pid for p in ex.procs if p.pid is not None]
        started = time.monotonic()
        dying = ex.submit(DiffusionRequest("dies", {"die_rank": 1, "enter_s": 0.5})).computed
        queued = ex.submit(DiffusionRequest("queued", {})).computed
        for fut in (dying, queued):
            err = exc_of(fut)
            assert isinstance(err, WorkerDied) and not isinstance(err, ComputeTimeout), repr(err)
            assert err.rank == 1 and "worker rank 1 died" in str(err), err
        assert time.monotonic() - started < compute_timeout  # the death, not the deadline
        with pytest.raises(WorkerDied, match="worker rank 1"):
            ex.check_health()
        with pytest.raises(WorkerDied, match="worker rank 1"):  # failed until restarted
            ex.submit(DiffusionRequest("after", {}))
    finally:
        ex.shutdown()
    assert _procs_gone(pids), [p for p in pids if pid_alive(p)]


@pytest.mark.slow
def test_a_rank_hung_outside_the_collective_fails_its_call_at_the_deadline_and_is_reaped() -> None:
    """Rank 1 sleeps while ranks 0 and 2 wait in the all-reduce: the call fails at its compute
    deadline, the survivors' collective fails at the group's timeout (their answer comes, rank
    1's never does), new calls are refused with ``WorkerStuck`` naming rank 1 once the grace
    period passed, and shutdown kills the hung rank: no process left."""
    grace = 1.0
    deadlines = Deadlines(compute_timeout=3, output_timeout=30, rpc_timeout=30, cancel_grace=grace)
    pg = ProcessGroupConfig(timeout=2.0)
    ex = MultiprocDiffusionExecutor(COLLECTIVE, world_size=3, deadlines=deadlines, process_group=pg)
    try:
        pids = [p.pid for p in ex.procs if p.pid is not None]
        started = time.monotonic()
        err = exc_of(ex.submit(DiffusionRequest("hangs", {"hang_rank": 1})).computed)
        assert isinstance(err, ComputeTimeout) and "rank(s) [" in str(err) and "1" in str(err), err
        assert time.monotonic() - started < 10
        time.sleep(grace + 0.5)
        # Rank 1, not rank 0: ranks 0 and 2 answered once their collective timed out (the
        # stuck rank named is the lowest that has not answered).
        with pytest.raises(WorkerStuck, match="worker rank 1 is stuck"):
            ex.submit(DiffusionRequest("after", {}))
    finally:
        ex.shutdown(timeout=10)
    assert _procs_gone(pids), [p for p in pids if pid_alive(p)]
