"""Two ranks on two GPUs of one host (issue 11): each rank on its own GPU, the copy of
each GPU measured in parallel in the same run, and requests through both ranks (every
call completes only when both have answered, F12; rank 0 ships the outputs).

Usage (a 2-GPU machine):  PYTHONPATH=src python3 bench/probes/two_gpu.py --out two_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="81,3,720,1280")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--forward-ms", type=float, default=30.0)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shape = [int(x) for x in args.shape.split(",")]
    nbytes = torch.empty(shape, dtype=getattr(torch, args.dtype), device="meta").numel() * 2
    spec = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker", {"device": "cuda"})
    opts = WorkerOptions(device="cuda", lease_timeout=120)
    deadlines = Deadlines(compute_timeout=300, output_timeout=300, rpc_timeout=300)
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    with MultiprocDiffusionExecutor(spec, world_size=2, options=opts, deadlines=deadlines) as ex:
        result["rank_devices"] = ex.collective_rpc("where")
        # Both ranks copy at once (a collective call runs on every rank): each GPU's own bandwidth.
        ex.collective_rpc("copy_alone", (2, shape, args.dtype))  # warm (pinned buffers)
        per_rank = ex.collective_rpc("copy_alone", (10, shape, args.dtype))
        result["parallel_copy_GBps"] = [nbytes / statistics.median(t) / 1e9 for t in per_rank]
        fwd = ex.collective_rpc("forward_alone", (20, args.forward_ms, shape, args.dtype))
        result["forward_alone_ms"] = [1e3 * statistics.median(t) for t in fwd]
        params = {"forward_ms": args.forward_ms, "shape": shape, "dtype": args.dtype}
        # Warm the pool with as many outputs in flight as the run will hold (two running,
        # two taken late): a segment made (and pinned) inside the run stalls it ~150 ms.
        warm = [ex.submit_request(DiffusionRequest(f"w{i}", {**params, "seed": i})) for i in range(10)]
        for w in warm:
            ro = w.result(300)
            assert ro.async_output_id is not None
            ex.release_output(ex.wait_output_ready(ro.async_output_id).result(300))
        slots: list[Any] = []  # running requests: submitted, COMPUTE_DONE not yet in
        outputs: list[str] = []
        done: list[float] = []
        spans: list[tuple[float, float]] = []
        t0 = time.monotonic()

        def take(oid: str) -> None:
            out = ex.wait_output_ready(oid).result(300)
            done.append(time.monotonic())
            spans.append((out.metrics["forward_started_at"], out.metrics["forward_ended_at"]))
            ex.release_output(out)

        for i in range(args.requests):
            # Two running slots, as the engine keeps: a call's COMPUTE_DONE comes only once
            # both ranks answered it (F12), and frees its slot for the next request.
            while len(slots) >= 2:
                outputs.append(slots.pop(0).result(300).async_output_id)
                while len(outputs) > 2:
                    take(outputs.pop(0))
            slots.append(ex.submit_request(DiffusionRequest(f"r{i}", {**params, "seed": i})))
        outputs += [f.result(300).async_output_id for f in slots]
        for oid in outputs:
            take(oid)
        steady = (len(done) - 2) / (done[-1] - done[1])
        result["requests_per_s"] = steady
        result["ideal_per_s"] = 1e3 / max(max(result["forward_alone_ms"]), 1e3 * nbytes / 1e9 / result["parallel_copy_GBps"][0])
        result["efficiency"] = steady / result["ideal_per_s"]
        result["wall_s"] = time.monotonic() - t0
        result["pool"] = str(ex.pool.stats())
        spans.sort()
        result["rank0_forward_ms"] = [round(1e3 * (e - b), 2) for b, e in spans]
        result["rank0_gap_ms"] = [round(1e3 * (spans[i + 1][0] - spans[i][1]), 2) for i in range(len(spans) - 1)]
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
