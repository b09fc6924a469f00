"""The engine's event loop's longest stall while 16 encodes run (issue 31), several runs,
per number of encoder processes (``omni_async.cli.bench_loop``; ``omni-async bench``
prints one run of it after its sweep).

    PYTHONPATH=src python3 bench/loop_stall.py --runs 3 --workers 1,2 --json bench/results/loop_stall_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

from omni_async.cli.bench_loop import loop_stall_line, run_loop_stall


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", default="1,2", help="encoder processes, comma-separated (alternated per run)")
    ap.add_argument("--encodes", type=int, default=16)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--format", default="png")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    rows = []
    for r in range(args.runs):
        for w in workers if r % 2 == 0 else workers[::-1]:
            row = run_loop_stall(args.device, args.encodes, args.side, args.format, encode_workers=w)
            rows.append(row)
            print(f"encode_workers={w}: {loop_stall_line(row).splitlines()[0]}", flush=True)
    if args.json is not None:
        report = {
            "command": shlex.join(["python3", "bench/loop_stall.py", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {os.cpu_count()} cpus, {platform.machine()}",
            "rows": rows,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
