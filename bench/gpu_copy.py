"""Device->host output copy: the RFC's sync path against the pooled, pinned path.

Measures, for one large bf16 output (>= 400 MB on CUDA, smaller on CPU):

(a) fresh:  ``.cpu()`` then a copy into a freshly created shared-memory segment
            (the RFC's original synchronous path; creation and page faults included);
(b) pooled: ``pack_diffusion_output_shm`` on a side stream into a pooled segment
            registered once with ``cudaHostRegister`` (steady state: reused, no creation);
(c) dma:    the raw side-stream copy into the registered segment, timed by CUDA events;
(d) overlap (CUDA only): a matmul "forward" on the default stream alone, the pooled copy
            alone, and both at once (the copy of request N during the forward of N+1).

Median of ``--runs`` after warm-up; device work is synchronized (or timed with CUDA
events) before any host clock is read.  Writes JSON to ``--out``.

    PYTHONPATH=src python3 bench/gpu_copy.py [--size-mb 448] [--runs 7] [--out bench/results/gpu_copy.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from omni_async.core.messages import DiffusionOutput
from omni_async.transport.packing import pack_diffusion_output_shm, release_packed_output
from omni_async.transport.platform import record_device_event
from omni_async.transport.shm import SHM_DIR, SegmentPool


def timed(fn: Callable[[], None], runs: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary(samples: list[float], nbytes: int | None = None) -> dict[str, Any]:
    med = statistics.median(samples)
    d: dict[str, Any] = {"median_ms": med * 1e3, "min_ms": min(samples) * 1e3, "samples_ms": [s * 1e3 for s in samples]}
    if nbytes:
        d["GBps"] = nbytes / med / 1e9
    return d


def fresh_segment_copy(x: torch.Tensor, name: str) -> None:
    """The RFC's sync path: .cpu(), then a new segment, then a copy into it."""
    host = x.cpu()  # blocks until the device is done and the bytes are in pageable memory
    n = host.numel() * host.element_size()
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
    finally:
        os.close(fd)
    try:
        mv = memoryview(mm)
        dst = torch.frombuffer(mv, dtype=torch.uint8)
        dst.copy_(host.reshape(-1).view(torch.uint8))
        del dst
        mv.release()
    finally:
        mm.close()
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    cuda = torch.cuda.is_available()
    ap.add_argument("--size-mb", type=float, default=448.0 if cuda else 64.0)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_copy.json"))
    args = ap.parse_args()

    st = os.statvfs(SHM_DIR)
    shm_free = st.f_bavail * st.f_frsize
    want = int(args.size_mb * 1e6) // 2 * 2
    # Two live segments of the next power of two (pool + fresh) must fit in /dev/shm.
    if 3 * want > shm_free:
        print(f"note: /dev/shm has {shm_free / 1e6:.0f} MB free; shrinking the output from {want / 1e6:.0f} MB")
        want = int(shm_free / 3) // 2 * 2
    dev = torch.device("cuda" if cuda else "cpu")
    n = want // 2
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "shm_free_bytes": shm_free,
        "bytes": nbytes,
        "dtype": "bfloat16",
        "runs": args.runs,
    }
    pool = SegmentPool(max_bytes=max(4 * nbytes, 1 << 30), max_segments=8)
    side = torch.cuda.Stream() if cuda else None  # type: ignore[no-untyped-call]
    counter = [0]

    def fresh() -> None:
        counter[0] += 1
        fresh_segment_copy(x, f"{pool.prefix}fresh-{counter[0]}")
        if cuda:
            torch.cuda.synchronize()

    def pooled(ev: Any = None) -> None:
        if ev is None:
            ev = record_device_event(x.device)
        packed = pack_diffusion_output_shm(DiffusionOutput("bench", {"video": x}), side, pool=pool, ready_event=ev)
        release_packed_output(packed)

    try:
        result["fresh"] = summary(timed(fresh, args.runs), nbytes)
        pooled()  # warm-up: creates the segment and registers it with CUDA, once
        warm = time.perf_counter()
        pooled()
        result["pooled_second_call_ms"] = (time.perf_counter() - warm) * 1e3
        before = pool.stats()
        result["pooled"] = summary(timed(pooled, args.runs, warmup=0), nbytes)
        after = pool.stats()
        result["pool"] = {
            "created_total": after.created,
            "created_during_timed_runs": after.created - before.created,
            "reused": after.reused,
        }
        result["fresh_over_pooled"] = result["fresh"]["median_ms"] / result["pooled"]["median_ms"]

        if cuda:
            assert side is not None
            lease = pool.lease(nbytes)
            seg, pinned = pool.pinned_view(lease)
            dst = seg[:nbytes]
            src = x.view(torch.uint8)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            dma = []
            for i in range(args.runs + 1):
                with torch.cuda.stream(side):
                    start.record(side)
                    dst.copy_(src, non_blocking=True)
                    end.record(side)
                end.synchronize()
                if i:
                    dma.append(start.elapsed_time(end) / 1e3)
            result["dma"] = summary(dma, nbytes) | {"pinned": pinned}
            del dst, seg
            pool.release(lease)

            a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
            w = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) / 90

            def forward() -> None:
                y = a
                for _ in range(40):
                    y = y @ w

            def forward_alone() -> None:
                forward()
                torch.cuda.synchronize()

            def both() -> None:
                # The packer thread copies the previous output while the main thread's
                # forward runs on the default stream (the production arrangement).  The
                # event is recorded BEFORE the forward is queued, as the worker records it
                # after the previous forward: the copy waits for that one only.
                ev = record_device_event(x.device)
                t = threading.Thread(target=pooled, args=(ev,), name="omni-packer-bench")
                t.start()
                forward()
                t.join()
                torch.cuda.synchronize()

            result["overlap"] = {
                "forward_alone": summary(timed(forward_alone, args.runs)),
                "copy_alone": summary(timed(pooled, args.runs)),
                "both": summary(timed(both, args.runs)),
            }
            o = result["overlap"]
            ideal = max(o["forward_alone"]["median_ms"], o["copy_alone"]["median_ms"])
            serial = o["forward_alone"]["median_ms"] + o["copy_alone"]["median_ms"]
            o["both_over_max"] = o["both"]["median_ms"] / ideal
            o["both_over_sum"] = o["both"]["median_ms"] / serial
    finally:
        pool.close()

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    mb = nbytes / 1e6
    print(f"{result['device']}, torch {result['torch']}, {mb:.0f} MB bf16, median of {args.runs}")
    print(f"  (a) .cpu() + fresh segment : {result['fresh']['median_ms']:9.1f} ms  {result['fresh']['GBps']:6.2f} GB/s")
    print(
        f"  (b) pooled pack            : {result['pooled']['median_ms']:9.1f} ms  {result['pooled']['GBps']:6.2f} GB/s"
    )
    print(f"      fresh / pooled         : {result['fresh_over_pooled']:9.1f} x")
    print(f"      segments created during timed runs: {result['pool']['created_during_timed_runs']}")
    if cuda:
        print(f"  (c) raw DMA (CUDA events)  : {result['dma']['median_ms']:9.1f} ms  {result['dma']['GBps']:6.2f} GB/s")
        o = result["overlap"]
        print(
            f"  (d) forward {o['forward_alone']['median_ms']:.1f} ms, copy {o['copy_alone']['median_ms']:.1f} ms, "
            f"both {o['both']['median_ms']:.1f} ms (both/max {o['both_over_max']:.2f}, both/sum {o['both_over_sum']:.2f})"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
