"""Probe (CUDA only): the uint8 finalize written straight into pinned host memory.

Today's path for a uint8 output is two steps: a fused kernel reads the bf16 output and
writes uint8 to device memory (``U8``), then the copy engine reads that back and sends it
over PCIe.  A Triton kernel can instead store its uint8 results into pinned host memory
directly (zero-copy: the stores cross PCIe themselves): the device never writes nor reads
back the uint8 copy, so the memory traffic that a forward beside it feels drops from
2.25 GB to 1.5 GB for the 1.5 GB video.  Its price: the stores go at PCIe speed, so the
kernel holds its thread blocks for the whole transfer.  This measures, with CUDA events:

* bit-exactness against ``u8_eager`` (to device memory and to pinned memory);
* alone: ``U8`` + copy engine, the copy alone, and the direct kernel at several grid
  sizes (persistent blocks), into ``pin_memory`` and into a registered /dev/shm mapping;
* beside a matmul forward (``--forward-ms``) on another stream: what each costs it.

    python3 bench/probes/direct_u8.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from omni_async.models.synthetic import U8, u8_eager
from omni_async.transport.shm.cuda_host import host_register, host_unregister


@triton.jit
def _u8_direct(x_ptr, y_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for b in range(pid, tl.cdiv(n, BLOCK), nprog):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        y = (x * 127.5).to(tl.bfloat16).to(tl.float32)
        y = (y + 127.5).to(tl.bfloat16).to(tl.float32)
        y = tl.minimum(tl.maximum(y, 0.0), 255.0)
        tl.store(y_ptr + offs, y.to(tl.uint8), mask=m)


def direct(x: torch.Tensor, out: torch.Tensor, grid: int, block: int = 4096, warps: int = 4) -> None:
    n = x.numel()
    _u8_direct[(min(grid, triton.cdiv(n, block)),)](x, out, n, BLOCK=block, num_warps=warps)


def device_ms(fn: Callable[[], object], reps: int) -> float:
    s = torch.cuda.current_stream()
    times = []
    for i in range(reps + 2):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(s)
        fn()
        end.record(s)
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="121,1080,1920,3")
    ap.add_argument("--forward-ms", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--grids", default="4,8,16,32,66,132,264")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    x = (torch.rand(shape, device="cuda") * 2.4 - 1.2).to(torch.bfloat16)
    n = x.numel()
    U8.warm_up("cuda", [torch.bfloat16])
    ref = u8_eager(x)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    # A /dev/shm mapping registered as the pool registers its segments.
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="direct_u8_probe_")
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n)
    shm = torch.frombuffer(mm, dtype=torch.uint8)
    rc = host_register(shm.data_ptr(), n)
    report: dict[str, object] = {
        "command": " ".join(sys.argv),
        "shape": shape,
        "gpu": torch.cuda.get_device_name(),
        "register_rc": rc,
    }
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report["sms"] = sms
    # Bit-exactness.
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    direct(x.view(-1), dev, 4 * sms)
    exact = {"device": bool(torch.equal(dev, ref.view(-1)))}
    pinned.zero_()
    direct(x.view(-1), pinned, 32)
    torch.cuda.synchronize()
    exact["pinned"] = bool(torch.equal(pinned, ref.view(-1).cpu()))
    if rc == 0:
        shm.zero_()
        direct(x.view(-1), shm, 32)
        torch.cuda.synchronize()
        exact["shm"] = bool(torch.equal(shm, ref.view(-1).cpu()))
    report["bit_exact"] = exact
    print("bit exact:", exact, flush=True)

    flat = x.view(-1)
    y = U8(flat)
    alone: dict[str, float] = {}
    alone["U8 alone"] = device_ms(lambda: U8(flat), args.reps)
    alone["direct to device, 4x SMs"] = device_ms(lambda: direct(flat, dev, 4 * sms), args.reps)
    alone["copy engine, uint8 to pinned"] = device_ms(lambda: pinned.copy_(y, non_blocking=True), args.reps)
    alone["U8 + copy engine to pinned"] = device_ms(lambda: pinned.copy_(U8(flat), non_blocking=True), args.reps)
    if rc == 0:
        alone["copy engine, uint8 to shm"] = device_ms(lambda: shm.copy_(y, non_blocking=True), args.reps)  # noqa: F821 (shm is deleted only at the end)
    for g in (int(v) for v in args.grids.split(",")):
        alone[f"direct to pinned, grid {g}"] = device_ms(lambda g=g: direct(flat, pinned, g), args.reps)
        if rc == 0:
            alone[f"direct to shm, grid {g}"] = device_ms(lambda g=g: direct(flat, shm, g), args.reps)  # noqa: F821 (as above)
    print(f"alone (ms; uint8 bytes {n / 1e9:.2f} GB):", flush=True)
    for k, v in alone.items():
        print(f"  {k:40s} {v:8.3f} ms  {n / 1e6 / v:6.1f} GB/s of uint8", flush=True)
    report["alone_ms"] = alone

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    one = device_ms(lambda: a @ b, 10)
    iters = max(1, round(args.forward_ms / one))

    def forward() -> None:
        z = a
        for _ in range(iters):
            z = z @ b

    fwd_alone = device_ms(forward, args.reps)
    beside: dict[str, float] = {"forward alone": fwd_alone}
    side = torch.cuda.Stream()
    dst = shm if rc == 0 else pinned

    def with_side(work: Callable[[], object]) -> Callable[[], None]:
        def both() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                work()
            forward()
            torch.cuda.current_stream().wait_stream(side)

        return both

    cases: dict[str, Callable[[], object]] = {
        "U8 then copy engine (today)": lambda: dst.copy_(U8(flat), non_blocking=True),
        "copy engine alone (bf16 output)": lambda: torch.empty(0),
    }
    for g in (int(v) for v in args.grids.split(",")):
        cases[f"direct, grid {g}"] = lambda g=g: direct(flat, dst, g)
    for name, work in cases.items():
        if name.startswith("copy engine alone"):
            continue
        beside[name] = device_ms(with_side(work), args.reps)
    print(f"beside a forward of {iters} matmuls ({fwd_alone:.2f} ms alone):", flush=True)
    for k, v in beside.items():
        print(f"  {k:40s} {v:8.3f} ms  {fwd_alone / v:.4f} of alone", flush=True)
    report["beside_forward_ms"] = beside
    # The direct kernel's own time while the forward runs (its events on the side stream).
    own: dict[str, float] = {}
    for g in (int(v) for v in args.grids.split(",")):
        ts = []
        for _ in range(args.reps):
            s0 = torch.cuda.Event(enable_timing=True)
            s1 = torch.cuda.Event(enable_timing=True)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                s0.record(side)
                direct(flat, dst, g)
                s1.record(side)
            forward()
            torch.cuda.synchronize()
            ts.append(s0.elapsed_time(s1))
        own[f"direct, grid {g}"] = float(statistics.median(ts))
    print("the direct kernel's own time beside the forward:", flush=True)
    for k, v in own.items():
        print(f"  {k:40s} {v:8.3f} ms  {n / 1e6 / v:6.1f} GB/s", flush=True)
    report["direct_own_ms_beside"] = own
    if rc == 0:
        host_unregister(shm.data_ptr())
    del shm
    try:
        mm.close()
    except BufferError:
        pass
    os.close(fd)
    os.unlink(path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
