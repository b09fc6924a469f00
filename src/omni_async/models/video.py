"""``FrameVideoWorker``: a stand-in for a video pipeline whose decoder makes the frames in
chunks, for the encoded-video bench and tests (``bench/encoded_video.py``).

A forward is a wait of ``forward_ms`` (the denoising, then the decoding): the last
``decode_share`` of it makes the ``frames`` frames, ``chunk_frames`` at a time, uint8
``[t, H, W, 3]`` on the worker's device (moving waves and a little noise, as a decoder
makes, so H.264 costs what it does on a generated video).  When the call streams
(``generate_video``) each chunk is shipped as a part of the final video as it is made
(``emit_frames``) and the final output carries none; otherwise the final output carries
them all (``{"frames": [T, H, W, 3], "fps": fps}``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from omni_async.core.errors import InvalidRequest
from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput, DiffusionRequest
from omni_async.worker.cancel import raise_if_cancelled
from omni_async.worker.stream import emit_frames, streaming_requested

__all__ = ["FrameVideoWorker", "video_frames"]

_KNOWN = {"frames", "height", "width", "chunk_frames", "forward_ms", "decode_share", "fps", "seed"}


def video_frames(start: int, count: int, height: int, width: int, seed: int, device: torch.device) -> torch.Tensor:
    """Frames ``start .. start + count`` of the synthetic video ``seed``: uint8 ``[count, H, W, 3]``."""
    t = torch.arange(start, start + count, device=device, dtype=torch.float32)[:, None, None]
    y = torch.linspace(0, 6 * math.pi, height, device=device)[None, :, None]
    x = torch.linspace(0, 10 * math.pi, width, device=device)[None, None, :]
    phase = 0.3 * seed
    channels = [torch.sin(x * (1 + 0.2 * c) + 0.5 * torch.sin(y + 0.1 * t) + 0.15 * t + phase + c) for c in range(3)]
    video = torch.stack(channels, dim=-1) * 100 + 128
    gen = torch.Generator(device=device).manual_seed(seed * 100_003 + start)
    video += torch.randn(video.shape, generator=gen, device=device) * 4
    return video.clamp(0, 255).to(torch.uint8)


class FrameVideoWorker:
    """See the module docstring; ``device``: where the frames are made."""

    def __init__(self, *, device: str = "cpu") -> None:
        self.device = torch.device(device)

    @staticmethod
    def validate_request(request: DiffusionRequest) -> None:
        p = request.params
        unknown = sorted(set(p) - _KNOWN)
        if unknown:
            raise InvalidRequest(request.request_id, unknown[0], f"is not a parameter; known: {sorted(_KNOWN)}")
        for key in ("frames", "height", "width", "chunk_frames"):
            v = p.get(key, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequest(request.request_id, key, f"must be a positive int, got {v!r}")
        share = p.get("decode_share", 0.25)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise InvalidRequest(request.request_id, "decode_share", f"must be a number in [0, 1], got {share!r}")

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        p = request.params
        frames, height, width = int(p.get("frames", 16)), int(p.get("height", 64)), int(p.get("width", 64))
        chunk = int(p.get("chunk_frames", 8))
        forward_s = float(p.get("forward_ms", 0)) / 1e3
        share = float(p.get("decode_share", 0.25))
        fps = float(p.get("fps", 16))
        seed = int(p.get("seed", 0))
        t0 = time.perf_counter()
        start_decode = t0 + forward_s * (1 - share)
        while time.perf_counter() < start_decode:  # the denoising: checked for cancellation as it goes
            raise_if_cancelled()
            time.sleep(min(0.01, max(0.0, start_decode - time.perf_counter())))
        parts = streaming_requested(request.request_id)
        kept: list[torch.Tensor] = []
        chunks = math.ceil(frames / chunk)
        for i in range(chunks):
            raise_if_cancelled()
            done_at = start_decode + forward_s * share * (i + 1) / chunks
            made = video_frames(i * chunk, min(chunk, frames - i * chunk), height, width, seed, self.device)
            delay = done_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if parts and emit_frames(request.request_id, made, fps=fps) is not None:
                continue
            kept.append(made)
        out: dict[str, object] = {"fps": fps}
        if kept:
            out["frames"] = torch.cat(kept)
        return DiffusionOutput(request.request_id, out)

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self.execute_model(r) for r in requests))
