"""The figures ``omni-async demo`` reports, as small pure functions (no clocks, no I/O).

Percentiles of latencies, the worker's idle gaps between forwards, throughput and the
speed-up of one output path over the other, and ``ModeSummary``: one output path's run
reduced to the numbers a person reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

__all__ = ["ModeSummary", "idle_gaps", "percentile", "speedup", "summarize_mode", "throughput"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolated linearly between the
    two nearest ranks (numpy's default method).  ``ValueError`` for no values or a ``q``
    outside 0..100."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0 or math.isnan(q):
        raise ValueError(f"percentile q must be in 0..100, got {q!r}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def idle_gaps(intervals: Sequence[tuple[float, float]]) -> list[float]:
    """The idle time before each forward but the first: ``intervals`` are the forwards'
    ``(start, end)`` on one worker, in any order; the result has one gap per forward
    after the earliest, in start order: how long the worker had nothing to compute
    before it (0 when it started before the forwards so far had ended -- a batch, or
    overlapping stamps).  Sum them for the worker's idle time between forwards; from
    the worker's stamps (``omni_async.worker.stamps``), the device's."""
    ordered = sorted(intervals)
    gaps: list[float] = []
    busy_until: float | None = None
    for start, end in ordered:
        if end < start:
            raise ValueError(f"an interval ends before it starts: ({start!r}, {end!r})")
        if busy_until is not None:
            gaps.append(max(0.0, start - busy_until))
            busy_until = max(busy_until, end)
        else:
            busy_until = end
    return gaps


def throughput(requests: int, seconds: float) -> float:
    """Requests per second (``inf`` for no time at all)."""
    if seconds < 0:
        raise ValueError(f"a negative duration: {seconds!r}")
    return math.inf if seconds == 0 else requests / seconds


def speedup(baseline_throughput: float, throughput_: float) -> float:
    """How many times the throughput of ``throughput_`` is the baseline's (> 1: faster)."""
    if baseline_throughput <= 0:
        raise ValueError(f"the baseline throughput must be > 0, got {baseline_throughput!r}")
    return throughput_ / baseline_throughput


@attrs.frozen
class ModeSummary:
    """One output path's run: ``requests`` finished in ``wall_s`` (first ``generate`` to
    the last result), ``throughput`` in requests/s, latency percentiles (``generate`` to
    result, seconds), and the worker's idle time between forwards (``idle_total_s``,
    ``idle_mean_s`` per gap, from the forwards' stamps) next to its time in forwards
    (``forward_total_s``)."""

    mode: str
    requests: int
    wall_s: float
    throughput: float
    p50_s: float
    p95_s: float
    forward_total_s: float
    idle_total_s: float
    idle_mean_s: float

    def as_dict(self) -> dict[str, float | int | str]:
        return attrs.asdict(self)


def summarize_mode(
    mode: str, latencies: Sequence[float], wall_s: float, forwards: Sequence[tuple[float, float]]
) -> ModeSummary:
    """A ``ModeSummary`` from each request's latency, the run's wall time and the forwards' intervals."""
    gaps = idle_gaps(forwards)
    return ModeSummary(
        mode=mode,
        requests=len(latencies),
        wall_s=wall_s,
        throughput=throughput(len(latencies), wall_s),
        p50_s=percentile(latencies, 50),
        p95_s=percentile(latencies, 95),
        forward_total_s=sum(end - start for start, end in forwards),
        idle_total_s=sum(gaps),
        idle_mean_s=sum(gaps) / len(gaps) if gaps else 0.0,
    )
