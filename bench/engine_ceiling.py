"""The engine's own ceiling: requests/s and latency through AsyncDiffusionEngine with a
no-op model, so what is measured is the engine, the executor and the channel alone.

A worker process (``MultiprocDiffusionExecutor``) runs ``SyntheticForwardWorker`` with a
forward of ``--forward-ms`` (0: none) and a tiny output; ``--requests`` concurrent
``generate`` calls (``--concurrency`` in flight at once) go through the engine.  Prints
requests/s, p50 and p99 of the end-to-end latency, and writes them as JSON (``--out``).

Usage:  PYTHONPATH=src python3 bench/engine_ceiling.py --requests 2000 --out bench/results/engine_ceiling.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from typing import Any

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

SPEC = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker", {"device": "cpu"})


async def run(args: argparse.Namespace) -> dict[str, Any]:
    executor = MultiprocDiffusionExecutor(SPEC, deadlines=Deadlines(compute_timeout=60, output_timeout=60))
    params = {"forward_ms": args.forward_ms, "shape": [4], "dtype": "float32"}
    try:
        async with AsyncDiffusionEngine(executor, max_running=args.max_running) as engine:
            for i in range(args.warmup):
                await engine.generate(DiffusionRequest(f"warm-{i}", dict(params)))
            latencies: list[float] = []
            gate = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                async with gate:
                    t0 = time.perf_counter()
                    await engine.generate(DiffusionRequest(f"r-{i}", dict(params)))
                    latencies.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(args.requests)))
            wall = time.perf_counter() - t0
            counts = engine.metrics().requests
    finally:
        executor.shutdown()
    latencies.sort()
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_running": args.max_running,
        "forward_ms": args.forward_ms,
        "wall_s": wall,
        "requests_per_s": args.requests / wall,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "outcomes": counts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64, help="generate calls in flight at once")
    ap.add_argument("--max-running", type=int, default=2)
    ap.add_argument("--forward-ms", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=1, help="runs, each with a fresh executor")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    runs = [asyncio.run(run(args)) for _ in range(args.repeat)]
    for r in runs:
        print(
            f"{r['requests']} requests, {r['concurrency']} in flight, forward {r['forward_ms']} ms: "
            f"{r['requests_per_s']:.0f} requests/s, p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"machine": f"{platform.node()} {os.cpu_count()} cpus", "python": platform.python_version(), "runs": runs},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
