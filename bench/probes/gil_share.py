"""Probe: which threads of a worker process hold the GIL while it serves (issue 31).

A launch-bound forward (the host's Python between kernel launches sets its pace) is slowed
by any other thread of its process that takes the GIL meanwhile: the packer, stager and
finisher threads of the asynchronous output path, the cancel and watch threads.  This serves
a pipeline through ``AsyncDiffusionEngine`` over a worker process, back to back, and samples
the worker with py-spy (``--gil``: a sample is taken only of the thread that holds the GIL;
``--nonblocking``: the worker is never paused) while it serves, then prints each thread's
share of the samples, on the sync and the async path in alternating order, with the worker's
median forward (its device stamps).

    python3 bench/probes/gil_share.py --json bench/results/gil_share_cpu.json
    python3 bench/probes/gil_share.py --device cuda --preset h200 --json gil_share_h200.json

Needs ``py-spy`` on the PATH (``pip install py-spy``); on Linux it reads another process's
memory, so it may need ``ptrace`` rights (a root shell, or ``kernel.yama.ptrace_scope=0``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import diffusers_serving as ds  # noqa: E402  # bench/diffusers_serving.py: the presets and requests

from omni_async.engine import AsyncDiffusionEngine  # noqa: E402
from omni_async.executor.multiproc import MultiprocDiffusionExecutor  # noqa: E402
from omni_async.integrations.diffusers import DiffusersPipelineWorker  # noqa: E402
from omni_async.worker.host import WorkerOptions  # noqa: E402


def shares(raw: str) -> dict[str, int]:
    """Samples per thread name from py-spy's ``--format raw --threads`` output."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        thread = stack.split(";", 1)[0]  # "thread (1234): omni-packer-0"
        counts[thread.split(": ", 1)[-1]] += int(n)
    return dict(counts)


def run(path: str, work: dict[str, Any], device: str, count: int, seconds: float, rate: int) -> dict[str, Any]:
    reqs = ds.requests("pixart", work, count + 2, "g")
    spec = DiffusersPipelineWorker.spec(
        builder=ds.BUILDER, builder_kwargs=ds.builder_kwargs(work), device=device, postprocess="diffusers",
        warmup=reqs[0].params,
    )  # fmt: skip

    def factory() -> MultiprocDiffusionExecutor:
        return MultiprocDiffusionExecutor(spec, options=WorkerOptions(device=device))

    async def body() -> dict[str, Any]:
        engine = AsyncDiffusionEngine.from_factory(factory, pipeline="diffusers", async_output=path == "async")
        async with engine:
            await engine.generate(reqs[1])
            executor = engine.executor
            assert isinstance(executor, MultiprocDiffusionExecutor)
            (pid,) = [p.pid for p in executor.procs if p.pid is not None]
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "gil.txt")
                spy = subprocess.Popen(
                    ["py-spy", "record", "--pid", str(pid), "--threads", "--gil", "--nonblocking", "--format", "raw",
                     "-o", out, "--duration", str(int(seconds)), "--rate", str(rate)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                )  # fmt: skip
                t0 = time.monotonic()
                results = []
                # Back to back, one in flight, while py-spy samples (at least its duration).
                while time.monotonic() - t0 < seconds + 0.5 or len(results) < count:
                    results.append(await engine.generate(reqs[2 + len(results) % count]))
                _, err = spy.communicate(timeout=60)
                raw = open(out).read() if os.path.exists(out) else ""
            forwards = [float(r.metrics["forward_ended_at"]) - float(r.metrics["forward_started_at"]) for r in results]
            counts = shares(raw)
            total = sum(counts.values())
            return {
                "path": path,
                "requests": len(results),
                "forward_s_median": statistics.median(forwards),
                "gil_samples": total,
                "gil_share": {k: round(v / total, 4) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
                if total
                else {},
                "py_spy_error": err.strip()[-500:] if not total else "",
            }

    return asyncio.run(body())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(ds.PRESETS), default="tiny")
    ap.add_argument("--device", default=None, help="default: the preset's")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: 40 on the tiny preset)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=6.0, help="py-spy's sampling time a run")
    ap.add_argument("--rate", type=int, default=250, help="py-spy's samples a second")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if shutil.which("py-spy") is None:
        ap.error("py-spy is not on the PATH (pip install py-spy)")
    preset = ds.PRESETS[args.preset]
    device = args.device or str(preset["device"])
    work = dict(preset["workloads"]["pixart"])
    steps = args.steps or (40 if args.preset == "tiny" else None)
    if steps:
        work["params"] = {**work["params"], "num_inference_steps": steps}
    rows = []
    for r in range(args.rounds):
        for path in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            row = {"round": r, **run(path, work, device, args.requests, args.seconds, args.rate)}
            rows.append(row)
            top = ", ".join(f"{k} {100 * v:.1f}%" for k, v in row["gil_share"].items())
            print(
                f"round {r} {path:5} forward {row['forward_s_median']:.4f} s, {row['requests']} requests, "
                f"{row['gil_samples']} GIL samples: {top or row['py_spy_error']}"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"command": " ".join(["python3", *sys.argv]), "device": device, "runs": rows}, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
