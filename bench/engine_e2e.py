"""The engine end to end: time per request through AsyncDiffusionEngine, and a timeline.

A worker process runs ``SyntheticVideoWorker`` (a device forward of set length, one
large output per request) behind ``MultiprocDiffusionExecutor``; ``AsyncDiffusionEngine``
gets ``--requests`` concurrent ``generate`` calls.  For each configuration it reports
the steady-state time per request next to the forward alone, and the median of each
``RequestTimings`` stage:

* ``max_running`` 1 against 2: with 2 the next request already waits on the worker
  when a forward ends (the COMPUTE_DONE round trip no longer idles the device);
* the result as an owned copy (no host stage) against a host stage that reduces the
  output to a small value (what a pipeline that encodes its output costs the engine
  besides its own work).

It also prints one run's timeline: per request, when it was sent, when its forward
must have started on the worker (estimated: its COMPUTE_DONE minus the forward alone),
when COMPUTE_DONE came, when the output was ready and when the result was; and counts
the requests that were already on the worker when the forward before them ended (sent
before that COMPUTE_DONE): the worker started them at once, before the previous output
was ready (COMPUTE_DONE precedes OUTPUT_READY).

Usage (GPU):  python bench/engine_e2e.py --device cuda --out $OUT/engine_e2e.json
Usage (CPU):  python bench/engine_e2e.py --device cpu --output-mb 16 --matmuls 4 --dim 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.tiny import SyntheticVideoWorker
from omni_async.worker.postprocess import PostProcess, register_postprocess


def _checksum(out: DiffusionOutput) -> float:
    video: torch.Tensor = out.output["video"]
    return float(video[:: 1 << 16].float().sum())  # reads the output, owns nothing of it


register_postprocess(PostProcess("bench-checksum", host=_checksum))


def forward_alone(args: argparse.Namespace) -> float:
    w = SyntheticVideoWorker(device=args.device, output_mb=args.output_mb, matmuls=args.matmuls, dim=args.dim)
    times = []
    for i in range(args.warmup + 5):
        t0 = time.perf_counter()
        w.execute_model(DiffusionRequest(f"f{i}", {}))
        w.synchronize()
        times.append(time.perf_counter() - t0)
    del w
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return statistics.median(times[args.warmup :])


async def run_engine(args: argparse.Namespace, *, max_running: int, pipeline: str | None) -> dict[str, Any]:
    spec = WorkerSpec(
        "omni_async.models.tiny:SyntheticVideoWorker",
        {"device": args.device, "output_mb": args.output_mb, "matmuls": args.matmuls, "dim": args.dim},
    )
    engine = AsyncDiffusionEngine.from_factory(
        lambda: MultiprocDiffusionExecutor(
            spec,
            deadlines=Deadlines(compute_timeout=600, output_timeout=600),
            options=WorkerOptions(device=args.device),
            max_held_outputs=args.max_held_outputs,
        ),
        pipeline=pipeline,
        max_running=max_running,
    )
    async with engine:
        await asyncio.gather(*(engine.generate(DiffusionRequest(f"w{i}", {"seed": i})) for i in range(args.warmup)))
        t0 = time.monotonic()
        results: list[GenerationResult] = await asyncio.gather(
            *(engine.generate(DiffusionRequest(f"r{i}", {"seed": i})) for i in range(args.requests))
        )
        wall = time.monotonic() - t0
        m = engine.metrics()
    # Steady state: from the first COMPUTE_DONE to the last result, over the requests between.
    first_done = min(r.timings.compute_done_at for r in results)
    last = max(r.timings.finished_at for r in results)
    stages = {
        stage: statistics.median(getattr(r.timings, stage) or 0.0 for r in results)
        for stage in ("queued", "forward", "pack", "transfer_wait", "postprocess", "total")
    }
    return {
        "max_running": max_running,
        "pipeline": pipeline,
        "ms_per_request": 1e3 * (last - first_done) / (len(results) - 1),
        "wall_s": wall,
        "median_ms": {k: 1e3 * v for k, v in stages.items()},
        "budget_waits": m.budget_waits,
        "in_flight_limit": m.in_flight_limit,
        "pool_waits": getattr(m.executor, "pool_waits", None),
        "results": results,
    }


def timeline(results: list[GenerationResult], fwd_s: float) -> tuple[list[str], int]:
    rows = sorted(results, key=lambda r: r.timings.compute_done_at)
    t0 = rows[0].timings.submitted_at
    lines = [
        f"{'request':>8} {'sent':>8} {'est. start':>10} {'COMPUTE_DONE':>12} {'output ready':>12} {'result':>8}"
        f"  {'queued':>7} {'forward':>7} {'pack':>6} {'xfer wait':>9} {'post':>6} {'total':>7}  (ms)"
    ]
    overlaps = 0
    for i, r in enumerate(rows):
        t = r.timings
        start = t.compute_done_at - fwd_s
        lines.append(
            f"{r.request_id:>8} {1e3 * (t.submitted_at - t0):8.1f} {1e3 * (start - t0):10.1f} "
            f"{1e3 * (t.compute_done_at - t0):12.1f} {1e3 * (t.output_ready_at - t0):12.1f} "
            f"{1e3 * (t.finished_at - t0):8.1f}  {1e3 * t.queued:7.1f} {1e3 * t.forward:7.1f} "
            f"{1e3 * (t.pack or 0.0):6.1f} {1e3 * t.transfer_wait:9.1f} {1e3 * t.postprocess:6.1f} {1e3 * t.total:7.1f}"
        )
        if i + 1 < len(rows) and rows[i + 1].timings.submitted_at < t.compute_done_at:
            overlaps += 1  # the next request waited on the worker when this forward ended
    return lines, overlaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--output-mb", type=float, default=448.0)
    ap.add_argument("--matmuls", type=int, default=32)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-held-outputs", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    fwd = forward_alone(args)
    print(f"forward alone: {fwd * 1e3:.1f} ms ({args.device}, {args.output_mb:g} MB outputs)", flush=True)
    runs = []
    for max_running, pipeline in ((1, "bench-checksum"), (2, "bench-checksum"), (2, None)):
        got = asyncio.run(run_engine(args, max_running=max_running, pipeline=pipeline))
        print(
            f"max_running={max_running} pipeline={pipeline}: {got['ms_per_request']:.1f} ms/request "
            f"({fwd * 1e3 / got['ms_per_request']:.2f} of ideal), medians "
            + ", ".join(f"{k} {v:.1f}" for k, v in got["median_ms"].items())
            + f"; budget_waits {got['budget_waits']}, pool_waits {got['pool_waits']}",
            flush=True,
        )
        runs.append(got)
    lines, overlaps = timeline(runs[1]["results"][:8], fwd)
    print("\ntimeline (max_running=2, host stage), first 8 requests:")
    print("\n".join(lines))
    pairs = min(8, len(runs[1]["results"])) - 1
    print(f"requests already on the worker when the forward before them ended: {overlaps} of {pairs}")
    if args.out:
        doc = {
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "args": vars(args),
            "forward_alone_ms": fwd * 1e3,
            "runs": [{k: v for k, v in r.items() if k != "results"} for r in runs],
            "timeline": lines,
            "overlaps": overlaps,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
