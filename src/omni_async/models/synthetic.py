"""``SyntheticForwardWorker``: a forward of a set length and one output of a set shape, for ``omni-async bench``.

Each request names its forward length (``forward_ms``) and its output (``shape``,
``dtype``), so one worker serves a whole sweep.  The forward:

* on CUDA, a real kernel loop: square bfloat16 matmuls, as many as take ``forward_ms``
  on this device (calibrated once per worker, ``iteration_s``), then the output is
  written (a fresh tensor per request, written last, as a pipeline's decoder does) and
  the forward's own stream is synchronized -- not the whole device: the packer's
  side-stream copy of the previous output goes on meanwhile, which is the overlap being
  measured.  With ``"sync": False`` the forward returns as soon as its kernels are
  queued, as a real pipeline's does (diffusers'): the worker's stamps
  (``omni_async.worker.stamps``) time the device either way;
* on CPU, the output is written, then the forward sleeps out the rest of ``forward_ms``
  (a sleeping forward leaves the CPU to the packer, as a device forward leaves the host).

From the worker loop's stamps of every output (``forward_started_at``,
``forward_ended_at``) the bench computes the device's idle time between forwards.

Two RPCs measure the limits of one case under the same conditions (``collective_rpc``):
``forward_alone`` (the forward in a sustained loop, nothing shipped) and ``copy_alone``
(one output copied again and again into one pinned host buffer on a side stream; on
CPU a reused host buffer).

The output's values are a function of the request (``synthetic_output``), so a test can
rebuild the tensor a worker produced and compare bytes.  With ``"picture": True`` the
output is an image instead, ``{"image": [H, W, C]}`` (``shape`` is ``(H, W, C)``): a smooth
picture with a little noise, as a decoder makes (``synthetic_picture``), so that encoding
it costs what encoding a generated image does (a constant or random tensor would be far
cheaper, or far dearer, to compress).  Post-process ``"bench-u8"``: a
device stage that turns every floating tensor (values in -1..1) into uint8 pixels
before the copy, the way a pipeline ships images.  ``"bench-client"``: a host stage
alone that hands the client its bytes (``to_client_bytes``: the conversion on the host);
``"bench-u8-client"``: ``"bench-u8"``'s device stage, then that host stage (a copy).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from numbers import Integral, Real

import attrs
import torch

from omni_async.core.errors import InvalidRequest
from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput, DiffusionRequest
from omni_async.worker.cancel import raise_if_cancelled
from omni_async.worker.finalize import FusedPointwise
from omni_async.worker.postprocess import PostProcess, register_postprocess

__all__ = [
    "BENCH_CLIENT",
    "BENCH_U8",
    "BENCH_U8_CLIENT",
    "DTYPES",
    "U8",
    "SyntheticForwardWorker",
    "synthetic_output",
    "synthetic_picture",
    "to_client_bytes",
    "to_uint8",
    "u8_eager",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
}
# Values vary over the first elements (all of a test-sized output); the rest is one value,
# so writing a large output costs one pass.
_VARIED = 1 << 18


def synthetic_output(shape: Sequence[int], dtype: torch.dtype, seed: int, device: str | torch.device) -> torch.Tensor:
    """The output of a request with this shape, dtype and seed: values in -1..1 (0..255 for uint8)."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    flat = out.view(-1)
    k = min(flat.numel(), _VARIED)
    if dtype == torch.uint8:
        flat.fill_(seed % 256)
        flat[:k].copy_((torch.arange(k, device=device) * 7 + seed) % 256)
        return out
    flat.fill_((seed % 17) / 17.0)
    ramp = torch.arange(k, device=device, dtype=torch.float32)
    flat[:k].copy_(torch.sin(ramp * 0.001 + seed))
    return out


def synthetic_picture(shape: Sequence[int], dtype: torch.dtype, seed: int, device: str | torch.device) -> torch.Tensor:
    """An image ``[H, W, C]`` of values in -1..1: smooth waves per channel and a little
    seeded noise (about one level in 128), a function of the request."""
    h, w, c = (int(d) for d in shape[-3:])
    y = torch.linspace(0.0, 1.0, h, device=device).view(h, 1, 1)
    x = torch.linspace(0.0, 1.0, w, device=device).view(1, w, 1)
    ch = torch.arange(c, device=device, dtype=torch.float32).view(1, 1, c)
    waves = 0.6 * torch.sin(6.0 * x + 4.0 * y + 1.3 * ch + seed) + 0.25 * torch.cos(11.0 * x * y + ch)
    gen = torch.Generator(device=device).manual_seed(seed)
    noise = torch.rand((h, w, c), generator=gen, device=device) * 0.016 - 0.008
    return (waves + noise).clamp_(-1.0, 1.0).to(dtype)


def _is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


