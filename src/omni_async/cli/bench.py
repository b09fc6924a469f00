"""``omni-async bench``: our output path against the seed's and the reference's, through real worker processes.

Every mode runs through ``MultiprocDiffusionExecutor`` over ``SyntheticForwardWorker``
(``omni_async.models.synthetic``: a forward of a set length, one output of a set shape
per request), the worker shipping outputs one way (``WorkerOptions.output_path``):

* ``sync``: the seed's original path, in step mode: ``.cpu()`` on the worker's main
  thread, a fresh shared-memory segment per tensor, the answer carries the output;
* ``reference``: the reference implementation's async path: side stream, bf16 upcast to
  fp32, a fresh pinned buffer and a synchronize per tensor, then a fresh segment and a
  second copy (both in ``omni_async.bench.paths``);
* ``omni``: ours, the pooled pinned copy on a side stream;
* ``omni-u8``: ours with the device-side post-process ``"bench-u8"`` (float to uint8 on
  the side stream before the copy).

The sweep: output sizes (``SIZES``) x forward lengths x concurrency (the running slots of
an engine: each submits its next request as soon as the last one's forward is done, at
COMPUTE_DONE, and hands the output to a consumer that takes it and releases it; in step
mode the answer carries the output), plus a copy-bound case per size list
(the largest size behind a forward that only writes its output).  Per case, right before
and after it and on the same worker, the forward alone (a sustained loop) and the pinned
copy alone are measured; from them the ideal rate ``1 / max(forward, bytes / copy
bandwidth)`` with ``bytes`` the output as the model produced it (so ``omni-u8``, which
ships fewer, can pass 1.0).  Reported per case: requests/s (after the warm-up), p50/p95
latency (submit to output in hand), copy GB/s (the worker's pack), the device's idle gap
between forwards (worker-side forward timestamps), efficiency = throughput / ideal, and
on CUDA the GPU's SM clock and power during the case.  To the client (``--client-bytes``,
the default): each output in hand is turned into the client's bytes on the host, as an
engine's host stage does (uint8 pixels; the conversion on the host unless ``omni-u8``'s
device stage did it; ``--client-path``: ``pooled``, ``bench_client.ClientBytes``, into
reused memory, or ``fresh``, the seed's ``models.synthetic.to_client_bytes``), in the
consumer threads, before it is released; ``client_ms_p50`` is the time from submit to those
bytes, and ``client_efficiency`` the forward alone over it (the ideal: the forward
alone).  The printed table fits 100 columns (``bench_report``); on CPU a paragraph says
what the figures do not show there.

``--loop-stall`` (the default): the engine's event loop's longest stall (and p99) while
``--loop-encodes`` PNG encodes run (``bench_loop``: target under 20 ms), one line.

``--pump``: a CPU micro-benchmark of the protocol: real worker processes, tiny outputs,
no forward: the latency from the end of the worker's forward (right before it sends
COMPUTE_DONE) to the wake-up of the thread blocked in ``execute_request``, and the
messages the pump handled per second.

Output: a table, ``--json PATH`` (every case with every field, the environment, the
command line) and a plot (``--plot PATH``; matplotlib, skipped with a note where it is
not installed: ``--plot-from JSON`` draws it later from the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import queue
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import torch
from rich.console import Console

from omni_async.cli import bench_plot
from omni_async.cli.bench_client import ClientBytes
from omni_async.cli.bench_loop import loop_stall_line, run_loop_stall
from omni_async.cli.bench_report import CPU_NOTE, TABLE_WIDTH, environment, table
from omni_async.cli.bench_stats import (
    efficiency,
    ideal_rate,
    idle_fraction,
    idle_gaps,
    median,
    percentile,
    steady_rate,
)
from omni_async.cli.parsers import CLIENT_PATHS, MODES, SIZES, TINY_SIZES
from omni_async.cli.parsers import add_bench as add_parser
from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.synthetic import to_client_bytes
from omni_async.transport.shm.files import entries
from omni_async.worker.stamps import FORWARD_ENDED_AT, FORWARD_RETURNED_AT, FORWARD_STARTED_AT

__all__ = ["CLIENT_PATHS", "MODES", "SIZES", "TINY_SIZES", "Case", "add_parser", "build_cases", "client_maker", "run"]

FORWARD_LABELS: Final = ("few-step", "long")
COPY_BOUND: Final = "copy-bound"
_SPEC: Final = "omni_async.models.synthetic:SyntheticForwardWorker"
_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}


@attrs.frozen
class Case:
    """One point of the sweep (the mode is run over each)."""

    size: str
    shape: tuple[int, ...]
    dtype: str
    forward_label: str
    forward_ms: float
    concurrency: int

    @property
    def nbytes(self) -> int:
        n = _ELEMENT[self.dtype]
        for d in self.shape:
            n *= d
        return n


def build_cases(
    sizes: dict[str, tuple[tuple[int, ...], str]],
    forward_ms: Sequence[float],
    concurrency: Sequence[int],
    copy_bound: bool,
) -> list[Case]:
    """sizes x forward lengths x concurrency, then the copy-bound cases: the largest size
    behind a forward of 0 ms (it only writes its output), at each concurrency."""
    cases = []
    for name, (shape, dtype) in sizes.items():
        for i, ms in enumerate(forward_ms):
            # Two lengths: the few-step distilled forward and the long one, named so.
            label = f"{FORWARD_LABELS[i]} {ms:g}ms" if len(forward_ms) == 2 else f"{ms:g}ms"
            for c in concurrency:
                cases.append(Case(name, shape, dtype, label, ms, c))
    if copy_bound and sizes:
        name, (shape, dtype) = max(sizes.items(), key=lambda kv: Case(kv[0], kv[1][0], kv[1][1], "", 0, 1).nbytes)
        cases += [Case(name, shape, dtype, COPY_BOUND, 0.0, c) for c in concurrency]
    return cases


# ------------------------------------------------------------------------------ options


def _apply_tiny(args: argparse.Namespace) -> None:
    args.sizes = list(TINY_SIZES)
    args.forward_ms = [20.0]
    args.concurrency = [1, 2]
    args.requests = min(args.requests, 6)
    args.warmup = 1
    args.alone_min_s = 0.1
    args.alone_reps = 3
    args.max_case_s = min(args.max_case_s, 10.0)
    args.pump = True
    args.pump_requests = min(args.pump_requests, 200)
    args.loop_side = min(args.loop_side, 256)


# ------------------------------------------------------------------------------ measuring


def gpu_sample(device: str) -> tuple[float | None, float | None]:
    """(SM clock in MHz, power in W) of ``device`` now: torch's NVML helpers, else
    ``nvidia-smi``, else (None, None)."""
    index = torch.device(device).index or 0
    try:
        return float(torch.cuda.clock_rate(index)), float(torch.cuda.power_draw(index)) / 1e3
    except Exception:  # noqa: BLE001  # no pynvml: try nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-i", str(index)],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
        clock, power = (float(v) for v in out.strip().splitlines()[0].split(","))
        return clock, power
    except Exception:  # noqa: BLE001  # a query that fails records nothing
        return None, None


class _GpuSampler:
    """Samples the GPU's clock and power every ``period`` seconds while a case runs."""

    def __init__(self, device: str, period: float = 0.25) -> None:
        self._device = device
        self._period = period
        self._stop = threading.Event()
        self.samples: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, name="bench-gpu-sampler", daemon=True)

    def __enter__(self) -> _GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            clock, power = gpu_sample(self._device)
            if clock is None or power is None:
                return
            self.samples.append((clock, power))
            self._stop.wait(self._period)

    def summary(self) -> dict[str, float] | None:
        if not self.samples:
            return None
        clocks = [c for c, _ in self.samples]
        powers = [p for _, p in self.samples]
        return {
            "sm_clock_mhz_p50": median(clocks),
            "sm_clock_mhz_min": min(clocks),
            "power_w_p50": median(powers),
            "power_w_max": max(powers),
            "samples": float(len(self.samples)),
        }


