"""``omni-async demo``: what the library buys, measured on the reference pipeline.

It serves ``DiTPipelineWorker``'s requests (``omni_async.models.dit``: a small DiT, a
rectified-flow sampler and a decoder, random weights: the images are noise) through an
``AsyncDiffusionEngine`` twice, each time handed every request at once (both workers
warmed up first, then each run's requests in ``ROUNDS`` rounds taken in turn, ABBA;
on CPU each worker's torch on one thread: ``make_worker`` says why):

1. ``sync`` ("before"): the seed's path.  A worker in step mode on the synchronous output
   path (``WorkerOptions(output_path="sync")``) does everything on its main thread after
   the forward: the post-process ``"dit-seed"`` (the float pixels to the host with
   ``.cpu()``, uint8 there), then a fresh shared-memory segment per tensor; only then
   does it answer and take the next request;
2. ``async`` ("omni_async"): the library's path.  The worker announces COMPUTE_DONE and
   starts the next forward at once; its packer turns the pixels into uint8 on the device
   (the post-process ``"dit"``'s device stage, on a side stream) and copies them into a
   pooled, pinned segment meanwhile; the engine builds the client's result (a PIL image,
   a frames array) on its host threads, off the worker.

``--output`` names what the client receives (``pixels``: uint8 channel-last pixels, a PIL
image or a frames array; encoded formats join it as their encoders land).  The defaults
depend on the device: a 384 x 384 image on CPU (about a minute), 16 frames of 480 x 832
on CUDA, where the output's copy and post-process are a real share of the request.
With ``--executor inproc`` (one process) the first run is the synchronous output path
(``async_output=False``: the copy on the worker's main thread), not the seed's.

Each result is checked off the event loop: its pixels against the digest the worker took
before the copy, the same request's pixels in both runs, and nothing left behind (every
request finished, the executor's registry empty, no segment leased).  It writes to
``--out``: the images (PNG, of the second run; a video's first frame), a timeline picture
per run (``timeline-sync.png``, ``timeline-async.png``), both timelines as one Chrome
trace (``timeline.json``, for https://ui.perfetto.dev), and prints a summary:
throughput, latency p50/p95, the worker's idle time between forwards and the speed-up
(``--json``: the same as JSON); on CPU, a paragraph on what the run does not show there.
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np
import torch

from omni_async.cli import EXIT_INTERRUPTED
from omni_async.cli.figures import ModeSummary, idle_gaps, percentile, speedup, throughput
from omni_async.cli.parsers import add_demo as add_parser
from omni_async.cli.parsers import deadlines as _deadlines
from omni_async.cli.timeline import Span, chrome_trace, draw_timeline, forward_intervals, request_spans
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.metrics import ExecutorMetrics
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.dit import PIPELINE, SEED_PIPELINE, DiTPipelineWorker
from omni_async.models.dit import make_worker as make_dit_worker
from omni_async.models.tiny import host_digest
from omni_async.transport.shm import files

#: The two runs: the seed's path is the baseline.
MODES: tuple[str, ...] = ("sync", "async")
#: The runs are served in rounds, each round a share of the requests, in ``MODES``' order
#: in even rounds and reversed in odd ones (ABBA): whatever the machine does meanwhile
#: (another job's load, a cache or allocator that settles) falls on both runs alike,
#: where one run after the other gave the whole drift to one of them.
ROUNDS = 2
_LABELS = {"sync": "before (seed)", "async": "omni_async"}
#: ``--output`` -> (the seed's post-process, ours): the pipelines that hand the client that format.
OUTPUT_PIPELINES: dict[str, tuple[str, str]] = {"pixels": (SEED_PIPELINE, PIPELINE)}
#: (height, width, frames) when not given, by device type.
DEVICE_DEFAULTS: dict[str, tuple[int, int, int]] = {"cpu": (384, 384, 1), "cuda": (480, 832, 16)}

CPU_NOTE = (
    "On CPU this run shows where the work goes, not what a GPU gains.  The 'device' is the CPU "
    "itself: a copy is a memcpy, and there is no separate device to keep busy while the host "
    "works, so the forward, the copy, the uint8 conversion and the engine's host work share the "
    "same cores.  What it shows: the worker's idle time between forwards, where the seed's path "
    "post-processes and copies and omni_async does not.  What it does not show: the throughput a "
    "GPU gains -- here the work moved off the worker competes with the next forward for the same "
    "cores, and the ratio of the two runs swings with the machine's load.  Run it with "
    "--device cuda on a GPU for the overlap the library is for."
)

__all__ = ["MODES", "add_parser", "run"]


def resolve_shape(args: argparse.Namespace) -> None:
    """Fill ``height``, ``width`` and ``frames`` left out with the device's defaults."""
    kind = "cuda" if str(args.device).startswith("cuda") else "cpu"
    height, width, frames = DEVICE_DEFAULTS[kind]
    args.height = height if args.height is None else args.height
    args.width = width if args.width is None else args.width
    args.frames = frames if args.frames is None else args.frames


