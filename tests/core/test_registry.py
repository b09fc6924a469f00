"""The output registry, sans-IO: every ordering of the two messages, every way a waiter ends.

No threads and no clock here: the tests pass ``now`` and apply the registry's
resolutions themselves, exactly as the pump does after releasing its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from omni_async.core.errors import (
    ExecutorShutdown,
    OutputDropped,
    OutputError,
    OutputTimeout,
    ProtocolError,
    RemoteError,
    WorkerDied,
)
from omni_async.core.messages import DiffusionOutput, Failure
from omni_async.core.registry import OutputRegistry, apply_resolutions
from omni_async.core.states import HOLDING, REQUEST_TERMINAL, RequestState
from omni_async.verify.recorder import ListTracer

S = RequestState


class Releases:
    """A release hook that records every payload it is given."""

    def __init__(self) -> None:
        self.payloads: list[DiffusionOutput] = []

    def __call__(self, payload: DiffusionOutput) -> None:
        self.payloads.append(payload)

    @property
    def tokens(self) -> list[Any]:
        return [p.output for p in self.payloads]


def payload(oid: str, tag: str = "") -> DiffusionOutput:
    return DiffusionOutput(request_id=f"req-{oid}", output=f"payload-{oid}{tag}")


FAIL = Failure("RuntimeError", "pack failed", "Traceback (most recent call last):\n  in pack\n")


def make(output_timeout: float | None = None, **kw: Any) -> tuple[OutputRegistry, Releases]:
    rel = Releases()
    return OutputRegistry(output_timeout=output_timeout, release_hook=rel, **kw), rel


def settle(reg: OutputRegistry) -> None:
    apply_resolutions(reg.take_resolutions())


def error_of(fut: Future[Any]) -> BaseException:
    assert fut.done() and not fut.cancelled()
    exc = fut.exception(timeout=0)
    assert exc is not None
    return exc


def check_empty(reg: OutputRegistry) -> None:
    assert len(reg) == 0
    assert list(reg) == []
    assert reg.pending_waiters() == 0 and reg.held_payloads() == 0
    assert reg.next_deadline() is None


# --------------------------------------------------------------------------- orderings


def test_compute_done_then_output_then_waiter() -> None:
    reg, rel = make()
    assert reg.on_compute_done(["o1"], now=0.0, rank=0, request_ids=["r1"]) == ["o1"]
    assert reg.state_of("o1") is S.COMPUTE_DONE
    reg.on_output("o1", output=payload("o1"), rank=0)
    assert reg.state_of("o1") is S.READY and reg.held_payloads() == 1
    fut = reg.wait("o1")
    settle(reg)
    got = fut.result(timeout=0)
    assert got.output == "payload-o1" and got.async_output_id == "o1" and got.request_id == "req-o1"
    check_empty(reg)
    assert rel.payloads == [] and reg.stats.delivered == 1 and reg.stats.terminal[S.DELIVERED] == 1


def test_waiter_before_output() -> None:
    reg, rel = make()
    reg.on_compute_done(["o1"], now=0.0)
    fut = reg.wait("o1")
    settle(reg)
    assert not fut.done() and reg.pending_waiters() == 1
    assert reg.wait("o1") is fut, "a second wait returns the same future"
    reg.on_output("o1", output=payload("o1"))
    assert not fut.done(), "resolved only when the caller applies the resolutions"
    settle(reg)
    assert fut.result(timeout=0).output == "payload-o1"
    check_empty(reg)


def test_output_before_compute_done_is_held_not_delivered() -> None:
    """Early arrival (F6): the packer's OUTPUT_READY overtakes the main thread's COMPUTE_DONE."""
    reg, rel = make(output_timeout=10.0)
    reg.on_output("o1", output=payload("o1"))
    assert reg.state_of("o1") is S.EARLY_READY and reg.held_payloads() == 1
    assert reg.next_deadline() is None, "the output deadline starts at COMPUTE_DONE"
    fut = reg.wait("o1")
    settle(reg)
    assert not fut.done(), "nothing is delivered before COMPUTE_DONE announces the id"
    assert reg.on_compute_done(["o1"], now=3.0) == ["o1"]
    settle(reg)
    assert fut.result(timeout=0).output == "payload-o1"
    check_empty(reg)


def test_output_before_compute_done_then_waiter_after() -> None:
    reg, _ = make()
    reg.on_output("o1", output=payload("o1"))
    reg.on_compute_done(["o1"], now=0.0)
    assert reg.state_of("o1") is S.READY
    fut = reg.wait("o1")
    settle(reg)
    assert fut.result(timeout=0).output == "payload-o1"
    check_empty(reg)


def test_batch_compute_done_names_every_request() -> None:
    reg, _ = make()
    ids = [f"o{i}" for i in range(4)]
    reg.on_output("o2", output=payload("o2"))
    assert reg.on_compute_done(ids, now=0.0, rank=0, request_ids=[f"r{i}" for i in range(4)], consumer="c") == ids
    futs = {oid: reg.wait(oid) for oid in ids}
    for oid in ids:
        if oid != "o2":
            reg.on_output(oid, output=payload(oid))
    settle(reg)
    for oid, fut in futs.items():
        assert fut.result(timeout=0).output == f"payload-{oid}"
    check_empty(reg)


# --------------------------------------------------------------------------- failures (F2)


@pytest.mark.parametrize("order", ["cd-wait-fail", "cd-fail-wait", "fail-cd-wait", "fail-wait-cd"])
def test_failure_fails_the_waiter_at_once_with_the_typed_failure(order: str) -> None:
    reg, rel = make(output_timeout=30.0)
    fut: Future[DiffusionOutput] | None = None
    for step in order.split("-"):
        if step == "cd":
            reg.on_compute_done(["o1"], now=0.0, rank=2)
        elif step == "fail":
            reg.on_output("o1", failure=FAIL, rank=2)
        else:
            fut = reg.wait("o1")
    settle(reg)
    assert fut is not None
    err = error_of(fut)
    assert isinstance(err, RemoteError)
    assert err.failure == FAIL and err.output_id == "o1" and err.rank == 2
    assert "RuntimeError: pack failed" in str(err) and "in pack" in str(err)
    check_empty(reg)
    assert rel.payloads == [] and reg.stats.received_failures == 1


def test_on_output_needs_exactly_one_of_output_or_failure() -> None:
    reg, _ = make()
    with pytest.raises(ValueError):
        reg.on_output("o1")
    with pytest.raises(ValueError):
        reg.on_output("o1", output=payload("o1"), failure=FAIL)
    check_empty(reg)


# --------------------------------------------------------------------------- cancelled waiters (F9)


def test_cancelled_waiter_late_output_is_released_at_once() -> None:
    reg, rel = make()
    reg.on_compute_done(["o1"], now=0.0)
    fut = reg.wait("o1")
    assert fut.cancel()
    reg.cancel("o1", fut)
    assert reg.state_of("o1") is S.RELEASING
    assert rel.payloads == []
    reg.on_output("o1", output=payload("o1"))
    assert rel.tokens == ["payload-o1"], "released the moment it arrived"
    check_empty(reg)
    assert reg.stats.terminal[S.RELEASED] == 1


def test_cancelled_waiter_of_an_early_output_releases_it_at_cancel() -> None:
    reg, rel = make()
    reg.on_output("o1", output=payload("o1"))
    fut = reg.wait("o1")
    fut.cancel()
    reg.cancel("o1", fut)
    assert rel.tokens == ["payload-o1"] and reg.state_of("o1") is S.RELEASING_EARLY
    reg.on_compute_done(["o1"], now=0.0)
    check_empty(reg)
    assert rel.tokens == ["payload-o1"]


def test_waiter_cancelled_before_delivery_is_not_resolved_and_output_released() -> None:
    """F3: the waiter was cancelled after the caller's check but before the registry told it."""
    reg, rel = make()
    reg.on_compute_done(["o1"], now=0.0)
    fut = reg.wait("o1")
    fut.cancel()  # the registry has not heard of it yet
    reg.on_output("o1", output=payload("o1"))  # must not raise
    settle(reg)
    assert fut.cancelled()
    assert rel.tokens == ["payload-o1"]
    check_empty(reg)
    reg.cancel("o1", fut)  # the late notification is harmless


