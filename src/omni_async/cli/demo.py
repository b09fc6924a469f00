"""``omni-async demo`` runs the reference stack end to end: an executor, its
workers (processes by default, threads with ``--executor inproc``) running
``TinyDiffusionWorker``, and an ``AsyncDiffusionEngine`` over it that is handed every
request at once and serves them (its scheduler never lets more outputs wait unclaimed
than the executor's budget of held outputs: the rest wait in the engine's queue, not
in a packer while their output deadlines run).  Each result is checked: its bytes
against the digest the worker took before packing (the transport is bit-exact), its
values against a fresh local forward (it is that request's image).  Ctrl-C closes the
engine, shuts the executor down in order and exits with 130, reporting in one line
whether any shared memory is left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator

import torch

from omni_async.cli import options
from omni_async.core.config import Deadlines
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.tiny import TinyDiffusionWorker, image_digest
from omni_async.transport.shm import files

# The exit status of a process that a SIGINT ended (128 + 2), as shells report it.
EXIT_INTERRUPTED = 130

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``omni-async demo``."""
    d = sub.add_parser(
        "demo",
        help="run the reference stack end to end and check every output",
        description=(
            "Start an executor with TinyDiffusionWorker and an AsyncDiffusionEngine over it, hand the "
            "engine every request at once, wait for every result and check its bytes (against the digest the worker took) and its values (against "
            "a local CPU forward).  Exit status 0: every output arrived intact and nothing was "
            "left behind; 1: a mismatch or a leak; 2: bad arguments."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument(
        "--executor",
        choices=("multiproc", "inproc"),
        default="multiproc",
        help="multiproc: worker processes and shared memory; inproc: worker threads in this process",
    )
    d.add_argument(
        "--device", type=options.device, default="cpu", help="where the workers compute: cpu, cuda or cuda:<index>"
    )
    d.add_argument(
        "--world-size", type=options.positive_int, default=1, help="number of worker ranks (rank 0 ships outputs)"
    )
    d.add_argument("--requests", type=options.positive_int, default=16, help="number of requests to submit")
    d.add_argument(
        "--max-running",
        type=options.positive_int,
        default=2,
        help="the engine's max_running: requests sent to the workers whose forward has not finished",
    )
    # 256 x 256 fp32 = 256 KiB per image: above the inline threshold, so the
    # images travel through the shared-memory pool.
    d.add_argument("--height", type=options.image_side, default=256, help="image height in pixels, a multiple of 8")
    d.add_argument("--width", type=options.image_side, default=256, help="image width in pixels, a multiple of 8")
    d.add_argument("--steps", type=options.positive_int, default=4, help="denoising steps per request")
    d.add_argument(
        "--compute-timeout",
        type=options.seconds,
        default=60.0,
        help="seconds from submitting an execute call until every rank has answered; 0 or 'none': no limit",
    )
    d.add_argument(
        "--output-timeout",
        type=options.seconds,
        default=60.0,
        help="seconds from COMPUTE_DONE until the output is delivered; 0 or 'none': no limit",
    )
    # The demo hands the engine every request at once: the engine runs at most this many
    # (running or holding an output), the rest wait in its queue.
    d.add_argument(
        "--max-held-outputs",
        type=options.positive_int,
        default=None,
        help=(
            "the executor's budget of outputs held in shared memory (multiproc; None: 64); the engine "
            "keeps its requests in flight within it"
        ),
    )
    d.set_defaults(subparser=d, check=_check, run=run)


def _check(args: argparse.Namespace) -> None:
    # The OMNI_ASYNC_*_TIMEOUT variables are read now as well: a bad one is reported
    # like a bad option, before anything starts.
    try:
        _deadlines(args)
    except UsageError as exc:
        args.subparser.error(str(exc))


def _make_worker(device: str, width: int, steps: int) -> TinyDiffusionWorker:
    return TinyDiffusionWorker(device=device, width=width, steps=steps)


def _deadlines(args: argparse.Namespace) -> Deadlines:
    """The options' deadlines over the environment's (``OMNI_ASYNC_*_TIMEOUT``)."""
    return Deadlines.from_env(compute_timeout=args.compute_timeout, output_timeout=args.output_timeout)


def _build_executor(args: argparse.Namespace) -> DiffusionExecutor:
    deadlines = _deadlines(args)
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
        max_held_outputs=args.max_held_outputs,
    )


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt:
        return interrupted()


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


def _run(args: argparse.Namespace) -> int:
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
        print(
            f"executor {type(ex).__name__} up in {started - t0:.2f}s "
            f"(world_size={args.world_size}, device={args.device})"
        )
        bad = asyncio.run(_serve(ex, args, requests, expected))
        m = ex.metrics()
        print("metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(m.items())))
        if m["pending_outputs"] or m["held_payloads"]:
            print("registry not empty at the end", file=sys.stderr)
            bad += 1
        if isinstance(ex, MultiprocDiffusionExecutor):
            st = ex.pool.stats()
            print(
                f"segment pool: {st.segments} segments, {st.created} created, {st.reused} reused, "
                f"{st.outstanding} still leased"
            )
            if st.outstanding:
                print("segments still leased at the end", file=sys.stderr)
                bad += 1
    finally:
        with _sigint_ignored():  # a second Ctrl-C must not cut the shutdown short
            ex.shutdown()
    return 1 if bad else 0


def _check_result(result: GenerationResult, expected: torch.Tensor) -> bool:
    """Whether ``result`` is intact: its bytes exactly what the worker computed (its
    digest, taken before packing; the engine's owned copy is bit-exact), and its values
    this request's image against a CPU forward, within a tolerance, since GPU kernels
    and even CPU BLAS differ in the last bits (see omni_async/models/tiny.py)."""
    got = result.output["image"].to("cpu")
    intact = int(image_digest(got)) == int(result.output["digest"])
    diff = float((got.double() - expected.double()).abs().max())
    if intact and diff <= 0.05:
        return True
    print(
        f"mismatch: {result.request_id}: bytes {'intact' if intact else 'CHANGED in transit'}, "
        f"max |diff| from the reference {diff:g}",
        file=sys.stderr,
    )
    return False


async def _serve(
    ex: DiffusionExecutor,
    args: argparse.Namespace,
    requests: list[DiffusionRequest],
    expected: dict[str, torch.Tensor],
) -> int:
    """Hand the engine every request at once, check each result as it comes; the mismatches
    and the requests that ended without a result, and the engine's own accounting."""
    bad = 0
    compute_done: list[float] = []
    async with AsyncDiffusionEngine(ex, max_running=args.max_running) as engine:
        started = time.monotonic()

        async def one(request: DiffusionRequest) -> None:
            nonlocal bad
            result = await engine.generate(request)
            compute_done.append(result.timings.compute_done_at)
            if not _check_result(result, expected[request.request_id]):
                bad += 1

        outcomes = await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)
        done = time.monotonic()
        for request, outcome in zip(requests, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                bad += 1
                print(f"{request.request_id} failed: {type(outcome).__name__}: {outcome}", file=sys.stderr)
        em = engine.metrics()
    print(
        f"{len(requests)} requests: all COMPUTE_DONE after {max(compute_done, default=started) - started:.3f}s, "
        f"all outputs after {done - started:.3f}s; {bad} mismatched"
    )
    print(
        f"engine: {', '.join(f'{k}={v}' for k, v in sorted(em.requests.items()))}; "
        f"in_flight_limit={em.in_flight_limit}, budget_waits={em.budget_waits}, "
        f"waiting={em.waiting}, running={em.running}, holding={em.holding}"
    )
    if em.requests["finished"] != len(requests) or em.waiting or em.running or em.holding:
        print("the engine did not finish every request, or holds one at the end", file=sys.stderr)
        bad += 1
    return bad
