"""When the device reached a point, on the host's clock: the timings of a real pipeline.

A real pipeline's forward returns on the host while the device still runs the kernels
it queued (diffusers' pipelines do; a Wan pipeline's 0.172 s "pack" was 0.17 s of the
forward's device tail).  So a worker times the device, not the host: it puts a *mark*
on a stream (``DeviceClock.mark``: before the forward, after it, where the copy starts)
and reads, later, when the device reached it (``DeviceClock.time_of``), as a
``time.monotonic()`` value -- the clock of every other stamp, the engine's included, so
device and host stamps line up on one timeline and subtract into durations.

Theory of operation:

* CUDA: a mark is a timing ``torch.cuda.Event`` recorded on the stream, with the host's
  ``time.monotonic()`` read just before it was recorded.  Recording only enqueues it: a
  mark never blocks the host (F14), so the worker's main thread marks freely.
* The conversion: the clock keeps an *anchor*, a timing event recorded on a private
  stream of its own, on which nothing else ever runs, so the device reaches it as soon
  as it is submitted, together with the host time of the record.  A mark's host time is
  ``anchor.host_at + anchor.event.elapsed_time(mark.event) / 1000`` (``to_host_time``).
  The anchor is recorded, never waited for; the clock records a new one when the last
  is older than ``reanchor_s`` (``elapsed_time`` is a float of milliseconds: kept short,
  its resolution stays in microseconds), and each mark keeps the anchor it was made
  under, so a new anchor never changes an old mark's time.
* The result is clamped to the host time of the record: the device reaches a mark no
  sooner than the host enqueued it, and the clamp absorbs the anchor's submission
  latency (microseconds) where the device was idle.
* ``time_of`` reads a completed mark only: it never waits (the caller reads marks after
  something synchronized them -- the packer's copy synchronizes its stream, which waited
  for the forward's event).  A mark the device has not reached yet reads as its host
  time, and ``reached`` says so.
* CPU (and every other device): a mark is the host's ``time.monotonic()``; CPU kernels
  have finished when the call returns.  Other accelerators are timed on the host too
  (their event APIs differ; ``platform`` still orders their copies).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final, Protocol, Self

import attrs
import torch

from omni_async.transport.platform import CopyStream

__all__ = ["ClockMark", "DeviceClock", "TimingEvent", "to_host_time"]

# Re-anchor after this long: elapsed_time is a float32 of milliseconds (24 bits of
# mantissa), so 30 s keeps its resolution at about 2 microseconds.
DEFAULT_REANCHOR_S: Final = 30.0


class TimingEvent(Protocol):
    """What the clock uses of a timing event (``torch.cuda.Event(enable_timing=True)``)."""

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Self, /) -> float: ...


@attrs.frozen(eq=False)
class _Anchor:
    event: TimingEvent
    host_at: float


@attrs.frozen(eq=False)
class ClockMark:
    """A point on a stream: ``host_at``, the host's ``time.monotonic()`` when it was
    recorded; on CUDA, ``event`` (timing) and the ``anchor`` it converts against."""

    host_at: float
    event: TimingEvent | None = None
    anchor: _Anchor | None = None


def to_host_time(anchor_host_at: float, elapsed_ms: float, recorded_at: float) -> float:
    """The host time at which the device reached a mark: ``elapsed_ms`` after the anchor
    (recorded at ``anchor_host_at``), and never before the host recorded the mark
    (``recorded_at``)."""
    return max(recorded_at, anchor_host_at + elapsed_ms / 1e3)


def _cuda_event() -> TimingEvent:
    ev: TimingEvent = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
    return ev


class DeviceClock:
    """Marks on ``device``'s streams, read on the host's monotonic clock (module docstring).

    ``mark`` and ``time_of`` are safe from any thread (the worker's main thread marks
    the forward, the packer thread the copy and reads them all).  ``make_event``,
    ``record`` (a mark's event on a stream) and ``record_anchor`` (an anchor's, on a
    stream nothing else runs on) replace the CUDA calls: tests drive the clock with them
    on CPU.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        reanchor_s: float = DEFAULT_REANCHOR_S,
        make_event: Callable[[], TimingEvent] | None = None,
        record: Callable[[TimingEvent, CopyStream], None] | None = None,
        record_anchor: Callable[[TimingEvent], None] | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = torch.device(device)
        self._timed = self.device.type == "cuda" or make_event is not None
        self._make_event = make_event if make_event is not None else _cuda_event
        self._record = record if record is not None else self._record_cuda
        self._record_anchor = record_anchor if record_anchor is not None else self._record_cuda_anchor
        self._reanchor_s = reanchor_s
        self._now = now
        self._lock = threading.Lock()
        self._anchor: _Anchor | None = None
        self._anchor_stream: CopyStream = None

    @property
    def on_device(self) -> bool:
        """Whether marks are device events (CUDA); False: the host's clock."""
        return self._timed

    def mark(self, stream: CopyStream = None) -> ClockMark:
        """A mark on ``stream`` (None: the calling thread's current stream of the device).
        Never blocks: on CUDA it records an event, elsewhere it reads the host's clock."""
        if not self._timed:
            return ClockMark(self._now())
        anchor = self._current_anchor()
        host_at = self._now()
        ev = self._make_event()
        self._record(ev, stream)
        return ClockMark(host_at, ev, anchor)

    def reached(self, mark: ClockMark) -> bool:
        """Whether the device has passed ``mark`` (and its anchor): ``time_of`` is then exact."""
        if mark.event is None:
            return True
        assert mark.anchor is not None
        return mark.anchor.event.query() and mark.event.query()

    def time_of(self, mark: ClockMark) -> float:
        """When the device reached ``mark``, as ``time.monotonic()``; its host time while the
        device has not reached it yet (never waits: see the module docstring)."""
        if mark.event is None or not self.reached(mark):
            return mark.host_at
        assert mark.anchor is not None
        elapsed = mark.anchor.event.elapsed_time(mark.event)
        return to_host_time(mark.anchor.host_at, elapsed, mark.host_at)

    # ------------------------------------------------------------- internals

    def _current_anchor(self) -> _Anchor:
        with self._lock:
            now = self._now()
            if self._anchor is None or now - self._anchor.host_at > self._reanchor_s:
                ev = self._make_event()
                host_at = self._now()
                self._record_anchor(ev)
                self._anchor = _Anchor(ev, host_at)
            return self._anchor

    def _record_cuda(self, ev: TimingEvent, stream: CopyStream) -> None:
        assert isinstance(ev, torch.cuda.Event)
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))

    def _record_cuda_anchor(self, ev: TimingEvent) -> None:
        # A stream of the clock's own: the device reaches its events at once, whatever
        # the other streams still run (made here: whichever thread marks first).
        if self._anchor_stream is None:
            with torch.cuda.device(self.device):
                self._anchor_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
        self._record_cuda(ev, self._anchor_stream)
