"""The Ray executor's host pack on a GPU (a rank on a node without the executor's pool):
device-to-host into a pageable buffer or a pinned one (``pack_diffusion_output_host``'s
``pin_memory``), then the copy ``ray.put`` makes (here: a memcpy into a preallocated
buffer, as into the object store).  No Ray needed: the probe times the two steps the
packer thread runs, per output, over ``--n`` outputs.

Usage (a GPU):  PYTHONPATH=src python3 bench/probes/host_pack.py --out host_pack.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from omni_async.core.messages import DiffusionOutput
from omni_async.transport.packing import pack_diffusion_output_host
from omni_async.transport.platform import record_device_event


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="81,3,720,1280")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    shape = [int(x) for x in a.shape.split(",")]
    x = torch.randn(shape, device="cuda").to(getattr(torch, a.dtype))
    nbytes = x.numel() * x.element_size()
    store = np.empty(nbytes + (1 << 20), np.uint8)  # stands for the object store's memory
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "bytes": nbytes,
    }
    for pinned in (False, True, False, True):  # interleaved: the second pair shows drift
        pack_s: list[float] = []
        put_s: list[float] = []

        def put(buf: Any) -> str:
            t = time.perf_counter()
            store[: buf.nbytes] = buf
            put_s.append(time.perf_counter() - t)  # noqa: B023 (called within this iteration)
            return "k"

        for i in range(a.n + 1):
            ev = record_device_event(x.device)
            t0 = time.perf_counter()
            pack_diffusion_output_host(DiffusionOutput("r", {"x": x}), side, put=put, ready_event=ev, pin_memory=pinned)
            if i:  # the first allocates (and, pinned, registers) its buffer
                pack_s.append(time.perf_counter() - t0 - put_s[-1])
            else:
                put_s.pop()
        key = "pinned" if pinned else "pageable"
        d2h = statistics.median(pack_s)
        cp = statistics.median(put_s)
        result.setdefault(key, []).append(
            {
                "d2h_ms": round(1e3 * d2h, 2),
                "d2h_GBps": round(nbytes / d2h / 1e9, 2),
                "put_copy_ms": round(1e3 * cp, 2),
                "put_copy_GBps": round(nbytes / cp / 1e9, 2),
            }
        )
        print(key, result[key][-1], flush=True)
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