class SyntheticForwardWorker:
    """See the module docstring.  ``dim``: the side of the CUDA forward's matmuls."""

    def __init__(self, *, device: str = "cpu", dim: int = 4096) -> None:
        self.device = torch.device(device)
        self.iteration_s: float | None = None
        if self.device.type == "cpu":
            # The CPU forward stands in for a device forward: it must not contend for the
            # cores (two, on the CI machine) through torch's thread pool, whose parallel
            # regions stall for tens of ms when the machine is loaded.
            torch.set_num_threads(1)
        if self.device.type == "cuda":
            gen = torch.Generator().manual_seed(0)
            self.a = (torch.randn(dim, dim, generator=gen) / dim**0.5).to(self.device, torch.bfloat16)
            self.b = (torch.randn(dim, dim, generator=gen) / dim**0.5).to(self.device, torch.bfloat16)
            self._calibrate()

    # -- the model interface -----------------------------------------------------

    @staticmethod
    def validate_request(request: DiffusionRequest) -> None:
        """``forward_ms``: a number >= 0 (default 0); ``shape``: a non-empty sequence of ints
        >= 1 (default ``(3, 64, 64)``); ``dtype``: one of ``DTYPES`` (``"float32"``);
        ``seed``: an int; ``sync``: a bool (default True: the forward synchronizes its
        stream before it returns; False: it returns with its kernels queued);
        ``picture``: a bool (default False; True: an image ``{"image": [H, W, C]}``, the
        shape three ints with C 1, 3 or 4, not uint8); nothing else."""
        known = {"forward_ms", "shape", "dtype", "seed", "sync", "picture"}
        p = request.params
        for name in p:
            if name not in known:
                raise InvalidRequest(request.request_id, name, f"is not a parameter of this model ({sorted(known)})")
        fwd = p.get("forward_ms", 0)
        if isinstance(fwd, bool) or not isinstance(fwd, Real) or not math.isfinite(float(fwd)) or fwd < 0:
            raise InvalidRequest(request.request_id, "forward_ms", f"must be a number >= 0, got {fwd!r}")
        shape = p.get("shape", (3, 64, 64))
        if not isinstance(shape, (tuple, list)) or not shape or not all(_is_int(d) and d >= 1 for d in shape):
            raise InvalidRequest(
                request.request_id, "shape", f"must be a non-empty sequence of ints >= 1, got {shape!r}"
            )
        if p.get("dtype", "float32") not in DTYPES:
            raise InvalidRequest(request.request_id, "dtype", f"must be one of {sorted(DTYPES)}, got {p['dtype']!r}")
        seed = p.get("seed", 0)
        if not _is_int(seed):
            raise InvalidRequest(request.request_id, "seed", f"must be an int, got {seed!r}")
        if not isinstance(p.get("sync", True), bool):
            raise InvalidRequest(request.request_id, "sync", f"must be a bool, got {p['sync']!r}")
        picture = p.get("picture", False)
        if not isinstance(picture, bool):
            raise InvalidRequest(request.request_id, "picture", f"must be a bool, got {picture!r}")
        if picture and (len(shape) != 3 or shape[-1] not in (1, 3, 4) or p.get("dtype") == "uint8"):
            raise InvalidRequest(
                request.request_id,
                "picture",
                f"needs shape (H, W, C) with C 1, 3 or 4 and a floating dtype, got {tuple(shape)!r} {p.get('dtype')!r}",
            )

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        self.validate_request(request)
        p = request.params
        picture = bool(p.get("picture", False))
        video = self._forward(
            float(p.get("forward_ms", 0)) / 1e3,
            tuple(p.get("shape", (3, 64, 64))),
            DTYPES[p.get("dtype", "float32")],
            int(p.get("seed", 0)),
            time.monotonic(),
            sync=bool(p.get("sync", True)),
            picture=picture,
        )
        return DiffusionOutput(request.request_id, {"image" if picture else "video": video})

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self.execute_model(r) for r in requests))

    # -- the bench's RPCs ------------------------------------------------------------

    def forward_alone(
        self, n: int, forward_ms: float, shape: Sequence[int], dtype: str, picture: bool = False
    ) -> list[float]:
        """``n`` forwards back to back, nothing shipped; the seconds of each."""
        times = []
        for i in range(n):
            t0 = time.monotonic()
            self._forward(forward_ms / 1e3, tuple(shape), DTYPES[dtype], i, t0, picture=picture)
            times.append(time.monotonic() - t0)
        return times

    def where(self) -> str:
        """The device this rank computes on (``cuda:<index>`` or ``cpu``)."""
        return f"cuda:{torch.cuda.current_device()}" if self.device.type == "cuda" else str(self.device)

    def copy_alone(self, n: int, shape: Sequence[int], dtype: str) -> list[float]:
        """One output copied ``n`` times into one pinned host buffer (CUDA: on a side
        stream, synchronized each time; CPU: a reused host buffer); the seconds of each."""
        src = synthetic_output(tuple(shape), DTYPES[dtype], 0, self.device).view(-1).view(torch.uint8)
        times = []
        if self.device.type == "cuda":
            host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
            side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
            side.wait_stream(torch.cuda.current_stream(self.device))
            for _ in range(n + 1):
                t0 = time.monotonic()
                with torch.cuda.stream(side):
                    host.copy_(src, non_blocking=True)
                side.synchronize()
                times.append(time.monotonic() - t0)
        else:
            host = torch.empty(src.numel(), dtype=torch.uint8)
            for _ in range(n + 1):
                t0 = time.monotonic()
                host.copy_(src)
                times.append(time.monotonic() - t0)
        return times[1:]  # the first touches the buffer's pages

    # -- internals ---------------------------------------------------------------------

    def _calibrate(self) -> None:
        """Seconds per matmul of the CUDA forward, measured once (after a warm-up)."""
        stream = torch.cuda.current_stream(self.device)
        for reps in (4, 32):
            t0 = time.monotonic()
            x = self.a
            for _ in range(reps):
                x = x @ self.b
            stream.synchronize()
            self.iteration_s = max((time.monotonic() - t0) / reps, 1e-6)

    def _forward(
        self,
        forward_s: float,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        seed: int,
        t0: float,
        *,
        sync: bool = True,
        picture: bool = False,
    ) -> torch.Tensor:
        make = synthetic_picture if picture else synthetic_output
        if self.device.type == "cuda":
            assert self.iteration_s is not None
            x = self.a
            for i in range(round(forward_s / self.iteration_s)):
                if i % 16 == 0:
                    raise_if_cancelled()
                x = x @ self.b
            video = make(shape, dtype, seed, self.device)
            if sync:
                # The forward's own stream only: the packer's copy on its side stream goes on.
                torch.cuda.current_stream(self.device).synchronize()
            return video
        raise_if_cancelled()
        video = make(shape, dtype, seed, self.device)
        left = t0 + forward_s - time.monotonic()
        if left > 0:
            time.sleep(left)
        return video


