"""``omni-async demo``: what the asynchronous output path buys, measured on the reference pipeline.

It starts an executor (worker processes by default, threads with ``--executor inproc``)
running ``DiTPipelineWorker`` (``omni_async.models.dit``: a small DiT, a rectified-flow
sampler and a decoder; its post-process ``"dit"`` turns the pixels into uint8 on the
worker and into PIL images in the engine), and serves the same requests twice through an
``AsyncDiffusionEngine``, each time handed every request at once:

1. ``sync``: the synchronous output path (``async_output=False``): the worker copies each
   output on its main thread before it answers, then takes the next request;
2. ``async``: the asynchronous output path: the worker announces COMPUTE_DONE, starts the
   next forward, and its packer copies the output meanwhile.

Each result is checked: its pixels against the digest the worker took before the copy
(the transport is bit-exact), the same request's pixels in both runs, and nothing left
behind (every request finished, the executor's registry empty, no segment leased).  It
writes to ``--out``: the images (PNG, of the second run), a timeline picture per run (``timeline-sync.png``,
``timeline-async.png``), both timelines as one Chrome trace (``timeline.json``, for
https://ui.perfetto.dev), and prints a summary: throughput, latency p50/p95, the
worker's idle time between forwards and the speed-up (``--json``: the same as JSON).
Ctrl-C closes the engine, shuts the executor down in order and exits with 130,
reporting in one line whether any shared memory is left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import torch

from omni_async.cli.parsers import add_demo as add_parser
from omni_async.cli.parsers import deadlines as _deadlines
from omni_async.cli.figures import ModeSummary, speedup, summarize_mode
from omni_async.cli.timeline import Span, chrome_trace, draw_timeline, forward_intervals, request_spans
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.metrics import ExecutorMetrics
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.dit import PIPELINE, DiTPipelineWorker
from omni_async.models.tiny import image_digest
from omni_async.transport.shm import files

# The exit status of a process that a SIGINT ended (128 + 2), as shells report it.
EXIT_INTERRUPTED = 130
#: The two runs, in the order they run: the synchronous output path is the baseline.
MODES: tuple[str, ...] = ("sync", "async")
_LABELS = {"sync": "sync output path", "async": "async output path"}

__all__ = ["MODES", "add_parser", "run"]



def _build_executor(args: argparse.Namespace) -> DiffusionExecutor:
    deadlines = _deadlines(args)
    if args.executor == "inproc":
        return InProcessExecutor(
            lambda rank: DiTPipelineWorker(device=args.device, steps=args.steps),
            world_size=args.world_size,
            deadlines=deadlines,
            postprocess=PIPELINE,
        )
    return MultiprocDiffusionExecutor(
        WorkerSpec(
            "omni_async.models.dit:make_worker",
            kwargs={"device": args.device, "steps": args.steps},
            postprocess=PIPELINE,
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


@attrs.define
class _Run:
    """One output path's run: what it served, how long it took, what went wrong."""

    mode: str
    started: float = 0.0
    finished: float = 0.0
    spans: list[Span] = attrs.field(factory=list)
    latencies: list[float] = attrs.field(factory=list)
    digests: dict[str, int] = attrs.field(factory=dict)
    images: dict[str, Any] = attrs.field(factory=dict)  # request id -> PIL image, until written
    bad: int = 0


def _requests(args: argparse.Namespace, prefix: str = "req") -> list[DiffusionRequest]:
    shape = {"height": args.height, "width": args.width, "digest": True}
    return [DiffusionRequest(f"{prefix}-{i}", {"seed": i, **shape}) for i in range(args.requests)]


