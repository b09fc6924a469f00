"""A small diffusion-like model, so the stack runs end to end on its own.

``TinyDiffusionWorker`` implements the worker-side model interface
(``DiffusionWorkerModel``): ``execute_model`` runs a few "denoising" steps --
a seeded latent, repeated matmuls through a fixed random network -- and returns
a ``DiffusionOutput`` whose tensors stay on the worker's device, exactly like a
real pipeline whose post-processing moved to the engine.  The output is a
nested structure (an image tensor in the model dtype, per-step latents and
small plain values) so the packing path sees what real pipelines return.

Deterministic up to the last bits: the same request parameters give the same
outputs on the same device.  Bit-identical across processes only almost always: on
a loaded 2-core CPU machine the first forward of a process sometimes differed from
a later one in the last bits (CPU BLAS; about one demo run in ten, max difference
0.009 on the 0..255 image).  So the image carries ``digest``, an exact checksum of
its bytes taken in the worker (``image_digest``): the demo checks the bytes that
arrive against it (the transport is bit-exact) and the values against a fresh
forward with a tolerance (it is the right request's image).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from numbers import Integral
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from omni_async.core.errors import InvalidRequest
from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput, DiffusionRequest
from omni_async.worker.cancel import raise_if_cancelled
from omni_async.worker.postprocess import PostProcess, register_postprocess
from omni_async.worker.stream import emit_chunk, streaming_requested

if TYPE_CHECKING:
    from PIL import Image

# The parameters ``TinyDiffusionWorker`` reads: name -> (kind, smallest value).
_PARAMS: dict[str, tuple[type, int | None]] = {
    "height": (int, 1),
    "width": (int, 1),
    "steps": (int, 1),
    "seed": (int, None),
    "raise": (bool, None),
    "keep_trajectory": (bool, None),
    "unpackable": (bool, None),
    "step_ms": (int, 0),
    "ignore_cancel": (bool, None),
    "preview_every": (int, 1),
    "unpackable_preview": (bool, None),
    "raise_at_step": (int, 1),
    "num_frames": (int, 1),
}


class TinyDiffusionWorker:
    """The reference model (see the module docstring).  It honours cancellation: between
    denoising steps it calls ``raise_if_cancelled()``, so a cancelled forward stops
    within one step (unless the request asks for ``ignore_cancel``).  It streams: a
    request with ``preview_every=k`` asked for as a stream gets a preview after every
    k-th denoising step (``emit_chunk``), the image of the latent so far, shaped like
    the final output (``image``, ``digest``, ``info`` with the step)."""

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

    @staticmethod
    def validate_request(request: DiffusionRequest) -> None:
        """Check the parameters this model reads; ``InvalidRequest`` names the parameter and the request.

        ``height``, ``width``, ``steps``: int >= 1; ``seed``: int; ``raise``,
        ``keep_trajectory``, ``unpackable``: bool; ``step_ms``: int >= 0, a pause per
        denoising step (a slow step without burning CPU); ``ignore_cancel``: bool, the
        forward skips its cancellation checks (a model that does not honour them);
        ``preview_every``: int >= 1, a preview chunk after every k-th step when the call
        streams; ``num_frames``: int >= 1, a "video": ``frames`` of that many
        ``[height, width]`` frames instead of ``image`` (a short clip for the HTTP server's
        video jobs); ``unpackable_preview``: bool, the previews carry a value no packer can
        ship (each chunk fails); ``raise_at_step``: int >= 1, the forward raises after
        that many steps (and their previews); nothing else (a misspelt name fails too).  Static, so
        the executor runs it in the caller's thread before sending (see ``WorkerSpec``);
        the forward runs it again for callers that reach the model directly.
        """
        for name, value in request.params.items():
            spec = _PARAMS.get(name)
            if spec is None:
                raise InvalidRequest(request.request_id, name, f"is not a parameter of this model ({sorted(_PARAMS)})")
            kind, low = spec
            ok = (
                isinstance(value, bool) if kind is bool else isinstance(value, Integral) and not isinstance(value, bool)
            )
            if not ok:
                raise InvalidRequest(request.request_id, name, f"must be {kind.__name__}, got {value!r}")
            if low is not None and value < low:
                raise InvalidRequest(request.request_id, name, f"must be >= {low}, got {value!r}")

    @staticmethod
    def batch_key(request: DiffusionRequest) -> Hashable:
        """Requests of one image size and step count batch together (an engine with
        ``max_batch_size > 1`` sends them in one ``execute_model_batch``).  The batch runs
        each request's own seeded forward, so a member gets the bits it gets alone."""
        p = request.params
        return ("tiny", p.get("height", 32), p.get("width"), p.get("steps"), p.get("num_frames"))

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        return self._forward(request)

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        for r in requests:  # the whole batch is checked before any forward runs
            self.validate_request(r)
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
        self.validate_request(request)
        p = request.params
        height = int(p.get("height", 32))
        width = int(p.get("width", self.width))
        steps = int(p.get("steps", self.steps))
        if p.get("raise"):
            raise RuntimeError(f"forward of {request.request_id} failed on purpose")
        if width != self.width:
            raise InvalidRequest(request.request_id, "width", f"must be this model's width {self.width}, got {width}")
        frames = p.get("num_frames")
        key = "image" if frames is None else "frames"
        shape = (height, width) if frames is None else (int(frames), height, width)
        gen = torch.Generator().manual_seed(int(p.get("seed", 0)))
        latent = torch.randn(*shape, generator=gen).to(self.device, self.dtype)
        trajectory: list[torch.Tensor] = []
        step_s = int(p.get("step_ms", 0)) / 1000.0
        honour_cancel = not p.get("ignore_cancel")
        preview_every = int(p.get("preview_every", 0))
        previews = preview_every > 0 and streaming_requested(request.request_id)
        raise_at = int(p.get("raise_at_step", 0))
        for step in range(1, steps + 1):
            if honour_cancel:
                # Between denoising steps: stop once every request of the call is cancelled.
                raise_if_cancelled()
            if step_s:
                time.sleep(step_s)
            latent = torch.tanh(latent @ self.weight)
            if p.get("keep_trajectory"):
                trajectory.append(latent.clone())
            if previews and step % preview_every == 0:
                # A fresh tensor the forward never writes again: the packer copies it
                # while the next steps run.
                preview = ((latent + 1) * 127.5).clamp(0, 255)
                chunk: dict[str, object] = {
                    key: preview,
                    "digest": image_digest(preview),
                    "latents": [],
                    "info": {"step": step, "steps": steps, "preview": True},
                }
                if p.get("unpackable_preview"):
                    chunk["unpackable"] = Unpackable()
                emit_chunk(request.request_id, chunk)
            if step == raise_at:
                raise RuntimeError(f"forward of {request.request_id} failed on purpose at step {step}")
        image = ((latent + 1) * 127.5).clamp(0, 255)
        output: dict[str, object] = {
            key: image,
            "digest": image_digest(image),
            "latents": trajectory,
            "info": {"steps": steps, "shape": (height, width), "dtype": str(self.dtype)},
        }
        if p.get("unpackable"):
            # A value no packer can carry: with worker processes, packing this output
            # fails (UnsupportedOutputType) and its waiter gets RemoteError.
            output["unpackable"] = Unpackable()
        return DiffusionOutput(request_id=request.request_id, output=output)


