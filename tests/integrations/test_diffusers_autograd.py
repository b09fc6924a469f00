"""Pipelines whose call takes gradients (Attend-and-Excite, DiffEdit, Pix2Pix-Zero) under
the worker's inference mode (``WorkerOptions.inference_mode``, on by default): the
integration finds them in the pipeline's own source and runs their call in the ordinary
mode, so they are served as diffusers runs them, pixels bit for bit."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from helpers.autograd_pipeline import gradient_nudged_ddim
from helpers.diffusers_direct import one_torch_thread
from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.multiproc import MultiprocDiffusionExecutor
from omni_async.integrations.diffusers import DiffusersPipelineWorker
from omni_async.integrations.diffusers.edge import PipelineHandle
from omni_async.integrations.diffusers.pixels import to_uint8
from omni_async.integrations.diffusers.profile import profile_of, takes_gradients
from omni_async.integrations.diffusers.tiny import tiny_family
from omni_async.worker.host import WorkerOptions

BUILDER = "helpers.autograd_pipeline:gradient_nudged_ddim"
DEADLINES = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)


@pytest.fixture(autouse=True)
def one_cpu_thread() -> Iterator[None]:
    """One torch thread here and in the workers: the same pixels on both sides."""
    with one_torch_thread():
        yield


DEPRECATED = "diffusers.pipelines.deprecated"


@pytest.mark.parametrize(
    ("module", "name", "takes"),
    [
        (f"{DEPRECATED}.stable_diffusion_attend_and_excite.pipeline_stable_diffusion_attend_and_excite",
         "StableDiffusionAttendAndExcitePipeline", True),
        (f"{DEPRECATED}.stable_diffusion_diffedit.pipeline_stable_diffusion_diffedit",
         "StableDiffusionDiffEditPipeline", True),
        (f"{DEPRECATED}.stable_diffusion_variants.pipeline_stable_diffusion_pix2pix_zero",
         "StableDiffusionPix2PixZeroPipeline", True),
        ("diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma", "PixArtSigmaPipeline", False),
        ("diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion", "StableDiffusionPipeline", False),
        ("diffusers.pipelines.flux.pipeline_flux", "FluxPipeline", False),
        ("diffusers.pipelines.ddim.pipeline_ddim", "DDIMPipeline", False),
        ("diffusers.pipelines.cogvideo.pipeline_cogvideox", "CogVideoXPipeline", False),
    ],
)  # fmt: skip
def test_the_pipelines_that_take_gradients_are_found_in_their_own_source(module: str, name: str, takes: bool) -> None:
    stand_in = object.__new__(getattr(importlib.import_module(module), name))  # its class is all the source needs
    source = PipelineHandle(stand_in).module_source()
    assert f"class {name}(" in source
    assert takes_gradients(source) is takes


def test_the_profile_of_a_built_pipeline_says_whether_it_takes_gradients() -> None:
    assert profile_of(PipelineHandle(gradient_nudged_ddim())).needs_autograd is True
    assert profile_of(PipelineHandle(tiny_family("ddim"))).needs_autograd is False


def test_a_pipeline_that_takes_gradients_is_served_over_worker_processes() -> None:
    """In the worker's default inference mode; without the integration's check, each call
    fails in the worker ("element 0 of tensors does not require grad")."""
    spec = DiffusersPipelineWorker.spec(builder=BUILDER, postprocess="diffusers")
    params = [{"seed": 30 + i, "num_inference_steps": 2, "nudge": 0.1 * (i + 1)} for i in range(2)]
    options = WorkerOptions()
    assert options.inference_mode

    async def body() -> list[GenerationResult]:
        engine = AsyncDiffusionEngine.from_factory(
            lambda: MultiprocDiffusionExecutor(spec, deadlines=DEADLINES, options=options), pipeline="diffusers"
        )
        async with engine:
            return list(
                await asyncio.gather(*(engine.generate(DiffusionRequest(f"g{i}", p)) for i, p in enumerate(params)))
            )

    direct: Any = gradient_nudged_ddim()
    direct.set_progress_bar_config(disable=True)
    for result, p in zip(asyncio.run(body()), params, strict=True):
        want = direct(generator=torch.Generator().manual_seed(int(p["seed"])), nudge=p["nudge"], output_type="pt")
        assert np.array_equal(np.asarray(result.output.images), to_uint8(want.images).numpy())
