"""A small DiT pipeline in plain torch, so the demo and the benchmarks serve a real model.

``DiTPipelineWorker`` implements the worker-side model interface
(``DiffusionWorkerModel``) with the shape of a modern latent diffusion pipeline, at
toy scale and with random weights (nothing to download):

1. a seeded Gaussian latent of ``[num_frames, latent_channels, height / 8, width / 8]``;
2. ``steps`` Euler steps of a rectified-flow sampler (``x += (sigma_next - sigma) * v``
   on ``sigma = 1 -> 0``), where ``v`` comes from a DiT denoiser: the latent is cut into
   2x2 patches, embedded with 2-d sin-cos positions (and a sin-cos frame index for
   videos), and run through ``depth`` transformer blocks whose LayerNorms are modulated
   by the timestep (adaLN, from a sinusoidal timestep embedding).  Each block attends
   over the patches of a frame (``scaled_dot_product_attention``) and, for videos, over
   the frames at each patch position (factorised space-time attention, as video DiTs
   do: cheap in both the frame count and the frame size);
3. a small convolutional decoder (three nearest-neighbour x2 upsamplings) from the
   latent to pixels in ``[0, 1]``.

A batch runs as one forward over the stacked latents of its same-shaped requests.  The
outputs stay on the model's device, as a pipeline whose post-processing moved off the
GPU path leaves them; the post-process registered here under ``"dit"`` turns them into
uint8 pixels on the worker's device (before the copy) and into a PIL image or a numpy
video on the engine's side.

Deterministic: the weights come from the model's ``seed`` (a CPU generator, so every
device gets the same weights), the initial latent from the request's ``seed`` (a
generator on the model's device).  The same request gives the same pixels on the same
device, up to the last bits of CPU math across processes (see ``models/tiny.py``); a
batch gives each request the very bits it gets alone (checked on CPU): every matrix
product is one per sample (``_Linear``) and every request is decoded on its own.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_async.core.errors import InvalidRequest, UsageError
from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput, DiffusionRequest
from omni_async.models.tiny import host_digest, image_digest
from omni_async.worker.cancel import raise_if_cancelled
from omni_async.worker.postprocess import PostProcess, register_postprocess
from omni_async.worker.stream import emit_chunk, streaming_requested

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from PIL import Image

#: The pipeline name the post-process is registered under (``get_postprocess("dit")``).
PIPELINE = "dit"
#: The decoder upsamples the latent by this factor: ``height`` and ``width`` are multiples of it.
DECODER_FACTOR = 8
#: The denoiser's patch size (a latent side that is odd is padded to it, then cropped).
PATCH_SIZE = 2

_MAX_SIDE = 16384
# name -> (kind, smallest, largest); ``None``: no bound.
_PARAMS: dict[str, tuple[type, int | None, int | None]] = {
    "height": (int, DECODER_FACTOR, _MAX_SIDE),
    "width": (int, DECODER_FACTOR, _MAX_SIDE),
    "num_frames": (int, 1, 4096),
    "steps": (int, 1, 1000),
    "seed": (int, 0, 2**64 - 1),
    "digest": (bool, None, None),
    "preview_every": (int, 1, 1000),
}
DEFAULT_HEIGHT = 128
DEFAULT_WIDTH = 128

StepCallback = Callable[[Sequence[DiffusionRequest], int, Tensor], None]


@attrs.frozen
class _Shape:
    """What requests must share to be denoised as one stacked batch."""

    height: int
    width: int
    num_frames: int
    steps: int


# --------------------------------------------------------------------------- embeddings


def _sincos(positions: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding ``[len(positions), dim]`` (float32) of float positions."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def _grid_embedding(rows: int, cols: int, dim: int, device: torch.device) -> Tensor:
    """2-d sin-cos position embedding of a rows x cols patch grid: ``[rows * cols, dim]``."""
    r = torch.arange(rows, device=device).repeat_interleave(cols)
    c = torch.arange(cols, device=device).repeat(rows)
    return torch.cat([_sincos(r, dim // 2), _sincos(c, dim - dim // 2)], dim=1)


# --------------------------------------------------------------------------- the networks


class _Linear(nn.Linear):
    """``nn.Linear`` that is batch-invariant: one matrix product per sample (the first
    axis), so a request's rows go through the same kernel with the same shapes whether it
    runs alone or in a batch.  ``F.linear`` over all the rows at once lets the BLAS pick
    its blocking (or a matrix-vector kernel for one row) by the total row count, and a
    batched request came out different in the last bits (1e-6 on CPU)."""

    def forward(self, x: Tensor) -> Tensor:
        b = x.shape[0]
        rows = x.reshape(b, -1, self.in_features)
        out = torch.baddbmm(
            self.bias.view(1, 1, -1).expand(b, 1, -1),
            rows,
            self.weight.t().unsqueeze(0).expand(b, -1, -1),
        )
        return out.view(*x.shape[:-1], self.out_features)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = _Linear(dim, 3 * dim)
        self.proj = _Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """Self-attention over the middle axis of ``x: [batch, length, dim]``."""
        b, n, d = x.shape
        qkv: Tensor = self.qkv(x)
        q, k, v = qkv.view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v)
        out: Tensor = self.proj(o.transpose(1, 2).reshape(b, n, d))
        return out


class _Block(nn.Module):
    """A DiT block: spatial attention, temporal attention (videos only) and an MLP, each a
    residual branch whose LayerNorm is shifted, scaled and gated by the timestep."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.spatial = _Attention(dim, heads)
        self.temporal = _Attention(dim, heads)
        self.fc1 = _Linear(dim, hidden)
        self.fc2 = _Linear(hidden, dim)
        self.modulation = _Linear(dim, 9 * dim)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        """``x: [B, T, N, D]`` tokens of T frames of N patches; ``cond: [B, D]``."""
        return block_forward(x, cond, self.modulation, self.spatial, self.temporal, self.mlp)

    def mlp(self, h: Tensor) -> Tensor:
        out: Tensor = self.fc2(F.gelu(self.fc1(h)))
        return out