def make_worker(*, device: str, **kwargs: Any) -> DiTPipelineWorker:
    """The demo's worker model: ``DiTPipelineWorker``, with torch on one intra-op thread
    when it computes on the CPU.  With torch's default (a thread per core) each of the
    forward's many parallel regions ends in an OpenMP barrier whose threads spin-wait
    for each other; on a machine with more runnable threads than cores (the engine's,
    the packer's, another job's) a partner is descheduled mid-region and the forward
    burns its time spinning: on the 2-core machine 6-8 s and 2 CPU-seconds per forward
    against 1.1 s and 0.33 on one thread (``OMP_WAIT_POLICY=passive``: 1.6-2.3 s, 0.35).
    libgomp only throttles the spinning once a process has more OpenMP threads than
    cores, which the library's worker reaches (its packer runs torch too) and the
    seed's does not, so the two runs' forwards differed by 5-10x for a reason that is
    neither path's.  One thread each: the same forward on both paths, and a core left
    for what each path does beside it."""
    if device == "cpu":
        torch.set_num_threads(1)
    return make_dit_worker(device=device, **kwargs)


make_worker.validate_request = DiTPipelineWorker.validate_request  # type: ignore[attr-defined]


def _build_executor(args: argparse.Namespace, mode: str) -> DiffusionExecutor:
    """The run's executor: the seed's path (``sync``: step mode, ``output_path="sync"``, the
    post-process on the worker's main thread) or ours (``async``)."""
    deadlines = _deadlines(args)
    before, after = OUTPUT_PIPELINES[args.output]
    if args.executor == "inproc":
        return InProcessExecutor(
            lambda rank: DiTPipelineWorker(device=args.device, steps=args.steps),
            world_size=args.world_size,
            deadlines=deadlines,
            postprocess=after,
        )
    seed = mode == "sync"
    return MultiprocDiffusionExecutor(
        WorkerSpec(
            "omni_async.cli.demo:make_worker",
            kwargs={"device": args.device, "steps": args.steps},
            postprocess=before if seed else after,
        ),
        world_size=args.world_size,
        deadlines=deadlines,
        step_mode=seed,
        options=WorkerOptions(device=args.device, output_path="sync" if seed else "omni"),
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
    """One output path's run (or one round of it): what it served, how long it took,
    what went wrong."""

    mode: str
    started: float = 0.0
    finished: float = 0.0
    spans: list[Span] = attrs.field(factory=list)
    latencies: list[float] = attrs.field(factory=list)
    digests: dict[str, int] = attrs.field(factory=dict)
    images: dict[str, Any] = attrs.field(factory=dict)  # request id -> PIL image, until written
    bad: int = 0
    failed: int = 0  # requests that ended in an error (counted in ``bad`` too)
    #: Each round's (wall seconds, forwards' intervals); the gaps are counted within a round.
    rounds: list[tuple[float, list[tuple[float, float]]]] = attrs.field(factory=list)

    def add_round(self, part: _Run) -> None:
        """Append a round: its spans shifted to start where the rounds so far ended, so the
        timeline shows the rounds back to back on one time scale."""
        if not self.rounds:
            self.started = self.finished = part.started
        shift = self.finished - part.started
        self.spans.extend(attrs.evolve(s, start=s.start + shift, end=s.end + shift) for s in part.spans)
        self.finished = part.finished + shift
        self.latencies.extend(part.latencies)
        self.digests.update(part.digests)
        self.images.update(part.images)
        self.bad += part.bad
        self.failed += part.failed
        self.rounds.append((part.finished - part.started, forward_intervals(part.spans)))

    def summary(self) -> ModeSummary:
        """The run's figures over its rounds: throughput over their summed wall time, the
        idle gaps within each round (not the pause between rounds)."""
        wall = sum(w for w, _ in self.rounds)
        forwards = [f for _, fs in self.rounds for f in fs]
        gaps = [g for _, fs in self.rounds for g in idle_gaps(fs)]
        return ModeSummary(
            mode=self.mode,
            requests=len(self.latencies),
            wall_s=wall,
            throughput=throughput(len(self.latencies), wall),
            p50_s=percentile(self.latencies, 50),
            p95_s=percentile(self.latencies, 95),
            forward_total_s=sum(end - start for start, end in forwards),
            idle_total_s=sum(gaps),
            idle_mean_s=sum(gaps) / len(gaps) if gaps else 0.0,
        )

    def forward_p50(self) -> float:
        """The median forward's seconds (the worker's stamps), over every round."""
        return percentile([end - start for _, fs in self.rounds for start, end in fs], 50)


def round_orders(rounds: int) -> list[tuple[str, ...]]:
    """The order of the runs in each round: ``MODES``, then reversed, alternately."""
    return [MODES if r % 2 == 0 else MODES[::-1] for r in range(rounds)]


def round_shares(requests: int, rounds: int) -> list[range]:
    """The request indices of each round: ``requests`` split as evenly as they go, the
    earlier rounds taking one more; no empty round (fewer requests than rounds: fewer rounds)."""
    rounds = max(1, min(rounds, requests))
    bounds = [requests * r // rounds for r in range(rounds + 1)]
    return [range(bounds[r], bounds[r + 1]) for r in range(rounds)]


def _shape(args: argparse.Namespace) -> dict[str, object]:
    return {"height": args.height, "width": args.width, "num_frames": args.frames}


def _requests(args: argparse.Namespace, share: range, prefix: str = "req") -> list[DiffusionRequest]:
    shape = {**_shape(args), "digest": True}
    return [DiffusionRequest(f"{prefix}-{i}", {"seed": i, **shape}) for i in share]


def _run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA requested but not available", file=sys.stderr)
        return 2
    resolve_shape(args)
    out = os.path.abspath(args.out)
    try:
        os.makedirs(os.path.join(out, "images"), exist_ok=True)
    except OSError as exc:
        print(f"cannot create the output folder {out}: {exc}", file=sys.stderr)
        return 2
    what = f"{args.frames} frames of {args.height}x{args.width}" if args.frames > 1 else f"{args.height}x{args.width}"
    print(
        f"DiT pipeline on {args.device} (world_size={args.world_size}): {what} {args.output}, {args.steps} steps, "
        f"{args.requests} requests per run"
    )
    runs: dict[str, _Run] = {}
    warm_ups: dict[str, list[float]] = {}
    executors: dict[str, dict[str, Any]] = {}
    built: dict[str, DiffusionExecutor] = {}
    bad = 0
    try:
        # Both workers are built and warmed before either run is timed: a fresh worker's
        # first forwards run several times slower (see steady), and neither run may pay
        # for that, nor run while the other's worker is still starting.
        for mode in MODES:
            t0 = time.perf_counter()
            built[mode] = ex = _build_executor(args, mode)
            print(f"{_LABELS[mode]}: executor {type(ex).__name__} up in {time.perf_counter() - t0:.2f}s", flush=True)
        for mode in MODES:
            warm_ups[mode] = asyncio.run(_warm_up(built[mode], args, mode))
            print(f"{_LABELS[mode]}: warm-up: {len(warm_ups[mode])} forwards "
                  f"({', '.join(f'{f:.2f}' for f in warm_ups[mode])} s)")  # fmt: skip
        runs = asyncio.run(_serve(built, args, round_shares(args.requests, ROUNDS)))
        for mode in MODES:
            ex = built[mode]
            bad += runs[mode].bad + _leftovers(ex, mode)
            m = ex.metrics()
            executors[mode] = m.as_dict()
            print(f"{_LABELS[mode]}: {_executor_line(m)}")
            if isinstance(ex, MultiprocDiffusionExecutor):
                st = ex.pool.stats()
                print(
                    f"{_LABELS[mode]}: segment pool: {st.segments} segments, {st.created} created, {st.reused} "
                    f"reused, {st.outstanding} still leased"
                )
    finally:
        with _sigint_ignored():  # a second Ctrl-C must not cut the shutdown short
            for ex in built.values():
                ex.shutdown()
    bad += _compare_runs(runs["sync"], runs["async"])
    summaries = {mode: r.summary() for mode, r in runs.items()}
    _write(out, args, runs, summaries)
    print()
    print(_summary_text(summaries, out, args, ok=not bad, runs=runs))
    if args.json is not None:
        forwards = {
            "warm_up_forwards_s": warm_ups,
            "forward_p50_s": {mode: r.forward_p50() for mode, r in runs.items()},
            "rounds": [{"order": list(order), "requests": len(share)}
                       for order, share in zip(round_orders(ROUNDS), round_shares(args.requests, ROUNDS), strict=False)],
        }  # fmt: skip
        with open(args.json, "w") as fh:
            summary = _summary_json(summaries, out, args, ok=not bad)
            json.dump(summary | forwards | {"executor_metrics": executors}, fh, indent=2)
            fh.write("\n")
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
    return f"executor: {metrics.delivered:g} outputs delivered; " + (
        bad or "no timeouts, protocol errors or outputs left"
    )


def _check_result(result: GenerationResult, args: argparse.Namespace) -> bool:
    """Whether ``result`` is intact: its pixels exactly what the worker computed (the
    digest it took before the copy; the engine's host stage made an owned copy, bit for
    bit), of the requested size, and not blank.  Off the event loop (a thread): the
    digest of a large output is real CPU work, which would hold up the engine's sends."""
    video = "frames" in result.output
    pixels = np.array(result.output["frames" if video else "image"])  # a writable copy
    intact = host_digest(torch.from_numpy(pixels)) == int(result.output["digest"])
    want = (args.frames, args.height, args.width, 3) if video else (args.height, args.width, 3)
    shaped = pixels.shape == want
    blank = int(pixels.min()) == int(pixels.max())
    if intact and shaped and not blank:
        return True
    print(
        f"mismatch: {result.request_id}: bytes {'intact' if intact else 'CHANGED in transit'}, "
        f"shape {pixels.shape}{'' if shaped else ' (wrong)'}{', blank' if blank else ''}",
        file=sys.stderr,
    )
    return False


def _picture(result: GenerationResult) -> Any:
    """The PIL image to write of ``result``: the image, or a video's first frame."""
    from PIL import Image

    if "frames" in result.output:
        return Image.fromarray(np.ascontiguousarray(result.output["frames"][0]))
    return result.output["image"]


# A fresh worker's first forwards run several times slower than the later ones (on CPU,
# seconds for the first handful): without a warm-up the first run would pay for it.
WARM_UP_MIN, WARM_UP_MAX, WARM_UP_STEADY = 4, 16, 1.25
#: Threads that check the results as they come (the demo's client).
CHECK_THREADS = 2


def steady(forwards: list[float]) -> bool:
    """Whether the warm-up may stop: at least ``WARM_UP_MIN`` forwards and the last three
    within ``WARM_UP_STEADY`` times each other (or ``WARM_UP_MAX`` of them)."""
    if len(forwards) >= WARM_UP_MAX:
        return True
    if len(forwards) < WARM_UP_MIN:
        return False
    last = forwards[-3:]
    return max(last) <= WARM_UP_STEADY * min(last)


async def _warm_up(ex: DiffusionExecutor, args: argparse.Namespace, mode: str) -> list[float]:
    """Forwards of the run's shape, one at a time, until they take a steady time; their seconds."""
    forwards: list[float] = []
    async with AsyncDiffusionEngine(ex, pipeline=PIPELINE, max_running=1, async_output=mode == "async") as engine:
        while not steady(forwards):
            req = DiffusionRequest(f"warm-up-{len(forwards)}", {"seed": 0, **_shape(args)})
            t = (await engine.generate(req)).timings
            if t.forward_started_at is not None and t.forward_ended_at is not None:
                forwards.append(t.forward_ended_at - t.forward_started_at)
            else:
                forwards.append(t.forward)
    return forwards


async def _serve(built: dict[str, DiffusionExecutor], args: argparse.Namespace, shares: list[range]) -> dict[str, _Run]:
    """Both runs: an engine per executor, open for the whole demo, each with a warm-up
    request (not counted); then the rounds, each run's share of the requests at once,
    each result checked as it comes, with a progress bar; then each engine's own accounting."""
    runs = {mode: _Run(mode) for mode in built}
    # The client's checks in two threads of their own, as a front end bounds its work: one
    # thread per result at once (asyncio.to_thread) took the cores the engine needs to send
    # the next request, and the GPU idled between forwards.
    checks = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="omni-demo-check")
    try:
        async with contextlib.AsyncExitStack() as stack:
            engines: dict[str, AsyncDiffusionEngine] = {}
            for mode, ex in built.items():
                engine = AsyncDiffusionEngine(
                    ex, pipeline=PIPELINE, max_running=args.max_running, async_output=mode == "async"
                )
                engines[mode] = await stack.enter_async_context(engine)
                await engine.generate(DiffusionRequest(f"warm-up-{mode}", {"seed": 0, **_shape(args)}))
            for i, (order, share) in enumerate(zip(round_orders(len(shares)), shares, strict=True)):
                for mode in order:
                    label = _LABELS[mode] if len(shares) == 1 else f"{_LABELS[mode]} {i + 1}/{len(shares)}"
                    runs[mode].add_round(await _serve_round(engines[mode], args, mode, share, label, checks))
            metrics = {mode: engine.metrics() for mode, engine in engines.items()}
    finally:
        checks.shutdown(wait=False, cancel_futures=True)
    for mode, run in runs.items():
        em = metrics[mode]
        # Only the outcomes that happened, and what the engine still holds only if anything.
        ended = ", ".join(f"{k}={v}" for k, v in sorted(em.requests.items()) if v) or "none"
        left = (
            "nothing left in it"
            if not (em.waiting or em.running or em.holding)
            else f"waiting={em.waiting}, running={em.running}, holding={em.holding}"
        )
        print(
            f"{mode}: {len(run.latencies) + run.failed} requests in {run.summary().wall_s:.2f}s; {run.bad} "
            f"mismatched; engine (with the warm-up request): {ended}; in_flight_limit={em.in_flight_limit}; {left}"
        )
        if em.requests["finished"] != args.requests + 1 or em.waiting or em.running or em.holding:
            print(f"{mode}: the engine did not finish every request, or holds one at the end", file=sys.stderr)
            run.bad += 1
    return runs


async def _serve_round(
    engine: AsyncDiffusionEngine,
    args: argparse.Namespace,
    mode: str,
    share: range,
    label: str,
    checks: ThreadPoolExecutor,
) -> _Run:
    """One round of a run: its requests at once, each result checked as it comes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    requests = _requests(args, share)
    result = _Run(mode)
    loop = asyncio.get_running_loop()
    columns = (TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(label, total=len(requests))
        result.started = time.monotonic()

        async def one(request: DiffusionRequest) -> None:
            r = await engine.generate(request)
            progress.advance(task)
            if not await loop.run_in_executor(checks, _check_result, r, args):
                result.bad += 1
            result.latencies.append(r.timings.total)
            result.spans.extend(request_spans(r.request_id, r.timings))
            result.digests[r.request_id] = int(r.output["digest"])
            if mode == "async":  # the sync run's are the same pixels (_compare_runs)
                result.images[r.request_id] = _picture(r)
            result.finished = max(result.finished, r.timings.finished_at)

        outcomes = await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)
    for request, outcome in zip(requests, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            result.bad += 1
            result.failed += 1
            print(f"{mode}: {request.request_id} failed: {type(outcome).__name__}: {outcome}", file=sys.stderr)
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
    for r in runs.values():
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


def _summary_text(
    summaries: dict[str, ModeSummary], out: str, args: argparse.Namespace, *, ok: bool, runs: dict[str, _Run]
) -> str:
    sync, async_ = summaries["sync"], summaries["async"]
    rows = [
        ("", _LABELS["sync"], _LABELS["async"]),
        ("throughput", f"{sync.throughput:.2f} req/s", f"{async_.throughput:.2f} req/s"),
        ("latency p50", _ms(sync.p50_s), _ms(async_.p50_s)),
        ("latency p95", _ms(sync.p95_s), _ms(async_.p95_s)),
        ("wall time", _ms(sync.wall_s), _ms(async_.wall_s)),
        ("worker busy in forwards", _ms(sync.forward_total_s), _ms(async_.forward_total_s)),
        ("  median forward", _ms(runs["sync"].forward_p50()), _ms(runs["async"].forward_p50())),
        ("worker idle between forwards", _ms(sync.idle_total_s), _ms(async_.idle_total_s)),
        ("  mean gap", _ms(sync.idle_mean_s), _ms(async_.idle_mean_s)),
    ]
    lines = [f"{a:<30}{b:>20}{c:>20}" for a, b, c in rows]
    lines.append(f"speed-up (omni_async over before): {speedup(sync.throughput, async_.throughput):.2f}x")
    rounds = len(runs["sync"].rounds)
    if rounds > 1:
        lines.append(
            f"both workers warmed up first; each run served in {rounds} rounds, in turn (before first, then "
            "omni_async first), so a change in the machine's load falls on both"
        )
    if args.executor == "inproc":
        lines.append("before: the synchronous output path in one process (the copy on the worker's main thread)")
    else:
        lines.append(
            "before: the seed's path: forward, post-process (.cpu(), uint8 on the host) and a fresh segment, all on "
            "the worker's main thread"
        )
    lines.append(
        "omni_async: the next forward at COMPUTE_DONE; uint8 on the device and the copy into pooled pinned memory "
        "on the packer's side stream; the client's result built in the engine's host threads"
    )
    lines.append(f"checks: {'every output intact, nothing left behind' if ok else 'FAILED (see the lines above)'}")
    lines.append(
        f"wrote {out}/: images/*.png ({args.requests} images{', first frames' if args.frames > 1 else ''}), "
        "timeline-sync.png, timeline-async.png, timeline.json (open in https://ui.perfetto.dev)"
        + (f"; summary JSON: {args.json}" if args.json else "")
    )
    if not str(args.device).startswith("cuda"):
        lines += ["", CPU_NOTE]
    return "\n".join(lines)


def _summary_json(summaries: dict[str, ModeSummary], out: str, args: argparse.Namespace, *, ok: bool) -> dict[str, Any]:
    config = {k: getattr(args, k) for k in ("executor", "device", "world_size", "requests", "max_running",
                                            "height", "width", "frames", "steps", "output")}  # fmt: skip
    return {
        "command": "omni-async demo " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["demo"] else "omni-async demo",
        "config": config,
        "modes": {m: s.as_dict() for m, s in summaries.items()},
        "speedup": speedup(summaries["sync"].throughput, summaries["async"].throughput),
        "labels": dict(_LABELS),
        "note": None if str(args.device).startswith("cuda") else CPU_NOTE,
        "ok": ok,
        "out": out,
    }
