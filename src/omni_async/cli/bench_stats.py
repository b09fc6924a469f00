"""The arithmetic of ``omni-async bench``: pure functions of measured numbers, tested on their own.

* ``percentile``: linear interpolation between order statistics (numpy's default).
* ``steady_rate``: completions per second after the warm-up, from completion times.
* ``idle_gaps``: the device's idle time between consecutive forwards, from the
  worker-side forward intervals (``time.monotonic``, one clock for every process).
* ``ideal_rate`` and ``efficiency``: the limit DESIGN.md section 4 states -- a request
  costs ``max(forward, bytes / pinned copy bandwidth)`` -- and how close a run came.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["efficiency", "idle_fraction", "idle_gaps", "ideal_rate", "median", "percentile", "steady_rate"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolating linearly between the
    two nearest order statistics; ``ValueError`` for no values or ``q`` outside 0..100."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be from 0 to 100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def steady_rate(done_times: Sequence[float], skip: int) -> float:
    """Completions per second after the first ``skip`` (the warm-up): the completions after
    the ``skip``-th one, over the time from it to the last.  Needs ``1 <= skip < len``."""
    if not 1 <= skip < len(done_times):
        raise ValueError(f"need 1 <= skip < {len(done_times)} completions, got skip={skip}")
    xs = sorted(done_times)
    span = xs[-1] - xs[skip - 1]
    if span <= 0:
        raise ValueError("completion times span no time")
    return (len(xs) - skip) / span


def idle_gaps(intervals: Sequence[tuple[float, float]]) -> list[float]:
    """The idle time before each forward but the first: its start minus the latest end of
    the forwards before it (0 when they overlap).  ``intervals``: (start, end), any order."""
    xs = sorted(intervals)
    gaps: list[float] = []
    latest_end = -math.inf
    for i, (start, end) in enumerate(xs):
        if end < start:
            raise ValueError(f"forward interval ends before it starts: {(start, end)}")
        if i:
            gaps.append(max(0.0, start - latest_end))
        latest_end = max(latest_end, end)
    return gaps


def idle_fraction(intervals: Sequence[tuple[float, float]]) -> float:
    """The share of the time from the first forward's start to the last one's end that no forward ran."""
    if not intervals:
        raise ValueError("idle fraction of no forwards")
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    return sum(idle_gaps(intervals)) / span if span > 0 else 0.0


def ideal_rate(forward_s: float, nbytes: float, copy_bytes_per_s: float) -> float:
    """Requests per second at the limit: ``1 / max(forward, bytes / copy bandwidth)``."""
    if forward_s < 0 or nbytes < 0 or copy_bytes_per_s <= 0:
        raise ValueError(f"need forward >= 0, bytes >= 0, bandwidth > 0; got {forward_s}, {nbytes}, {copy_bytes_per_s}")
    per_request = max(forward_s, nbytes / copy_bytes_per_s)
    if per_request <= 0:
        raise ValueError("a request that costs no time has no ideal rate")
    return 1.0 / per_request


def efficiency(throughput: float, ideal: float) -> float:
    """``throughput / ideal``: 1.0 is the limit; above it only when a run ships fewer bytes
    than the model produced (the uint8 device stage) or the limit was measured noisily."""
    if ideal <= 0:
        raise ValueError(f"ideal rate must be > 0, got {ideal}")
    return throughput / ideal