def _executor(mode: str, device: str, copies_in_flight: int = 2) -> MultiprocDiffusionExecutor:
    # "sync" and "reference": the names WorkerOptions registers for the comparison paths
    # (omni_async.bench.paths); each worker resolves its own.
    path = mode if mode in ("sync", "reference") else "omni"
    spec = WorkerSpec(_SPEC, {"device": device}, postprocess="bench-u8" if mode == "omni-u8" else None)
    return MultiprocDiffusionExecutor(
        spec,
        step_mode=mode == "sync",
        deadlines=Deadlines(compute_timeout=600, output_timeout=600, rpc_timeout=600),
        options=WorkerOptions(device=device, output_path=path, lease_timeout=120, copies_in_flight=copies_in_flight),
    )


@attrs.define
class _Record:
    index: int
    submitted: float
    done: float
    metrics: dict[str, float]
    # When the client's bytes were in hand (None: not made, ``--no-client-bytes``).
    client: float | None = None


def _take(ex: MultiprocDiffusionExecutor, output_id: str) -> dict[str, float]:
    """Wait for an announced output, give it back; its metrics."""
    out = ex.wait_output_ready(output_id).result(timeout=600)
    metrics = dict(out.metrics)
    ex.release_output(out)  # nothing of it is viewed here: the segment goes back at once
    return metrics


