"""Load on ``omni-async serve`` over loopback (issue 32): images through HTTP against the
engine's own rate for the same workload.

Starts the real server (``python -m omni_async.cli serve --model MODEL --port 0``) and sends
``--requests`` image generations (PNG, ``--size``) from ``--concurrency`` tasks of the
``openai`` async client, each checked (its PNG decodes to the asked size).  Meanwhile a
probe calls ``GET /health`` every 50 ms: its p99 says whether the event loop stays free
while the engine works (the encodes run in its encoder processes, base64 and JSON on a
thread).  ``--videos N``: then N video jobs at once (create, poll, download, check the MP4's
frames with PyAV, delete).  Then (``--direct``, the default) the same requests go straight into an
``AsyncDiffusionEngine`` built as the server builds its own (``omni_async.serve.engine_for``),
in this process, at the same concurrency: ``http_over_direct`` is the server's requests/s
over the engine's.  Bounded: at most ``--max-s`` seconds a run.

Prints a table and writes JSON (the command included) to ``--json`` (default
``bench/results/serve_load_<model>.json``); ``--tiny``: a smoke run for CI (a few requests,
no JSON unless asked).

    PYTHONPATH=src python3 bench/serve_load.py --model tiny
    PYTHONPATH=src python3 bench/serve_load.py --model dit --device cuda --size 512x512
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import openai
from PIL import Image

from omni_async.core.messages import DiffusionRequest
from omni_async.serve import ServeConfig, engine_for, served_model

HEALTH_EVERY_S = 0.05
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The server's environment: the caller's, with the checkout's ``src`` first on its
    ``PYTHONPATH`` and the caller's entries kept after it (packages installed with
    ``pip install --target``, as on the device machine)."""
    path = os.pathsep.join(p for p in (os.path.abspath(SRC), environ.get("PYTHONPATH", "")) if p)
    return dict(environ, PYTHONPATH=path)


def model_params(text: str) -> dict[str, Any]:
    """``--params``: a JSON object of model parameters."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of parameters, got {text!r}")
    return value


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "omni_async.cli", "serve", "--model", args.model, "--port", "0",
           "--device", args.device, "--max-batch-size", str(args.max_batch_size),
           "--poll-after-ms", str(args.poll_after_ms)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=server_env(os.environ)
    )
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        m = re.search(r"ready at (http://\S+)", line)
        if m:
            # Its later output is drained (and echoed to stderr): a full pipe would block its writes.
            threading.Thread(target=_drain, args=(proc.stdout,), name="server-output", daemon=True).start()
            return proc, m.group(1)
    tail = "".join(seen[-20:])
    raise RuntimeError(f"the server did not start (exit {proc.wait()}); its last output:\n{tail}")


def _drain(stream: Any) -> None:
    for line in stream:
        sys.stderr.write(f"[server] {line}")


# The /health probe runs in a process of its own: in this one, the 32 client tasks keep the
# event loop (and the GIL) busy, and their delays would be counted as the server's.
_PROBE = """
import json, sys, threading, time, httpx
url, every = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
seconds, bad = [], []
with httpx.Client() as h:
    while not stop.is_set():
        t0 = time.perf_counter()
        r = h.get(url + "/health")
        seconds.append(time.perf_counter() - t0)
        if r.status_code != 200:
            bad.append(r.status_code)
        stop.wait(every)
