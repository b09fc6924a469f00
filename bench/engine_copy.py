"""What the engine's owned copy costs, against the worker's copy into shared memory.

Without a host stage the engine returns owned copies of the output's tensors (so a
result never holds the executor's budget of held outputs); this measures that copy
(``timings.postprocess``: the copy and the release) next to the worker's pack
(``timings.pack``) and the forward, per request, through the real stack:
``AsyncDiffusionEngine`` over ``MultiprocDiffusionExecutor`` with the reference model.

    PYTHONPATH=src python3 bench/engine_copy.py --size-mb 8 64 --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

WIDTH = 128  # float32 rows of 512 bytes


async def measure(size_mb: float, requests: int, device: str) -> dict[str, float]:
    rows = int(size_mb * (1 << 20)) // (WIDTH * 4)
    spec = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": WIDTH, "steps": 2, "device": device})
    engine = AsyncDiffusionEngine.from_factory(
        lambda: MultiprocDiffusionExecutor(spec, deadlines=Deadlines(compute_timeout=600, output_timeout=600))
    )
    async with engine:
        await engine.generate(DiffusionRequest("warm-up", {"height": rows}))
        results = [
            await engine.generate(DiffusionRequest(f"r{i}", {"height": rows, "seed": i})) for i in range(requests)
        ]
    nbytes = results[0].metrics["pack_shm_bytes"]
    med = {
        stage: statistics.median(getattr(r.timings, stage) or 0.0 for r in results)
        for stage in ("forward", "pack", "transfer_wait", "postprocess", "total")
    }
    return {
        "size_mb": nbytes / (1 << 20),
        **{f"{k}_ms": v * 1e3 for k, v in med.items()},
        "pack_gb_s": nbytes / med["pack"] / 1e9 if med["pack"] else 0.0,
        "engine_copy_gb_s": nbytes / med["postprocess"] / 1e9 if med["postprocess"] else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, nargs="+", default=[8.0, 64.0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for size in args.size_mb:
        print(json.dumps(asyncio.run(measure(size, args.requests, args.device))))


if __name__ == "__main__":
    main()
