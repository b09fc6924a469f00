"""DeviceClock: marks on a device's streams read on the host's monotonic clock.

On CPU: the arithmetic (``to_host_time``), the host clock of a CPU device, and the
conversion, anchoring and "not reached yet" rules driven by a fake device whose timer
has another epoch (``helpers.fake_device``).  On CUDA (marked ``cuda``): real events
around a kernel the host does not wait for.
"""

from __future__ import annotations

import time

import pytest
import torch

from helpers.fake_device import OFFSET, FakeDevice, FakeEvent
from omni_async.transport.clock import ClockMark, DeviceClock, to_host_time


def test_to_host_time_adds_the_elapsed_milliseconds_to_the_anchor() -> None:
    assert to_host_time(100.0, 250.0, 99.0) == pytest.approx(100.25)


def test_to_host_time_never_precedes_the_host_record_of_the_mark() -> None:
    # The anchor's submission latency can put the converted time before the record.
    assert to_host_time(100.0, 1.0, 100.5) == 100.5


def test_on_cpu_a_mark_is_the_host_clock_and_reads_as_itself() -> None:
    clock = DeviceClock("cpu")
    before = time.monotonic()
    m = clock.mark()
    after = time.monotonic()
    assert not clock.on_device and m.event is None
    assert before <= m.host_at <= after
    assert clock.reached(m) and clock.time_of(m) == m.host_at


def test_a_mark_behind_queued_kernels_reads_when_the_device_reached_it() -> None:
    dev = FakeDevice()
    clock = dev.clock()
    assert clock.on_device
    first = clock.mark()
    dev.launch(0.2)  # a forward that returned on the host with its kernels still queued
    end = clock.mark()
    assert not clock.reached(end)
    assert clock.time_of(end) == end.host_at  # not reached: its host time, never a wait
    assert isinstance(end.event, FakeEvent)
    end.event.synchronize()
    assert clock.reached(end)
    # The device's timer has another epoch (OFFSET): the host times come out right anyway.
    assert clock.time_of(end) - end.host_at == pytest.approx(0.2, abs=0.02)
    assert clock.time_of(end) - clock.time_of(first) == pytest.approx(0.2, abs=0.02)
    # On the host's clock, not the device timer's: near now, whatever the machine's uptime.
    assert abs(clock.time_of(end) - time.monotonic()) < OFFSET / 2


def test_the_clock_anchors_again_and_old_marks_keep_their_anchor() -> None:
    dev = FakeDevice()
    now = [time.monotonic()]
    clock = DeviceClock("cpu", make_event=FakeEvent, record=dev.record, record_anchor=dev.record_anchor,
                        now=lambda: now[0], reanchor_s=5.0)  # fmt: skip
    a = clock.mark()
    b = clock.mark()
    assert a.anchor is b.anchor
    now[0] += 6.0  # past reanchor_s on the clock the anchor is kept by
    c = clock.mark()
    assert c.anchor is not a.anchor
    assert clock.time_of(a) == pytest.approx(a.host_at, abs=0.01)


def test_time_of_a_host_mark_on_a_timing_clock() -> None:
    # The loop's ranks that ship nothing mark with the host's clock (no event).
    clock = FakeDevice().clock()
    m = ClockMark(123.0)
    assert clock.reached(m) and clock.time_of(m) == 123.0


@pytest.mark.cuda
def test_cuda_marks_time_a_kernel_the_host_did_not_wait_for() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", torch.cuda.current_device())
    clock = DeviceClock(dev)
    torch.cuda.synchronize()
    clock.mark()  # the first mark records the anchor (and makes its stream)
    start = clock.mark()
    t0 = time.monotonic()
    torch.cuda._sleep(int(0.2 * _cycles_per_second()))  # type: ignore[no-untyped-call]
    end = clock.mark()
    host_s = time.monotonic() - t0
    assert host_s < 0.05, f"marking blocked the host for {host_s:.3f} s"
    assert not clock.reached(end)
    torch.cuda.synchronize()
    assert clock.reached(end)
    device_s = clock.time_of(end) - clock.time_of(start)
    assert device_s == pytest.approx(0.2, rel=0.25), device_s
    assert clock.time_of(end) - end.host_at == pytest.approx(0.2, rel=0.3)
    assert abs(clock.time_of(start) - start.host_at) < 0.01


def _cycles_per_second() -> float:
    """The GPU's clock, for ``torch.cuda._sleep`` (which spins a number of cycles)."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    torch.cuda._sleep(10_000_000)  # type: ignore[no-untyped-call]
    end.record()
    end.synchronize()
    return float(10_000_000 / (start.elapsed_time(end) / 1e3))
