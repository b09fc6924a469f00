"""Encoded video behind a forward (issue 31): MP4s in the caller's hands against the
forward-bound rate, and how long after its forward ends a video's last byte comes, per
way of serving them, in one run.

A ``FrameVideoWorker`` (``omni_async.models.video``) makes one video per request: a
forward of ``--forward-ms`` (a wait), whose last ``--decode-share`` decodes the frames,
``--chunk-frames`` at a time, uint8 on ``--device`` (moving waves and a little noise, so
H.264 costs what it does on a generated video).  Each mode serves ``--requests``
requests through ``AsyncDiffusionEngine`` over a worker process, ``--concurrency`` in flight:

* ``sync-mp4``: the seed's path (``async_output=False``: the worker copies the whole
  output on its main thread before it answers), then the whole video encoded;
* ``omni-mp4``: the library's path, the whole video encoded once the output is in shared
  memory (``generate(format="mp4")``: the encoder process reads the segment);
* ``omni-mp4-parts``: the library's path, the video encoded while it decodes
  (``generate_video(fragmented=True)``: each chunk of frames encoded as it arrives; the
  fragmented MP4's bytes reach the caller as they are made).

Per mode: requests/s over the completions after the first ``--concurrency`` (the fill),
``forward_bound_ratio`` (that rate over the forward-bound rate, 1 / the forward: the
shorter of ``--forward-ms`` and the device's median forward while serving, from the
worker's stamps), and ``tail_ms`` (from the forward's end, the worker's stamp, to the
MP4's last byte in the caller's hands: p50 and p90, and p50 over the forward).
Presets: ``--preset 480p`` (81x480x832, a 2 s forward), ``--preset 720p`` (121x720x1280,
4 s), ``--tiny`` (16x64x96, 0.2 s, on the CPU: the CI's smoke run).  Prints a table and
writes JSON (``--json``) with the command.  On an H200:

    PYTHONPATH=src python3 bench/encoded_video.py --device cuda --preset 480p \\
        --json bench/results/encoded_video_h200_480p.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.encoders import EncodedOutput, VideoBytes
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec

#: mode -> (the engine's async_output, encoded in parts while it decodes)
MODES: dict[str, tuple[bool, bool]] = {
    "sync-mp4": (False, False),
    "omni-mp4": (True, False),
    "omni-mp4-parts": (True, True),
}
#: preset -> (frames, height, width, forward_ms, requests)
PRESETS: dict[str, tuple[int, int, int, float, int]] = {
    "480p": (81, 480, 832, 2000.0, 10),
    "720p": (121, 720, 1280, 4000.0, 8),
    "tiny": (16, 64, 96, 200.0, 3),
}


def steady_rate(done: list[float], skip: int) -> float:
    """Completions per second from the ``skip``-th completion to the last."""
    done = sorted(done)
    if len(done) - skip < 2:
        return (len(done) - 1) / (done[-1] - done[0]) if len(done) > 1 and done[-1] > done[0] else math.nan
    return (len(done) - 1 - skip) / (done[-1] - done[skip])


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan


async def one_video(
    engine: AsyncDiffusionEngine, request: DiffusionRequest, parts: bool
) -> tuple[GenerationResult, float, int]:
    """The request's result, when its MP4's last byte was in hand (``time.monotonic()``),
    and how many pieces it came in."""
    if not parts:
        whole = await engine.generate(request)
        return whole, time.monotonic(), 1
    last, pieces = 0.0, 0
    result: GenerationResult | None = None
    async for item in engine.generate_video(request, fragmented=True):
        if isinstance(item, VideoBytes):
            last, pieces = time.monotonic(), pieces + 1
        else:
            result = item
    assert result is not None
    return result, max(last, result.timings.finished_at), pieces


async def serve(engine: AsyncDiffusionEngine, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    parts = MODES[mode][1]
    params = {"frames": args.frames, "height": args.height, "width": args.width, "chunk_frames": args.chunk_frames,
              "forward_ms": args.forward_ms, "decode_share": args.decode_share}  # fmt: skip
    await asyncio.gather(*(
        one_video(engine, DiffusionRequest(f"{mode}-warm-{i}", dict(params, seed=i), format="mp4"), parts)
        for i in range(args.warmup)
    ))  # fmt: skip
    gate = asyncio.Semaphore(args.concurrency)
    done: list[float] = []
    tails: list[float] = []
    latencies: list[float] = []
    forwards: list[float] = []
    sizes: list[int] = []
    pieces: list[int] = []

    async def one(i: int) -> None:
        async with gate:
            t0 = time.monotonic()
            request = DiffusionRequest(f"{mode}-{i}", dict(params, seed=i), format="mp4")
            result, last_byte, n = await one_video(engine, request, parts)
            out = result.output
            assert isinstance(out, EncodedOutput) and out.frames == args.frames, out
            done.append(last_byte)
            latencies.append(last_byte - t0)
            t = result.timings
            if t.forward_started_at is not None and t.forward_ended_at is not None:
                forwards.append(t.forward_ended_at - t.forward_started_at)
                tails.append(last_byte - t.forward_ended_at)
            sizes.append(len(out.data))
            pieces.append(n)

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.monotonic() - t0
    forward_s = min(args.forward_ms / 1e3, statistics.median(forwards)) if forwards else args.forward_ms / 1e3
    rate = steady_rate(done, args.concurrency)
    return {
        "mode": mode,
        "format": "mp4",
        "container": "fragmented" if parts else "plain",
        "video": [args.frames, args.height, args.width, 3],
        "requests": args.requests,
        "wall_s": wall,
        "requests_per_s": rate,
        "forward_bound_per_s": 1.0 / forward_s,
        "forward_bound_ratio": rate * forward_s,
        "forward_in_serving_ms": 1e3 * statistics.median(forwards) if forwards else math.nan,
        "tail_ms_p50": 1e3 * pct(tails, 0.5),
        "tail_ms_p90": 1e3 * pct(tails, 0.9),
        "tail_over_forward_p50": pct(tails, 0.5) / forward_s,
        "latency_ms_p50": 1e3 * pct(latencies, 0.5),
        "bytes_per_video": statistics.median(sizes),
        "pieces_per_video": statistics.median(pieces),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = WorkerSpec("omni_async.models.video:FrameVideoWorker", {"device": args.device})
    executor = MultiprocDiffusionExecutor(
        spec, deadlines=Deadlines(compute_timeout=600, output_timeout=600), options=WorkerOptions(device=args.device)
    )
    rows = []
    try:
        for mode in args.modes:
            async with AsyncDiffusionEngine(executor, async_output=MODES[mode][0],
                                            encode_workers=args.encode_workers) as engine:  # fmt: skip
                row = await serve(engine, mode, args)
            rows.append(row)
            print(
                f"{mode:>15}: {row['requests_per_s']:6.3f} videos/s = {row['forward_bound_ratio']:.3f} of the "
                f"forward-bound {row['forward_bound_per_s']:.3f}/s; last byte {row['tail_ms_p50']:.0f} ms "
                f"(p90 {row['tail_ms_p90']:.0f}) after the forward = {row['tail_over_forward_p50']:.2f} x the forward; "
                f"{row['bytes_per_video'] / 1e6:.2f} MB/video in {row['pieces_per_video']:.0f} piece(s)",
                flush=True,
            )
    finally:
        executor.shutdown()
    print()
    print(f"{'mode':>15} {'req/s':>8} {'ratio':>6} {'tail p50 ms':>12} {'tail/fwd':>9} {'MB':>6}")
    for r in rows:
        print(f"{r['mode']:>15} {r['requests_per_s']:8.3f} {r['forward_bound_ratio']:6.3f} {r['tail_ms_p50']:12.0f} "
              f"{r['tail_over_forward_p50']:9.2f} {r['bytes_per_video'] / 1e6:6.2f}")  # fmt: skip
    return {"command": " ".join(["python3", *sys.argv]), "machine": f"{platform.node()} {os.cpu_count()} cpus",
            "python": platform.python_version(), "config": {k: v for k, v in vars(args).items() if k != "json"},
            "runs": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="480p")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset on the CPU (the CI's smoke run)")
    ap.add_argument("--modes", type=lambda t: [m for m in t.split(",") if m], default=list(MODES),
                    help=f"comma-separated, of {', '.join(MODES)}")  # fmt: skip
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--forward-ms", type=float, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--chunk-frames", type=int, default=8, help="frames per decoded chunk (a part)")
    ap.add_argument("--decode-share", type=float, default=0.25, help="the forward's share that decodes the frames")
    ap.add_argument("--concurrency", type=int, default=3, help="generate calls in flight")
    ap.add_argument("--warmup", type=int, default=2, help="requests served together before the measured ones")
    ap.add_argument(
        "--encode-workers", type=int, default=None, help="the engine's encoder processes (default: one per core)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.preset, args.device = "tiny", "cpu"
    frames, height, width, forward_ms, requests = PRESETS[args.preset]
    for name, value in (("frames", frames), ("height", height), ("width", width), ("forward_ms", forward_ms),
                        ("requests", requests)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, value)
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
