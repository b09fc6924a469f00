"""``omni-async``: command-line entry point.

``omni-async demo`` runs the reference stack end to end: an executor, its
workers (processes by default, threads with ``--executor inproc``) running
``TinyDiffusionWorker``, and an engine-side loop that submits requests, awaits
every output with a deadline, and checks each one: its bytes against the digest the
worker took before packing (the transport is bit-exact), its values against a fresh
local forward (it is that request's image).  Ctrl-C shuts the executor down in
order and exits with 130, reporting in one line whether any shared memory is left.

``omni-async cleanup`` removes what crashed executors left in ``/dev/shm``: the
segments and lock files of pools whose executor (the pid in their names) no longer
runs.  ``--dry-run`` only lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence

import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.tiny import TinyDiffusionWorker, image_digest
from omni_async.transport.shm import files

# The exit status of a process that a SIGINT ended (128 + 2), as shells report it.
EXIT_INTERRUPTED = 130


def _make_worker(device: str, width: int, steps: int) -> TinyDiffusionWorker:
    return TinyDiffusionWorker(device=device, width=width, steps=steps)


def _build_executor(args: argparse.Namespace) -> DiffusionExecutor:
    deadlines = Deadlines.from_env(compute_timeout=args.compute_timeout, output_timeout=args.output_timeout)
    if args.executor == "inproc":
        return InProcessExecutor(
            lambda rank: _make_worker(args.device, args.width, args.steps),
            world_size=args.world_size,
            deadlines=deadlines,
        )
    return MultiprocDiffusionExecutor(
        WorkerSpec(
            "omni_async.models.tiny:TinyDiffusionWorker",
            kwargs={"device": args.device, "width": args.width, "steps": args.steps},
        ),
        world_size=args.world_size,
        deadlines=deadlines,
        options=WorkerOptions(device=args.device),
    )


def demo(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA requested but not available", file=sys.stderr)
        return 2
    reference = TinyDiffusionWorker(device="cpu", width=args.width, steps=args.steps)
    requests = [
        DiffusionRequest(f"req-{i}", {"seed": i, "height": args.height, "keep_trajectory": i % 2 == 0})
        for i in range(args.requests)
    ]
    expected = {r.request_id: reference.execute_model(r).output["image"] for r in requests}
    t0 = time.perf_counter()
    ex = _build_executor(args)
    try:
        started = time.perf_counter()
        print(f"executor {type(ex).__name__} up in {started - t0:.2f}s "
              f"(world_size={args.world_size}, device={args.device})")
        announced = []
        for i in range(0, len(requests), args.batch):
            chunk = requests[i : i + args.batch]
            outs = ex.execute_batch(chunk) if len(chunk) > 1 else [ex.execute_request(chunk[0])]
            announced.extend(outs)
        computed = time.perf_counter()
        bad = 0
        for ro in announced:
            assert ro.async_output_id is not None
            out: DiffusionOutput = ex.wait_output_ready(ro.async_output_id).result(timeout=args.output_timeout)
            got = out.output["image"].to("cpu")
            # The bytes: exactly what the worker computed (its digest, taken before
            # packing).  The values: this request's image, against a CPU forward; a
            # tolerance, since GPU kernels and even CPU BLAS differ in the last bits
            # (see model.py).
            intact = int(image_digest(got)) == int(out.output["digest"])
            diff = (got.double() - expected[ro.request_id].double()).abs()
            if not intact or float(diff.max()) > 0.05:
                bad += 1
                print(f"mismatch: {ro.request_id} (output {ro.async_output_id}): bytes "
                      f"{'intact' if intact else 'CHANGED in transit'}, max |diff| from the reference "
                      f"{float(diff.max()):g}", file=sys.stderr)
            ex.release_output(out)
        done = time.perf_counter()
        m = ex.metrics()
        print(f"{len(requests)} requests: all COMPUTE_DONE after {computed - started:.3f}s, "
              f"all outputs after {done - started:.3f}s; {bad} mismatched")
        print("metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(m.items())))
        if m["pending_outputs"] or m["held_payloads"]:
            print("registry not empty at the end", file=sys.stderr)
            bad += 1
        if isinstance(ex, MultiprocDiffusionExecutor):
            st = ex.pool.stats()
            print(f"segment pool: {st.segments} segments, {st.created} created, {st.reused} reused, "
                  f"{st.outstanding} still leased")
            if st.outstanding:
                print("segments still leased at the end", file=sys.stderr)
                bad += 1
    finally:
        with _sigint_ignored():  # a second Ctrl-C must not cut the shutdown short
            ex.shutdown()
    return 1 if bad else 0


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def interrupted() -> int:
    """After Ctrl-C: one line on what is left of this process's shared memory; 130."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    left = files.entries(f"{files.SHM_PREFIX_ROOT}{os.getpid()}-")
    how = "shut down cleanly" if not left else "shut down"
    print(f"interrupted; {how}, {len(left)} shared-memory files left", file=sys.stderr)
    return EXIT_INTERRUPTED


def cleanup(args: argparse.Namespace) -> int:
    """Remove (or with --dry-run list) the /dev/shm files of executors that died."""
    found = files.dead_executor_files()
    removed: list[files.DeadFile] = []
    failed = 0
    for f in found:
        why = f"{f.size} bytes, executor pid {f.pid} not running"
        if args.dry_run:
            print(f"would remove {f.path} ({why})")
            removed.append(f)
            continue
        try:
            gone = files.unlink(f.name)
        except OSError as exc:
            print(f"cannot remove {f.path}: {exc}", file=sys.stderr)
            failed += 1
            continue
        if gone:
            print(f"removed {f.path} ({why})")
            removed.append(f)
    verb = "would remove" if args.dry_run else "removed"
    pids = sorted({f.pid for f in removed})
    print(
        f"{verb} {len(removed)} file(s), {sum(f.size for f in removed)} bytes, "
        f"of {len(pids)} dead executor(s)" + (f": pid(s) {', '.join(map(str, pids))}" if pids else "")
    )
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-async")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the reference stack end to end and check every output")
    d.add_argument("--executor", choices=("multiproc", "inproc"), default="multiproc")
    d.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    d.add_argument("--world-size", type=int, default=1)
    d.add_argument("--requests", type=int, default=16)
    d.add_argument("--batch", type=int, default=2)
    # 256 x 256 fp32 = 256 KiB per image: above the inline threshold, so the
    # images travel through the shared-memory pool.
    d.add_argument("--height", type=int, default=256)
    d.add_argument("--width", type=int, default=256)
    d.add_argument("--steps", type=int, default=4)
    d.add_argument("--compute-timeout", type=float, default=60.0)
    d.add_argument("--output-timeout", type=float, default=60.0)
    c = sub.add_parser(
        "cleanup", help="remove the shared memory (/dev/shm) left by executors that died without cleaning up"
    )
    c.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    args = parser.parse_args(argv)
    if args.command == "cleanup":
        return cleanup(args)
    assert args.command == "demo"
    try:
        return demo(args)
    except KeyboardInterrupt:
        return interrupted()


if __name__ == "__main__":
    sys.exit(main())