def test_cancel_with_a_foreign_future_is_ignored() -> None:
    reg, rel = make()
    reg.on_compute_done(["o1"], now=0.0)
    fut = reg.wait("o1")
    other: Future[DiffusionOutput] = Future()
    reg.cancel("o1", other)
    assert reg.pending_waiters() == 1
    reg.cancel("nope")
    reg.on_output("o1", output=payload("o1"))
    settle(reg)
    assert fut.result(timeout=0).output == "payload-o1"


def test_claimed_waiter_cannot_be_cancelled() -> None:
    reg, _ = make()
    reg.on_compute_done(["o1"], now=0.0)
    fut = reg.wait("o1")
    reg.on_output("o1", output=payload("o1"))
    assert not fut.cancel(), "claimed under the lock: the delivery wins"
    settle(reg)
    assert fut.result(timeout=0).output == "payload-o1"


def test_wait_on_an_abandoned_or_dropped_record_fails() -> None:
    reg, _ = make()
    reg.on_compute_done(["a", "d"], now=0.0)
    f = reg.wait("a")
    f.cancel()
    reg.cancel("a", f)
    reg.drop("d")
    for oid in ("a", "d"):
        err = error_of(reg.wait(oid))
        assert isinstance(err, OutputDropped) and err.output_id == oid


