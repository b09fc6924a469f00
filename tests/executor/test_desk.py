"""``OutputDesk``: claims, deliveries, drops and releases, through a real pump and registry
(no workers: the tests play COMPUTE_DONE and OUTPUT_READY by hand)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from helpers.executor_harness import exc_of
from helpers.executor_rig import Rig, done_value
from helpers.executor_rig import rig as make_rig
from omni_async.core.calls import ClaimSlots
from omni_async.core.errors import OutputAlreadyClaimed, OutputDropped, OutputError, RequestAborted, UsageError
from omni_async.core.messages import ComputeDone, DiffusionOutput, DiffusionRequest, OutputReady, RunnerOutput


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield from make_rig()


def _announce(rig: Rig, oid: str, rid: str) -> None:
    """Register ``oid`` as a call's COMPUTE_DONE would (the registry alone: no pending call)."""
    rig.pump.call(lambda d: d.registry.on_compute_done([oid], now=rig.pump.now(), request_ids=[rid]))


def test_an_output_is_delivered_to_its_first_claim_only_and_later_claims_say_why(rig: Rig) -> None:
    _announce(rig, "o1", "r1")
    first = rig.desk.wait_output_ready("o1")
    err = exc_of(rig.desk.wait_output_ready("o1"))
    assert isinstance(err, OutputAlreadyClaimed) and "waiting" in str(err) and err.output_id == "o1"
    rig.play(OutputReady("o1", rig.output("o1", "r1", 7)))
    assert done_value(first).output == {"value": 7}
    err = exc_of(rig.desk.wait_output_ready("o1"))  # the record is gone: the registry remembers
    assert isinstance(err, OutputAlreadyClaimed) and "delivered" in str(err)
    assert not isinstance(exc_of(rig.desk.wait_output_ready("never")), OutputAlreadyClaimed)
    assert rig.desk.wait_stats()[0] == 1


def test_a_cancelled_claim_is_remembered_and_its_output_released_on_arrival(rig: Rig) -> None:
    _announce(rig, "o2", "r2")
    fut = rig.desk.wait_output_ready("o2")
    assert fut.cancel()
    err = exc_of(rig.desk.wait_output_ready("o2"))
    assert isinstance(err, OutputAlreadyClaimed) and "cancelled" in str(err)
    rig.play(OutputReady("o2", rig.output("o2", "r2")))
    assert rig.store.released == ["o2"] and len(rig.registry) == 0


def test_attach_relays_the_outputs_the_dispatcher_claimed_into_the_handles(rig: Rig) -> None:
    """``attach`` takes the waiters from the slots once the call resolves: no id travels back."""
    call: Future[tuple[RunnerOutput, ...]] = Future()
    slots = ClaimSlots([None, None, None])
    outputs: list[Future[DiffusionOutput]] = [Future(), Future(), Future()]
    rig.desk.attach(call, slots, outputs)
    _announce(rig, "a", "ra")
    slots.waiters[0] = rig.pump.call(lambda d: d.registry.wait("a"))
    assert outputs[2].cancel()  # a member's caller gave up before COMPUTE_DONE
    _announce(rig, "c", "rc")
    slots.waiters[2] = rig.pump.call(lambda d: d.registry.wait("c"))
    call.set_result(
        (
            RunnerOutput("ra", finished=True, async_output_id="a"),
            RunnerOutput("rb", finished=True, aborted=True),
            RunnerOutput("rc", finished=True, async_output_id="c"),
        )
    )
    assert isinstance(exc_of(outputs[1]), RequestAborted)
    assert not outputs[0].done()
    rig.play(OutputReady("a", rig.output("a", "ra", 1)))
    rig.play(OutputReady("c", rig.output("c", "rc", 3)))
    assert done_value(outputs[0]).output == {"value": 1}
    assert rig.store.released == ["c"], "the cancelled member's output is released on arrival (F9)"
    assert len(rig.registry) == 0


def test_attach_fails_every_output_with_the_calls_error(rig: Rig) -> None:
    call: Future[tuple[RunnerOutput, ...]] = Future()
    outputs: list[Future[DiffusionOutput]] = [Future(), Future()]
    rig.desk.attach(call, ClaimSlots([None, None]), outputs)
    boom = OutputError("the call failed")
    call.set_exception(boom)
    assert all(exc_of(o) is boom for o in outputs)


def test_drop_tells_the_workers_only_what_is_not_gone_at_once(rig: Rig) -> None:
    assert rig.desk.drop_output("unknown").done() and rig.ranks.sent == []
    _announce(rig, "d", "rd")
    waiter = rig.desk.wait_output_ready("d")
    gone = rig.desk.drop_output("d")
    assert not gone.done(), "its OUTPUT_READY is still to come"
    assert [r.method for r in rig.ranks.sent] == ["drop_outputs"] and rig.ranks.sent[0].args == (["d"],)
    assert isinstance(exc_of(waiter), OutputDropped)
    rig.play(OutputReady("d", rig.output("d", "rd")))
    assert gone.done() and rig.store.released == ["d"]


def test_release_checks_its_argument_and_asks_the_store(rig: Rig) -> None:
    with pytest.raises(UsageError, match="release_output: output must be"):
        rig.desk.release_output("x")  # type: ignore[arg-type]
    assert rig.desk.release_output(DiffusionOutput("r", None, async_output_id="o")) == 0
    with pytest.raises(UsageError, match="wait_output_ready: async_output_id"):
        rig.desk.wait_output_ready("")


def test_a_compute_done_claims_the_handles_outputs_under_the_pumps_lock(rig: Rig) -> None:
    """The dispatcher fills the slots while it dispatches COMPUTE_DONE, before the call's
    future resolves: by the time anyone sees the id, a second claim is refused."""
    seen: list[object] = []
    handles = rig.submitter.handles(
        [DiffusionRequest("h1", {}), DiffusionRequest("h2", {})], None, None, batch=True, stream=False
    )
    (sent,) = rig.ranks.sent

    def first_look(_: Future[RunnerOutput]) -> None:
        seen.append(exc_of(rig.desk.wait_output_ready("o-h1")))

    handles[0].computed.add_done_callback(first_look)
    rig.play(ComputeDone(sent.rpc_id, ("o-h1", "o-h2"), ("h1", "h2")))
    assert isinstance(seen[0], OutputAlreadyClaimed)
    for i, h in enumerate(handles):
        rig.play(OutputReady(f"o-{h.request_id}", rig.output(f"o-{h.request_id}", h.request_id, i)))
        assert done_value(h.output).output == {"value": i}
    assert len(rig.registry) == 0