def u8_eager(x: torch.Tensor) -> torch.Tensor:
    """The reference of ``"bench-u8"``'s finalize, in eager PyTorch: four passes (multiply,
    add, clamp, cast), each rounding in ``x``'s dtype; the cast truncates (no rounding).
    The fused kernel (``U8``) gives these bits exactly."""
    y = x.mul(127.5)
    y.add_(127.5).clamp_(0, 255)
    return y.to(torch.uint8)


#: ``u8_eager`` as one fused kernel on CUDA (``omni_async.worker.finalize``), eager elsewhere.
U8 = FusedPointwise(u8_eager)


def to_uint8(output: DiffusionOutput) -> DiffusionOutput:
    """The device stage of ``"bench-u8"``: each floating tensor (-1..1) becomes uint8 pixels
    (0..255), in one fused kernel on CUDA (``U8``); ``metrics`` say which path ran
    (``finalize_fused``: 1.0 fused, 0.0 eager)."""
    fused = 1.0

    def convert(x: object) -> object:
        nonlocal fused
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            y, was_fused = U8.apply(x)
            fused = min(fused, float(was_fused))
            return y
        return x

    out = {k: convert(v) for k, v in output.output.items()}
    return attrs.evolve(output, output=out, metrics=output.metrics.set(finalize_fused=fused))


def warm_up_u8(device: torch.device) -> None:
    """``"bench-u8"``'s warm-up: compile ``U8`` on the worker's device at start-up."""
    U8.warm_up(device)


BENCH_U8 = register_postprocess(PostProcess("bench-u8", device=to_uint8, warmup=warm_up_u8))


def to_client_bytes(output: DiffusionOutput) -> dict[str, bytes]:
    """A host stage: what a client receives of each tensor, as owned bytes of uint8 pixels.

    A floating tensor (-1..1) is converted on the host with ``to_uint8``'s arithmetic
    (the seed's engine-side post-process: the float output crossed PCIe as it was); a
    uint8 one (the device stage ran) is only copied.  Until the encoders land this is
    the client's payload: raw pixels, the bytes an encoder would take."""
    result: dict[str, bytes] = {}
    for key, value in output.output.items():
        if not isinstance(value, torch.Tensor):
            continue
        t = value
        if t.is_floating_point():
            t = t.to(torch.float32).mul(127.5).add_(127.5).clamp_(0, 255).to(torch.uint8)
        result[key] = t.contiguous().numpy().tobytes()
    return result


#: The client's bytes with the conversion on the host (the seed's split of the work).
BENCH_CLIENT = register_postprocess(PostProcess("bench-client", host=to_client_bytes, host_reads_only=True))
#: The client's bytes with the conversion on the device before the copy (ours).
BENCH_U8_CLIENT = register_postprocess(
    PostProcess("bench-u8-client", device=to_uint8, host=to_client_bytes, host_reads_only=True, warmup=warm_up_u8)
)