# --------------------------------------------------------------------------- deadlines (F4, F11)


def test_expire_fails_the_waiter_and_releases_the_late_output() -> None:
    reg, rel = make(output_timeout=5.0)
    reg.on_compute_done(["o1"], now=100.0)
    fut = reg.wait("o1")
    assert reg.next_deadline() == 105.0
    assert reg.expire(104.99) == 0
    settle(reg)
    assert not fut.done()
    assert reg.expire(105.0) == 1
    settle(reg)
    err = error_of(fut)
    assert isinstance(err, OutputTimeout) and isinstance(err, TimeoutError) and err.output_id == "o1"
    assert reg.stats.timeouts == 1 and reg.next_deadline() is None
    assert reg.expire(1e9) == 0, "a deadline fires once"
    reg.on_output("o1", output=payload("o1"))
    assert rel.tokens == ["payload-o1"]
    check_empty(reg)


def test_expire_releases_an_unclaimed_output() -> None:
    reg, rel = make(output_timeout=1.0)
    reg.on_compute_done(["o1"], now=0.0)
    reg.on_output("o1", output=payload("o1"))
    reg.expire(0.5)
    assert rel.payloads == []
    reg.expire(1.0)
    assert rel.tokens == ["payload-o1"]
    check_empty(reg)
    assert isinstance(error_of(reg.wait("o1")), OutputError)


def test_no_output_timeout_means_no_deadline() -> None:
    reg, _ = make(output_timeout=None)
    reg.on_compute_done(["o1"], now=0.0)
    assert reg.next_deadline() is None
    assert reg.expire(1e12) == 0
    assert reg.state_of("o1") is S.COMPUTE_DONE


def test_next_deadline_is_the_earliest() -> None:
    reg, _ = make(output_timeout=2.0)
    reg.on_compute_done(["a"], now=5.0)
    reg.on_compute_done(["b"], now=1.0)
    reg.on_compute_done(["c"], now=3.0)
    assert reg.next_deadline() == 3.0
    assert reg.expire(3.0) == 1
    assert reg.next_deadline() == 5.0


# --------------------------------------------------------------------------- drop / abort (F10)


