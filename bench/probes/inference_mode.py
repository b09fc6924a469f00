"""One pipeline's forward called directly, under its own ``no_grad`` against inside
``torch.inference_mode()`` (what a worker runs forwards in: ``WorkerOptions.inference_mode``),
in one process, alternating, with the outputs compared.

    python3 bench/probes/inference_mode.py --preset cpu-launch --json bench/results/inference_mode_cpu.json
    python3 bench/probes/inference_mode.py --preset h200 --json ...   # on the device

A forward bound by the host thread that launches its ops (PixArt-Sigma-512 on a GPU; the
``cpu-launch`` preset on a CPU) pays autograd's bookkeeping on every op under ``no_grad``;
inference mode skips it.  Times: the call's wall time on the host, from its start to its
output on the host (``DirectLoop.call``: the ``.cpu()`` waits for the device)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import diffusers_serving as ds  # noqa: E402  (bench/diffusers_serving.py: the presets and the direct loop)

MODES = ("no_grad", "inference_mode")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("cpu-launch", "h200"), default="cpu-launch")
    parser.add_argument("--workload", default="pixart")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each mode, the order reversed every other one")
    parser.add_argument("--calls", type=int, default=2, help="calls of each mode in a round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    preset = ds.PRESETS[args.preset]
    device = str(preset["device"])
    if device == "cpu":
        torch.set_num_threads(1)  # as the cpu-launch bench runs (OMP_NUM_THREADS=1)
    loop = ds.DirectLoop(args.workload, preset["workloads"][args.workload], device)
    (request,) = ds.requests(args.workload, preset["workloads"][args.workload], 1, "probe")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    first: dict[str, Any] = {}
    equal = True
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            for _ in range(args.calls):
                context = torch.inference_mode() if mode == "inference_mode" else contextlib.nullcontext()
                t0 = time.perf_counter()
                with context:
                    pixels, _ = loop.call(request)
                times[mode].append(time.perf_counter() - t0)
                if mode in first:
                    equal = equal and bool(np.array_equal(first[mode], pixels))
                first.setdefault(mode, pixels)
    equal = equal and bool(np.array_equal(first["no_grad"], first["inference_mode"]))
    medians = {m: statistics.median(v) for m, v in times.items()}
    for m in MODES:
        print(f"{m:15} median {medians[m]:.4f} s  calls {' '.join(f'{t:.3f}' for t in times[m])}")
    ratio = medians["inference_mode"] / medians["no_grad"]
    print(f"inference_mode / no_grad: {ratio:.3f}   outputs equal: {equal}")
    if args.json:
        report = {
            "command": " ".join(["python3", *sys.argv]),
            "preset": args.preset,
            "workload": args.workload,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__,
            "median_s": medians,
            "calls_s": times,
            "inference_over_no_grad": round(ratio, 4),
            "outputs_equal": equal,
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