def client_maker(path: str) -> Callable[[DiffusionOutput], object]:
    """The maker of the client's bytes that ``--client-path`` names (``CLIENT_PATHS``):
    ``pooled`` (``ClientBytes``: into reused memory, in cache-sized slices) or ``fresh``
    (the seed's ``to_client_bytes``: fresh memory for every pass, as before issue 31)."""
    return ClientBytes() if path == "pooled" else to_client_bytes


def _deliver(
    ex: MultiprocDiffusionExecutor, out: DiffusionOutput, client: Callable[[DiffusionOutput], object] | None
) -> tuple[dict[str, float], float, float | None]:
    """An output in hand: (its metrics, now, when the client's bytes were made), then released.

    ``client``: the client's bytes are made first, on the host, as an engine's host stage
    does (uint8 pixels, converted here unless the device stage did it; ``client_maker``)."""
    done = time.monotonic()
    metrics = dict(out.metrics)
    made = None
    if client is not None:
        payload = client(out)
        made = time.monotonic()
        del payload
    ex.release_output(out)  # nothing of it is viewed here: the segment goes back at once
    return metrics, done, made


def _alone(ex: MultiprocDiffusionExecutor, case: Case, reps: int, min_s: float) -> tuple[list[float], list[float]]:
    """The forward alone (at least ``reps`` of them, and at least ``min_s`` seconds of them:
    a 30 ms forward's median over 5 varied by 3-5% on the H200) and the copy alone."""
    n_fwd = max(reps, math.ceil(1000.0 * min_s / case.forward_ms)) if case.forward_ms > 0 else reps
    fwd = ex.collective_rpc("forward_alone", (n_fwd, case.forward_ms, case.shape, case.dtype))[0]
    copy = ex.collective_rpc("copy_alone", (reps, case.shape, case.dtype))[0]
    return list(fwd), list(copy)