def _cd(reg: OutputRegistry) -> None:
    reg.on_compute_done(["o1"], now=0.0, consumer="c")


def _out(reg: OutputRegistry) -> None:
    reg.on_output("o1", output=payload("o1"))


def _fail(reg: OutputRegistry) -> None:
    reg.on_output("o1", failure=FAIL)


def _abandon(reg: OutputRegistry, oid: str = "o1") -> None:
    f = reg.wait(oid)
    f.cancel()
    reg.cancel(oid, f)


def _predrop(reg: OutputRegistry) -> None:
    reg.drop("o1")


# state -> (steps that reach it, whether a waiter can be pending there, what is still outstanding)
DROP_CASES: dict[str, tuple[list[Callable[[OutputRegistry], None]], bool, str | None]] = {
    "COMPUTE_DONE": ([_cd], True, "out"),
    "READY": ([_cd, _out], False, None),
    "FAILED": ([_cd, _fail], False, None),
    "EARLY_READY": ([_out], True, "cd"),
    "EARLY_FAILED": ([_fail], True, "cd"),
    "DROPPING": ([_cd, _predrop], False, "out"),
    "DROPPING_EARLY": ([_out, _predrop], False, "cd"),
    "RELEASING": ([_cd, _abandon], False, "out"),
    "RELEASING_EARLY": ([_out, _abandon], False, "cd"),
}


def test_drop_cases_cover_every_registry_resting_state() -> None:
    from omni_async.core.states import REGISTRY_INITIAL, REQUEST_TABLE, reachable

    resting = reachable(REQUEST_TABLE, REGISTRY_INITIAL) - REQUEST_TERMINAL - {S.COMPUTING, S.PACKING}
    assert {S.__members__[name] for name in DROP_CASES} == resting


@pytest.mark.parametrize(
    ("state", "with_waiter"),
    [(s, False) for s in sorted(DROP_CASES)] + [(s, True) for s in sorted(DROP_CASES) if DROP_CASES[s][1]],
)
def test_drop_in_every_state_leaves_nothing(state: str, with_waiter: bool) -> None:
    steps, _, outstanding = DROP_CASES[state]
    reg, rel = make(output_timeout=60.0)
    for step in steps:
        step(reg)
    settle(reg)
    assert reg.state_of("o1") is S.__members__[state]
    fut = reg.wait("o1") if with_waiter else None
    released_before = len(rel.payloads)
    held = reg.state_of("o1") in HOLDING and state not in ("FAILED", "EARLY_FAILED")

    gone = reg.drop("o1")
    settle(reg)
    if fut is not None:
        err = error_of(fut)
        assert isinstance(err, OutputDropped) and err.output_id == "o1"
    assert len(rel.payloads) == released_before + (1 if held else 0), "a held payload is released at once"
    if outstanding is None:
        assert gone.done() and "o1" not in reg
    else:
        assert not gone.done() and "o1" in reg and reg.held_payloads() == 0
        assert reg.drop("o1") is not gone  # dropping again is valid in every state
        if outstanding == "out":
            reg.on_output("o1", output=payload("o1", "-late"))
            assert rel.tokens[-1] == "payload-o1-late", "the late output is released on arrival"
        else:
            reg.on_compute_done(["o1"], now=1.0)
        settle(reg)
        assert gone.done() and gone.result(timeout=0) is None
    check_empty(reg)
    assert reg.stats.protocol_errors == 0


def test_drop_of_an_unknown_id_is_resolved_at_once() -> None:
    reg, _ = make()
    gone = reg.drop("never-seen")
    assert gone.done() and gone.result(timeout=0) is None
    check_empty(reg)
    assert reg.stats.protocol_errors == 0


