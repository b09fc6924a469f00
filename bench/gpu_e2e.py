"""End-to-end overlap through the real stack: request mode (async packing) vs step mode.

A worker process runs ``SyntheticVideoWorker`` (a device forward of set length and one
large output per request) behind ``MultiprocDiffusionExecutor``.  For each mode it
submits requests back to back, the way an engine does, with a consumer thread that
awaits each output and gives its segment back, and reports the steady-state time per
request next to the forward alone and the pack alone:

* step mode: the worker packs on its main thread before answering, so a request costs
  about forward + pack;
* request mode: the worker answers COMPUTE_DONE and packs on a side stream while the
  next forward runs, so a request should cost about max(forward, pack).

Usage (GPU):  python bench/gpu_e2e.py --device cuda --out bench/results/gpu_e2e.json
Usage (CPU):  python bench/gpu_e2e.py --device cpu --output-mb 16 --matmuls 4 --dim 512
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import statistics
import sys
import threading
import time
from typing import Any

import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.tiny import SyntheticVideoWorker
from omni_async.transport.packing import pack_diffusion_output_shm, release_packed_output
from omni_async.transport.shm import SegmentPool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_alone(args: argparse.Namespace) -> dict[str, float]:
    """Forward alone and pack alone (into a pooled, pinned segment), in this process."""
    w = SyntheticVideoWorker(device=args.device, output_mb=args.output_mb, matmuls=args.matmuls, dim=args.dim)
    dev = torch.device(args.device)
    fwd: list[float] = []
    pack: list[float] = []
    with SegmentPool(max_bytes=4 * (1 << 30)) as pool:
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # type: ignore[no-untyped-call]
        for i in range(args.warmup + args.repeats):
            _sync(dev)
            t0 = time.perf_counter()
            out = w.execute_model(DiffusionRequest(f"a{i}", {"seed": i}))
            _sync(dev)
            t1 = time.perf_counter()
            packed = pack_diffusion_output_shm(out, stream, pool=pool)
            t2 = time.perf_counter()
            release_packed_output(packed, pool=pool)
            if i >= args.warmup:
                fwd.append(t1 - t0)
                pack.append(t2 - t1)
    nbytes = w.numel * torch.empty((), dtype=w.dtype).element_size()
    med_pack = statistics.median(pack)
    return {
        "forward_ms": statistics.median(fwd) * 1e3,
        "pack_ms": med_pack * 1e3,
        "pack_GBps": nbytes / med_pack / 1e9,
        "output_bytes": float(nbytes),
    }


def run_mode(args: argparse.Namespace, step_mode: bool) -> dict[str, float]:
    spec = WorkerSpec(
        "omni_async.models.tiny:SyntheticVideoWorker",
        {"device": args.device, "output_mb": args.output_mb, "matmuls": args.matmuls, "dim": args.dim},
    )
    opts = WorkerOptions(device=args.device, max_outputs_in_flight=args.max_in_flight, lease_timeout=120)
    deadlines = Deadlines(compute_timeout=300, output_timeout=300, rpc_timeout=300)
    n = args.warmup + args.repeats
    with MultiprocDiffusionExecutor(
        spec, step_mode=step_mode, deadlines=deadlines, options=opts, max_held_bytes=4 * (1 << 30)
    ) as ex:
        done_at: list[float] = []
        pack_s: list[float] = []
        pinned: list[float] = []
        ids: queue.Queue[str | None] = queue.Queue()

        def consume() -> None:
            while (oid := ids.get()) is not None:
                out = ex.wait_output_ready(oid).result(timeout=300)
                done_at.append(time.perf_counter())
                pack_s.append(out.metrics.get("pack_s", 0.0))
                pinned.append(out.metrics.get("pack_pinned", -1.0))
                ex.release_output(out)

        def submit(i: int) -> None:
            ro = ex.execute_request(DiffusionRequest(f"r{i}", {"seed": i}))
            if step_mode:
                assert ro.result is not None
                done_at.append(time.perf_counter())
                pack_s.append(ro.result.metrics.get("pack_s", 0.0))
                pinned.append(ro.result.metrics.get("pack_pinned", -1.0))
                ex.release_output(ro.result)
            else:
                assert ro.async_output_id is not None
                ids.put(ro.async_output_id)

        consumer = threading.Thread(target=consume, name="bench-consumer")
        consumer.start()
        # Warm-up (segment creation, pinning, kernels): finished, outputs delivered,
        # before the clock starts, so its slow first packs are not in the timing.
        for i in range(args.warmup):
            submit(i)
        while len(done_at) < args.warmup:
            time.sleep(0.01)
        done_at.clear()
        t_start = time.perf_counter()
        for i in range(args.warmup, n):
            submit(i)
        ids.put(None)
        consumer.join()
        t_end = max(done_at)
        workers = ex.worker_metrics()
        pool = ex.pool.stats()
    packer = workers[0].packer
    return {
        "per_request_ms": (t_end - t_start) / args.repeats * 1e3,
        "backpressure_waits": float(packer.backpressure_waits),
        "backpressure_ms_total": packer.backpressure_seconds * 1e3,
        "pack_ms_per_output": [round(x * 1e3, 2) for x in pack_s],
        "pinned": pinned,
        "pool_created": float(pool.created),
        "pool_reused": float(pool.reused),
        "pool_evicted": float(pool.evicted),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--output-mb", type=float, default=448.0)
    p.add_argument("--matmuls", type=int, default=32)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--max-in-flight", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    alone = measure_alone(args)
    sync = run_mode(args, step_mode=True)
    async_ = run_mode(args, step_mode=False)
    ideal_async = max(alone["forward_ms"], alone["pack_ms"])
    hidden = (sync["per_request_ms"] - async_["per_request_ms"]) / alone["pack_ms"] if alone["pack_ms"] else 0.0
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "config": vars(args),
        "alone": alone,
        "step_mode_sync": sync,
        "request_mode_async": async_,
        "ideal_async_ms": ideal_async,
        "speedup_async_vs_sync": sync["per_request_ms"] / async_["per_request_ms"],
        "fraction_of_pack_hidden": hidden,
    }
    print(f"forward alone          {alone['forward_ms']:8.1f} ms")
    print(
        f"pack alone             {alone['pack_ms']:8.1f} ms  ({alone['pack_GBps']:.1f} GB/s, "
        f"{alone['output_bytes'] / 1e6:.0f} MB)"
    )
    print(f"step mode (sync)       {sync['per_request_ms']:8.1f} ms / request")
    print(f"request mode (async)   {async_['per_request_ms']:8.1f} ms / request  (ideal {ideal_async:.1f})")
    print(f"speed-up {result['speedup_async_vs_sync']:.2f}x; {hidden:.0%} of the pack time hidden")
    for name in ("step_mode_sync", "request_mode_async"):
        r = result[name]
        print(
            f"  {name}: pack ms per output {r['pack_ms_per_output']}, pinned {r['pinned']}, "
            f"pool created {r['pool_created']:.0f} reused {r['pool_reused']:.0f} evicted {r['pool_evicted']:.0f}, "
            f"back-pressure waits {r['backpressure_waits']:.0f} ({r['backpressure_ms_total']:.0f} ms)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