print(json.dumps({"seconds": seconds, "bad": bad}))
"""


def start_probe(url: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _PROBE, url, str(HEALTH_EVERY_S)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip


def stop_probe(proc: subprocess.Popen[str]) -> tuple[list[float], list[int]]:
    out, _ = proc.communicate("", timeout=30)
    found = json.loads(out.strip().splitlines()[-1])
    return [float(s) for s in found["seconds"]], [int(c) for c in found["bad"]]


def check_png(b64: str | None, size: tuple[int, int]) -> None:
    image = Image.open(io.BytesIO(base64.b64decode(b64 or "")))
    if (image.format, image.size) != ("PNG", size):
        raise AssertionError(f"got a {image.format} of {image.size}, asked for a PNG of {size}")


async def http_run(url: str, args: argparse.Namespace, size: tuple[int, int]) -> list[dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.max_s)
    latencies: list[float] = []
    failures: list[str] = []
    gate = asyncio.Semaphore(args.concurrency)
    deadline = time.monotonic() + args.max_s

    async def one(i: int) -> None:
        async with gate:
            if time.monotonic() > deadline:
                return
            t0 = time.perf_counter()
            try:
                r = await client.images.generate(
                    prompt=f"image {i}", size=args.size, extra_body={**args.params, "seed": i}
                )
                assert r.data is not None and len(r.data) == 1
                await asyncio.to_thread(check_png, r.data[0].b64_json, size)
                latencies.append(time.perf_counter() - t0)
            except Exception as exc:  # every failure is counted and reported
                failures.append(f"{type(exc).__name__}: {exc}"[:200])

    prober = start_probe(url)  # from the warm-up on: its interpreter takes a moment to start
    await asyncio.gather(*(one(i) for i in range(args.warmup)))
    latencies.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.warmup, args.warmup + args.requests)))
    wall = time.perf_counter() - t0
    rows = [summary("http", latencies, wall, failures, [])]
    if args.videos:
        rows.append(await _http_videos(client, args))
    health, bad = await asyncio.to_thread(stop_probe, prober)
    rows[0]["first_failures"] += [f"/health answered {code}" for code in bad]
    rows[0]["failures"] += len(bad)
    rows[0].update(_health(health))
    await client.close()
    return rows


async def _http_videos(client: openai.AsyncOpenAI, args: argparse.Namespace) -> dict[str, Any]:
    """``--videos`` jobs at once: create, poll (at the server's pace), download, check, delete."""
    latencies: list[float] = []
    failures: list[str] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            job = await client.videos.create(prompt=f"clip {i}", seconds=str(args.seconds), size=args.size,  # type: ignore[arg-type]
                                             extra_body={**args.params, "seed": i})  # fmt: skip
            job = await client.videos.poll(job.id)
            if job.status != "completed":
                raise AssertionError(f"video job {job.id} {job.status}: {job.error}")
            data = await (await client.videos.download_content(job.id)).aread()
            latencies.append(time.perf_counter() - t0)
            await asyncio.to_thread(check_mp4, data, args.frames)
            await client.videos.delete(job.id)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:200])

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.videos)))
    return summary("http-mp4", latencies, time.perf_counter() - t0, failures, [])


def check_mp4(data: bytes, frames: int) -> None:
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        got = sum(1 for _ in container.decode(video=0))
    if got != frames:
        raise AssertionError(f"the MP4 has {got} frames, asked for {frames}")


async def direct_run(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = ServeConfig(model=served_model(args.model, device=args.device), device=args.device,
                         max_batch_size=args.max_batch_size)  # fmt: skip
    params = {**config.model.size_params(args.size), **args.params}
    latencies: list[float] = []
    failures: list[str] = []
    gate = asyncio.Semaphore(args.concurrency)
    async with engine_for(config) as engine:

        async def one(i: int) -> None:
            async with gate:
                t0 = time.perf_counter()
                try:
                    result = await engine.generate(DiffusionRequest(f"d-{i}", {**params, "seed": i}, format="png"))
                    # What the server does with each image before it answers: its base64.
                    await asyncio.to_thread(base64.b64encode, result.data or b"")
                    latencies.append(time.perf_counter() - t0)
                except Exception as exc:
                    failures.append(f"{type(exc).__name__}: {exc}"[:200])

        await asyncio.gather(*(one(i) for i in range(args.warmup)))
        latencies.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.warmup, args.warmup + args.requests)))
        wall = time.perf_counter() - t0
        rows = [summary("direct", latencies, wall, failures, [])]
        if args.videos:
            clip = {**params, "num_frames": args.frames}
            vlat: list[float] = []
            vfail: list[str] = []

            async def video(i: int) -> None:
                t0 = time.perf_counter()
                try:
                    result = await engine.generate(DiffusionRequest(f"v-{i}", {**clip, "seed": i}, format="mp4"))
                    vlat.append(time.perf_counter() - t0)
                    await asyncio.to_thread(check_mp4, result.data or b"", args.frames)
                except Exception as exc:
                    vfail.append(f"{type(exc).__name__}: {exc}"[:200])

            t0 = time.perf_counter()
            await asyncio.gather(*(video(i) for i in range(args.videos)))
            rows.append(summary("direct-mp4", vlat, time.perf_counter() - t0, vfail, []))
    return rows