def test_drop_future_callbacks_run_outside_the_registry() -> None:
    """A done-callback of an acknowledged drop must not run inside the registry call.

    The pump calls the registry under its lock; a callback run there that calls back
    into the executor (any ``pump.call``) deadlocks the pump (F3: it looks alive, does
    nothing).  The registry must hand the future to the outbox like every waiter.
    """
    reg, _ = make()
    reg.on_compute_done(["o1"], now=0.0)
    gone = reg.drop("o1")
    inside = False
    seen: list[bool] = []
    gone.add_done_callback(lambda f: seen.append(inside))
    inside = True
    reg.on_output("o1", output=payload("o1"))
    inside = False
    assert seen == [], "the callback ran inside on_output, under the caller's lock"
    settle(reg)
    assert seen == [False] and gone.done()


def test_cancelled_drop_future_is_not_resolved() -> None:
    reg, _ = make()
    reg.on_compute_done(["o1"], now=0.0)
    gone = reg.drop("o1")
    assert gone.cancel()
    reg.on_output("o1", output=payload("o1"))
    settle(reg)  # must not raise InvalidStateError
    assert gone.cancelled()
    check_empty(reg)


# --------------------------------------------------------------------------- consumer gone (F11)


def test_release_consumer_abandons_only_that_consumers_outputs() -> None:
    reg, rel = make()
    reg.on_compute_done(["a1", "a2", "a3"], now=0.0, consumer="A")
    reg.on_compute_done(["b1"], now=0.0, consumer="B")
    reg.on_output("a2", output=payload("a2"))
    reg.on_output("b1", output=payload("b1"))
    fa1 = reg.wait("a1")
    assert reg.release_consumer("A") == 3
    settle(reg)
    err = error_of(fa1)
    assert isinstance(err, OutputDropped) and "'A'" in str(err)
    assert rel.tokens == ["payload-a2"]
    assert reg.state_of("a1") is S.RELEASING and reg.state_of("a3") is S.RELEASING
    assert "a2" not in reg and reg.state_of("b1") is S.READY
    reg.on_output("a1", output=payload("a1"))
    reg.on_output("a3", failure=FAIL)
    assert rel.tokens == ["payload-a2", "payload-a1"]
    assert reg.release_consumer("A") == 0
    assert reg.release_consumer("nobody") == 0
    assert len(reg) == 1
    fb = reg.wait("b1")
    settle(reg)
    assert fb.result(timeout=0).output == "payload-b1"
    check_empty(reg)


# --------------------------------------------------------------------------- duplicates and unknown ids


def test_duplicate_compute_done_is_a_counted_protocol_error() -> None:
    reg, _ = make()
    assert reg.on_compute_done(["o1"], now=0.0) == ["o1"]
    assert reg.on_compute_done(["o1", "o2"], now=1.0) == ["o2"], "the duplicate is left out"
    assert reg.stats.protocol_errors == 1
    err = reg.errors[-1]
    assert isinstance(err, ProtocolError) and err.output_id == "o1" and "duplicate COMPUTE_DONE" in str(err)
    assert reg.state_of("o1") is S.COMPUTE_DONE


def test_duplicate_output_is_counted_and_its_payload_released() -> None:
    reg, rel = make()
    reg.on_compute_done(["o1"], now=0.0)
    reg.on_output("o1", output=payload("o1"))
    reg.on_output("o1", output=payload("o1", "-dup"))
    reg.on_output("o1", failure=FAIL)
    assert reg.stats.protocol_errors == 2
    assert rel.tokens == ["payload-o1-dup"]
    fut = reg.wait("o1")
    settle(reg)
    assert fut.result(timeout=0).output == "payload-o1", "the first output wins"


def test_duplicate_early_output_is_counted_and_released() -> None:
    reg, rel = make()
    reg.on_output("o1", output=payload("o1"))
    reg.on_output("o1", output=payload("o1", "-dup"))
    assert reg.stats.protocol_errors == 1 and rel.tokens == ["payload-o1-dup"]
    assert reg.state_of("o1") is S.EARLY_READY


