"""Where do the missing milliseconds go?  GPU-side timestamps of every forward.

A ``SyntheticVideoWorker`` that records a CUDA event on its compute stream at the start
and end of each forward, run behind ``MultiprocDiffusionExecutor`` in request mode
(async packing), with a consumer thread that awaits and releases each output.  After
the run the worker reports, from the events (GPU clock, not host clock):

* each forward's GPU duration, and the GPU idle gap between one forward's end and the
  next one's start;
* the same forward run back to back in the same process with nothing else (sustained,
  before and after the pipeline run), and with a side-stream copy of the output into
  pinned host memory beside it;
* host-side: when each forward was entered and returned (perf_counter), to see whether
  the host fell behind the GPU.

Usage (on the GPU machine, from the repository root):

    PYTHONPATH=src:bench/probes python3 bench/probes/gpu_gaps.py --out gpu_gaps.json
"""

from __future__ import annotations

import argparse
import collections
import json
import queue
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.executor import RequestHandle
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.tiny import SyntheticVideoWorker


class GapWorker(SyntheticVideoWorker):
    """Records a start and an end event around every forward (on the current stream)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.marks: list[tuple[Any, Any, float, float]] = []
        self.base = torch.cuda.Event(enable_timing=True)
        self.base.record()

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        h0 = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = super().execute_model(request)
        end.record()
        self.marks.append((start, end, h0, time.perf_counter()))
        return out

    def gpu_marks(self) -> dict[str, Any]:
        torch.cuda.synchronize()
        rows = [(self.base.elapsed_time(s), self.base.elapsed_time(e), h0, h1) for s, e, h0, h1 in self.marks]
        self.marks.clear()
        return _summary(rows)

    def sustained(self, n: int, copy: bool = False) -> dict[str, Any]:
        """``n`` forwards back to back; with ``copy``, each output is copied to pinned host
        memory on a side stream while the next forward runs (as the packer does)."""
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        host = torch.empty(self.numel, dtype=self.dtype, pin_memory=True) if copy else None
        self.marks.clear()
        for i in range(n):
            out = self.execute_model(DiffusionRequest(f"s{i}", {"seed": i}))
            if host is not None:
                ev = torch.cuda.Event()
                ev.record()
                with torch.cuda.stream(side):
                    side.wait_event(ev)
                    host.copy_(out.output["video"], non_blocking=True)
        torch.cuda.synchronize()
        return self.gpu_marks()

    def clocks(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for name in ("clock_rate", "power_draw", "temperature", "utilization"):
            fn = getattr(torch.cuda, name, None)
            try:
                info[name] = fn() if fn is not None else None
            except Exception as exc:  # noqa: BLE001 - a probe: report what failed
                info[name] = f"unavailable: {exc}"
        return info


def _summary(rows: list[tuple[float, float, float, float]]) -> dict[str, Any]:
    dur = [e - s for s, e, _, _ in rows]
    gaps = [rows[i + 1][0] - rows[i][1] for i in range(len(rows) - 1)]
    host_ret = [h1 - h0 for _, _, h0, h1 in rows]
    period = (rows[-1][1] - rows[0][0]) / len(rows) if rows else 0.0
    return {
        "n": len(rows),
        "forward_gpu_ms_median": statistics.median(dur) if dur else None,
        "forward_gpu_ms": [round(x, 2) for x in dur],
        "gap_gpu_ms": [round(x, 3) for x in gaps],
        "gap_gpu_ms_total": sum(gaps),
        "period_gpu_ms": period,
        "host_forward_call_ms": [round(x * 1e3, 2) for x in host_ret],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--output-mb", type=float, default=448.0)
    p.add_argument("--matmuls", type=int, default=32)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--max-in-flight", type=int, default=2)
    p.add_argument("--submitted", type=int, default=2, help="requests kept submitted ahead")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = WorkerSpec(
        "gpu_gaps:GapWorker", {"device": "cuda", "output_mb": args.output_mb, "matmuls": args.matmuls, "dim": args.dim}
    )
    opts = WorkerOptions(device="cuda", max_outputs_in_flight=args.max_in_flight, lease_timeout=120)
    deadlines = Deadlines(compute_timeout=300, output_timeout=300, rpc_timeout=300)
    result: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "torch": torch.__version__}
    with MultiprocDiffusionExecutor(
        spec, deadlines=deadlines, options=opts, max_held_bytes=4 << 30, max_held_outputs=8
    ) as ex:
        result["clocks_before"] = ex.collective_rpc("clocks")[0]
        result["sustained_before"] = ex.collective_rpc("sustained", args=(args.requests,))[0]
        result["sustained_copy"] = ex.collective_rpc("sustained", args=(args.requests, True))[0]
        # warm the pipeline (segments, pinning), then drop those marks
        for phase in ("warm", "run"):
            n = 4 if phase == "warm" else args.requests
            ids: queue.Queue[Future[DiffusionOutput] | None] = queue.Queue()
            done: list[float] = []
            packs: list[dict[str, float]] = []

            # The thread is joined inside this iteration: binding late is what it wants.
            def consume() -> None:
                while (output := ids.get()) is not None:  # noqa: B023
                    out = output.result(timeout=300)
                    done.append(time.perf_counter())  # noqa: B023
                    packs.append(dict(out.metrics))  # noqa: B023
                    ex.release_output(out)

            t = threading.Thread(target=consume)
            t.start()
            pending: collections.deque[RequestHandle] = collections.deque()
            t0 = time.perf_counter()

            def announce(h: RequestHandle) -> None:
                h.computed.result(timeout=300)  # COMPUTE_DONE: its output claimed for the handle
                ids.put(h.output)  # noqa: B023

            for i in range(n):
                while len(pending) >= args.submitted:
                    announce(pending.popleft())
                pending.append(ex.submit(DiffusionRequest(f"{phase}{i}", {"seed": i})))
            while pending:
                announce(pending.popleft())
            ids.put(None)
            t.join()
            wall = max(done) - t0
            marks = ex.collective_rpc("gpu_marks")[0]
            if phase == "run":
                result["pipeline"] = marks
                result["pipeline_ms_per_request"] = wall / n * 1e3
                result["pack_metrics"] = packs
                result["done_at_ms"] = [round((x - t0) * 1e3, 2) for x in done]
        result["clocks_after_pipeline"] = ex.collective_rpc("clocks")[0]
        result["sustained_after"] = ex.collective_rpc("sustained", args=(args.requests,))[0]
    for k in ("sustained_before", "sustained_copy", "pipeline", "sustained_after"):
        r = result[k]
        print(
            f"{k:18s} forward(gpu) median {r['forward_gpu_ms_median']:7.2f} ms  period {r['period_gpu_ms']:7.2f} ms"
            f"  gaps total {r['gap_gpu_ms_total']:7.2f} ms over {r['n']}"
        )
    print(f"pipeline wall per request {result['pipeline_ms_per_request']:.2f} ms")
    print("pipeline gaps", result["pipeline"]["gap_gpu_ms"])
    print("pipeline forwards", result["pipeline"]["forward_gpu_ms"])
    print("pack_s ms", [round(m.get("pack_s", 0) * 1e3, 2) for m in result["pack_metrics"]])
    print("done at", result["done_at_ms"])
    print("clocks", result["clocks_before"], result["clocks_after_pipeline"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
