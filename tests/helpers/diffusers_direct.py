"""The tiny diffusers pipelines of the integration tests, and the direct pipeline call a
request stands for: what ``DiffusersPipelineWorker`` must reproduce bit for bit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from omni_async.integrations.diffusers.tiny import (
    tiny_dit,
    tiny_prompt_embeds,
    tiny_wan,
)

DIT = "omni_async.integrations.diffusers.tiny:tiny_dit"
WAN = "omni_async.integrations.diffusers.tiny:tiny_wan"
BUILDERS = {"dit": (DIT, tiny_dit), "wan": (WAN, tiny_wan)}


def direct_pipeline(name: str) -> Any:
    """A tiny pipeline (``"dit"`` or ``"wan"``) built as a client would, to call directly."""
    pipe: Any = BUILDERS[name][1]()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tensor(params: Mapping[str, object], name: str) -> torch.Tensor:
    value = params[name]
    assert isinstance(value, torch.Tensor)
    return value


def dit_params(seed: int, label: int = 7, steps: int = 3, **extra: object) -> dict[str, object]:
    return {"class_labels": label, "seed": seed, "num_inference_steps": steps, **extra}


def wan_params(seed: int, steps: int = 2, frames: int = 5, **extra: object) -> dict[str, object]:
    return {
        "prompt_embeds": tiny_prompt_embeds(100 + seed),
        "negative_prompt_embeds": tiny_prompt_embeds(200 + seed),
        "height": 16,
        "width": 16,
        "num_frames": frames,
        "num_inference_steps": steps,
        "guidance_scale": 5.0,
        "seed": seed,
        **extra,
    }


def direct_call(pipe: Any, params: Mapping[str, object]) -> Any:
    """``pipe`` called directly as a client would for one request with ``params``."""
    kwargs = {k: v for k, v in params.items() if k not in ("seed", "preview_every")}
    if "class_labels" in kwargs:
        kwargs["class_labels"] = [kwargs["class_labels"]]
    kwargs.setdefault("output_type", "pt")
    seed = params.get("seed")
    assert isinstance(seed, int)
    return pipe(**kwargs, generator=torch.Generator().manual_seed(seed))


def pixels_of(output: Any) -> torch.Tensor:
    """The tensor of a pipeline output (``images`` or ``frames``)."""
    for key in ("images", "frames", "latents"):
        if key in output:
            value = output[key]
            assert isinstance(value, torch.Tensor)
            return value
    raise AssertionError(f"no pixels in {type(output).__name__}: {list(output)}")


# Fixtures: the pipelines called directly, which the tests compare against (one of each
# per test module that imports them: building them is the slow part).
@pytest.fixture(scope="module")
def dit_direct() -> Any:
    return direct_pipeline("dit")


@pytest.fixture(scope="module")
def wan_direct() -> Any:
    return direct_pipeline("wan")
