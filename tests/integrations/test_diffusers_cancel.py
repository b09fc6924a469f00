"""Cancelling a diffusers request mid-denoise stops its pipeline within one step and never
runs the VAE decode: after ``callback_on_step_end`` (Wan) and after the wrapped
``scheduler.step`` (DiT, which has no callback).  The transformer's and the decoder's
calls are counted with forward hooks on the worker's own modules (worker threads:
``InProcessExecutor``), and the cancel is sent while the transformer is inside a given
call, so the count is exact."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers.diffusers_direct import BUILDERS, dit_params, wan_params
from helpers.executor_harness import exc_of
from omni_async.core.config import Deadlines
from omni_async.core.errors import RequestAborted
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.integrations.diffusers import DiffusersPipelineWorker

DEADLINES = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)
# Transformer calls per denoising step: DiT batches its guidance into one call, Wan makes two.
CALLS_PER_STEP = {"dit": 1, "wan": 2}


class Counted:
    """Counts the transformer's and the decoder's forwards; holds the transformer inside call
    ``pause_at`` until ``resume`` (so a cancel lands in a known step)."""

    def __init__(self, worker: DiffusersPipelineWorker, pause_at: int) -> None:
        transformer = worker.handle.module("transformer")
        vae = worker.handle.module("vae")
        assert transformer is not None and vae is not None
        self.transformer = 0
        self.decodes = 0
        self.pause_at = pause_at
        self.paused = threading.Event()
        self.resume = threading.Event()
        self._hooks = [
            transformer.register_forward_pre_hook(self._on_transformer),
            vae.get_submodule("decoder").register_forward_pre_hook(self._on_decode),
        ]

    def _on_transformer(self, module: torch.nn.Module, args: Any) -> None:
        self.transformer += 1
        if self.transformer == self.pause_at:
            self.paused.set()
            assert self.resume.wait(60)

    def _on_decode(self, module: torch.nn.Module, args: Any) -> None:
        self.decodes += 1

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


@pytest.fixture(params=["dit", "wan"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, InProcessExecutor, DiffusersPipelineWorker]]:
    name = str(request.param)
    spec = DiffusersPipelineWorker.spec(builder=BUILDERS[name][0])
    ex = InProcessExecutor(spec.build, deadlines=DEADLINES, validate_request=spec.request_validator())
    worker = ex.loops[0].worker
    assert isinstance(worker, DiffusersPipelineWorker)
    try:
        yield name, ex, worker
    finally:
        ex.shutdown()


def _long(name: str, seed: int) -> dict[str, object]:
    return dit_params(seed, steps=40) if name == "dit" else wan_params(seed, steps=40)


def test_cancel_mid_denoise_stops_within_one_step_and_never_decodes(
    served: tuple[str, InProcessExecutor, DiffusersPipelineWorker],
) -> None:
    name, ex, worker = served
    per_step = CALLS_PER_STEP[name]
    pause_at = 3 * per_step + 1  # the first transformer call of the fourth step
    counted = Counted(worker, pause_at)
    try:
        fut = ex.submit(DiffusionRequest("long", _long(name, 1))).computed
        assert counted.paused.wait(60)
        ex.cancel_requests(["long"])
        counted.resume.set()
        err = exc_of(fut)
        assert isinstance(err, RequestAborted) and err.request_id == "long", err
        assert "while computing; its forward stopped" in str(err)
        # The fourth step ran to its end (its other guidance call too), then the check raised.
        assert counted.transformer == 4 * per_step, counted.transformer
        assert counted.decodes == 0
        # The worker serves the next request at once, and decodes it.
        ro = ex.execute_request(DiffusionRequest("next", _long(name, 2) | {"num_inference_steps": 1}))
        assert ro.async_output_id is not None
        ex.release_output(ex.wait_output_ready(ro.async_output_id).result(timeout=60))
        assert counted.decodes >= 1
    finally:
        counted.remove()


def test_a_cancel_during_the_last_step_still_saves_the_decode(
    served: tuple[str, InProcessExecutor, DiffusersPipelineWorker],
) -> None:
    name, ex, worker = served
    steps = 3
    counted = Counted(worker, (steps - 1) * CALLS_PER_STEP[name] + 1)  # inside the last step
    try:
        params = _long(name, 3) | {"num_inference_steps": steps}
        fut = ex.submit(DiffusionRequest("last", params)).computed
        assert counted.paused.wait(60)
        ex.cancel_requests(["last"])
        counted.resume.set()
        assert isinstance(exc_of(fut), RequestAborted)
        assert counted.transformer == steps * CALLS_PER_STEP[name] and counted.decodes == 0
    finally:
        counted.remove()


def test_engine_abort_mid_denoise_stops_the_pipeline(
    served: tuple[str, InProcessExecutor, DiffusersPipelineWorker],
) -> None:
    name, ex, worker = served
    per_step = CALLS_PER_STEP[name]
    counted = Counted(worker, 2 * per_step + 1)

    async def body() -> None:
        async with AsyncDiffusionEngine(ex, pipeline="diffusers") as engine:
            task = asyncio.create_task(engine.generate(DiffusionRequest("gone", _long(name, 4))))
            assert await asyncio.to_thread(counted.paused.wait, 60)
            aborting = asyncio.create_task(engine.abort("gone", wait=True))
            await asyncio.sleep(0.05)  # the cancel reaches the worker while it is held in step 3
            counted.resume.set()
            await aborting
            with pytest.raises(RequestAborted):
                await task

    try:
        asyncio.run(body())
        assert counted.transformer == 3 * per_step and counted.decodes == 0
    finally:
        counted.remove()
