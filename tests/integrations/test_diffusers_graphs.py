"""``DiffusersPipelineWorker(cuda_graphs=True)``: the denoiser replayed as CUDA graphs, the
pipeline's own call around it, pixels bit for bit against the pipeline called directly.
The option's checks run everywhere; the graphs on the device only (``cuda``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from helpers.diffusers_direct import direct_family_call, family_params, family_spec_kwargs, pixels_of
from helpers.diffusers_direct import one_torch_thread as _one_torch_thread
from omni_async.core.config import Deadlines
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.executor.multiproc import MultiprocDiffusionExecutor
from omni_async.integrations.diffusers import DiffusersPipelineWorker
from omni_async.integrations.diffusers.pixels import to_uint8
from omni_async.integrations.diffusers.source import PipelineSource
from omni_async.worker.graphs import CudaGraphForward
from omni_async.worker.host import WorkerOptions

DEADLINES = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread() -> Iterator[None]:
    with _one_torch_thread():
        yield


def test_cuda_graphs_off_a_cuda_device_or_not_a_bool_is_refused_at_once() -> None:
    kwargs = family_spec_kwargs("pixart")
    with pytest.raises(UsageError, match="cuda_graphs=True replays the denoiser as CUDA graphs, and device='cpu'"):
        DiffusersPipelineWorker.spec(**kwargs, device="cpu", cuda_graphs=True)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="cuda_graphs must be True or False, got 'yes'"):
        DiffusersPipelineWorker.spec(**kwargs, cuda_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="cuda_graphs=True replays"):
        DiffusersPipelineWorker(**kwargs, device="cpu", cuda_graphs=True)  # type: ignore[arg-type]
    if not torch.cuda.is_available():  # "auto" finds the CPU: refused as the worker starts
        with pytest.raises(UsageError, match="needs a CUDA device, and this worker's device is 'cpu'"):
            DiffusersPipelineWorker(**kwargs, cuda_graphs=True)  # type: ignore[arg-type]
    # Off (the default) builds anywhere, and the denoiser keeps its own forward.
    worker = DiffusersPipelineWorker(**kwargs, device="cpu")  # type: ignore[arg-type]
    assert worker.graphed is None
    assert not isinstance(worker.handle.module("transformer").forward, CudaGraphForward)  # type: ignore[union-attr]


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda", 0)


def _pipeline(dev: torch.device) -> Any:
    """The tiny PixArt-Sigma as the worker builds it (its random weights drawn on ``dev``:
    drawn on the CPU they are other weights), to call directly."""
    builder = str(family_spec_kwargs("pixart")["builder"])
    pipe: Any = PipelineSource(builder=builder, builder_kwargs={"name": "pixart"}).load(dev).pipeline
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _direct(pipe: Any, params: dict[str, object]) -> torch.Tensor:
    """The pipeline called directly, its tensors on its device (as the worker moves them:
    PixArt's attention masks are used as given)."""
    dev = pipe.device
    on_device = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    return pixels_of(direct_family_call(pipe, [on_device]))


@pytest.mark.cuda
def test_the_denoiser_replays_as_graphs_in_process_bit_for_bit() -> None:
    dev = _cuda()
    pipe = _pipeline(dev)
    worker = DiffusersPipelineWorker(**family_spec_kwargs("pixart"), device=str(dev), cuda_graphs=True)  # type: ignore[arg-type]
    assert worker.graphed is not None
    with torch.inference_mode():  # as the worker process runs its forwards
        for seed in (1, 2, 3):
            params = family_params("pixart", seed, steps=3)
            got = pixels_of(worker.execute_model(DiffusionRequest(f"r{seed}", params)).output)
            assert torch.equal(got, _direct(pipe, params)), seed
        # Another size: another signature, another graph.
        params = {**family_params("pixart", 4, steps=3), "height": 32, "width": 32}
        got = pixels_of(worker.execute_model(DiffusionRequest("small", params)).output)
        assert torch.equal(got, _direct(pipe, params))
    stats = worker.graphed.stats
    assert worker.graphed.graphs() == 2 and stats.failed_captures == 0 and stats.eager_calls == 0
    assert stats.replays == 4 * 3  # a replay a step (the guidance batch is one call)


@pytest.mark.cuda
@pytest.mark.parametrize("async_output", [True, False])
def test_served_through_the_engine_with_graphs_bit_for_bit(async_output: bool) -> None:
    """Over a worker process (forwards in inference mode, the packer copying on its side
    stream while the next forward replays), with a warm-up that captures at start."""
    dev = _cuda()
    pipe = _pipeline(dev)
    seeds = [11, 12, 13, 14]
    spec = DiffusersPipelineWorker.spec(
        **family_spec_kwargs("pixart"),
        device="cuda",
        cuda_graphs=True,
        warmup=family_params("pixart", 0, steps=3),
        postprocess="diffusers",
    )

    async def body() -> list[Any]:
        engine = AsyncDiffusionEngine.from_factory(
            lambda: MultiprocDiffusionExecutor(spec, deadlines=DEADLINES, options=WorkerOptions(device="cuda")),
            pipeline="diffusers",
            async_output=async_output,
        )
        async with engine:
            requests = [DiffusionRequest(f"e{s}", family_params("pixart", s, steps=3)) for s in seeds]
            return list(await asyncio.gather(*(engine.generate(r) for r in requests)))

    results = asyncio.run(body())
    for seed, result in zip(seeds, results, strict=True):
        want = to_uint8(_direct(pipe, family_params("pixart", seed, steps=3)).cpu()).numpy()
        assert np.array_equal(result.output["images"], want), seed
