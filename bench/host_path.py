"""Where the host's time goes between an output in shared memory and the client's bytes
(issue 31), before and after: fresh memory per request against memory reused.

Three parts (``--parts``, comma-separated), each "before" and "after" in alternating
order (ABAB in even rounds, BABA in odd ones: machines drift), ``--rounds`` rounds:

* ``stages``: in this process, on an output in a real shared-memory segment (as an
  unpacked output's tensors are): the seed's client bytes (``to_client_bytes``), pass by
  pass (upcast, multiply, add and clamp, cast to uint8, ``tobytes``), against
  ``ClientBytes`` (into reused memory, in cache-sized slices); the engine's owned copy
  into fresh memory (``owned_copy(x)``, before) against ``HostBuffers`` (after); a uint8
  output (``omni-u8``: the device stage converted it) the same; where the host has the
  cores for it (``DEFAULT_COPY_THREADS`` > 1), the owned copy into reused memory on one
  thread against the default's threads.  Median ms and GB/s.
* ``engine``: ``AsyncDiffusionEngine`` over ``SyntheticForwardWorker`` in a worker
  process, no host stage (the result is the owned copy): the engine's ``postprocess``
  time (the copy and the release) and the request's total, p50, with the engine's
  ``HostBuffers`` (after) or one that keeps nothing (before: every copy into fresh
  memory).
* ``bench``: ``omni-async bench`` itself, ``--client-path fresh`` (before) against
  ``pooled`` (after): ``client_ms_p50``, the GPU's (here: the worker's) idle gap.

Usage (repo root; the CPU machine's figures are in ``bench/results/host_path_cpu.json``)::

    PYTHONPATH=src python3 bench/host_path.py --rounds 4 --json bench/results/host_path_cpu.json

On the H200 (``bench/h200_owed.sh 10``)::

    PYTHONPATH=src python3 bench/host_path.py --device cuda --rounds 3 --engine-sizes \\
        image-2k-bf16,video-81x720p-bf16 --bench-runs \\
        "omni,omni-u8@image-2k-bf16,video-81x720p-bf16,video-121x1080p-bf16" --json host_path_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_async.cli.bench_client import ClientBytes
from omni_async.cli.parsers import SIZES, TINY_SIZES
from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.owned import DEFAULT_COPY_THREADS, HostBuffers, owned_copy
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.synthetic import DTYPES, synthetic_output, to_client_bytes

Row = dict[str, Any]
# A 112 MB video: the CPU worker makes the bench's 448 MB one in seconds per request.
EXTRA_SIZES: dict[str, tuple[tuple[int, ...], str]] = {"video-81x360p-bf16": ((81, 3, 360, 640), "bfloat16")}


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    del out
    return 1e3 * seconds


def _seed_passes(t: torch.Tensor) -> dict[str, float]:
    """``to_client_bytes`` of a float tensor, pass by pass (ms): the same operations, timed apart."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    x = t.to(torch.float32)
    times["upcast"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    y = x.mul(127.5)
    times["mul"] = time.perf_counter() - t0
    del x
    t0 = time.perf_counter()
    y.add_(127.5).clamp_(0, 255)
    times["add_clamp"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    u = y.to(torch.uint8)
    times["to_uint8"] = time.perf_counter() - t0
    del y
    t0 = time.perf_counter()
    data = u.contiguous().numpy().tobytes()
    times["tobytes"] = time.perf_counter() - t0
    del data, u
    return {k: 1e3 * v for k, v in times.items()}


def _compare(name: str, label: str, view: torch.Tensor, rounds: int) -> list[Row]:
    """Before against after on ``view`` (a tensor in shared memory), in alternating order."""
    nbytes = view.numel() * view.element_size()
    output = DiffusionOutput("r", {"frames": view})
    buffers = HostBuffers()
    maker = ClientBytes(HostBuffers())
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "client_bytes": (lambda: to_client_bytes(output), lambda: maker(output)),
        "owned_copy": (lambda: owned_copy(output.output), lambda: owned_copy(output.output, buffers)),
    }
    if DEFAULT_COPY_THREADS > 1:
        # Reused memory both, one copy thread (before) against the default (after).
        serial = HostBuffers(copy_threads=1)
        pairs[f"owned_copy 1 vs {DEFAULT_COPY_THREADS} threads"] = (
            lambda: owned_copy(output.output, serial),
            lambda: owned_copy(output.output, buffers),
        )
    rows: list[Row] = []
    for what, (before, after) in pairs.items():
        after()  # the pool's first buffer: faulted in once, as a serving engine's first request
        got: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(rounds):
            order = (("before", before), ("after", after)) if r % 2 == 0 else (("after", after), ("before", before))
            for which, fn in order * 2:
                got[which].append(_ms(fn))
        row: Row = {"part": "stages", "size": name, "stage": what, "dtype": label, "bytes": nbytes}
        for which, xs in got.items():
            row[f"{which}_ms_p50"] = statistics.median(xs)
            row[f"{which}_ms_all"] = xs
            row[f"{which}_GBps"] = nbytes / statistics.median(xs) / 1e6
        row["speedup"] = row["before_ms_p50"] / row["after_ms_p50"]
        rows.append(row)
    if view.is_floating_point():
        passes = [_seed_passes(view) for _ in range(max(3, rounds))]
        rows.append(
            {
                "part": "stages",
                "size": name,
                "stage": "client_bytes seed, by pass",
                "dtype": label,
                "bytes": nbytes,
                **{f"{k}_ms_p50": statistics.median(p[k] for p in passes) for k in passes[0]},
            }
        )
    return rows


def stages(name: str, shape: tuple[int, ...], dtype: str, rounds: int) -> list[Row]:
    """The host's stages on one output in a shared-memory segment, before and after."""
    src = synthetic_output(shape, DTYPES[dtype], seed=3, device="cpu")
    u8 = ((src.to(torch.float32) * 127.5 + 127.5).clamp(0, 255)).to(torch.uint8)
    rows: list[Row] = []
    for label, value in ((dtype, src), ("uint8", u8)):
        nbytes = value.numel() * value.element_size()
        seg = shared_memory.SharedMemory(create=True, size=nbytes)
        try:
            view = torch.frombuffer(seg.buf, dtype=value.dtype, count=value.numel()).view(value.shape)
            view.copy_(value)
            rows += _compare(name, label, view, rounds)
            del view
        finally:
            seg.close()
            seg.unlink()
    return rows


async def _engine_once(shape: tuple[int, ...], dtype: str, device: str, requests: int, reuse: bool) -> Row:
    spec = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker", {"device": device})
    ex = MultiprocDiffusionExecutor(
        spec, deadlines=Deadlines(compute_timeout=300, output_timeout=300), options=WorkerOptions(device=device)
    )
    params = {"forward_ms": 30.0, "shape": list(shape), "dtype": dtype}
    async with AsyncDiffusionEngine(ex) as engine:
        if not reuse:
            # Before issue 31: every owned copy into fresh memory (a pool that keeps nothing).
            engine._post.buffers = HostBuffers(max_idle_bytes=0)
        for i in range(2):
            await engine.generate(DiffusionRequest(f"w{i}", {**params, "seed": i}))
        post, total = [], []
        for i in range(requests):
            res = await engine.generate(DiffusionRequest(f"r{i}", {**params, "seed": i}))
            post.append(res.timings.postprocess or 0.0)
            total.append(res.timings.total)
            del res
    return {"postprocess_ms_p50": 1e3 * statistics.median(post), "total_ms_p50": 1e3 * statistics.median(total)}


def engine_part(name: str, shape: tuple[int, ...], dtype: str, device: str, rounds: int, requests: int) -> Row:
    got: dict[str, list[Row]] = {"before": [], "after": []}
    for r in range(rounds):
        for which in ("before", "after") if r % 2 == 0 else ("after", "before"):
            got[which].append(asyncio.run(_engine_once(shape, dtype, device, requests, which == "after")))
    nbytes = int(np.prod(shape)) * torch.tensor([], dtype=DTYPES[dtype]).element_size()
    row: Row = {"part": "engine", "size": name, "bytes": nbytes, "requests": requests}
    for which, runs in got.items():
        for key in ("postprocess_ms_p50", "total_ms_p50"):
            row[f"{which}_{key}"] = statistics.median(x[key] for x in runs)
            row[f"{which}_{key}_runs"] = [x[key] for x in runs]
    row["postprocess_speedup"] = row["before_postprocess_ms_p50"] / row["after_postprocess_ms_p50"]
    return row


def bench_part(specs: str, device: str, rounds: int, requests: int) -> list[Row]:
    """``specs``: ``MODES@SIZES`` runs separated by ``;`` (each one ``omni-async bench``)."""
    got: dict[tuple[str, str, str], list[Row]] = {}
    runs = [spec.split("@") for spec in specs.split(";")]
    for r in range(rounds):
        for path, (modes, sizes) in itertools.product(("fresh", "pooled") if r % 2 == 0 else ("pooled", "fresh"), runs):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "bench.json"
                cmd = [sys.executable, "-m", "omni_async.cli", "bench", "--device", device, "--modes", modes,
                       "--sizes", sizes, "--forward-ms", "30", "--concurrency", "1", "--requests", str(requests),
                       "--warmup", "1", "--alone-min-s", "0.3", "--no-copy-bound", "--client-path", path,
                       "--no-loop-stall", "--json", str(out)]  # fmt: skip
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
                for case in json.loads(out.read_text())["cases"]:
                    got.setdefault((case["mode"], case["size"], path), []).append(case)
    rows: list[Row] = []
    for mode, size in sorted({(m, s) for m, s, _ in got}):
        row: Row = {"part": "bench", "mode": mode, "size": size}
        for path, which in (("fresh", "before"), ("pooled", "after")):
            cases = got[(mode, size, path)]
            for key in ("client_ms_p50", "latency_ms_p50", "idle_gap_ms_p50", "throughput_rps", "client_efficiency"):
                row[f"{which}_{key}"] = statistics.median(c[key] for c in cases)
                row[f"{which}_{key}_runs"] = [c[key] for c in cases]
        # The host's own part: from the output in hand to the client's bytes.
        row["before_host_ms"] = row["before_client_ms_p50"] - row["before_latency_ms_p50"]
        row["after_host_ms"] = row["after_client_ms_p50"] - row["after_latency_ms_p50"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--parts", default="stages,engine,bench")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds (ABAB, then BABA, ...)")
    ap.add_argument("--stage-sizes", default="image-2k-bf16,video-81x720p-bf16")
    ap.add_argument("--engine-sizes", default="image-2k-bf16,video-81x360p-bf16")
    ap.add_argument("--engine-requests", type=int, default=6)
    ap.add_argument(
        "--bench-runs",
        default="omni,omni-u8@image-2k-bf16;omni-u8@video-81x720p-bf16",
        help="MODES@SIZES runs of omni-async bench, ';'-separated (omni on the 448 MB video takes 30 s a request on CPU)",
    )
    ap.add_argument("--bench-requests", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    parts = args.parts.split(",")
    catalog = {**SIZES, **TINY_SIZES, **EXTRA_SIZES}
    rows: list[Row] = []
    if "stages" in parts:
        for name in args.stage_sizes.split(","):
            shape, dtype = catalog[name]
            rows += stages(name, shape, dtype, args.rounds)
            for row in rows[-5:]:
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
    if "engine" in parts:
        for name in args.engine_sizes.split(","):
            shape, dtype = catalog[name]
            rows.append(engine_part(name, shape, dtype, args.device, args.rounds, args.engine_requests))
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_runs")}), flush=True)
    if "bench" in parts:
        got = bench_part(args.bench_runs, args.device, args.rounds, args.bench_requests)
        for row in got:
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_runs")}), flush=True)
        rows += got
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": shlex.join(["python3", "bench/host_path.py", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {os.cpu_count()} cpus, torch {torch.__version__}, {platform.machine()}",
            "rows": rows,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
