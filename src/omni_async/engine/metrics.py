"""What the engine measures: per-request timings, latency histograms, a metrics snapshot.

Sans-IO bookkeeping (no clocks of its own, no threads): the engine feeds it from its
event loop; ``omni_async.engine.prometheus`` exports the same numbers to Prometheus.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

import attrs

from omni_async.core.errors import UsageError
from omni_async.engine.encoders import EncodedOutput
from omni_async.executor.metrics import ExecutorMetrics

__all__ = [
    "LATENCY_BUCKETS",
    "STAGES",
    "EngineMetrics",
    "GenerationChunk",
    "GenerationResult",
    "HistogramSnapshot",
    "LatencyHistogram",
    "RequestTimings",
    "forward_end",
]

# Upper bounds in seconds (the last bucket, +Inf, is implicit), from a sub-millisecond
# post-process to a minutes-long video forward.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

# The stages a finished request's time is split into (``RequestTimings``), plus the total.
STAGES: tuple[str, ...] = ("queued", "forward", "pack", "transfer_wait", "postprocess", "encode", "total")


@attrs.frozen
class RequestTimings:
    """Where one request's time went, in seconds, and when each step happened.

    * ``queued``: from ``generate`` to the engine sending it (time in the engine's queue);
    * ``forward``: from sending to the end of its forward (``forward_end``: on the device,
      when the worker's stamps say so, its tail included -- a real pipeline returns
      before its kernels end -- else COMPUTE_DONE here; includes waiting behind an
      earlier forward on the worker: with ``max_running >= 2`` the next request is sent
      early);
    * ``pack``: the worker's copy into shared memory, from the copy's start on the
      device to the packed output (the output's ``pack_s``; None when it did not say);
    * ``transfer_wait``: from the end of the forward to the output being ready in the
      engine (packing, the message, the unpack), the part of the copy the engine waited
      for;
    * ``postprocess``: the host stage (or the copy of the tensors) and the release;
      for a request that asked for a format, the copy of its pixels out of shared
      memory and the release;
    * ``encode``: a request that asked for a format: its encode, from handing the pixels
      to the engine's encoder processes to the files here (their queue included), or,
      for a JPEG the worker's GPU encoded, that encode's time on the worker
      (``device_encode_s``); None for the others;
    * ``total``: from ``generate`` to the result.

    The ``*_at`` stamps are ``time.monotonic()`` values, comparable across requests of
    one process (to draw a timeline: one request's forward starting before the
    previous one's output is ready): ``enqueued_at`` (``generate``), ``submitted_at``
    (sent), ``compute_done_at`` (COMPUTE_DONE here), ``output_ready_at`` (the output
    here: OUTPUT_READY, unpacked), ``postprocess_started_at`` (its host stage began, on
    an ``omni-postprocess`` thread), ``finished_at`` (the result).  The worker's stamps
    (``omni_async.worker.stamps``, carried in the output's metrics), on the device's
    time converted to the host's clock: ``forward_started_at`` / ``forward_ended_at``
    (the forward on the device, its tail included), ``forward_returned_at`` (the model
    call returned on the host) and ``pack_started_at`` / ``pack_ended_at`` (the copy,
    from its start on the device, after the device stage: on the packer, or on the main
    thread on the synchronous path); None when the output did not carry them.
    CLOCK_MONOTONIC is one clock for all processes of a Linux host, so the worker's
    stamps and the engine's compare on one timeline.
    """

    queued: float
    forward: float
    pack: float | None
    transfer_wait: float
    postprocess: float
    total: float
    enqueued_at: float
    submitted_at: float
    compute_done_at: float
    output_ready_at: float
    finished_at: float
    postprocess_started_at: float | None = None
    forward_started_at: float | None = None
    forward_ended_at: float | None = None
    pack_started_at: float | None = None
    pack_ended_at: float | None = None
    forward_returned_at: float | None = None
    encode: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return attrs.asdict(self)


def forward_end(compute_done_at: float, forward_ended_at: float | None) -> float:
    """When a request's forward ended, for ``RequestTimings.forward``: COMPUTE_DONE's
    arrival here, or the forward's end on the device when that came later (the worker
    sends COMPUTE_DONE when the call returns on the host, while a real pipeline's kernels
    may still run)."""
    return compute_done_at if forward_ended_at is None else max(compute_done_at, forward_ended_at)


@attrs.frozen
class GenerationResult:
    """A finished request: the pipeline's result and where its time went.

    ``output``: what the pipeline's host stage returned; without a host stage, the
    model's output structure (``DiffusionOutput.output``: tensors, arrays, plain values)
    as owned copies.  Either way it owns its memory: it holds no shared memory, so
    keeping it holds back nothing of the executor's budget.  Its type is the model's
    and the pipeline's to define, as ``DiffusionOutput.output`` is.
    ``metrics``: the output's own metrics (the packer's ``pack_s``, ``pack_shm_bytes``, ...).

    A request that asked for a format (``DiffusionRequest(..., format="png")``) gets an
    ``EncodedOutput`` as ``output`` (a tuple of them for several images: a batch, or a
    video's frames in an image format), instead of the host stage's result: ``encoded``,
    ``data`` and ``media_type`` read it.
    """

    request_id: str
    output: Any
    timings: RequestTimings
    metrics: Mapping[str, float] = attrs.field(factory=dict)
    pipeline: str | None = None

    @property
    def encoded(self) -> tuple[EncodedOutput, ...]:
        """The encoded files (empty: the request asked for no format)."""
        if isinstance(self.output, EncodedOutput):
            return (self.output,)
        if isinstance(self.output, tuple) and self.output and all(isinstance(o, EncodedOutput) for o in self.output):
            return self.output
        return ()

    @property
    def media_type(self) -> str | None:
        """The encoded files' media type (``"image/png"``, ...); None: not encoded."""
        files = self.encoded
        return files[0].media_type if files else None

    @property
    def data(self) -> bytes | None:
        """The bytes of the one encoded file (None: not encoded); ``UsageError`` when there
        are several (a batch of images): read ``encoded``."""
        files = self.encoded
        if len(files) > 1:
            raise UsageError(
                f"request {self.request_id!r} has {len(files)} encoded files (a batch of images): read "
                "result.encoded, not result.data"
            )
        return files[0].data if files else None


@attrs.frozen
class GenerationChunk:
    """One intermediate output of a streaming request (``generate_stream``): the ``seq``-th
    chunk the model emitted (a preview, a chunk of video), post-processed as the final
    result is -- the pipeline's host stage, or owned copies -- so it holds no shared
    memory.  ``metrics``: the chunk's own (``pack_s``, ``pack_shm_bytes``, ...);
    ``arrived_at``: when its output was ready in the engine (``time.monotonic()``);
    ``postprocess``: the host stage's (or the copy's) seconds."""

    request_id: str
    seq: int
    output: Any
    metrics: Mapping[str, float] = attrs.field(factory=dict)
    pipeline: str | None = None
    arrived_at: float = 0.0
    postprocess: float = 0.0


@attrs.frozen
class HistogramSnapshot:
    """Cumulative bucket counts (as Prometheus has them): ``buckets[i]`` observations were
    ``<= bounds[i]``; ``count`` is the +Inf bucket."""

    bounds: tuple[float, ...]
    buckets: tuple[int, ...]
    count: int
    sum: float


class LatencyHistogram:
    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        cumulative: list[int] = []
        total = 0
        for c in self._counts[:-1]:
            total += c
            cumulative.append(total)
        return HistogramSnapshot(self._bounds, tuple(cumulative), total + self._counts[-1], self._sum)


@attrs.frozen
class EngineMetrics:
    """A snapshot of the engine (``AsyncDiffusionEngine.metrics()``).

    ``requests``: how many requests ended, by outcome: ``finished`` (a result),
    ``failed`` (a typed error), ``aborted`` (``abort``), ``cancelled`` (the caller's
    task was cancelled), ``closed`` (failed with ``EngineClosed``), ``rejected``
    (``EngineOverloaded`` at the call).  Every accepted request ends in exactly one.
    ``waiting`` / ``running`` / ``holding`` / ``postprocessing``: the scheduler's queue
    depths (``postprocessing`` is part of ``holding``); ``in_flight_limit``: how many may
    be running or holding (None: no limit beyond ``max_running``); ``budget_waits`` /
    ``budget_wait_s``: how often and how long a request that could have run waited for
    the budget of held outputs (back-pressure, in the engine's queue);
    ``largest_output_bytes``: the largest output seen; ``pack_s_total`` /
    ``pack_bytes_total``: the workers' copy time and bytes of the finished requests
    (their ratio is the copy throughput); ``latency``: a histogram per stage of
    ``RequestTimings`` (finished requests); ``loop_alive``: the engine's scheduling
    task runs; ``pump_alive``: the executor's result pump runs; ``executor_healthy``:
    the executor's ``check_health`` passes (every worker alive); ``executor``: the
    executor's own ``metrics()`` (None when it could not give them: shut down); ``chunks``: intermediate outputs of streams delivered
    to their callers (``generate_stream``).  Batching (``max_batch_size``): ``batches``:
    groups of requests admitted to go to the workers together (a request alone is a
    group of one), ``batched``: those of two or more members, ``batch_size_mean`` /
    ``batch_size_max``: their members on average (admitted requests / ``batches``; 0
    before the first) and at most.  Output sinks: ``files_held``, the files of
    ``sink="file"`` requests on disk now (until their expiry or ``files.delete``);
    ``leases_held``, the outputs lent with ``sink="segment"`` and not yet released
    (each also counted in ``holding``).
    """

    requests: Mapping[str, int]
    waiting: int
    running: int
    holding: int
    postprocessing: int
    in_flight_limit: int | None
    budget_waits: int
    budget_wait_s: float
    largest_output_bytes: int
    pack_s_total: float
    pack_bytes_total: float
    latency: Mapping[str, HistogramSnapshot]
    loop_alive: bool
    pump_alive: bool
    executor_healthy: bool
    executor: ExecutorMetrics | None
    chunks: int = 0
    batches: int = 0
    batched: int = 0
    batch_size_mean: float = 0.0
    batch_size_max: int = 0
    files_held: int = 0
    leases_held: int = 0

    def as_dict(self) -> dict[str, float]:
        """Flat numbers: ``requests_<outcome>``, the depths and counters, and
        ``executor_<key>`` for each executor metric (latency histograms left out)."""
        out: dict[str, float] = {f"requests_{k}": float(v) for k, v in self.requests.items()}
        out.update(
            waiting=float(self.waiting),
            running=float(self.running),
            holding=float(self.holding),
            postprocessing=float(self.postprocessing),
            in_flight_limit=float("inf") if self.in_flight_limit is None else float(self.in_flight_limit),
            budget_waits=float(self.budget_waits),
            budget_wait_s=self.budget_wait_s,
            largest_output_bytes=float(self.largest_output_bytes),
            pack_s_total=self.pack_s_total,
            pack_bytes_total=self.pack_bytes_total,
            loop_alive=float(self.loop_alive),
            pump_alive=float(self.pump_alive),
            executor_healthy=float(self.executor_healthy),
            chunks=float(self.chunks),
            batches=float(self.batches),
            batched=float(self.batched),
            batch_size_mean=self.batch_size_mean,
            batch_size_max=float(self.batch_size_max),
            files_held=float(self.files_held),
            leases_held=float(self.leases_held),
        )
        if self.executor is not None:
            out.update({f"executor_{k}": v for k, v in self.executor.as_dict().items()})
        return out
