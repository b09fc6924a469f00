"""The ranks' process group on CUDA: NCCL, chosen by device (skipped without CUDA; run on the H200).

World size 1 needs one GPU: the rank joins an NCCL group of one, its collectives run on
its device, and the executor ships the output as usual.  World size 2 needs two GPUs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.dit import DiTPipelineWorker

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEADLINES = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)
COLLECTIVE = WorkerSpec("helpers.dist_workers:CollectiveWorker", pass_dist=True)
DIT_KWARGS: dict[str, Any] = {"steps": 2, "depth": 2, "hidden_size": 64, "heads": 4, "decoder_width": 16}


def test_world_size_1_joins_an_nccl_group_on_its_gpu() -> None:
    with MultiprocDiffusionExecutor(
        COLLECTIVE, world_size=1, deadlines=DEADLINES, process_group=True, options=WorkerOptions(device="cuda")
    ) as ex:
        (info,) = ex.collective_rpc("dist_info")
        assert info["backend"] == "nccl" and info["device"] == "cuda:0" and info["group_size"] == 1, info
        ro = ex.execute_request(DiffusionRequest("r1", {"numel": 1 << 20}))
        assert ro.async_output_id is not None
        out = ex.wait_output_ready(ro.async_output_id).result(timeout=120)
        assert out.output["sum"].shape == (1 << 20,) and bool((out.output["sum"] == 1.0).all())
        ex.release_output(out)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("mode", ["tensor", "sequence"])
def test_split_dit_on_two_gpus_equals_the_unsplit_model(mode: str) -> None:
    params = {"height": 64, "width": 64, "seed": 5}
    ref = (
        DiTPipelineWorker(device="cuda:0", **DIT_KWARGS).execute_model(DiffusionRequest("ref", params)).output["image"]
    )
    assert isinstance(ref, torch.Tensor)
    spec = WorkerSpec("omni_async.models.parallel_dit:make_worker", {"mode": mode, **DIT_KWARGS}, pass_dist=True)
    with MultiprocDiffusionExecutor(
        spec, world_size=2, deadlines=DEADLINES, process_group=True, options=WorkerOptions(device="cuda")
    ) as ex:
        ro = ex.execute_request(DiffusionRequest("img", params))
        assert ro.async_output_id is not None
        out = ex.wait_output_ready(ro.async_output_id).result(timeout=120)
        # GPU matmuls may use TF32 and another reduction order per split: a looser bound than the CPU's.
        assert (out.output["image"] - ref.cpu()).abs().max().item() <= 1e-2
        ex.release_output(out)
