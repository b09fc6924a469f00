"""The first request after an executor starts, against a steady one (issue 19, prewarm).

Target: the first request no slower than twice a steady one.  For each case a fresh
``MultiprocDiffusionExecutor`` (``SyntheticForwardWorker``; CPU by default), then
``--requests`` requests one at a time; per request the latency from ``execute_request``
to the output in hand (``wait_output_ready``) and its ``pack_s``.  Cases: no prewarm,
and ``prewarm=Prewarm.of_tensor(shape, dtype)`` (the pool's segments made, and mapped by
the packing rank, before the first request).  Prints the first request's figures, the
median of the rest, and their ratio.

    PYTHONPATH=src python3 bench/first_request.py [--device cuda] [--mib 64] [--forward-ms 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.config import Prewarm
from omni_async.executor.multiproc import (
    MultiprocDiffusionExecutor,
    WorkerOptions,
    WorkerSpec,
)


def run_case(args: argparse.Namespace, prewarm: bool) -> dict[str, float]:
    numel = args.mib * (1 << 20) // 4
    shape = [numel]
    params = {"forward_ms": args.forward_ms, "shape": shape, "dtype": "float32"}
    spec = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker", {"device": args.device})
    kw = {"prewarm": Prewarm.of_tensor(shape, torch.float32, count=2)} if prewarm else {}
    deadlines = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)
    t0 = time.monotonic()
    with MultiprocDiffusionExecutor(spec, deadlines=deadlines, options=WorkerOptions(device=args.device), **kw) as ex:
        start_s = time.monotonic() - t0
        lat: list[float] = []
        pack: list[float] = []
        for i in range(args.requests):
            t = time.monotonic()
            ro = ex.execute_request(DiffusionRequest(f"r{i}", {**params, "seed": i}))
            assert ro.async_output_id is not None
            out = ex.wait_output_ready(ro.async_output_id).result(timeout=120)
            lat.append(time.monotonic() - t)
            pack.append(out.metrics.pack_s or 0.0)
            ex.release_output(out)
        created = ex.pool.stats().created
    steady_lat, steady_pack = statistics.median(lat[1:]), statistics.median(pack[1:])
    return {
        "start_s": start_s,
        "first_ms": 1e3 * lat[0],
        "steady_ms": 1e3 * steady_lat,
        "ratio": lat[0] / steady_lat,
        "first_pack_ms": 1e3 * pack[0],
        "steady_pack_ms": 1e3 * steady_pack,
        "segments_created": created,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--mib", type=int, default=64, help="the output's size (float32)")
    p.add_argument("--forward-ms", type=float, default=20.0)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--repeat", type=int, default=2, help="cases run this many times each, alternating")
    args = p.parse_args()
    print(f"device={args.device} output={args.mib} MiB forward={args.forward_ms} ms requests={args.requests}")
    for rep in range(args.repeat):
        for prewarm in (False, True):
            r = run_case(args, prewarm)
            name = "prewarm" if prewarm else "none"
            print(
                f"[{rep}] {name:8s} start {r['start_s']:.2f} s  first {r['first_ms']:7.1f} ms  steady "
                f"{r['steady_ms']:7.1f} ms  ratio {r['ratio']:.2f}  pack first {r['first_pack_ms']:6.1f} ms "
                f"steady {r['steady_pack_ms']:6.1f} ms  segments {r['segments_created']:.0f}"
            )


if __name__ == "__main__":
    main()
