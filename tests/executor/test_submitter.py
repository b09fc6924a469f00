"""``BatchSubmitter`` and ``RpcSender``: calls registered, sent and turned into handles,
through a real pump and dispatcher (no workers: the tests play their answers)."""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import pytest

from helpers.executor_harness import exc_of
from helpers.executor_rig import Rig, done_value
from helpers.executor_rig import rig as make_rig
from omni_async.core.errors import ExecutorShutdown, RequestAborted, UsageError
from omni_async.core.messages import ComputeDone, DiffusionRequest, Failure, OutputReady, RpcResult
from omni_async.executor.sender import RpcIds
from omni_async.executor.submitter import BatchSubmitter


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield from make_rig()


def _req(rid: str) -> DiffusionRequest:
    return DiffusionRequest(rid, {})


def test_one_call_per_submission_and_one_handle_per_request_in_order(rig: Rig) -> None:
    handles = rig.submitter.handles([_req("a"), _req("b")], "me", None, batch=True, stream=True)
    (sent,) = rig.ranks.sent
    assert sent.method == "execute_model_batch" and sent.async_output and sent.stream
    assert [h.request_id for h in handles] == ["a", "b"] and all(h.stream is not None for h in handles)
    assert rig.health_checks == 1 and rig.dispatcher.pending_rpcs() == 1
    single = rig.submitter.handles([_req("c")], None, None, batch=False, stream=False)
    assert rig.ranks.sent[-1].method == "execute_model" and single[0].stream is None


def test_a_member_cancelled_alone_fails_and_the_rest_of_its_batch_is_delivered(rig: Rig) -> None:
    a, b = rig.submitter.handles([_req("a"), _req("b")], None, None, batch=True, stream=False)
    rig.pump.call(lambda d: d.cancel(["a"]))
    assert [m.request_ids for m in rig.ranks.cancels] == [("a",)]
    rpc_id = rig.ranks.sent[0].rpc_id
    rig.play(ComputeDone(rpc_id, ("oa", "ob"), ("a", "b")))
    assert isinstance(exc_of(a.computed), RequestAborted) and isinstance(exc_of(a.output), RequestAborted)
    assert b.computed.result(0).async_output_id == "ob"
    rig.play(OutputReady("oa", rig.output("oa", "a")))
    rig.play(OutputReady("ob", rig.output("ob", "b", 2)))
    assert done_value(b.output).output == {"value": 2}
    assert rig.store.released == ["oa"] and len(rig.registry) == 0


def test_cancelling_a_single_requests_computed_cancels_its_call(rig: Rig) -> None:
    (h,) = rig.submitter.handles([_req("s")], None, None, batch=False, stream=False)
    assert h.computed.cancel()
    assert h.output.cancelled() or not h.output.done()
    rig.play(ComputeDone(rig.ranks.sent[0].rpc_id, ("os",), ("s",)))
    rig.play(OutputReady("os", rig.output("os", "s")))
    assert rig.store.released == ["os"] and len(rig.registry) == 0 and rig.dispatcher.pending_rpcs() == 0


def test_a_call_that_cannot_be_sent_leaves_nothing_behind(rig: Rig) -> None:
    rig.ranks.refuse = BrokenPipeError("worker gone")
    with pytest.raises(ExecutorShutdown, match="cannot send execute_model_batch"):
        rig.submitter.handles([_req("x"), _req("y")], None, None, batch=True, stream=False)
    assert rig.dispatcher.pending_rpcs() == 0 and len(rig.registry) == 0


def test_drops_the_dispatcher_queued_travel_ahead_of_the_next_rpc(rig: Rig) -> None:
    """A call that failed after its reply rank announced ids: the drop is queued on the pump's
    thread (which never writes a pipe) and sent before the next call."""
    rig.dispatcher.world_size = 2  # a second rank that fails
    rig.dispatcher.reply_rank = 0
    fut = rig.submitter.submit("execute_model", (_req("f"),), None, [_req("f")])
    rpc_id = rig.ranks.sent[0].rpc_id
    rig.play(ComputeDone(rpc_id, ("of",), ("f",), rank=0))

    rig.play(RpcResult(rpc_id, None, rank=1, failure=Failure("ValueError", "boom", "")))
    assert exc_of(fut) is not None
    rig.submitter.submit("execute_model", (_req("g"),), None, [_req("g")])
    assert [r.method for r in rig.ranks.sent] == ["execute_model", "drop_outputs", "execute_model"]
    assert rig.ranks.sent[1].args == (["of"],)


def _unhashable(request: DiffusionRequest) -> Hashable | None:
    return [request.request_id]  # type: ignore[return-value]  # the mistake under test


def test_request_mode_refuses_a_call_in_step_mode_and_the_batch_key_must_hash(rig: Rig) -> None:
    step = BatchSubmitter(rig.pump, rig.sender, rig.desk, lambda: None, step_mode=True, batch_key=_unhashable)
    with pytest.raises(UsageError, match="request-mode path"):
        step.submit("execute_model", (_req("z"),), None, [_req("z")])
    with pytest.raises(UsageError, match="unhashable list"):
        step.batch_key(_req("z"))
    assert rig.submitter.batch_key(_req("z")) is None


def test_rpc_ids_are_ours_only_once_issued() -> None:
    ids = RpcIds()
    first = ids.next()
    assert ids.issued_here(first) and not ids.issued_here(f"{ids.token}-1")
    assert not ids.issued_here("other-0") and not ids.issued_here(None) and not ids.issued_here("nodash")
