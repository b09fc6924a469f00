"""The engine's own ceiling, and whether it keeps the worker busy: AsyncDiffusionEngine over
``SyntheticForwardWorker`` in a worker process, several engine settings in one run.

What is measured per setting (``--settings``, comma-separated: ``mr<N>`` is the engine's
``max_running``, ``-nodefer`` adds ``WorkerOptions(defer_packing=False)``; ``before``
is ``mr2-nodefer``, the engine and worker before issue 20, ``after`` ``mr3``, today's
defaults; each gets a fresh executor, the settings run one after the other, so
compare them as ratios in one run):

* requests/s, p50 and p99 of the end-to-end latency (``generate`` to its result);
* the worker's idle time between forwards, from the worker's own stamps
  (``forward_started_at`` / ``forward_ended_at``): its share of the span from the first
  forward's start to the last one's end, and the mean gap;
* ``starved``: the forwards that ended with no request sent behind them although
  requests were waiting in the engine (the next forward's request was sent after this
  one ended): each one is idle the engine caused.

By default the CUDA forward synchronizes its stream before it returns (the library's own
models do): the device then waits out the worker's own loop between forwards (sending
COMPUTE_DONE, taking the next request: about 0.4 ms).  ``--queued``: it returns with its
kernels queued, as a diffusers pipeline does, and the next forward's kernels queue behind
them.

With ``--forward-ms 0`` (the default) the model does nothing: the figures are the
engine's, the executor's and the channel's ceiling.  ``--forward-ms 15 --post client``
(or ``u8-client``) is a serving shape: a forward, then the client's bytes made on the
host (``models.synthetic.to_client_bytes``).  ``--consumer-ms`` burns that much CPU on
the event loop per result (a front end building its response), which delays the
engine's next send the way a busy loop does.

Usage (repo root, ``PYTHONPATH=src``)::

    python3 bench/engine_ceiling.py --requests 2000 --settings before,after --repeat 3 \\
        --out bench/results/engine_ceiling/ceiling_issue20.json
    python3 bench/engine_ceiling.py --forward-ms 15 --post client --shape 3,512,512 --requests 300 \\
        --consumer-ms 5 --settings before,mr2,after --out bench/results/engine_ceiling/idle_cpu.json
    python3 bench/engine_ceiling.py --device cuda --forward-ms 15 --post u8-client --shape 3,1024,1024 \\
        --dtype bfloat16 --requests 400 --consumer-ms 5 --settings before,mr2,after --out idle_cuda.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import time
from typing import Any

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import RequestTimings
from omni_async.executor.multiproc import (
    MultiprocDiffusionExecutor,
    WorkerOptions,
    WorkerSpec,
)

POSTS = {"none": None, "client": "bench-client", "u8-client": "bench-u8-client"}


def _busy(seconds: float) -> None:
    """Hold the CPU (and the GIL) for ``seconds``, as Python work on the event loop does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def worker_idle(timings: list[RequestTimings]) -> dict[str, float | int]:
    """The worker's idle between forwards (from its stamps) and the forwards the engine starved."""
    ts = sorted((t for t in timings if t.forward_started_at is not None and t.forward_ended_at is not None),
                key=lambda t: t.forward_started_at or 0.0)  # fmt: skip
    if len(ts) < 2:
        return {"idle_fraction": 0.0, "idle_gap_ms_mean": 0.0, "starved": 0, "forward_ms_mean": 0.0}
    gaps, starved, busy = [], 0, 0.0
    for a, b in itertools.pairwise(ts):
        assert a.forward_ended_at is not None and b.forward_started_at is not None and a.forward_started_at is not None
        gaps.append(max(0.0, b.forward_started_at - a.forward_ended_at))
        # b was waiting in the engine while a ran, and reached the worker only after a ended.
        if b.enqueued_at < a.forward_ended_at < b.submitted_at:
            starved += 1
        busy += a.forward_ended_at - a.forward_started_at
    first, last = ts[0], ts[-1]
    assert first.forward_started_at is not None and last.forward_ended_at is not None
    span = last.forward_ended_at - first.forward_started_at
    return {
        "idle_fraction": sum(gaps) / span if span > 0 else 0.0,
        "idle_gap_ms_mean": 1e3 * statistics.mean(gaps),
        "idle_gap_ms_max": 1e3 * max(gaps),
        "starved": starved,
        "forward_ms_mean": 1e3 * busy / (len(ts) - 1),
    }


