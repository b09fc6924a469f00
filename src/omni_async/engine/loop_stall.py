"""``LoopStallMonitor``: how long the event loop was kept from running its callbacks.

An encode, a mux, a file write or a large copy run on the engine's event loop stops
every request's progress for as long as it runs (a 4 s clip's MP4 mux froze another
engine's loop for 11.3 s: vllm-omni PR #7095).  The monitor schedules a callback every
``period`` seconds and records how late each one ran (its lag): a loop blocked for
``d`` seconds runs the next one about ``d`` late, whatever blocked it.  ``stalls()``:
the samples' count, p50, p99 and max in milliseconds (``LoopStalls``), and the CPU
time the loop's own thread used over the longest stall: close to the stall itself, the
loop ran something (code on the loop: the defect); close to zero, the thread waited (for
the GIL held by another thread, or for a core on a loaded machine).

Run it on the loop it measures (``start`` from a coroutine, or ``async with``); it costs
one callback per period (the default, 2 ms, is far below the 20 ms the engine is held
to, and a few microseconds of the loop's time each).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import Final

import attrs

from omni_async.core.errors import UsageError

__all__ = ["DEFAULT_PERIOD_S", "LoopStallMonitor", "LoopStalls"]

#: Seconds between the monitor's callbacks.
DEFAULT_PERIOD_S: Final = 0.002
#: Lags kept for the percentiles (the max is kept over the whole run): 200 s at 2 ms.
_KEEP: Final = 100_000


@attrs.frozen
class LoopStalls:
    """What a ``LoopStallMonitor`` saw: its callbacks' lags in milliseconds (``samples``
    of them, ``p50``, ``p99``, ``max``), over ``seconds``, one scheduled every ``period_ms``."""

    samples: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    seconds: float
    period_ms: float
    #: CPU time of the loop's thread over the longest stall (see the module docstring).
    max_cpu_ms: float = 0.0

    def line(self) -> str:
        """One line for a report: ``max 3.1 ms, p99 1.2 ms, p50 0.1 ms (4,210 samples over 8.4 s)``."""
        return (
            f"max {self.max_ms:.1f} ms ({self.max_cpu_ms:.1f} ms of it running on the loop), p99 "
            f"{self.p99_ms:.1f} ms, p50 {self.p50_ms:.2f} ms ({self.samples:,} samples over {self.seconds:.1f} s)"
        )


class LoopStallMonitor:
    """Measures the event loop's lag with a periodic callback (see the module docstring)."""

    def __init__(self, period: float = DEFAULT_PERIOD_S) -> None:
        if not (isinstance(period, (int, float)) and 0 < period < 10):
            raise UsageError(f"LoopStallMonitor: period must be seconds in (0, 10), got {period!r}")
        self.period = float(period)
        self._lags: collections.deque[float] = collections.deque(maxlen=_KEEP)
        self._max = 0.0
        self._max_cpu = 0.0
        self._cpu = 0.0
        self._count = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._started = 0.0
        self._stopped: float | None = None

    def start(self) -> None:
        """Start measuring the running loop (call it on that loop)."""
        if self._loop is not None:
            raise UsageError("LoopStallMonitor.start: already started (make a new monitor for a new run)")
        self._loop = asyncio.get_running_loop()
        self._started = time.monotonic()
        self._cpu = time.thread_time()
        self._schedule(self._loop.time())

    def stop(self) -> LoopStalls:
        """Stop measuring; what was seen."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._stopped is None:
            self._stopped = time.monotonic()
        return self.stalls()

    def stalls(self) -> LoopStalls:
        """What was seen so far (or until ``stop``)."""
        lags = sorted(self._lags)
        end = self._stopped if self._stopped is not None else time.monotonic()
        return LoopStalls(
            samples=self._count,
            p50_ms=1e3 * _rank(lags, 0.50),
            p99_ms=1e3 * _rank(lags, 0.99),
            max_ms=1e3 * self._max,
            seconds=end - self._started if self._loop is not None else 0.0,
            period_ms=1e3 * self.period,
            max_cpu_ms=1e3 * self._max_cpu,
        )

    async def __aenter__(self) -> LoopStallMonitor:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    def _schedule(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self.period
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        cpu = time.thread_time()
        # The loop may run a timer up to its clock's resolution early: no negative lags.
        lag = max(0.0, now - self._due)
        self._lags.append(lag)
        self._count += 1
        if lag > self._max:
            self._max, self._max_cpu = lag, cpu - self._cpu
        self._cpu = cpu
        self._schedule(now)


def _rank(sorted_lags: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``sorted_lags`` (0.0 when empty)."""
    if not sorted_lags:
        return 0.0
    return sorted_lags[min(len(sorted_lags) - 1, max(0, math.ceil(q * len(sorted_lags)) - 1))]
