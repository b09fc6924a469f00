"""A device whose kernels run "in the background": what a real pipeline's forward leaves
behind when it returns on the host (its tail), without CUDA.

``FakeDevice.launch(seconds)`` queues a kernel and returns at once; the device is busy
until the kernels queued so far have run (``busy_until``, on the host's monotonic clock).
``FakeEvent`` is a timing event on it: recorded (``record``), the device reaches it when
the kernels queued before it have run; ``query`` says whether it has, ``synchronize``
waits for it, ``elapsed_time`` reads the device's timer, whose epoch is not the host's
(``OFFSET``): the conversion to the host's clock must not depend on it.  A
``GenericEvent`` over a ``FakeEvent`` is a ready event the transport waits on (a
host-side ``synchronize``), as it waits on an accelerator's event.
"""

from __future__ import annotations

import threading
import time

import torch

from omni_async.transport.clock import DeviceClock
from omni_async.transport.platform import CopyStream, GenericEvent

# The device timer's epoch: far from the host's monotonic clock.
OFFSET = 12_345.678


class FakeEvent:
    def __init__(self) -> None:
        self.device_at: float | None = None  # on the device's timer

    def query(self) -> bool:
        assert self.device_at is not None, "query of an event never recorded"
        return time.monotonic() + OFFSET >= self.device_at

    def synchronize(self) -> None:
        assert self.device_at is not None
        left = self.device_at - OFFSET - time.monotonic()
        if left > 0:
            time.sleep(left)

    def elapsed_time(self, end_event: FakeEvent, /) -> float:
        assert self.device_at is not None and end_event.device_at is not None
        assert self.query() and end_event.query(), "elapsed_time of an event not reached"
        return (end_event.device_at - self.device_at) * 1e3


class FakeDevice:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.busy_until = 0.0
        self.records = 0

    def launch(self, seconds: float) -> None:
        """Queue a kernel of ``seconds``; returns at once."""
        with self._lock:
            self.busy_until = max(time.monotonic(), self.busy_until) + seconds

    def record(self, ev: object, stream: CopyStream = None) -> None:
        """Record ``ev``: the device reaches it once the kernels queued so far have run
        (every stream is one queue here)."""
        assert isinstance(ev, FakeEvent)
        with self._lock:
            self.records += 1
            ev.device_at = OFFSET + max(time.monotonic(), self.busy_until)

    def record_anchor(self, ev: object) -> None:
        """Record the clock's anchor, on a stream nothing else runs on: reached at once."""
        assert isinstance(ev, FakeEvent)
        ev.device_at = OFFSET + time.monotonic()

    def ready_event(self) -> GenericEvent:
        """The event the worker records after the forward (``record_event``)."""
        ev = FakeEvent()
        self.record(ev)
        return GenericEvent(torch.device("privateuseone"), ev)

    def clock(self) -> DeviceClock:
        return DeviceClock("cpu", make_event=FakeEvent, record=self.record, record_anchor=self.record_anchor)