@pytest.mark.parametrize("how", ["delivered", "dropped", "expired", "abandoned"])
def test_duplicate_after_finish_is_counted_and_creates_no_record(how: str) -> None:
    """A message for an id that already finished must not bring it back.

    The reference cached such outputs forever (F9); here a repeated OUTPUT_READY once
    created a fresh EARLY_READY record that held its payload with no deadline at all.
    """
    reg, rel = make(output_timeout=5.0)
    reg.on_compute_done(["o1"], now=0.0)
    reg.on_output("o1", output=payload("o1"))
    if how == "delivered":
        reg.wait("o1")
    elif how == "dropped":
        reg.drop("o1")
    elif how == "expired":
        reg.expire(10.0)
    else:
        _abandon(reg)
    settle(reg)
    check_empty(reg)
    released = len(rel.payloads)
    reg.on_output("o1", output=payload("o1", "-dup"))
    assert reg.on_compute_done(["o1"], now=20.0) == []
    assert reg.stats.protocol_errors == 2
    assert len(rel.payloads) == released + 1 and rel.tokens[-1] == "payload-o1-dup"
    check_empty(reg)


def test_late_message_of_a_force_released_id_is_released_quietly() -> None:
    """Worker death (fail_all without close): the other ranks' late messages are expected."""
    reg, rel = make()
    reg.on_compute_done(["a"], now=0.0)
    reg.on_output("b", output=payload("b"))
    reg.fail_all(lambda oid: WorkerDied(1, -9, output_id=oid), outcome="worker_died")
    assert rel.tokens == ["payload-b"]
    check_empty(reg)
    reg.on_output("a", output=payload("a"))
    assert reg.on_compute_done(["b"], now=1.0) == []
    assert rel.tokens == ["payload-b", "payload-a"]
    assert reg.stats.protocol_errors == 0, "these messages were still owed"
    check_empty(reg)
    # A second copy of either is a duplicate.
    reg.on_output("a", output=payload("a", "-dup"))
    assert reg.stats.protocol_errors == 1
    check_empty(reg)


def test_finished_memory_is_bounded() -> None:
    reg, _ = make(max_finished=3)
    for i in range(10):
        oid = f"o{i}"
        reg.on_compute_done([oid], now=0.0)
        reg.drop(oid)
        reg.on_output(oid, failure=FAIL)
    check_empty(reg)
    assert len(reg._finished) == 3  # bounded; the oldest are forgotten


def test_unknown_ids_never_raise() -> None:
    reg, _ = make()
    err = error_of(reg.wait("ghost"))
    assert type(err) is OutputError and err.output_id == "ghost" and "unknown output id" in str(err)
    reg.cancel("ghost")
    assert reg.drop("ghost").done()
    assert reg.release_consumer("ghost") == 0
    assert reg.state_of("ghost") is None and "ghost" not in reg
    check_empty(reg)


def test_wait_after_delivery_reports_unknown() -> None:
    reg, _ = make()
    reg.on_compute_done(["o1"], now=0.0)
    reg.on_output("o1", output=payload("o1"))
    f1 = reg.wait("o1")
    settle(reg)
    assert f1.result(timeout=0).output == "payload-o1"
    err = error_of(reg.wait("o1"))
    assert type(err) is OutputError


def test_error_log_is_bounded() -> None:
    reg, _ = make(max_error_log=4)
    reg.on_compute_done(["o1"], now=0.0)
    for i in range(10):
        reg.on_compute_done(["o1"], now=float(i))
    assert reg.stats.protocol_errors == 10 and len(reg.errors) == 4


# --------------------------------------------------------------------------- shutdown (F16)


