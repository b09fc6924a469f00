"""Encoded images behind a forward (issue 20): the rate of encoded bytes in the client's
hands against the forward-bound rate, per way of serving them, in one run.

A ``SyntheticForwardWorker`` makes a 1024x1024 RGB picture per request (``"picture":
True``: smooth waves and a little noise, as a decoder makes, so PNG costs what it does
on a generated image) behind a forward of ``--forward-ms``; the ``"bench-u8"`` device
stage turns it into uint8 pixels.  Each mode serves ``--requests`` requests through
``AsyncDiffusionEngine`` over a worker process, ``--concurrency`` generate calls in flight:

* ``sync-png``: the seed's path (``async_output=False``: the worker copies each output on
  its main thread before it answers), the PNG made by the engine's encoder processes;
* ``omni-png``: the library's path, PNG by the engine's encoder processes;
* ``omni-jpeg``: the library's path, JPEG on the worker's GPU (nvJPEG: only the bytes
  cross PCIe; on a CPU worker the encoder processes make it, and the row says so).

Per mode: requests/s over the completions after the first ``--concurrency`` (the
pipeline's fill), its ratio to the forward-bound rate (1 / the shortest of: the forward
alone, in a sustained loop on the same worker right before and right after the mode, and
the device's median forward while serving, from the worker's stamps), p50/p99 latency,
bytes per image, where the encoding ran.  Prints a table and writes JSON (``--json``).  On an H200:

    PYTHONPATH=src python3 bench/encoded_images.py --device cuda --json encoded_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import time
from typing import Any

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.encoders import EncodedOutput
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec

#: mode -> (the engine's async_output, the requests' format)
MODES: dict[str, tuple[bool, str]] = {
    "sync-png": (False, "png"),
    "omni-png": (True, "png"),
    "omni-jpeg": (True, "jpeg"),
}


def steady_rate(done: list[float], skip: int) -> float:
    """Completions per second from the ``skip``-th completion to the last."""
    done = sorted(done)
    if len(done) - skip < 2:
        return len(done) / (done[-1] - done[0]) if len(done) > 1 and done[-1] > done[0] else math.nan
    return (len(done) - 1 - skip) / (done[-1] - done[skip])


async def serve(engine: AsyncDiffusionEngine, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    fmt = MODES[mode][1]
    params = {"forward_ms": args.forward_ms, "shape": [args.size, args.size, 3], "dtype": "bfloat16",
              "picture": True}  # fmt: skip
    # The warm-up runs its requests together: every encoder process then has had a job
    # (each imports torch when it starts) before the measured requests come.
    await asyncio.gather(*(
        engine.generate(DiffusionRequest(f"{mode}-warm-{i}", dict(params, seed=i), format=fmt,
                                         quality=args.png_level if fmt == "png" else None))
        for i in range(args.warmup)
    ))  # fmt: skip
    gate = asyncio.Semaphore(args.concurrency)
    done: list[float] = []
    latencies: list[float] = []
    forwards: list[float] = []  # the device's forward of each request, from the worker's stamps
    sizes: list[int] = []
    where: set[str] = set()

    async def one(i: int) -> None:
        async with gate:
            t0 = time.perf_counter()
            request = DiffusionRequest(f"{mode}-{i}", dict(params, seed=i), format=fmt,
                                       quality=args.png_level if fmt == "png" else None)  # fmt: skip
            result = await engine.generate(request)
            t1 = time.perf_counter()
            out = result.output
            assert isinstance(out, EncodedOutput), f"{mode}: a {type(out).__name__}, not an EncodedOutput"
            assert out.media_type == f"image/{fmt}" and (out.width, out.height) == (args.size, args.size)
            done.append(t1)
            latencies.append(t1 - t0)
            t = result.timings
            if t.forward_started_at is not None and t.forward_ended_at is not None:
                forwards.append(t.forward_ended_at - t.forward_started_at)
            sizes.append(len(out.data))
            where.add(out.encoded_on + (f" ({out.note})" if out.note else ""))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - t0
    latencies.sort()
    return {
        "mode": mode,
        "format": fmt,
        "requests": args.requests,
        "wall_s": wall,
        "requests_per_s": steady_rate(done, args.concurrency),
        "requests_per_wall_s": args.requests / wall,  # the fill and the drain included
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "bytes_per_image": statistics.median(sizes),
        "forward_in_serving_ms": 1e3 * statistics.median(forwards) if forwards else math.nan,
        "encoded_on": sorted(where),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker", {"device": args.device},
                      postprocess="bench-u8")  # fmt: skip
    executor = MultiprocDiffusionExecutor(
        spec, deadlines=Deadlines(compute_timeout=120, output_timeout=120), options=WorkerOptions(device=args.device)
    )
    rows = []
    try:
        n = max(5, math.ceil(1000.0 * args.alone_s / args.forward_ms))
        alone_args = (n, args.forward_ms, [args.size, args.size, 3], "bfloat16", True)

        def forward_alone() -> float:
            return float(statistics.median(executor.collective_rpc("forward_alone", alone_args)[0]))

        for mode in args.modes:
            before = forward_alone()
            async with AsyncDiffusionEngine(executor, pipeline="bench-u8", async_output=MODES[mode][0],
                                            encode_workers=args.encode_workers) as engine:  # fmt: skip
                row = await serve(engine, mode, args)
            after = forward_alone()
            # The forward-bound rate from the shortest of the three forwards (alone before and
            # after the mode, and the device's own in serving): the strictest ideal.
            forward_s = min(before, after, row["forward_in_serving_ms"] / 1e3)
            row["forward_alone_ms"] = [1e3 * before, 1e3 * after]
            row["forward_bound_per_s"] = 1.0 / forward_s
            row["of_forward_bound"] = row["requests_per_s"] * forward_s
            rows.append(row)
            print(
                f"{mode:>10}: {row['requests_per_s']:6.1f} images/s = {row['of_forward_bound']:.3f} of the forward-bound "
                f"{row['forward_bound_per_s']:.1f}/s (forward alone {1e3 * before:.1f} / {1e3 * after:.1f} ms before / "
                f"after, {row['forward_in_serving_ms']:.1f} ms in serving); over the whole run "
                f"{row['requests_per_wall_s']:.1f}/s; p50 "
                f"{row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms; {row['bytes_per_image'] / 1e6:.2f} MB/image; "
                f"encoded on {', '.join(row['encoded_on'])}",
                flush=True,
            )
    finally:
        executor.shutdown()
    return {"machine": f"{platform.node()} {os.cpu_count()} cpus", "python": platform.python_version(),
            "config": {k: v for k, v in vars(args).items() if k != "json"}, "runs": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", type=lambda t: [m for m in t.split(",") if m], default=list(MODES),
                    help=f"comma-separated, of {', '.join(MODES)}")  # fmt: skip
    ap.add_argument("--forward-ms", type=float, default=30.0)
    ap.add_argument("--size", type=int, default=1024, help="the square image's side")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32, help="generate calls in flight")
    ap.add_argument("--warmup", type=int, default=32, help="requests served together before the measured ones")
    ap.add_argument("--png-level", type=int, default=1, help="PNG's zlib level (1: the fast one servers use)")
    ap.add_argument(
        "--encode-workers", type=int, default=None, help="the engine's encoder processes (default: one per core)"
    )
    ap.add_argument("--alone-s", type=float, default=1.0, help="seconds of forwards alone for the forward-bound rate")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    report = asyncio.run(run(args))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
