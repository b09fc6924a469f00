"""The segment pool's crash-safe lock: what it costs, and how often a kill lands inside it.

* ``lease + release`` of a pooled 1 MiB segment, uncontended, per pair (the lock is taken
  twice): the price of the ``threading.Lock`` + ``flock(2)`` pair and the holder mark.
* ``--kills N``: spawn N children that lease, write and release as fast as they can and
  SIGKILL each at a random moment; count how many died inside the lock (``repairs``) and
  check after each that the table is true (nothing leased, the files under /dev/shm are
  the segments the table names).  Before the flock lock, each such kill wedged the pool.

Usage: ``python bench/pool_lock.py [--pairs N] [--kills N] [--out PATH]``; prints the
figures and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import _shm_children as children  # noqa: E402  (the same child the tests kill)

from omni_async.transport.shm import SegmentPool, list_segments  # noqa: E402


def pair_cost_us(pairs: int, repeat: int = 5) -> float:
    with SegmentPool(max_bytes=64 << 20) as pool:
        pool.prewarm(1 << 20)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(pairs):
                pool.release(pool.lease(1 << 20))
            best = min(best, (time.perf_counter() - t0) / pairs * 1e6)
        return best


def kill_at_random(kills: int, seed: int = 1) -> dict[str, int]:
    spawn = multiprocessing.get_context("spawn")
    rng = random.Random(seed)
    with SegmentPool(max_bytes=2 << 20, max_segments=6) as pool:
        for i in range(kills):
            busy = pool.stats().leased + 200
            p = spawn.Process(target=children.lease_and_release_forever, args=(pool, i))
            p.start()
            while pool.stats().leased < busy:
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.05))
            assert p.pid is not None
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            pool.reclaim_owner(p.pid)
            if pool.outstanding() or set(list_segments(pool.prefix)) != set(pool.segment_names()):
                raise SystemExit(f"the table is not true after kill {i}: {pool.stats()}")
        st = pool.stats()
        return {"kills": kills, "died_inside_the_lock": st.repairs, "leases": st.leased}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "lease_release_pair_us": round(pair_cost_us(args.pairs), 2),
        **kill_at_random(args.kills),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