def run_case(ex: MultiprocDiffusionExecutor, mode: str, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """One mode on one case: the limits alone, a warm-up run to its end, the measured run,
    the limits alone again.

    The warm-up makes the pool's segments (and, on CUDA, pins them) and is over, every
    output taken, before the measured run starts: its slow first copies would otherwise
    bunch the next completions together and inflate the rate measured after them.
    """
    fwd_before, copy_before = _alone(ex, case, args.alone_reps, args.alone_min_s)
    params: dict[str, Any] = {"forward_ms": case.forward_ms, "shape": list(case.shape), "dtype": case.dtype}
    sampler = _GpuSampler(args.device) if args.device.startswith("cuda") else None
    maker = client_maker(args.client_path) if args.client_bytes else None

    def closed_loop(phase: str, total: int, stop_at: float) -> list[_Record]:
        counter = itertools.count()
        records: list[_Record] = []
        lock = threading.Lock()
        errors: list[BaseException] = []
        announced: queue.Queue[tuple[int, float, str | DiffusionOutput] | None] = queue.Queue()

        def client() -> None:
            # A running slot of an engine: it submits the next request as soon as the
            # last one's forward is done (COMPUTE_DONE), and hands the output to a
            # consumer.  In step mode (``sync``) the answer carries the output itself.
            try:
                while True:
                    i = next(counter)
                    if i >= total or (time.monotonic() > stop_at and i >= 2 * case.concurrency + 1):
                        return
                    t0 = time.monotonic()
                    ro = ex.execute_request(DiffusionRequest(f"{mode}-{phase}{i}", {**params, "seed": i}))
                    if ro.result is not None:
                        announced.put((i, t0, ro.result))  # in hand: the consumer makes the client's bytes
                    else:
                        assert ro.async_output_id is not None
                        announced.put((i, t0, ro.async_output_id))
            except BaseException as exc:  # noqa: BLE001  # re-raised by the caller's thread below
                errors.append(exc)

        def consumer() -> None:
            while (item := announced.get()) is not None:
                i, t0, what = item
                try:
                    out = what if isinstance(what, DiffusionOutput) else ex.wait_output_ready(what).result(timeout=600)
                    metrics, done, made = _deliver(ex, out, maker)
                    del out
                except BaseException as exc:  # noqa: BLE001  # re-raised by the caller's thread below
                    errors.append(exc)
                    continue
                with lock:
                    records.append(_Record(i, t0, done, metrics, made))

        clients = [threading.Thread(target=client, name=f"bench-client-{k}") for k in range(case.concurrency)]
        consumers = [threading.Thread(target=consumer, name=f"bench-consumer-{k}") for k in range(case.concurrency)]
        for t in clients + consumers:
            t.start()
        for t in clients:
            t.join()
        for _ in consumers:
            announced.put(None)
        for t in consumers:
            t.join()
        if errors:
            raise errors[0]
        return records

    t_start = time.monotonic()
    # The pooled modes hold up to the packer's budget of outputs in flight (4 by default):
    # warm at least that many segments, and one more.
    warm = args.warmup * case.concurrency
    if mode in ("omni", "omni-u8"):
        warm = max(warm, WorkerOptions().max_outputs_in_flight + 2)
    closed_loop("warmup", warm, t_start + args.max_case_s)
    if sampler is not None:
        sampler.__enter__()
    try:
        t_run = time.monotonic()
        records = closed_loop("", args.requests, t_run + args.max_case_s)
    finally:
        if sampler is not None:
            sampler.__exit__()
    wall = time.monotonic() - t_start
    fwd_after, copy_after = _alone(ex, case, args.alone_reps, args.alone_min_s)
    # The ideal's forward is the one measured right after the case, on a device in the
    # state the case left it in (clocks, power: a GPU at its power limit runs a
    # sustained forward several percent slower than a cold one); the one before is
    # reported beside it.
    # The rate is measured after the first ``concurrency`` completions: the pipeline's fill.
    return summarize(mode, case, records, case.concurrency, fwd_after, copy_before + copy_after, wall) | {
        "forward_alone_before_ms": 1e3 * median(fwd_before),
        "gpu": sampler.summary() if sampler is not None else None,
        # Every output of the case was read: a baseline's fresh segment still here leaked.
        "fresh_segments_left": len(entries(f"{ex.pool.prefix}fresh-")),
    }


def summarize(
    mode: str,
    case: Case,
    records: Sequence[_Record],
    warmup: int,
    forward_alone_s: Sequence[float],
    copy_alone_s: Sequence[float],
    wall_s: float,
) -> dict[str, Any]:
    """A case's row: the measured window is every completion after the first ``warmup`` (the
    rate runs from the ``warmup``-th completion to the last)."""
    by_done = sorted(records, key=lambda r: r.done)
    skip = min(warmup, len(by_done) - 1)
    window = by_done[skip:]
    latencies = [r.done - r.submitted for r in window]
    to_client = [r.client - r.submitted for r in window if r.client is not None]
    forwards = [(r.metrics[FORWARD_STARTED_AT], r.metrics[FORWARD_ENDED_AT]) for r in window]
    gaps = idle_gaps(forwards)
    copied = [r.metrics.get("pack_shm_bytes", 0.0) + r.metrics.get("pack_inline_bytes", 0.0) for r in window]
    pack_s = [r.metrics["pack_s"] for r in window if "pack_s" in r.metrics]
    rates = [c / s for c, s in zip(copied, pack_s, strict=False) if s > 0]
    throughput = steady_rate([r.done for r in by_done], skip)
    fwd_s = median(forward_alone_s)
    copy_s = median(copy_alone_s)
    copy_bps = case.nbytes / copy_s
    ideal = ideal_rate(fwd_s, case.nbytes, copy_bps)
    return {
        "mode": mode,
        "size": case.size,
        "shape": list(case.shape),
        "dtype": case.dtype,
        "output_bytes": case.nbytes,
        "copied_bytes": median(copied),
        "forward_label": case.forward_label,
        "forward_ms": case.forward_ms,
        "concurrency": case.concurrency,
        "requests": len(window),
        "warmup": skip,
        "throughput_rps": throughput,
        "latency_ms_p50": 1e3 * percentile(latencies, 50),
        "latency_ms_p95": 1e3 * percentile(latencies, 95),
        "latency_ms_max": 1e3 * max(latencies),
        "copy_GBps": median(rates) / 1e9 if rates else None,
        "pack_ms_p50": 1e3 * median(pack_s) if pack_s else None,
        "idle_gap_ms_p50": 1e3 * median(gaps) if gaps else 0.0,
        "idle_gap_ms_mean": 1e3 * sum(gaps) / len(gaps) if gaps else 0.0,
        "idle_fraction": idle_fraction(forwards),
        "forward_alone_ms": 1e3 * fwd_s,
        "copy_alone_ms": 1e3 * copy_s,
        "copy_alone_GBps": copy_bps / 1e9,
        "ideal_rps": ideal,
        "bound": "copy" if case.nbytes / copy_bps > fwd_s else "forward",
        "efficiency": efficiency(throughput, ideal),
        # To the client's bytes (the output in hand and post-processed on the host); the
        # ideal is the forward alone, so its efficiency is forward / that time.
        "client_ms_p50": 1e3 * percentile(to_client, 50) if to_client else None,
        "client_ms_p95": 1e3 * percentile(to_client, 95) if to_client else None,
        "client_efficiency": fwd_s / percentile(to_client, 50) if to_client and fwd_s > 0 else None,
        "wall_s": wall_s,
    }


def run_pump(requests: int, concurrency: int = 1) -> dict[str, Any]:
    """The protocol alone (CPU, worker process, tiny inline outputs, no forward): latency from the
    end of the worker's forward (right before COMPUTE_DONE is sent) to the wake-up of the
    thread blocked in ``execute_request``; the pump's messages per second."""
    with _executor("omni", "cpu") as ex:
        params = {"forward_ms": 0, "shape": [4], "dtype": "float32"}
        for i in range(20):  # warm-up
            ro = ex.execute_request(DiffusionRequest(f"w{i}", params))
            assert ro.async_output_id is not None
            _take(ex, ro.async_output_id)
        counter = itertools.count()
        wake: list[float] = []
        lock = threading.Lock()

        def client() -> None:
            while (i := next(counter)) < requests:
                ro = ex.execute_request(DiffusionRequest(f"p{i}", params))
                woke = time.monotonic()
                assert ro.async_output_id is not None
                out = ex.wait_output_ready(ro.async_output_id).result(timeout=60)
                with lock:
                    # From the host's return of the forward (COMPUTE_DONE is sent then).
                    wake.append(woke - out.metrics[FORWARD_RETURNED_AT])
                ex.release_output(out)

        before = ex.pump.messages
        t0 = time.monotonic()
        threads = [threading.Thread(target=client, name=f"bench-pump-{k}") for k in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        messages = ex.pump.messages - before
    return {
        "requests": requests,
        "concurrency": concurrency,
        "messages": messages,
        "messages_per_s": messages / wall,
        "requests_per_s": requests / wall,
        "compute_done_latency_us_p50": 1e6 * percentile(wake, 50),
        "compute_done_latency_us_p99": 1e6 * percentile(wake, 99),
        "wall_s": wall,
    }


# ------------------------------------------------------------------------------ reporting


def _plot(report: dict[str, Any], path: Path, console: Console) -> None:
    if not bench_plot.have_matplotlib():
        console.print(
            f"note: matplotlib is not installed here: no plot.  Draw it where it is with "
            f"omni-async bench --plot-from {report.get('json') or 'REPORT.json'}"
        )
        return
    bench_plot.draw(report, path)
    console.print(f"plot: {path}")


def run(args: argparse.Namespace) -> int:
    # The table is laid out for 100 columns (every field is in the JSON), also when the
    # output goes to a file or a CI log.
    console = Console(width=TABLE_WIDTH)
    if args.plot_from is not None:
        saved = json.loads(args.plot_from.read_text(encoding="utf-8"))
        _plot(saved, args.plot or args.plot_from.with_suffix(".png"), console)
        return 0
    if args.tiny:
        _apply_tiny(args)
    if args.pump_only:
        args.pump, args.modes, args.loop_stall = True, [], False
    t0 = time.monotonic()
    argv = ["omni-async", *sys.argv[1:]] if sys.argv[1:2] == ["bench"] else ["omni-async", "bench"]
    sizes = {name: {**SIZES, **TINY_SIZES}[name] for name in args.sizes}
    cases = build_cases(sizes, args.forward_ms, args.concurrency, args.copy_bound)
    report: dict[str, Any] = {
        "command": shlex.join(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": environment(args.device),
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in sorted(vars(args).items())
            if k not in ("run", "check")
        },
        "json": str(args.json) if args.json else None,
        "cases": [],
        "pump": None,
        "loop_stall": None,
    }
    if args.modes:
        console.print(
            f"omni-async bench: {len(cases)} case(s) x {len(args.modes)} mode(s) on {args.device} "
            f"({report['environment']['device_name']})"
        )
    for mode in args.modes:
        with _executor(mode, args.device, args.copies_in_flight) as ex:
            for case in cases:
                row = run_case(ex, mode, case, args)
                report["cases"].append(row)
                console.print(
                    f"  {mode:9} {case.size:22} {case.forward_label:16} c={case.concurrency}: "
                    f"{row['throughput_rps']:8.2f} req/s, efficiency {row['efficiency']:.2f}"
                )
    # Cases side by side: each case's modes together.
    order = {(c.size, c.forward_label, c.concurrency): i for i, c in enumerate(cases)}
    report["cases"].sort(
        key=lambda r: (order[(r["size"], r["forward_label"], r["concurrency"])], MODES.index(r["mode"]))
    )
    if report["cases"]:
        console.print(
            table(report["cases"], f"omni-async bench ({args.device}, {report['environment']['device_name']})")
        )
        if not args.device.startswith("cuda"):
            console.print(CPU_NOTE)
    if args.pump:
        report["pump"] = run_pump(args.pump_requests, args.pump_clients)
        p = report["pump"]
        console.print(
            f"pump (CPU, worker process, {p['requests']} requests, {p['concurrency']} clients): COMPUTE_DONE "
            f"send -> waiter wake-up p50 {p['compute_done_latency_us_p50']:.0f} us, p99 "
            f"{p['compute_done_latency_us_p99']:.0f} us; {p['messages_per_s']:.0f} messages/s "
            f"({p['requests_per_s']:.0f} requests/s)"
        )
    if args.loop_stall:
        report["loop_stall"] = run_loop_stall(args.device, args.loop_encodes, args.loop_side)
        console.print(loop_stall_line(report["loop_stall"]))
    report["wall_s"] = time.monotonic() - t0
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        console.print(f"report: {args.json}")
    plot_path = args.plot or (args.json.with_suffix(".png") if args.json is not None else None)
    if plot_path is not None and report["cases"]:
        _plot(report, plot_path, console)
    console.print(f"bench done in {report['wall_s']:.1f} s")
    return 0
