"""How fast does a worker's death reach the engine?  From SIGKILL to the failed future.

Issue 4 asks that a dead worker fail every pending waiter within a second.  Tests bound
it loosely (CI machines are shared); this measures it: ``--runs`` times each,

* ``mid-forward``: two ranks; rank 1 is SIGKILLed while its forward sleeps; the time
  until the pending execute call fails with ``WorkerDied``;
* ``mid-pack``: one rank with a one-segment pool; the engine holds the segment, so the
  second output's pack waits for it; the rank is SIGKILLed; the time until that output's
  waiter fails with ``WorkerDied``.

Usage: ``python bench/worker_death.py [--runs N] [--out PATH]``; prints the figures and
writes them (every sample) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from concurrent.futures import Future
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from omni_async.core.config import Deadlines  # noqa: E402
from omni_async.core.errors import WorkerDied  # noqa: E402
from omni_async.core.messages import DiffusionRequest  # noqa: E402
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec  # noqa: E402
from omni_async.transport.shm import SegmentPool  # noqa: E402

SPEC = WorkerSpec("_mp_workers:ScriptedWorker", pass_rank=True)
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


def _time_to_failure(ex: MultiprocDiffusionExecutor, fut: Future[Any], rank: int) -> float:
    pid = ex.procs[rank].pid
    assert pid is not None
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        fut.result(timeout=30)
    except WorkerDied:
        return time.monotonic() - t0
    raise SystemExit("the future did not fail with WorkerDied")


def mid_forward() -> float:
    with MultiprocDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES) as ex:
        fut = ex.submit(DiffusionRequest("slow", {"sleep": 30})).computed
        time.sleep(0.3)
        return _time_to_failure(ex, fut, rank=1)


def mid_pack() -> float:
    pool = SegmentPool(max_bytes=1 << 20, max_segments=1)
    params = {"seed": 31, "numel": (1 << 18) - 1024}
    with MultiprocDiffusionExecutor(
        SPEC, deadlines=DEADLINES, options=WorkerOptions(lease_timeout=60), pool=pool
    ) as ex:
        first = ex.execute_request(DiffusionRequest("p1", params))
        held = ex.wait_output_ready(first.async_output_id or "").result(timeout=30)
        second = ex.execute_request(DiffusionRequest("p2", params))
        fut = ex.wait_output_ready(second.async_output_id or "")
        time.sleep(0.3)
        took = _time_to_failure(ex, fut, rank=0)
        del held
        return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
    }
    for name, fn in (("mid_forward", mid_forward), ("mid_pack", mid_pack)):
        samples = [fn() * 1e3 for _ in range(args.runs)]
        result[name] = {
            "median_ms": round(statistics.median(samples), 2),
            "max_ms": round(max(samples), 2),
            "samples_ms": [round(s, 2) for s in samples],
        }
        print(f"{name}: SIGKILL -> WorkerDied median {statistics.median(samples):.1f} ms, max {max(samples):.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
