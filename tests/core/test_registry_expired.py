"""Expired outputs say so (issue 8): a wait after the output deadline names the expiry.

An output nobody claimed within ``output_timeout`` is released (F11), and its record
ends.  A later ``wait`` used to fail with "unknown output id ... (never announced, or
already finished)" -- or, while the record still waited for its late output, with
"abandoned by its waiter" -- which sent users looking for a protocol bug.  The
registry keeps a bounded tombstone per expired id: the wait fails with
``OutputTimeout`` naming the request, how long the output waited, and the deadline.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from omni_async.core.errors import OutputTimeout
from omni_async.core.messages import DiffusionOutput
from omni_async.core.registry import OutputRegistry, apply_resolutions


def make(output_timeout: float | None = 1.0, **kw: Any) -> tuple[OutputRegistry, list[DiffusionOutput]]:
    released: list[DiffusionOutput] = []
    return OutputRegistry(output_timeout=output_timeout, release_hook=released.append, **kw), released


def payload(oid: str) -> DiffusionOutput:
    return DiffusionOutput(request_id=f"req-{oid}", output=f"payload-{oid}")


def timeout_of(reg: OutputRegistry, fut: Future[Any]) -> OutputTimeout:
    apply_resolutions(reg.take_resolutions())
    assert fut.done()
    exc = fut.exception(timeout=0)
    assert isinstance(exc, OutputTimeout), repr(exc)
    return exc


def test_a_wait_after_an_unclaimed_output_expired_says_it_expired() -> None:
    reg, released = make(output_timeout=20.0)
    reg.on_compute_done(["o1"], now=100.0, request_ids=["req-1"])
    reg.on_output("o1", output=payload("o1"))
    assert reg.expire(120.0) == 1
    assert [p.output for p in released] == ["payload-o1"] and len(reg) == 0
    err = timeout_of(reg, reg.wait("o1"))
    assert str(err) == "output 'o1' of request 'req-1' expired unclaimed after 20.0 s (output_timeout=20.0)"
    assert err.output_id == "o1" and "unknown" not in str(err)


def test_the_message_says_how_long_the_output_waited() -> None:
    reg, _ = make(output_timeout=1.0)
    reg.on_compute_done(["o1"], now=0.0, request_ids=["req-1"])
    reg.on_output("o1", output=payload("o1"))
    reg.expire(3.5)  # the pump was busy: expired late
    assert "expired unclaimed after 3.5 s (output_timeout=1.0)" in str(timeout_of(reg, reg.wait("o1")))


def test_an_output_that_expired_before_it_arrived_says_so_and_still_expired_after() -> None:
    """Packing stalled (a full pool): the record waits for the late output, the wait says expired."""
    reg, released = make(output_timeout=2.0)
    reg.on_compute_done(["o1"], now=0.0, request_ids=["req-1"])
    reg.expire(2.0)
    assert "o1" in reg  # RELEASING: its OUTPUT_READY is still owed
    err = timeout_of(reg, reg.wait("o1"))
    assert "expired unclaimed after 2.0 s (output_timeout=2.0)" in str(err)
    assert "had not arrived from the worker" in str(err)
    reg.on_output("o1", output=payload("o1"))  # the late output: released on arrival
    assert [p.output for p in released] == ["payload-o1"] and len(reg) == 0
    assert "expired unclaimed" in str(timeout_of(reg, reg.wait("o1")))


def test_a_waiter_that_timed_out_and_a_later_wait_both_hear_expired() -> None:
    reg, _ = make(output_timeout=5.0)
    reg.on_compute_done(["o1"], now=0.0, request_ids=["req-1"])
    fut = reg.wait("o1")
    reg.expire(5.0)
    first = timeout_of(reg, fut)
    assert "output 'o1' of request 'req-1' expired undelivered after 5.0 s (output_timeout=5.0)" in str(first)
    assert str(timeout_of(reg, reg.wait("o1"))) == str(first)


def test_tombstones_are_bounded() -> None:
    reg, _ = make(output_timeout=1.0, max_finished=3)
    for i in range(10):
        reg.on_compute_done([f"o{i}"], now=float(i), request_ids=[f"req-{i}"])
        reg.on_output(f"o{i}", output=payload(f"o{i}"))
        reg.expire(float(i) + 1.0)
    assert len(reg._expired) == 3  # the oldest are forgotten
    assert isinstance(timeout_of(reg, reg.wait("o9")), OutputTimeout)
    fut = reg.wait("o0")
    apply_resolutions(reg.take_resolutions())
    assert "unknown output id" in str(fut.exception(timeout=0))
