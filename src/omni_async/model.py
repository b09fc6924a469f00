"""A small diffusion-like model, so the stack runs end to end on its own.

``TinyDiffusionWorker`` implements the worker-side model interface
(``DiffusionWorkerModel``): ``execute_model`` runs a few "denoising" steps --
a seeded latent, repeated matmuls through a fixed random network -- and returns
a ``DiffusionOutput`` whose tensors stay on the worker's device, exactly like a
real pipeline whose post-processing moved to the engine.  The output is a
nested structure (an image tensor in the model dtype, per-step latents and
small plain values) so the packing path sees what real pipelines return.

Deterministic: the same request parameters give bit-identical outputs on the
same device, so tests and the demo can check what arrives against a fresh
forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omni_async.messages import BatchDiffusionOutput, DiffusionOutput, DiffusionRequest


class TinyDiffusionWorker:
    def __init__(
        self,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        width: int = 64,
        steps: int = 4,
        seed: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.width = width
        self.steps = steps
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(width, width, generator=gen) / width**0.5
        self.weight = w.to(self.device, dtype)
        self.sleeping = False

    # -- the model interface -----------------------------------------------------

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        return self._forward(request)

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self._forward(r) for r in requests))

    # -- ordinary RPCs --------------------------------------------------------------

    def ping(self) -> str:
        return "pong"

    def sleep(self) -> None:
        self.sleeping = True

    def wake_up(self) -> None:
        self.sleeping = False

    def fail(self, message: str = "requested failure") -> None:
        raise RuntimeError(message)

    # -- internals ---------------------------------------------------------------------

    def _forward(self, request: DiffusionRequest) -> DiffusionOutput:
        p = request.params
        height = int(p.get("height", 32))
        width = int(p.get("width", self.width))
        steps = int(p.get("steps", self.steps))
        if p.get("raise"):
            raise RuntimeError(f"forward of {request.request_id} failed on purpose")
        if width != self.width:
            raise ValueError(f"this model has width {self.width}, request asks for {width}")
        gen = torch.Generator().manual_seed(int(p.get("seed", 0)))
        latent = torch.randn(height, width, generator=gen).to(self.device, self.dtype)
        trajectory: list[torch.Tensor] = []
        for _ in range(steps):
            latent = torch.tanh(latent @ self.weight)
            if p.get("keep_trajectory"):
                trajectory.append(latent.clone())
        image = ((latent + 1) * 127.5).clamp(0, 255)
        output: dict[str, Any] = {
            "image": image,
            "latents": trajectory,
            "info": {"steps": steps, "shape": (height, width), "dtype": str(self.dtype)},
        }
        return DiffusionOutput(request_id=request.request_id, output=output)
