"""The promised output shapes through real worker processes: packed on the worker,
unpacked on the executor (diffusers' ``BaseOutput`` failed there with
``OutputUnpackFailed: TypeError: object.__new__(ImagePipelineOutput) is not safe``).
A shape that cannot be rebuilt fails on the worker, at pack time, with the class named
and what to do."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.leaks import kept_for_the_module
from helpers.output_shapes import SHAPES, assert_same, make_shape
from omni_async.core.config import Deadlines
from omni_async.core.errors import RemoteError
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

SPEC = WorkerSpec("helpers.output_shapes:ShapesWorker", pass_rank=True)
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


@pytest.fixture(scope="module")
def ex() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(SPEC, world_size=1, deadlines=DEADLINES))


@pytest.mark.parametrize("shape", SHAPES)
def test_every_promised_shape_crosses_the_process_boundary(ex: MultiprocDiffusionExecutor, shape: str) -> None:
    ro = ex.execute_request(DiffusionRequest(f"shape-{shape}", {"shape": shape, "seed": 11}))
    assert ro.async_output_id is not None
    out = ex.wait_output_ready(ro.async_output_id).result(timeout=30)
    assert_same(out.output, make_shape(shape, seed=11))
    ex.release_output(out)
    assert ex.pool.stats().outstanding == 0, ex.pool.outstanding()


def test_an_unbuildable_shape_fails_on_the_worker_naming_the_class(ex: MultiprocDiffusionExecutor) -> None:
    ro = ex.execute_request(DiffusionRequest("shape-over-list", {"shape": "over_list"}))
    assert ro.async_output_id is not None
    with pytest.raises(RemoteError) as info:
        ex.wait_output_ready(ro.async_output_id).result(timeout=30)
    assert info.value.failure.type_name == "UnsupportedOutputType"
    text = str(info.value)
    assert "OverList" in text and "return the value in a dict, a list, or a field" in text
    ex.check_health()  # the worker goes on
    ro = ex.execute_request(DiffusionRequest("shape-after", {"shape": "base_output"}))
    assert ro.async_output_id is not None
    ex.release_output(ex.wait_output_ready(ro.async_output_id).result(timeout=30))