def _health(health: list[float]) -> dict[str, Any]:
    return {
        "health_probes": len(health),
        "health_p50_ms": 1000 * percentile(health, 50),
        "health_p99_ms": 1000 * percentile(health, 99),
    }


def summary(mode: str, latencies: list[float], wall: float, failures: list[str], health: list[float]) -> dict[str, Any]:
    return {
        "mode": mode,
        "requests": len(latencies),
        "failures": len(failures),
        "first_failures": failures[:5],
        "wall_s": wall,
        "req_per_s": len(latencies) / wall if wall > 0 else float("nan"),
        "p50_ms": 1000 * percentile(latencies, 50),
        "p99_ms": 1000 * percentile(latencies, 99),
        "mean_ms": 1000 * statistics.fmean(latencies) if latencies else float("nan"),
        **_health(health),
    }


def _strict(value: Any) -> Any:
    """``value`` with every NaN (a figure nothing was measured for) as null: strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'mode':<12}{'requests':>9}{'failed':>8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'health p99 ms':>15}"
    lines = [head, "-" * len(head)]
    for r in rows:
        hp = f"{r['health_p99_ms']:.1f}" if r["health_probes"] else "-"
        lines.append(
            f"{r['mode']:<12}{r['requests']:>9}{r['failures']:>8}{r['req_per_s']:>9.1f}{r['p50_ms']:>9.1f}"
            f"{r['p99_ms']:>9.1f}{hp:>15}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # The openai client marks its videos API deprecated (OpenAI's own service); the API is ours here.
    warnings.filterwarnings("ignore", message="The Sora API", category=DeprecationWarning)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, dit or diffusers:MODULE:BUILDER (as omni-async serve)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default=None, help="WxH (default: the model's)")
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--max-batch-size", type=int, default=4)
    ap.add_argument("--max-s", type=float, default=120.0, help="a run stops taking requests after this many seconds")
    ap.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the same requests straight through the engine (the rate HTTP is compared to)")  # fmt: skip
    ap.add_argument("--videos", type=int, default=0, help="also this many video jobs at once (MP4), after the images")
    ap.add_argument("--seconds", type=int, default=1, help="each video job's length")
    ap.add_argument("--poll-after-ms", type=int, default=100, help="the server's openai-poll-after-ms (video jobs)")
    ap.add_argument("--params", type=model_params, default={},
                    help='JSON object: more model parameters for every request, e.g. \'{"step_ms": 250}\' (tiny: a '
                         "pause per step, for a forward of a realistic length)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="CI smoke: 24 requests at concurrency 8, 4 warm-up, 2 videos")
    ap.add_argument("--json", default=None, help="default: bench/results/serve_load_<model>.json (not with --tiny)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.requests, args.concurrency, args.warmup, args.max_s, args.videos = 24, 8, 4, 60.0, 2
    model = served_model(args.model, device=args.device)
    args.frames = args.seconds * model.fps
    args.size = args.size or model.size_text()
    width, height = (int(x) for x in args.size.split("x"))
    rows: list[dict[str, Any]] = []
    proc, url = start_server(args)
    try:
        rows += asyncio.run(http_run(url, args, (width, height)))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    if args.direct:
        rows += asyncio.run(direct_run(args))
    print(table(rows))
    rate = {r["mode"]: r["req_per_s"] for r in rows}
    ratio = rate["http"] / rate["direct"] if "direct" in rate else None
    video_ratio = rate["http-mp4"] / rate["direct-mp4"] if "direct-mp4" in rate and "http-mp4" in rate else None
    if ratio is not None:
        print(f"http_over_direct = {ratio:.3f}" + (f", mp4: {video_ratio:.3f}" if video_ratio is not None else ""))
    print(f"server exit status {code}")
    report = {
        "command": shlex.join(
            [
                os.path.relpath(sys.argv[0]) if argv is None else "bench/serve_load.py",
                *(sys.argv[1:] if argv is None else argv),
            ]
        ),  # fmt: skip
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "config": vars(args),
        "runs": rows,
        "http_over_direct": ratio,
        "mp4_http_over_direct": video_ratio,
        "server_exit": code,
    }
    path = args.json or (None if args.tiny else f"bench/results/serve_load_{args.model.split(':')[0]}.json")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(_strict(report), f, indent=2, allow_nan=False)
        print(f"wrote {path}")
    bad = sum(r["failures"] for r in rows)
    return 0 if bad == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