SETTINGS = {"before": "mr2-nodefer", "after": "mr3"}


def setting(text: str) -> tuple[int, bool]:
    """``mr<N>[-nodefer]`` (or ``before``, ``after``) as (max_running, defer_packing)."""
    spec = SETTINGS.get(text, text)
    head, _, tail = spec.partition("-")
    if not head.startswith("mr") or not head[2:].isdigit() or tail not in ("", "nodefer"):
        raise argparse.ArgumentTypeError(f"a setting is mr<N>[-nodefer], before or after; got {text!r}")
    return int(head[2:]), tail != "nodefer"


async def run(args: argparse.Namespace, name: str) -> dict[str, Any]:
    max_running, defer = setting(name)
    spec = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker", {"device": args.device},
                      postprocess=POSTS[args.post])  # fmt: skip
    executor = MultiprocDiffusionExecutor(
        spec,
        deadlines=Deadlines(compute_timeout=120, output_timeout=120),
        options=WorkerOptions(device=args.device, defer_packing=defer),
    )
    params = {"forward_ms": args.forward_ms, "shape": args.shape, "dtype": args.dtype, "sync": not args.queued}
    try:
        async with AsyncDiffusionEngine(executor, max_running=max_running, pipeline=POSTS[args.post]) as engine:
            for i in range(args.warmup):
                await engine.generate(DiffusionRequest(f"warm-{i}", dict(params)))
            latencies: list[float] = []
            timings: list[RequestTimings] = []
            gate = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                async with gate:
                    t0 = time.perf_counter()
                    result = await engine.generate(DiffusionRequest(f"r-{i}", dict(params)))
                    latencies.append(time.perf_counter() - t0)
                    timings.append(result.timings)
                    if args.consumer_ms:
                        _busy(args.consumer_ms / 1e3)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(args.requests)))
            wall = time.perf_counter() - t0
            counts = engine.metrics().requests
    finally:
        executor.shutdown()
    latencies.sort()
    return {
        "setting": name,
        "max_running": max_running,
        "defer_packing": defer,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "forward_ms": args.forward_ms,
        "wall_s": wall,
        "requests_per_s": args.requests / wall,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        **worker_idle(timings),
        "outcomes": counts,
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _settings(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    for n in names:
        setting(n)
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64, help="generate calls in flight at once")
    ap.add_argument("--settings", type=_settings, default=["after"],
                    help="one run each: mr<N>[-nodefer], before (mr2-nodefer), after (mr3)")  # fmt: skip
    ap.add_argument("--forward-ms", type=float, default=0.0, help="the model's forward (CPU: a sleep; CUDA: matmuls)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", type=_ints, default=[4], help="the output's shape: 3,1024,1024")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "uint8"))
    ap.add_argument("--post", default="none", choices=sorted(POSTS), help="the client's bytes on the host (client), "
                    "after a uint8 device stage (u8-client), or none")  # fmt: skip
    ap.add_argument("--queued", action="store_true",
                    help="the forward returns with its kernels queued, as a diffusers pipeline does (CUDA; "
                    "default: it synchronizes its stream before returning, so the device waits out the "
                    "worker's own loop between forwards)")  # fmt: skip
    ap.add_argument("--consumer-ms", type=float, default=0.0, help="CPU work on the event loop per result")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the settings, each with fresh executors")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    runs = [asyncio.run(run(args, name)) for _ in range(args.repeat) for name in args.settings]
    base = runs[0]
    for r in runs:
        print(
            f"{r['setting']:>12}: {r['requests']} requests, {r['concurrency']} in flight, forward "
            f"{r['forward_ms']:g} ms{' (queued)' if args.queued else ''}: {r['requests_per_s']:.0f} requests/s ({r['requests_per_s'] / base['requests_per_s']:.2f}x), "
            f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; worker idle {100 * r['idle_fraction']:.1f} % between "
            f"forwards (mean gap {r['idle_gap_ms_mean']:.2f} ms), starved {r['starved']}"
        )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "machine": f"{platform.node()} {os.cpu_count()} cpus",
                    "python": platform.python_version(),
                    "config": {k: v for k, v in vars(args).items() if k != "out"},
                    "runs": runs,
                },
                f,
                indent=2,
            )
            f.write("\n")


if __name__ == "__main__":
    main()
