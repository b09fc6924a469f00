"""Prewarm from the executor's constructor (issue 19): ``prewarm=Prewarm.of_bytes / of_tensor
/ of_output`` makes the segments before the workers start, with the budget of held
outputs (``max_held_outputs``/``max_held_bytes``) or a caller's pool; what the budget
cannot hold, or an output that needs no segment, is an ``InvalidConfig`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from helpers.leaks import with_prefix
from helpers.mp_workers import expected_image
from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.executor.config import ExecutorConfig, InvalidConfig, Prewarm
from omni_async.executor.multiproc import (
    MultiprocDiffusionExecutor,
    WorkerOptions,
    WorkerSpec,
)
from omni_async.transport.budget import OutputBudget
from omni_async.transport.packing import (
    pack_diffusion_output_shm,
    packed_lease,
    release_packed_output,
)
from omni_async.transport.shm import SegmentPool

SPEC = WorkerSpec("helpers.mp_workers:ScriptedWorker", pass_rank=True)
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)
MIB = 1 << 20


@dataclass
class Sample:
    image: torch.Tensor
    latents: np.ndarray
    caption: str


def test_the_three_ways_to_size_a_segment() -> None:
    opts = WorkerOptions()
    assert Prewarm.of_bytes(3 * MIB).segment_nbytes(opts.inline_threshold) == 3 * MIB
    assert Prewarm.of_tensor((3, 512, 512), torch.bfloat16).segment_nbytes(opts.inline_threshold) == 3 * 512 * 512 * 2
    sample = Sample(torch.zeros(MIB // 4), np.zeros(1000, dtype=np.float32), "a cat")
    assert Prewarm.of_output(sample).segment_nbytes(opts.inline_threshold) == MIB  # the small array travels inline
    # Two large leaves: at aligned offsets, as the packer places them.
    two = {"a": torch.zeros(100_000, dtype=torch.uint8), "b": torch.zeros(MIB, dtype=torch.uint8)}
    assert Prewarm.of_output(DiffusionOutput("r", two)).segment_nbytes(opts.inline_threshold) > 100_000 + MIB - 1


def test_of_output_sizes_the_segment_the_packer_leases() -> None:
    sample = {"video": torch.zeros(3, 300, 301), "extra": [torch.ones(7), b"x" * 70_000], "meta": {"k": 1}}
    with SegmentPool(max_bytes=64 * MIB, max_segments=2) as pool:
        packed = pack_diffusion_output_shm(DiffusionOutput("r", sample), pool=pool)
        lease = packed_lease(packed)
        assert lease is not None
        leased = lease.nbytes  # the bytes the packer asked the pool for
        release_packed_output(packed, pool=pool)
    assert Prewarm.of_output(sample).segment_nbytes(WorkerOptions().inline_threshold) == leased


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Prewarm.of_bytes(0), "nbytes must be a positive int"),
        (lambda: Prewarm.of_bytes(MIB, count=0), "count must be a positive int"),
        (lambda: Prewarm.of_tensor((2, -1), torch.float32), "shape must be a sequence of ints"),
        (lambda: Prewarm.of_tensor((2, 2), "float32"), "dtype must be a torch.dtype"),  # type: ignore[arg-type]
        (lambda: Prewarm.of_output(object()), "sample cannot be packed"),
        (lambda: ExecutorConfig(prewarm=MIB), "must be a Prewarm"),  # type: ignore[arg-type]
        (lambda: ExecutorConfig(prewarm=Prewarm.of_bytes(MIB, 5), max_held_outputs=4), "count=5 is more than"),
        (
            lambda: ExecutorConfig(prewarm=Prewarm.of_bytes(3 * MIB, 2), max_held_bytes=7 * MIB),
            "2 segment\\(s\\) of 4194304 bytes .* over max_held_bytes=7340032",
        ),
        (lambda: ExecutorConfig(prewarm=Prewarm.of_tensor((8,), torch.float32)), "travels inline"),
    ],
)
def test_a_prewarm_that_cannot_work_is_an_invalid_config(make: object, message: str) -> None:
    assert callable(make)
    with pytest.raises(InvalidConfig, match=message) as info:
        make()
    assert info.value.field == "prewarm"


def test_the_default_count_is_the_packers_budget_plus_two_within_the_held_budget() -> None:
    cfg = ExecutorConfig(prewarm=Prewarm.of_bytes(MIB))
    assert cfg.prewarm_plan(OutputBudget(max_outputs=64, max_bytes=None)) == (MIB, 6)
    assert cfg.prewarm_plan(OutputBudget(max_outputs=3, max_bytes=None)) == (MIB, 3)
    assert cfg.prewarm_plan(OutputBudget(max_outputs=64, max_bytes=2 * MIB)) == (MIB, 2)


@pytest.mark.slow
def test_the_executor_prewarms_with_its_budget_and_no_request_makes_a_segment() -> None:
    params = {"numel": 1 << 18, "seed": 3}
    sample = DiffusionOutput("sample", {"image": expected_image(params)})
    with MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, max_held_outputs=4, max_held_bytes=16 * MIB,
                                    prewarm=Prewarm.of_output(sample, count=3)) as ex:  # fmt: skip
        assert ex.pool.stats().created == 3  # before the first request
        assert ex.budget.max_outputs == 4 and ex.budget.max_bytes == 16 * MIB
        info = ex.worker_metrics()[0]
        assert info.mapped_segments == 3, info  # the packing rank mapped them while starting
        for i in range(5):
            ro = ex.execute_request(DiffusionRequest(f"r{i}", {**params, "seed": i}))
            assert ro.async_output_id is not None
            out = ex.wait_output_ready(ro.async_output_id).result(timeout=30)
            assert torch.equal(out.output["image"], expected_image({**params, "seed": i}))
            assert ex.release_output(out) == 1
        assert ex.pool.stats().created == 3  # every request reused a prewarmed segment


def test_with_a_callers_pool_the_pools_budget_decides() -> None:
    pool = SegmentPool(max_segments=2, max_bytes=8 * MIB)
    try:
        with pytest.raises(InvalidConfig, match="count=3 is more than max_held_outputs=2"):
            MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, pool=pool, prewarm=Prewarm.of_bytes(MIB, 3))
        assert not pool.closed  # the caller's pool: theirs to close
        assert pool.stats().created == 0
    finally:
        pool.close()


def test_a_failed_prewarm_leaves_nothing_in_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[SegmentPool] = []
    real = OutputBudget.make_pool

    def make_pool(self: OutputBudget, **kw: object) -> SegmentPool:
        pool = real(self, **kw)  # type: ignore[arg-type]
        made.append(pool)
        return pool

    def full(self: SegmentPool, nbytes: int, count: int = 1) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(OutputBudget, "make_pool", make_pool)
    monkeypatch.setattr(SegmentPool, "prewarm", full)
    with pytest.raises(InvalidConfig, match=r"could not make 6 segment\(s\) of 1048576 bytes .*No space left"):
        MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES, prewarm=Prewarm.of_bytes(MIB))
    assert made and made[0].closed
    assert not with_prefix(made[0].prefix)
