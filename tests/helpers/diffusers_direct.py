"""The tiny diffusers pipelines of the integration tests, and the direct pipeline call a
request stands for: what ``DiffusersPipelineWorker`` must reproduce bit for bit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

from omni_async.integrations.diffusers.tiny import (
    tiny_dit,
    tiny_prompt_embeds,
    tiny_wan,
)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a busy CPU: torch's intra-op threads wait on each other at every op
    when the cores are taken (CI's two cores run two test processes and their workers), so
    a tiny forward took 0.9 s on two threads and 0.01 s on one.  One thread here and in the
    workers (OMP_NUM_THREADS, read by torch as a spawned worker imports it): the same count
    on both sides, so the reductions, and the pixels, are the same too."""
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)


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


# -- the family matrix (omni_async.integrations.diffusers.tiny.FAMILIES, plus DiT and Wan) --------

FAMILY = "omni_async.integrations.diffusers.tiny:tiny_family"


def _draw(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def family_params(name: str, seed: int, steps: int = 2) -> dict[str, object]:
    """One request's parameters for the tiny pipeline of family ``name``: precomputed
    embeddings (and the pooled embeddings and masks its pipeline requires), a small size."""
    from omni_async.integrations.diffusers.tiny import POOLED_DIM, TEXT_DIM

    if name == "dit":
        return dit_params(seed, label=seed % 1000, steps=steps)
    if name == "wan":
        return wan_params(seed, steps=steps)
    embeds = {"prompt_embeds": _draw(100 + seed, 8, TEXT_DIM), "negative_prompt_embeds": _draw(200 + seed, 8, TEXT_DIM)}
    pooled = {
        "pooled_prompt_embeds": _draw(300 + seed, POOLED_DIM),
        "negative_pooled_prompt_embeds": _draw(400 + seed, POOLED_DIM),
    }
    masks = {
        "prompt_attention_mask": torch.ones(8, dtype=torch.long),
        "negative_prompt_attention_mask": torch.tensor([1] * 6 + [0] * 2),
    }
    by_family: dict[str, dict[str, object]] = {
        "sd": {**embeds},
        "sdxl": {"prompt_embeds": embeds["prompt_embeds"], "pooled_prompt_embeds": pooled["pooled_prompt_embeds"]},
        "sd3": {**embeds, **pooled},
        "flux": {
            "prompt_embeds": embeds["prompt_embeds"],
            "pooled_prompt_embeds": pooled["pooled_prompt_embeds"],
            "height": 16,
            "width": 16,
        },
        "pixart": {**embeds, **masks, "height": 64, "width": 64},
        # Sana's resolution binning would run the loop at 512x512 (its smallest bin); PixArt's covers that tail.
        "sana": {**embeds, **masks, "height": 32, "width": 32, "use_resolution_binning": False},
        "ddim": {},
        "cogvideox": {**embeds, "height": 16, "width": 16, "num_frames": 9},
        "ltx": {**embeds, **masks, "height": 32, "width": 32, "num_frames": 9},
    }
    extra = by_family[name]
    return {**extra, "num_inference_steps": steps, "seed": seed}


def text_params(name: str, seed: int, steps: int = 2) -> dict[str, object]:
    """A prompt request for family ``name`` built with its text encoders
    (``tiny_family(name, text=True)``): ``family_params``' size and steps, a prompt and a
    negative prompt in place of the embeddings, and the pipeline's text options at toy
    scale (``max_sequence_length``: the tiny tokenizer's length)."""
    import importlib
    import inspect

    from omni_async.integrations.diffusers.tiny import FAMILIES, TOKENS

    base = family_params(name, seed, steps)
    params = {k: v for k, v in base.items() if not isinstance(v, torch.Tensor)}
    pipeline = FAMILIES[name][0] if name in FAMILIES else "WanPipeline"
    takes = set(inspect.signature(getattr(importlib.import_module("diffusers"), pipeline).__call__).parameters)
    params["prompt"] = "a red cat"
    if "negative_prompt" in takes:
        params["negative_prompt"] = "blurry photo"
    if "max_sequence_length" in takes:
        params["max_sequence_length"] = TOKENS
    if "clean_caption" in takes:
        params["clean_caption"] = False  # its True needs BeautifulSoup and ftfy, and only cleans the text
    return params


def family_pipeline(name: str, text: bool = False) -> Any:
    """The tiny pipeline of family ``name`` (with text encoders: ``text``), built as a client would, to call directly."""
    from omni_async.integrations.diffusers.tiny import tiny_family

    pipe: Any = direct_pipeline(name) if name in BUILDERS and not text else tiny_family(name, text=text)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def family_spec_kwargs(name: str, text: bool = False) -> dict[str, object]:
    """``DiffusersPipelineWorker`` keyword arguments that build family ``name`` (with text encoders: ``text``)."""
    if name in BUILDERS and not text:
        return {"builder": BUILDERS[name][0]}
    return {"builder": FAMILY, "builder_kwargs": {"name": name, "text": True} if text else {"name": name}}


def direct_family_call(pipe: Any, params: Sequence[Mapping[str, object]], **extra: object) -> Any:
    """``pipe`` called directly for one request or a batch of them (lists of prompts, stacked
    tensors, one generator each; ``batch_size`` for an unconditional pipeline)."""
    kwargs: dict[str, object] = {}
    for key, value in params[0].items():
        if key in ("seed", "preview_every"):
            continue
        if key == "class_labels":
            kwargs[key] = [p[key] for p in params]
        elif isinstance(value, torch.Tensor):
            # One request's tensor without its batch dimension ([seq, dim], [dim], [seq]) gets one.
            full = 3 if key.removeprefix("negative_") == "prompt_embeds" else 2
            kwargs[key] = torch.cat([t if (t := tensor(p, key)).dim() == full else t[None] for p in params])
        else:
            kwargs[key] = value
    if "negative_prompt_embeds" in kwargs and "negative_prompt" in _call_names(pipe):
        kwargs["negative_prompt"] = None  # PixArt's default "" is refused beside embeddings
    if "batch_size" in _call_names(pipe) and len(params) > 1:
        kwargs["batch_size"] = len(params)
    gens = [torch.Generator().manual_seed(int(str(p["seed"]))) for p in params]
    kwargs.setdefault("output_type", "pt")
    kwargs.update(extra)
    return pipe(**kwargs, generator=gens[0] if len(gens) == 1 else gens)


def _call_names(pipe: Any) -> set[str]:
    import inspect

    return set(inspect.signature(type(pipe).__call__).parameters)


def leave_like_a_worker() -> None:
    """A worker's life in a spawned process: build a pipeline, run one call (diffusers makes
    a progress bar, shown or not), leave by ``os._exit`` as a worker process does."""
    import os

    from omni_async.core.messages import DiffusionRequest
    from omni_async.integrations.diffusers import DiffusersPipelineWorker

    worker = DiffusersPipelineWorker(builder=FAMILY, builder_kwargs={"name": "ddim"})
    worker.execute_model(DiffusionRequest("a", {"seed": 1, "num_inference_steps": 1}))
    os._exit(0)
