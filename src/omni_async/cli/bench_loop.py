"""``omni-async bench``'s event-loop line: the engine's loop stall while encodes run (issue 31).

``AsyncDiffusionEngine`` over ``SyntheticForwardWorker`` in a worker process, its
``"bench-u8"`` device stage making uint8 pictures (``"picture": True``: smooth waves and
a little noise, as a decoder makes); ``encodes`` requests at once, each asking for
``fmt`` (PNG by default), so the engine copies each picture out of shared memory and its
encoder processes encode it.  A ``LoopStallMonitor`` runs on the engine's loop the while
(after one warm-up encode, which starts the encoder processes).  Beside it, what one
encode of the same pixels costs run on the loop (``encode_on_loop_ms``): what the stall
would be if an encode ran there.  Target: the max stall under 20 ms.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

import numpy as np

from omni_async.core.config import Deadlines
from omni_async.core.encoding import Encoding
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.encoders import EncodedOutput, encode_image
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.loop_stall import LoopStallMonitor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.synthetic import synthetic_picture

__all__ = ["TARGET_MS", "loop_stall_line", "run_loop_stall"]

#: The issue's target for the loop's longest stall while encodes run.
TARGET_MS: Final = 20.0
_SPEC: Final = "omni_async.models.synthetic:SyntheticForwardWorker"


def picture_pixels(side: int, seed: int = 0) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The uint8 pixels the worker's ``"bench-u8"`` stage makes of a ``side`` x ``side`` picture."""
    import torch

    x = synthetic_picture((side, side, 3), torch.float32, seed, "cpu")
    return ((x * 127.5 + 127.5).clamp(0, 255)).to(torch.uint8).numpy()


async def _measure(device: str, encodes: int, side: int, fmt: str, encode_workers: int | None) -> dict[str, Any]:
    spec = WorkerSpec(_SPEC, {"device": device}, postprocess="bench-u8")
    ex = MultiprocDiffusionExecutor(
        spec,
        deadlines=Deadlines(compute_timeout=300, output_timeout=300, rpc_timeout=300),
        options=WorkerOptions(device=device),
    )
    params = {"forward_ms": 0.0, "shape": [side, side, 3], "dtype": "float32", "picture": True}
    async with AsyncDiffusionEngine(ex, encode_workers=encode_workers) as engine:
        await engine.generate(DiffusionRequest("loop-warm", params, format=fmt))
        monitor = LoopStallMonitor()
        t0 = time.perf_counter()
        async with monitor:
            results = await asyncio.gather(
                *(
                    engine.generate(DiffusionRequest(f"loop-{i}", {**params, "seed": i}, format=fmt))
                    for i in range(encodes)
                )
            )
        wall = time.perf_counter() - t0
        stalls = monitor.stalls()
        workers = len(engine._post.encoders.pids())
    assert all(isinstance(r.output, EncodedOutput) for r in results)
    pixels = picture_pixels(side)
    t1 = time.perf_counter()
    encode_image(pixels, Encoding(fmt))
    on_loop = time.perf_counter() - t1
    return {
        "encodes": encodes,
        "format": fmt,
        "size": f"{side}x{side}",
        "encode_workers": workers,
        "wall_s": wall,
        "stall_ms_max": stalls.max_ms,
        "stall_max_cpu_ms": stalls.max_cpu_ms,
        "stall_ms_p99": stalls.p99_ms,
        "stall_ms_p50": stalls.p50_ms,
        "samples": stalls.samples,
        "period_ms": stalls.period_ms,
        "encode_on_loop_ms": 1e3 * on_loop,
        "target_ms": TARGET_MS,
    }


def run_loop_stall(
    device: str, encodes: int = 16, side: int = 1024, fmt: str = "png", encode_workers: int | None = None
) -> dict[str, Any]:
    """The engine's loop stall while ``encodes`` ``fmt`` encodes of ``side`` x ``side`` pictures run."""
    return asyncio.run(_measure(device, encodes, side, fmt, encode_workers))


def loop_stall_line(row: dict[str, Any]) -> str:
    """The bench's lines (each within 100 columns)."""
    return (
        f"event loop while {row['encodes']} {row['format']} encodes ({row['size']}) ran: max stall "
        f"{row['stall_ms_max']:.1f} ms, p99 {row['stall_ms_p99']:.1f} ms (target < {row['target_ms']:g} ms)\n"
        f"  ({row['stall_max_cpu_ms']:.1f} ms of the longest spent running on the loop; one encode run on it "
        f"instead: {row['encode_on_loop_ms']:.0f} ms)"
    )
