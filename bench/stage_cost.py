"""What a uint8 device stage costs the forward running beside it (CUDA only).

In a forward-bound worker the packer's device stage runs on its own stream while the
next forward runs: the stage's kernels take SMs and memory bandwidth from it.  This
measures, on one GPU, for a bf16 output of ``--shape``:

* the stage alone: eager (four passes), the fused kernel ``U8`` (``torch.compile``,
  dynamic sizes: what the worker runs), the same compiled for the one shape, and a
  ``clone`` of the input as the memory system's reference (bytes moved / time);
* a forward (``SyntheticForwardWorker``'s matmul loop, ``--forward-ms``) alone, and with
  one stage queued on a side stream at its start: what the stage adds to the forward.

Every time is from CUDA events.  Prints a table and writes JSON (``--json``).

    python3 bench/stage_cost.py --json bench/results/stage_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from omni_async.models.synthetic import U8, u8_eager


def device_ms(fn: Callable[[], object], reps: int, stream: torch.cuda.Stream | None = None) -> float:
    """The median of ``reps`` device times of ``fn`` (ms), after two warm-up calls."""
    s = stream if stream is not None else torch.cuda.current_stream()
    times = []
    for i in range(reps + 2):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(s):
            start.record()
            fn()
            end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="121,1080,1920,3", help="the output's shape (bf16)")
    ap.add_argument("--forward-ms", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("stage_cost: needs CUDA", file=sys.stderr)
        return 2
    shape = tuple(int(v) for v in args.shape.split(","))
    x = (torch.rand(shape, device="cuda") * 2.4 - 1.2).to(torch.bfloat16)
    gb = x.nbytes / 1e9
    U8.warm_up("cuda", [torch.bfloat16])
    static = torch.compile(u8_eager, dynamic=False, options={"emulate_precision_casts": True})
    assert torch.equal(static(x), u8_eager(x))
    # Without eager's roundings (not bit for bit: only to see what they cost).
    loose = torch.compile(u8_eager, dynamic=True)
    loose_static = torch.compile(lambda t: u8_eager(t), dynamic=False)
    rows = {
        "clone (reference: read + write the input)": (device_ms(x.clone, args.reps), 2 * gb),
        "eager (4 passes)": (device_ms(lambda: u8_eager(x), args.reps), None),
        "fused, dynamic sizes (the worker's)": (device_ms(lambda: U8.apply(x), args.reps), 1.5 * gb),
        "fused, this shape only": (device_ms(lambda: static(x), args.reps), 1.5 * gb),
        "fused, dynamic, no eager roundings": (device_ms(lambda: loose(x), args.reps), 1.5 * gb),
        "fused, this shape, no eager roundings": (device_ms(lambda: loose_static(x), args.reps), 1.5 * gb),
    }
    report: dict[str, object] = {
        "command": " ".join(sys.argv),
        "shape": shape,
        "input_GB": gb,
        "gpu": torch.cuda.get_device_name(),
    }
    print(f"stage alone, bf16 {shape} ({gb:.2f} GB), median of {args.reps}, device events:")
    stages = {}
    for name, (ms, moved) in rows.items():
        bw = f"{moved / ms:.2f} TB/s of traffic" if moved else ""
        print(f"  {name:45s} {ms:7.3f} ms  {bw}")
        stages[name] = {"ms": ms, "traffic_TBps": (moved / ms) if moved else None}
    report["stage_alone"] = stages

    # The synthetic forward: a matmul loop calibrated to --forward-ms.
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    one = device_ms(lambda: a @ b, 10)
    n = max(1, round(args.forward_ms / one))

    def forward() -> None:
        y = a
        for _ in range(n):
            y = y @ b

    high = -1  # torch.cuda.Stream: priority -1 (high) or 0 (low, the default streams')
    alone = device_ms(forward, args.reps)
    results = {"forward_alone_ms": alone}
    print(f"forward ({n} matmuls of 4096^2 bf16), median of {args.reps}: alone {alone:.3f} ms")
    cases = [
        ("fused, dynamic sizes", lambda: U8.apply(x), 0),
        ("fused, dynamic sizes, high-priority stream", lambda: U8.apply(x), high),
        ("fused, this shape only", lambda: static(x), 0),
        ("fused, this shape only, high-priority stream", lambda: static(x), high),
        ("eager", lambda: u8_eager(x), 0),
        ("on the forward's stream, after it (fused, dynamic)", lambda: U8.apply(x), None),
    ]
    for name, stage, priority in cases:
        side = torch.cuda.Stream(priority=priority or 0)  # type: ignore[no-untyped-call]

        def both(
            stage: Callable[[], object] = stage, side: torch.cuda.Stream = side, serial: bool = priority is None
        ) -> None:
            if serial:
                forward()
                stage()
                return
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                stage()
            forward()
            torch.cuda.current_stream().wait_stream(side)

        ms = device_ms(both, args.reps)
        results[f"forward_with_{name}_ms"] = ms
        print(f"  with the stage ({name}): {ms:.3f} ms (+{ms - alone:.3f} ms, {alone / ms:.3f} of alone)")
    report["forward"] = results
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