class Unpackable:
    """What ``TinyDiffusionWorker`` puts in an output asked for with ``unpackable``: not a
    tensor, array, bytes, plain value or container, so the packer refuses it."""


def image_digest(t: torch.Tensor) -> torch.Tensor:
    """An exact, order-sensitive checksum of a tensor's bytes, as a 0-d int64 tensor on
    the tensor's device (no host sync).  Integer sums are exact in any order (wrapping
    mod 2**64 at worst), so the CPU and CUDA values agree."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(data.numel(), device=data.device, dtype=torch.int64) % 251 + 1
    return (data * weights).sum()


_DIGEST_WEIGHTS = np.arange(1, 252, dtype=np.int64)  # image_digest's weights: byte i counts (i % 251) + 1


def host_digest(t: torch.Tensor) -> int:
    """``int(image_digest(t))`` for a tensor on the host, without its temporaries: what
    a check on the host uses.

    ``image_digest`` widens every byte to int64 and multiplies by a weight tensor as
    long: three 8-byte temporaries per byte of the image (24 MiB for a 1 MiB image, 450 MiB
    for a 480x832 video of 16 frames).  On the soak's engine threads glibc kept them in each
    thread's arena (most of the driver's RSS growth, defect 15); in the demo's checks,
    several at once, they took the engine's cores and left the GPU idle between forwards.
    Here the bytes are summed per weight (column sums of a ``(-1, 251)`` view, in numpy's
    small buffers; numpy lets go of the GIL), then weighted: the same exact integer.
    """
    if t.device.type != "cpu":
        return int(image_digest(t))
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    whole = raw.size - raw.size % 251
    total = 0
    if whole:
        total = int(np.add.reduce(raw[:whole].reshape(-1, 251), axis=0, dtype=np.int64) @ _DIGEST_WEIGHTS)
    rest = raw[whole:]
    if rest.size:
        total += int(rest.astype(np.int64) @ _DIGEST_WEIGHTS[: rest.size])
    return total  # no wrap: under 2**63 for any image below 32 TiB


class SyntheticVideoWorker:
    """A stand-in for a video pipeline, for benchmarks: a device forward of a set length
    (a chain of square matmuls) and one large output tensor (a "video") per request.

    Each request gets a freshly allocated output, written last by the forward, as a
    real pipeline's decoder would: the packer must copy it while the next forward runs.
    Between matmuls (its "denoising steps") it checks for cancellation
    (``raise_if_cancelled``).
    """

    def __init__(
        self,
        *,
        device: str = "cuda",
        output_mb: float = 448.0,
        matmuls: int = 32,
        dim: int = 8192,
        dtype: str = "bfloat16",
    ) -> None:
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.numel = int(output_mb * 1e6) // torch.empty((), dtype=self.dtype).element_size()
        self.matmuls = matmuls
        gen = torch.Generator().manual_seed(0)
        self.a = (torch.randn(dim, dim, generator=gen) / dim**0.5).to(self.device, self.dtype)
        self.b = (torch.randn(dim, dim, generator=gen) / dim**0.5).to(self.device, self.dtype)

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        x = self.a
        for _ in range(int(request.params.get("matmuls", self.matmuls))):
            raise_if_cancelled()
            x = x @ self.b
        video = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        video.fill_(float(request.params.get("seed", 0)))
        k = min(x.numel(), self.numel)
        video[:k].copy_(x.reshape(-1)[:k])  # the forward's last kernel writes the output
        return DiffusionOutput(request.request_id, {"video": video})

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self.execute_model(r) for r in requests))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# -- post-processing of TinyDiffusionWorker's outputs: pipeline "tiny" --------------------------


def tiny_to_uint8(output: DiffusionOutput) -> DiffusionOutput:
    """The device stage: the float image (0..255) becomes uint8 on the worker's device, before
    the copy -- four times fewer bytes than float32; the trajectory is not shipped.  The
    ``digest`` is taken again, of the uint8 bytes, so the engine can still check them."""
    out = dict(output.output)
    key = "frames" if "frames" in out else "image"
    image = out[key].round().clamp(0, 255).to(torch.uint8)
    out.update({key: image, "digest": image_digest(image), "latents": []})
    return attrs.evolve(output, output=out)


def tiny_to_pil(output: DiffusionOutput) -> Image.Image:
    """The host stage: the uint8 image as a grayscale ``PIL.Image`` that owns its pixels."""
    from PIL import Image

    image = output.output["image"]
    if image.dtype != torch.uint8:  # the device stage did not run (step mode without it, say)
        image = image.round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(image.cpu().numpy().copy())  # 2-D uint8: mode "L"


# ``WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", postprocess="tiny")``
TINY_POSTPROCESS = register_postprocess(
    PostProcess("tiny", host=tiny_to_pil, device=tiny_to_uint8, host_reads_only=True)
)