def _run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA requested but not available", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    try:
        os.makedirs(os.path.join(out, "images"), exist_ok=True)
    except OSError as exc:
        print(f"cannot create the output folder {out}: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    ex = _build_executor(args)
    try:
        print(
            f"executor {type(ex).__name__} up in {time.perf_counter() - t0:.2f}s "
            f"(world_size={args.world_size}, device={args.device}, DiT {args.height}x{args.width}, "
            f"{args.steps} steps, {args.requests} requests per run)",
            flush=True,
        )
        warm = asyncio.run(_warm_up(ex, args))
        print(f"warm-up: {len(warm)} forwards ({', '.join(f'{f:.2f}' for f in warm)} s) until they took a steady time")
        runs: dict[str, _Run] = {}
        bad = 0
        for mode in MODES:
            runs[mode] = asyncio.run(_serve(ex, args, mode))
            bad += runs[mode].bad + _leftovers(ex, mode)
        bad += _compare_runs(runs["sync"], runs["async"])
        summaries = {mode: summarize_mode(mode, r.latencies, r.finished - r.started, forward_intervals(r.spans))
                     for mode, r in runs.items()}  # fmt: skip
        _write(out, args, runs, summaries)
        m = ex.metrics()
        print(_executor_line(m))
        if m.pending_outputs or m.held_payloads:
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
        print()
        print(_summary_text(summaries, out, args, ok=not bad))
        if args.json is not None:
            with open(args.json, "w") as fh:
                json.dump(_summary_json(summaries, out, args, ok=not bad) | {"executor_metrics": m.as_dict()}, fh, indent=2)
                fh.write("\n")
    finally:
        with _sigint_ignored():  # a second Ctrl-C must not cut the shutdown short
            ex.shutdown()
    return 1 if bad else 0


# The executor's counters that say something went wrong (the JSON summary has them all).
_PROBLEMS = (
    "timeouts",
    "compute_timeouts",
    "protocol_errors",
    "orphaned_outputs",
    "dispatch_errors",
    "pending_outputs",
    "pending_rpcs",
    "held_payloads",
)


def _executor_line(metrics: ExecutorMetrics) -> str:
    """One line: what the executor delivered, and its problem counters that are not 0."""
    m = metrics.as_dict()
    bad = ", ".join(f"{k}={m[k]:g}" for k in _PROBLEMS if m.get(k))
    return f"executor: {metrics.delivered:g} outputs delivered; " + (bad or "no timeouts, protocol errors or outputs left")


def _check_result(result: GenerationResult, args: argparse.Namespace) -> bool:
    """Whether ``result`` is intact: its pixels exactly what the worker computed (the
    digest it took before the copy; the engine's host stage made an owned copy, bit for
    bit), of the requested size, and not blank."""
    image = result.output["image"]
    pixels = np.array(image)  # a writable copy (torch.from_numpy warns on a read-only one)
    intact = int(image_digest(torch.from_numpy(pixels))) == int(result.output["digest"])
    shaped = pixels.shape == (args.height, args.width, 3)
    blank = int(pixels.min()) == int(pixels.max())
    if intact and shaped and not blank:
        return True
    print(
        f"mismatch: {result.request_id}: bytes {'intact' if intact else 'CHANGED in transit'}, "
        f"shape {pixels.shape}{'' if shaped else ' (wrong)'}{', blank' if blank else ''}",
        file=sys.stderr,
    )
    return False


# A fresh worker's first forwards run several times slower than the later ones (on CPU,
# seconds for the first handful): without a warm-up the first run would pay for it.
WARM_UP_MIN, WARM_UP_MAX, WARM_UP_STEADY = 3, 12, 1.25


def steady(forwards: list[float]) -> bool:
    """Whether the warm-up may stop: at least ``WARM_UP_MIN`` forwards and the last two
    within ``WARM_UP_STEADY`` times each other (or ``WARM_UP_MAX`` of them)."""
    if len(forwards) >= WARM_UP_MAX:
        return True
    if len(forwards) < WARM_UP_MIN:
        return False
    a, b = forwards[-2:]
    return max(a, b) <= WARM_UP_STEADY * min(a, b)


async def _warm_up(ex: DiffusionExecutor, args: argparse.Namespace) -> list[float]:
    """Forwards of the run's shape, one at a time, until they take a steady time; their seconds."""
    forwards: list[float] = []
    async with AsyncDiffusionEngine(ex, pipeline=PIPELINE, max_running=1) as engine:
        while not steady(forwards):
            req = DiffusionRequest(f"warm-up-{len(forwards)}", {"seed": 0, "height": args.height, "width": args.width})
            t = (await engine.generate(req)).timings
            if t.forward_started_at is not None and t.forward_ended_at is not None:
                forwards.append(t.forward_ended_at - t.forward_started_at)
            else:
                forwards.append(t.forward)
    return forwards


async def _serve(ex: DiffusionExecutor, args: argparse.Namespace, mode: str) -> _Run:
    """One run: a warm-up request (not counted), then every request at once, each result
    checked as it comes, with a progress bar; then the engine's own accounting."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    requests = _requests(args)
    result = _Run(mode)
    engine = AsyncDiffusionEngine(ex, pipeline=PIPELINE, max_running=args.max_running, async_output=mode == "async")
    async with engine:
        warm = DiffusionRequest(f"warm-up-{mode}", {"seed": 0, "height": args.height, "width": args.width})
        await engine.generate(warm)
        columns = (TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task(_LABELS[mode], total=len(requests))
            result.started = time.monotonic()

            async def one(request: DiffusionRequest) -> None:
                r = await engine.generate(request)
                progress.advance(task)
                if not _check_result(r, args):
                    result.bad += 1
                result.latencies.append(r.timings.total)
                result.spans.extend(request_spans(r.request_id, r.timings))
                result.digests[r.request_id] = int(r.output["digest"])
                if mode == "async":  # the sync run's are the same pixels (_compare_runs)
                    result.images[r.request_id] = r.output["image"]
                result.finished = max(result.finished, r.timings.finished_at)

            outcomes = await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)
        for request, outcome in zip(requests, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                result.bad += 1
                print(f"{mode}: {request.request_id} failed: {type(outcome).__name__}: {outcome}", file=sys.stderr)
        em = engine.metrics()
    # Only the outcomes that happened, and what the engine still holds only if anything.
    ended = ", ".join(f"{k}={v}" for k, v in sorted(em.requests.items()) if v) or "none"
    left = (
        "nothing left in it"
        if not (em.waiting or em.running or em.holding)
        else f"waiting={em.waiting}, running={em.running}, holding={em.holding}"
    )
    print(
        f"{mode}: {len(requests)} requests in {result.finished - result.started:.2f}s; {result.bad} mismatched; "
        f"engine (with the warm-up request): {ended}; in_flight_limit={em.in_flight_limit}; {left}"
    )
    if em.requests["finished"] != len(requests) + 1 or em.waiting or em.running or em.holding:
        print(f"{mode}: the engine did not finish every request, or holds one at the end", file=sys.stderr)
        result.bad += 1
    return result


def _leftovers(ex: DiffusionExecutor, mode: str) -> int:
    """1 if the run left an output in the executor or a segment leased, else 0."""
    m = ex.metrics()
    left = bool(m.pending_outputs or m.held_payloads)
    if isinstance(ex, MultiprocDiffusionExecutor):
        left = left or bool(ex.pool.stats().outstanding)
    if left:
        print(f"{mode}: outputs or segments left behind after the run: {m}", file=sys.stderr)
    return int(left)


def _compare_runs(sync: _Run, async_: _Run) -> int:
    """The same request gives the same pixels on both paths (same worker, same weights)."""
    differ = sorted(r for r, d in sync.digests.items() if async_.digests.get(r, d) != d)
    if differ:
        print(f"{len(differ)} request(s) differ between the two runs: {differ[:10]}", file=sys.stderr)
    return len(differ)


def _write(out: str, args: argparse.Namespace, runs: dict[str, _Run], summaries: dict[str, ModeSummary]) -> None:
    """The images (PNG), a timeline picture per run and the Chrome trace of both."""
    for mode, r in runs.items():
        for rid, image in r.images.items():
            image.save(os.path.join(out, "images", f"{rid}.png"))
        r.images.clear()
    xmax = max(s.wall_s for s in summaries.values()) * 1.02
    for mode, r in runs.items():
        s = summaries[mode]
        title = (
            f"{_LABELS[mode]}: {s.requests} requests in {s.wall_s:.2f}s ({s.throughput:.2f} req/s); "
            f"worker idle {s.idle_total_s:.2f}s between forwards"
        )
        # Only the run's requests: the warm-up came before ``started``.
        draw_timeline(os.path.join(out, f"timeline-{mode}.png"), r.spans, title=title, xmax=xmax,
                      main_thread_packs=mode == "sync")  # fmt: skip
    trace = chrome_trace({_LABELS[m]: r.spans for m, r in runs.items()},
                         origin={_LABELS[m]: r.started for m, r in runs.items()})  # fmt: skip
    with open(os.path.join(out, "timeline.json"), "w") as fh:
        json.dump(trace, fh)


def _ms(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _summary_text(summaries: dict[str, ModeSummary], out: str, args: argparse.Namespace, *, ok: bool) -> str:
    sync, async_ = summaries["sync"], summaries["async"]
    rows = [
        ("", _LABELS["sync"], _LABELS["async"]),
        ("throughput", f"{sync.throughput:.2f} req/s", f"{async_.throughput:.2f} req/s"),
        ("latency p50", _ms(sync.p50_s), _ms(async_.p50_s)),
        ("latency p95", _ms(sync.p95_s), _ms(async_.p95_s)),
        ("wall time", _ms(sync.wall_s), _ms(async_.wall_s)),
        ("worker busy in forwards", _ms(sync.forward_total_s), _ms(async_.forward_total_s)),
        ("worker idle between forwards", _ms(sync.idle_total_s), _ms(async_.idle_total_s)),
        ("  mean gap", _ms(sync.idle_mean_s), _ms(async_.idle_mean_s)),
    ]
    lines = [f"{a:<30}{b:>20}{c:>20}" for a, b, c in rows]
    lines.append(f"speed-up (async over sync throughput): {speedup(sync.throughput, async_.throughput):.2f}x")
    lines.append(
        f"checks: {'every output intact, nothing left behind' if ok else 'FAILED (see the lines above)'}"
    )
    lines.append(
        f"wrote {out}/: images/*.png ({args.requests} images), "
        "timeline-sync.png, timeline-async.png, timeline.json (open in https://ui.perfetto.dev)"
        + (f"; summary JSON: {args.json}" if args.json else "")
    )
    return "\n".join(lines)


def _summary_json(summaries: dict[str, ModeSummary], out: str, args: argparse.Namespace, *, ok: bool) -> dict[str, Any]:
    config = {k: getattr(args, k) for k in ("executor", "device", "world_size", "requests", "max_running",
                                            "height", "width", "steps")}  # fmt: skip
    return {
        "command": "omni-async demo " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["demo"] else "omni-async demo",
        "config": config,
        "modes": {m: s.as_dict() for m, s in summaries.items()},
        "speedup": speedup(summaries["sync"].throughput, summaries["async"].throughput),
        "ok": ok,
        "out": out,
    }