def block_forward(
    x: Tensor,
    cond: Tensor,
    modulation: Callable[[Tensor], Tensor],
    spatial: Callable[[Tensor], Tensor],
    temporal: Callable[[Tensor], Tensor],
    mlp: Callable[[Tensor], Tensor],
) -> Tensor:
    """A DiT block's arithmetic over its parts (``_Block``; the split model's blocks give
    their own parts, the same arithmetic)."""
    b, t, n, d = x.shape
    mod = modulation(F.silu(cond))
    m = mod[:, None, None, :].chunk(9, dim=-1)
    h = _modulate(x, m[0], m[1]).reshape(b * t, n, d)
    x = x + m[2] * spatial(h).view(b, t, n, d)
    if t > 1:
        h = _modulate(x, m[3], m[4]).transpose(1, 2).reshape(b * n, t, d)
        x = x + m[5] * temporal(h).view(b, n, t, d).transpose(1, 2)
    out: Tensor = x + m[8] * mlp(_modulate(x, m[6], m[7]))
    return out


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return F.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift


class _Denoiser(nn.Module):
    """Predicts the flow velocity ``v`` of latents ``[B, T, C, h, w]`` at noise level ``sigma: [B]``."""

    def __init__(self, channels: int, dim: int, depth: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.channels = channels
        self.dim = dim
        patch = channels * PATCH_SIZE * PATCH_SIZE
        self.embed = _Linear(patch, dim)
        self.t_fc1 = _Linear(256, dim)
        self.t_fc2 = _Linear(dim, dim)
        self.blocks = nn.ModuleList([_Block(dim, heads, mlp_ratio) for _ in range(depth)])
        self.final_modulation = _Linear(dim, 2 * dim)
        self.final = _Linear(dim, patch)

    def forward(self, z: Tensor, sigma: Tensor) -> Tensor:
        x, cond, grid = self.tokens(z, sigma)
        for block in self.blocks:
            x = block(x, cond)
        return self.velocity(self.head(x, cond), grid)

    # The stages of ``forward``, apart, so that a model split across ranks
    # (``omni_async.models.parallel_dit``) runs its own blocks between them.

    def tokens(self, z: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor, PatchGrid]:
        """Latents ``[B, T, C, h, w]`` to embedded tokens ``[B, T, N, D]`` (N patches per
        frame, with their positions), the timestep condition ``[B, D]`` and the grid."""
        b, t, c, h, w = z.shape
        p = PATCH_SIZE
        ph, pw = -h % p, -w % p  # an odd latent side is padded to whole patches, then cropped
        if ph or pw:
            z = F.pad(z.reshape(b * t, c, h, w), (0, pw, 0, ph), mode="replicate").view(b, t, c, h + ph, w + pw)
        grid = PatchGrid(t, c, h, w, (h + ph) // p, (w + pw) // p)
        rows, cols = grid.rows, grid.cols
        tokens = z.reshape(b, t, c, rows, p, cols, p).permute(0, 1, 3, 5, 2, 4, 6).reshape(b, t, rows * cols, c * p * p)
        x: Tensor = self.embed(tokens)
        pos = _grid_embedding(rows, cols, self.dim, z.device)[None, None]
        x = x + pos.to(x.dtype)
        if t > 1:
            frames = _sincos(torch.arange(t, device=z.device), self.dim)[None, :, None, :]
            x = x + frames.to(x.dtype)
        temb = _sincos(sigma * 1000.0, 256).to(x.dtype)
        cond: Tensor = self.t_fc2(F.silu(self.t_fc1(temb)))
        return x, cond, grid

    def head(self, x: Tensor, cond: Tensor) -> Tensor:
        """Tokens ``[B, T, n, D]`` to patch velocities ``[B, T, n, C*p*p]`` (token-wise: any subset of tokens)."""
        shift, scale = self.final_modulation(F.silu(cond))[:, None, None, :].chunk(2, dim=-1)
        out: Tensor = self.final(_modulate(x, shift, scale))
        return out

    @staticmethod
    def velocity(out: Tensor, grid: PatchGrid) -> Tensor:
        """Patch velocities ``[B, T, N, C*p*p]`` of every patch back to latents ``[B, T, C, h, w]``."""
        g, p = grid, PATCH_SIZE
        b = out.shape[0]
        v = out.reshape(b, g.t, g.rows, g.cols, g.c, p, p).permute(0, 1, 4, 2, 5, 3, 6)
        return v.reshape(b, g.t, g.c, g.rows * p, g.cols * p)[..., : g.h, : g.w]


@attrs.frozen
class PatchGrid:
    """How ``_Denoiser.tokens`` cut latents: frames, channels, the latent size, the patch grid."""

    t: int
    c: int
    h: int
    w: int
    rows: int
    cols: int


class _Decoder(nn.Module):
    """Latents ``[N, C, h, w]`` to pixels ``[N, 3, 8h, 8w]`` in [-1, 1]: three x2 upsamplings."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        widths = [width, max(width // 2, 8), max(width // 4, 8), max(width // 4, 8)]
        self.conv_in = nn.Conv2d(channels, widths[0], 3, padding=1)
        self.ups = nn.ModuleList([nn.Conv2d(a, b, 3, padding=1) for a, b in itertools.pairwise(widths)])
        self.conv_out = nn.Conv2d(widths[-1], 3, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = _norm_act(self.conv_in(z))
        for conv in self.ups:
            h = _norm_act(conv(F.interpolate(h, scale_factor=2.0, mode="nearest")))
        out: Tensor = torch.tanh(self.conv_out(h))
        return out


def _norm_act(h: Tensor) -> Tensor:
    return F.silu(F.group_norm(h, min(8, h.shape[1])))


def _init_weights(module: nn.Module, gen: torch.Generator) -> None:
    """Random weights from ``gen`` alone, in registration order: unit-variance layers,
    zero biases, and small modulations (gates about 0.1), so the untrained stack stays
    well scaled through any number of blocks and steps."""
    for name, param in module.named_parameters():
        with torch.no_grad():
            if name.endswith("bias"):
                param.zero_()
                continue
            fan_in = param[0].numel()
            gain = 0.1 if "modulation" in name else 1.0
            param.copy_(torch.randn(param.shape, generator=gen) * (gain / math.sqrt(fan_in)))


# --------------------------------------------------------------------------- the worker


class DiTPipelineWorker:
    """A DiT denoiser, a rectified-flow sampler and a conv decoder: images and videos.

    Constructor (keyword-only): ``device`` (``"cpu"``), ``dtype`` (``torch.float32``; a
    ``torch.dtype`` or its name, e.g. ``"bfloat16"`` on CUDA), ``hidden_size`` (128),
    ``depth`` (4), ``heads`` (4), ``mlp_ratio`` (4.0), ``latent_channels`` (4),
    ``decoder_width`` (64), ``steps`` (8; the default of the request parameter), ``seed``
    (0; seeds the weights), ``decode_chunk`` (8; images decoded at once, bounding the
    decoder's memory for long videos), ``step_callback`` (None; called after every
    denoising step as ``step_callback(requests, step, latents)``: an exception raised
    there stops the forward and fails the call).

    Between denoising steps the forward checks for cancellation
    (``raise_if_cancelled``): an aborted request stops at the next step.  A request with
    ``preview_every=k`` run as a stream (``generate_stream``, ``submit(..., stream=True)``) gets a
    preview chunk after every k-th step but the last: its latents so far, decoded, in
    the output's own layout (``image`` or ``frames``, with ``info["step"]`` and
    ``info["preview"] = True``), post-processed like the final output.
    """

    pipeline: ClassVar[str] = PIPELINE

    def __init__(
        self,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        hidden_size: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: float = 4.0,
        latent_channels: int = 4,
        decoder_width: int = 64,
        steps: int = 8,
        seed: int = 0,
        decode_chunk: int = 8,
        step_callback: StepCallback | None = None,
    ) -> None:
        self.dtype = _dtype(dtype)
        if hidden_size % heads or (hidden_size // heads) % 2:
            raise UsageError(
                f"DiTPipelineWorker: hidden_size ({hidden_size}) must be a multiple of heads ({heads}) "
                "with an even head size"
            )
        sizes = {"depth": depth, "latent_channels": latent_channels, "decoder_width": decoder_width, "steps": steps}
        for name, value in {**sizes, "decode_chunk": decode_chunk}.items():
            if value < 1:
                raise UsageError(f"DiTPipelineWorker: {name} must be >= 1, got {value}")
        self.device = torch.device(device)
        self.latent_channels = latent_channels
        self.steps = steps
        self.decode_chunk = decode_chunk
        self.step_callback = step_callback
        self.sleeping = False
        gen = torch.Generator().manual_seed(seed)
        with torch.device("meta"):  # no default init: it would draw from the global RNG
            denoiser = _Denoiser(latent_channels, hidden_size, depth, heads, mlp_ratio)
            decoder = _Decoder(latent_channels, decoder_width)
        self.denoiser = denoiser.to_empty(device="cpu")
        self.decoder = decoder.to_empty(device="cpu")
        _init_weights(self.denoiser, gen)
        _init_weights(self.decoder, gen)
        self.denoiser.to(self.device, self.dtype).eval()
        self.decoder.to(self.device, self.dtype).eval()

    # -- the model interface -----------------------------------------------------

    @staticmethod
    def validate_request(request: DiffusionRequest) -> None:
        """Check the parameters this pipeline reads; ``InvalidRequest`` names the parameter.

        ``height``, ``width``: int, a multiple of 8 in 8..16384; ``num_frames``: int in
        1..4096; ``steps``: int in 1..1000; ``seed``: int in 0..2**64-1; ``digest``: bool;
        nothing else (a misspelt name fails too).  Static, so the executor runs it in the
        caller's thread; the forward runs it again.
        """
        for name, value in request.params.items():
            spec = _PARAMS.get(name)
            if spec is None:
                known = sorted(_PARAMS)
                raise InvalidRequest(request.request_id, name, f"is not a parameter of this pipeline ({known})")
            kind, low, high = spec
            is_int = isinstance(value, Integral) and not isinstance(value, bool)
            ok = isinstance(value, bool) if kind is bool else is_int
            if not ok:
                raise InvalidRequest(request.request_id, name, f"must be {kind.__name__}, got {value!r:.60}")
            if low is not None and value < low or high is not None and value > high:
                raise InvalidRequest(request.request_id, name, f"must be in {low}..{high}, got {value!r}")
            if name in ("height", "width") and value % DECODER_FACTOR:
                raise InvalidRequest(
                    request.request_id,
                    name,
                    f"must be a multiple of {DECODER_FACTOR} (the decoder's upsampling factor), got {value!r}",
                )

    @staticmethod
    def batch_key(request: DiffusionRequest) -> Hashable:
        """What requests must share to be denoised as one stacked batch: ``height``,
        ``width``, ``num_frames`` and ``steps`` as the request gives them (a request that
        leaves ``steps`` to the model's default batches with those that leave it too).
        An engine with ``max_batch_size > 1`` sends requests of one key together."""
        p = request.params
        return (
            PIPELINE,
            int(p.get("height", DEFAULT_HEIGHT)),
            int(p.get("width", DEFAULT_WIDTH)),
            int(p.get("num_frames", 1)),
            None if p.get("steps") is None else int(p["steps"]),
        )

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        return self._run([request])[0]

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        """One stacked forward per group of same-shaped requests (height, width, frames,
        steps); outputs in request order."""
        for r in requests:  # the whole batch is checked before any forward runs
            self.validate_request(r)
        groups: dict[_Shape, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(_shape_of(r, self.steps), []).append(i)
        outputs: list[DiffusionOutput | None] = [None] * len(requests)
        for indices in groups.values():
            for i, out in zip(indices, self._run([requests[i] for i in indices]), strict=True):
                outputs[i] = out
        return BatchDiffusionOutput(tuple(o for o in outputs if o is not None))

    # -- the pipeline's stages (public: previews and tools can drive them) ----------

    def initial_latents(self, requests: Sequence[DiffusionRequest]) -> Tensor:
        """The seeded noise of same-shaped requests, stacked: ``[B, T, C, height/8, width/8]``.

        Each request's noise comes from its own generator, so it does not depend on the
        batch it is in."""
        shape = _shape_of(requests[0], self.steps)
        size = (shape.num_frames, self.latent_channels, shape.height // DECODER_FACTOR, shape.width // DECODER_FACTOR)
        noise = []
        for r in requests:
            gen = torch.Generator(self.device).manual_seed(int(r.params.get("seed", 0)))
            noise.append(torch.randn(size, generator=gen, device=self.device, dtype=torch.float32))
        return torch.stack(noise).to(self.dtype)

    def denoise(self, latents: Tensor, steps: int) -> Iterator[Tensor]:
        """Run the sampler on ``latents`` ``[B, T, C, h, w]``, yielding the latents after each
        step (the last is the result).  A generator, so a caller can stop between steps
        or look at each step's latents (previews)."""
        sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float32).tolist()
        x = latents
        for sigma, sigma_next in itertools.pairwise(sigmas):
            # Not around the loop: a generator suspended inside ``no_grad`` would leave
            # the caller's thread in it between steps.
            with torch.no_grad():
                s = torch.full((x.shape[0],), sigma, device=x.device, dtype=torch.float32)
                x = x + (sigma_next - sigma) * self.denoiser(x, s)
            yield x

    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, T, C, h, w]`` to pixels ``[B, T, 3, 8h, 8w]`` in [0, 1], in the model's
        dtype, ``decode_chunk`` images at a time."""
        b, t, _, h, w = latents.shape
        with torch.no_grad():
            pixels = torch.empty(
                b, t, 3, h * DECODER_FACTOR, w * DECODER_FACTOR, device=latents.device, dtype=latents.dtype
            )
            # Each request's frames on their own (never another request's in the same
            # convolution): the convolution's kernel choice depends on how many images it
            # gets, and a batched request must decode to the bits it decodes to alone.
            for i in range(b):
                for start in range(0, t, self.decode_chunk):
                    chunk = self.decoder(latents[i, start : start + self.decode_chunk])
                    pixels[i, start : start + self.decode_chunk] = (chunk + 1) * 0.5
        return pixels

    # -- ordinary RPCs --------------------------------------------------------------

    def ping(self) -> str:
        return "pong"

    def sleep(self) -> None:
        """Offload the weights to the host (frees the device's memory); forwards fail until ``wake_up``."""
        self.sleeping = True
        self.denoiser.to("cpu")
        self.decoder.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        self.denoiser.to(self.device)
        self.decoder.to(self.device)
        self.sleeping = False

    # -- internals ---------------------------------------------------------------------

    def _run(self, requests: Sequence[DiffusionRequest]) -> list[DiffusionOutput]:
        """The forward of same-shaped requests as one batch."""
        for r in requests:
            self.validate_request(r)
        if self.sleeping:
            raise UsageError(
                f"request {requests[0].request_id!r}: the DiT pipeline is asleep (sleep() was called); "
                "call wake_up() before sending requests"
            )
        shape = _shape_of(requests[0], self.steps)
        noise = self.initial_latents(requests)
        latents = noise
        previews = {
            i: int(r.params["preview_every"])
            for i, r in enumerate(requests)
            if r.params.get("preview_every") and streaming_requested(r.request_id)
        }
        for step, latents in enumerate(self.denoise(noise, shape.steps)):  # the last one is the result
            if self.step_callback is not None:
                self.step_callback(requests, step, latents)
            done = step + 1
            if done < shape.steps:
                # Between denoising steps: stop once every request of the call is cancelled.
                raise_if_cancelled()
                for i, every in previews.items():
                    if done % every == 0:
                        # A fresh decode the forward never writes again: the packer copies it
                        # while the next steps run.
                        px = self.decode(latents[i : i + 1])[0]
                        emit_chunk(requests[i].request_id, self._output(requests[i], px, shape, preview_step=done))
        pixels = self.decode(latents)
        return [
            DiffusionOutput(request_id=r.request_id, output=self._output(r, pixels[i], shape))
            for i, r in enumerate(requests)
        ]

    def _output(
        self, request: DiffusionRequest, pixels: Tensor, shape: _Shape, preview_step: int | None = None
    ) -> dict[str, object]:
        """One request's output (or preview) structure from its pixels ``[T, 3, H, W]``."""
        px = pixels[0] if shape.num_frames == 1 else pixels
        output: dict[str, object] = {"image" if shape.num_frames == 1 else "frames": px}
        if request.params.get("digest"):
            output["digest"] = image_digest(px)
        info: dict[str, object] = {
            "height": shape.height,
            "width": shape.width,
            "num_frames": shape.num_frames,
            "steps": shape.steps,
            "seed": int(request.params.get("seed", 0)),
            "dtype": str(self.dtype),
        }
        if preview_step is not None:
            info.update(step=preview_step, preview=True)
        output["info"] = info
        return output


def _shape_of(request: DiffusionRequest, default_steps: int) -> _Shape:
    p = request.params
    return _Shape(
        height=int(p.get("height", DEFAULT_HEIGHT)),
        width=int(p.get("width", DEFAULT_WIDTH)),
        num_frames=int(p.get("num_frames", 1)),
        steps=int(p.get("steps", default_steps)),
    )


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise UsageError(f"DiTPipelineWorker: dtype must be a floating torch dtype or its name, got {dtype!r}")
    return found


def make_worker(*, device: str = "auto", **kwargs: Any) -> DiTPipelineWorker:
    """``WorkerSpec("omni_async.models.dit:make_worker", {...})``: a ``DiTPipelineWorker``
    whose ``device="auto"`` (the default) is the process's current CUDA device when there
    is one, else the CPU; the other keyword arguments are the constructor's (``dtype`` as
    a name travels well: ``{"dtype": "bfloat16"}``)."""
    if device == "auto":
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return DiTPipelineWorker(device=device, **kwargs)


# ``WorkerSpec.request_validator`` looks for this on a factory function: with it, the
# executor rejects a bad request in the caller's thread.
make_worker.validate_request = DiTPipelineWorker.validate_request  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- post-processing


def pixels_to_uint8(pixels: Tensor, *, chunk: int = 8) -> Tensor:
    """Float pixels ``[..., 3, H, W]`` in [0, 1] to uint8 ``[..., H, W, 3]`` (channel-last,
    rounded), on the pixels' device; the float math runs ``chunk`` images at a time so a
    long bf16 video needs little extra memory."""
    lead = pixels.shape[:-3]
    flat = pixels.reshape(-1, *pixels.shape[-3:])
    out = torch.empty(flat.shape[0], flat.shape[2], flat.shape[3], 3, dtype=torch.uint8, device=pixels.device)
    for start in range(0, flat.shape[0], chunk):
        # Out of place first: ``.to`` returns float32 input itself, which must not change.
        part = (flat[start : start + chunk].to(torch.float32) * 255.0).round_().clamp_(0.0, 255.0)
        out[start : start + chunk] = part.permute(0, 2, 3, 1)
    return out.view(*lead, flat.shape[2], flat.shape[3], 3)


def device_stage(output: DiffusionOutput) -> DiffusionOutput:
    """The worker-side stage: ``image`` / ``frames`` to uint8 channel-last on the device
    (4x fewer bytes to copy than float32, 2x fewer than bfloat16), and ``digest`` taken
    again over the uint8 pixels.  A pixel tensor that is already uint8 is left as is."""
    out = dict(output.output)
    for key in ("image", "frames"):
        px = out.get(key)
        if isinstance(px, Tensor) and px.is_floating_point():
            out[key] = pixels_to_uint8(px)
            if "digest" in out:
                out["digest"] = image_digest(out[key])
    return attrs.evolve(output, output=out)


class HostResult(TypedDict, total=False):
    """What ``host_stage`` returns: ``image`` for an image, ``frames`` for a video."""

    image: Image.Image
    frames: npt.NDArray[np.uint8]
    digest: int
    info: dict[str, object]


def host_stage(output: DiffusionOutput) -> HostResult:
    """The engine-side stage: the user's result, owning its memory.

    ``{"image": PIL.Image.Image}`` (RGB) for an image, ``{"frames": numpy.ndarray}``
    (uint8 ``[T, H, W, 3]``) for a video, plus ``info`` (a dict) and, when asked for,
    ``digest`` (an int: ``image_digest`` of the uint8 channel-last pixels).  Takes the
    output with or without the device stage applied (float pixels are converted here)."""
    import numpy as np
    from PIL import Image

    src: Mapping[str, Any] = output.output
    result: HostResult = {}
    for key in ("image", "frames"):
        px = src.get(key)
        if px is None:
            continue
        t = torch.as_tensor(px).cpu()
        if t.is_floating_point():
            t = pixels_to_uint8(t)
            if "digest" in src:
                result["digest"] = host_digest(t)
        # Both copy: the input views a shared-memory segment released after this returns.
        if key == "image":
            result["image"] = Image.fromarray(t.numpy())
        else:
            result["frames"] = np.array(t.numpy(), copy=True)
    if "digest" in src and "digest" not in result:
        result["digest"] = int(torch.as_tensor(src["digest"]))
    if "info" in src:
        result["info"] = dict(src["info"])
    return result


POSTPROCESS = register_postprocess(PostProcess(PIPELINE, host=host_stage, device=device_stage, host_reads_only=True))

#: The seed's split of the work, the "before" of ``omni-async demo``: the post-process
#: runs on the worker's main thread after the forward, on the host.
SEED_PIPELINE = "dit-seed"


def seed_stage(output: DiffusionOutput) -> DiffusionOutput:
    """The seed's worker-side post-process, for the synchronous output path in step mode
    (``WorkerOptions(output_path="sync")``, which runs a device stage on the worker's main
    thread before its ``.cpu()`` and fresh segment): the float pixels are brought to the
    host as the forward left them (``.cpu()``: it waits for the forward), then turned into
    uint8 channel-last there (``pixels_to_uint8`` on the CPU: the same arithmetic as
    ``device_stage``, so the same bytes), and ``digest`` is taken again over them.  The
    seed ran its pipeline's denormalize-to-PIL here; the PIL image is the engine's
    ``host_stage`` in both paths (a copy of the uint8 pixels)."""
    out = dict(output.output)
    for key in ("image", "frames"):
        px = out.get(key)
        if isinstance(px, Tensor) and px.is_floating_point():
            out[key] = pixels_to_uint8(px.cpu())
            if "digest" in out:
                out["digest"] = host_digest(out[key])
    return attrs.evolve(output, output=out)


SEED_POSTPROCESS = register_postprocess(
    PostProcess(SEED_PIPELINE, host=host_stage, device=seed_stage, host_reads_only=True)
)