def test_shutdown_fails_every_waiter_and_empties_the_registry() -> None:
    reg, rel = make(output_timeout=100.0)
    reg.on_compute_done(["w1", "w2", "held"], now=0.0)
    reg.on_output("early", output=payload("early"))
    reg.on_output("held", output=payload("held"))
    f1, f2, fe = reg.wait("w1"), reg.wait("w2"), reg.wait("early")
    assert reg.shutdown() == 4
    settle(reg)
    for f, oid in ((f1, "w1"), (f2, "w2"), (fe, "early")):
        err = error_of(f)
        assert isinstance(err, ExecutorShutdown) and err.output_id == oid
    assert sorted(rel.tokens) == ["payload-early", "payload-held"]
    check_empty(reg)
    assert reg.closed
    # Later: payloads released on arrival, COMPUTE_DONE ignored, waits fail at once.
    reg.on_output("w1", output=payload("w1"))
    reg.on_output("new", output=payload("new"))
    assert reg.on_compute_done(["new2"], now=1.0) == []
    assert sorted(rel.tokens) == ["payload-early", "payload-held", "payload-new", "payload-w1"]
    assert isinstance(error_of(reg.wait("new2")), ExecutorShutdown)
    assert reg.drop("new2").done()
    check_empty(reg)
    assert reg.shutdown() == 0, "idempotent"
    assert reg.stats.protocol_errors == 0


def test_fail_all_without_close_keeps_accepting_work() -> None:
    reg, _ = make()
    reg.on_compute_done(["a"], now=0.0)
    fa = reg.wait("a")
    assert reg.fail_all(lambda oid: WorkerDied(0, 1, output_id=oid), outcome="worker_died") == 1
    settle(reg)
    assert isinstance(error_of(fa), WorkerDied)
    assert not reg.closed
    reg.on_compute_done(["b"], now=0.0)
    reg.on_output("b", output=payload("b"))
    fb = reg.wait("b")
    settle(reg)
    assert fb.result(timeout=0).output == "payload-b"


# --------------------------------------------------------------------------- robustness


def test_release_hook_that_raises_does_not_corrupt_the_registry() -> None:
    """F3: a release hook that raises must not leave a terminal record behind."""
    calls: list[str] = []

    def bad_hook(p: DiffusionOutput) -> None:
        calls.append(str(p.output))
        raise OSError("unlink failed")

    reg = OutputRegistry(release_hook=bad_hook)
    reg.on_compute_done(["o1", "o2", "o3"], now=0.0)
    gone = reg.drop("o1")
    reg.on_output("o1", output=payload("o1"))  # released on arrival: the hook raises
    settle(reg)
    assert gone.done() and "o1" not in reg
    f2 = reg.wait("o2")
    reg.on_output("o3", output=payload("o3"))
    reg.shutdown()  # releases o3: the hook raises; o2's waiter must still fail
    settle(reg)
    assert isinstance(error_of(f2), ExecutorShutdown)
    check_empty(reg)
    assert calls == ["payload-o1", "payload-o3"]
    assert reg.stats.release_errors == 2 and reg.stats.released == 2


def test_release_hook_that_raises_during_drop_still_fails_the_waiter() -> None:
    def bad_hook(p: DiffusionOutput) -> None:
        raise RuntimeError("boom")

    reg = OutputRegistry(release_hook=bad_hook)
    reg.on_output("o1", output=payload("o1"))
    fut = reg.wait("o1")
    gone = reg.drop("o1")  # must not raise
    settle(reg)
    assert isinstance(error_of(fut), OutputDropped)
    reg.on_compute_done(["o1"], now=0.0)
    settle(reg)
    assert gone.done()
    check_empty(reg)


def test_empty_whenever_nothing_is_in_flight() -> None:
    reg, rel = make(output_timeout=1.0)
    for i in range(50):
        oid = f"o{i}"
        kind = i % 5
        if kind == 0:
            reg.on_compute_done([oid], now=float(i))
            reg.on_output(oid, output=payload(oid))
            reg.wait(oid)
        elif kind == 1:
            reg.on_output(oid, failure=FAIL)
            f = reg.wait(oid)
            reg.on_compute_done([oid], now=float(i))
            assert isinstance(error_of_after(reg, f), RemoteError)
        elif kind == 2:
            reg.on_compute_done([oid], now=float(i))
            reg.drop(oid)
            reg.on_output(oid, output=payload(oid))
        elif kind == 3:
            reg.on_compute_done([oid], now=float(i))
            reg.on_output(oid, output=payload(oid))
            reg.expire(float(i) + 1.0)
        else:
            reg.on_output(oid, output=payload(oid))
            _abandon(reg, oid)
            reg.on_compute_done([oid], now=float(i))
        settle(reg)
        check_empty(reg)
    assert reg.stats.delivered == 10 and reg.stats.released == 30
    assert sum(reg.stats.terminal.values()) == 50


