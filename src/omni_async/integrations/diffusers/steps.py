"""Inside a pipeline's denoising loop: cancellation and previews after every step.

A pipeline with ``callback_on_step_end`` (Wan, and most modern pipelines) calls us after
each step; one without it (DiT) is reached through its scheduler: for the length of the
call, ``scheduler.step`` is wrapped so that the hook runs after each step.  Either way
``StepHook.after_step`` runs on the forward's thread, between steps:

* cancellation: ``raise_if_cancelled()`` (``omni_async.worker.cancel``) raises once
  every request of the call is cancelled; the exception leaves the pipeline's loop, so
  no further step and never the VAE decode runs.  (diffusers' own ``_interrupt`` is
  not used: it skips the remaining steps but still decodes.)  The check also runs after
  the last step, so a cancel that arrives during it still saves the decode.
* previews: a streamed request with ``preview_every=k`` gets, every k steps but the
  last, its latents so far decoded by the pipeline's own decode (``decode.DECODES``)
  into the final output's layout (``emit_chunk``, ``omni_async.worker.stream``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import cast

import torch

from omni_async.core.messages import DiffusionRequest
from omni_async.integrations.diffusers.decode import Decode
from omni_async.integrations.diffusers.edge import PipelineHandle, Stepper
from omni_async.worker.cancel import raise_if_cancelled
from omni_async.worker.stream import emit_chunk, streaming_requested

__all__ = ["DecodeLater", "LatentDecoder", "StepHook", "hooked_scheduler"]


class LatentDecoder:
    """The pipeline's own decode (``decode.DECODES``) behind one lock: the forward's thread
    decodes previews with it while the packer's thread decodes finished latents (a worker
    with ``decode="device"``), and a VAE may keep state while it decodes (Wan's keeps a
    feature cache), so two decodes never run at once."""

    def __init__(self, handle: PipelineHandle, decode: Decode) -> None:
        self._handle = handle
        self._decode = decode
        self._lock = threading.Lock()

    def __call__(self, latents: torch.Tensor, params: Mapping[str, object]) -> Mapping[str, torch.Tensor]:
        with self._lock, torch.no_grad():
            return self._decode(self._handle, latents, params)


class DecodeLater:
    """What a ``decode="device"`` output carries to its device stage (``pixels.device_stage``):
    the decode of its latents with its request's parameters.  It holds the pipeline and a
    lock, so it never leaves the worker's process; where no device stage runs (an executor
    built without ``postprocess="diffusers"``) the output would travel with it, and pickling
    it fails saying what to do."""

    def __init__(self, decoder: LatentDecoder, params: Mapping[str, object]) -> None:
        self._decoder = decoder
        self._params = dict(params)

    def __call__(self, latents: torch.Tensor) -> Mapping[str, torch.Tensor]:
        return self._decoder(latents, self._params)

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError(
            "a decode='device' output left its latents for the device stage of postprocess='diffusers', and this "
            "executor runs none: build it with the spec's post-process, e.g. "
            "InProcessExecutor.from_spec(spec) (or InProcessExecutor(spec.build, postprocess=spec.postprocess, ...))"
        )


class StepHook:
    """Runs after every denoising step of one pipeline call over ``requests``."""

    def __init__(self, decoder: LatentDecoder | None, requests: Sequence[DiffusionRequest], steps: int) -> None:
        self._decode = decoder
        self._requests = requests
        self._steps = steps
        self.done = 0
        self._previews = {
            i: int(r.params["preview_every"])
            for i, r in enumerate(requests)
            if r.params.get("preview_every") is not None and streaming_requested(r.request_id)
        }
        # Validated: a request asks for previews only of a pipeline whose decode is known.
        assert decoder is not None or not self._previews

    def after_step(self, latents: torch.Tensor) -> None:
        self.done += 1
        raise_if_cancelled()
        if self.done >= self._steps:
            return
        for i, every in self._previews.items():
            if self.done % every == 0 and self._decode is not None:
                request = self._requests[i]
                rid = request.request_id
                # Row i of the batch (a scheduler hooked under classifier-free guidance sees the
                # conditional rows first): a fresh decode, which the forward never writes again.
                preview = dict(self._decode(latents[i : i + 1], request.params))
                emit_chunk(rid, {**preview, "step": self.done})

    def callback(
        self, pipeline: object, step: int, timestep: object, tensors: Mapping[str, object]
    ) -> dict[str, object]:
        """``callback_on_step_end``; returns nothing to replace."""
        latents = tensors.get("latents")
        if isinstance(latents, torch.Tensor):
            self.after_step(latents)
        return {}


@contextmanager
def hooked_scheduler(handle: PipelineHandle, hook: StepHook) -> Iterator[None]:
    """``scheduler.step`` wrapped to call ``hook.after_step(prev_sample)`` for the block's length."""
    found = handle.component("scheduler")
    if not callable(getattr(found, "step", None)):
        yield
        return
    scheduler = cast("Stepper", found)
    original = scheduler.step

    def step(*args: object, **kwargs: object) -> object:
        out = original(*args, **kwargs)
        prev = getattr(out, "prev_sample", None)
        if prev is None and isinstance(out, tuple) and out:
            prev = out[0]
        if isinstance(prev, torch.Tensor):
            hook.after_step(prev)
        return out

    had_own = "step" in vars(scheduler)
    scheduler.step = step  # an instance attribute shadows the class's method
    try:
        yield
    finally:
        if had_own:
            scheduler.step = original
        else:
            del scheduler.step