def error_of_after(reg: OutputRegistry, fut: Future[Any]) -> BaseException:
    settle(reg)
    return error_of(fut)


def test_trace_records_the_protocol_in_order() -> None:
    tracer = ListTracer()
    reg = OutputRegistry(tracer=tracer)
    reg.on_output("o1", output=payload("o1"))
    reg.wait("o1")
    reg.on_compute_done(["o1"], now=0.0)
    settle(reg)
    actions = [(e.action, dict(e.fields)) for e in tracer.snapshot()]
    assert actions == [
        ("Create", {"output_id": "o1"}),
        ("Fire", {"output_id": "o1", "event": "OUTPUT_READY", "src": "COMPUTING", "dst": "EARLY_READY"}),
        ("WaiterAdd", {"output_id": "o1"}),
        ("Fire", {"output_id": "o1", "event": "COMPUTE_DONE", "src": "EARLY_READY", "dst": "READY"}),
        ("Fire", {"output_id": "o1", "event": "DELIVER", "src": "READY", "dst": "DELIVERED"}),
        ("PayloadDeliver", {"output_id": "o1"}),
        ("WaiterResolve", {"output_id": "o1", "outcome": "output"}),
        ("Remove", {"output_id": "o1", "state": "DELIVERED"}),
    ]


def test_late_messages_are_traced_as_the_trace_spec_spells_them() -> None:
    """``Late``'s kind is "cd" or "out" on the wire (TraceAsyncOutput.tla), whatever the registry calls them."""
    tracer = ListTracer()
    reg = OutputRegistry(tracer=tracer)
    reg.on_compute_done(["a"], now=0.0)
    reg.on_output("b", output=payload("b"))
    reg.fail_all(lambda oid: WorkerDied(1, -9, output_id=oid), outcome="worker_died")
    reg.on_output("a", output=payload("a"))  # owed
    reg.on_compute_done(["b"], now=1.0)  # owed
    reg.on_output("b", failure=FAIL)  # already arrived: a protocol error
    reg.on_compute_done(["a"], now=2.0)  # likewise
    late = [(e.action, dict(e.fields)) for e in tracer.snapshot() if e.action in ("Late", "ProtocolError")]
    assert late == [
        ("Late", {"output_id": "a", "kind": "out", "expected": True}),
        ("Late", {"output_id": "b", "kind": "cd", "expected": True}),
        ("Late", {"output_id": "b", "kind": "out", "expected": False}),
        ("ProtocolError", {"output_id": "b", "reason": "OUTPUT_READY for an output that already finished"}),
        ("Late", {"output_id": "a", "kind": "cd", "expected": False}),
        ("ProtocolError", {"output_id": "a", "reason": "COMPUTE_DONE for an output that already finished"}),
    ]
    assert all(type(e.fields["kind"]) is str for e in tracer.snapshot() if e.action == "Late")
    check_empty(reg)


def test_records_expose_their_state_and_never_a_terminal_one() -> None:
    reg, _ = make()
    reg.on_compute_done(["a"], now=0.0, rank=1, request_ids=["ra"], consumer="c")
    (rec,) = list(reg)
    assert rec.output_id == "a" and rec.rank == 1 and rec.request_id == "ra" and rec.consumer == "c"
    assert rec.state is S.COMPUTE_DONE and not rec.machine.terminal
