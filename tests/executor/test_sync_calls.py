"""``SyncCalls``: path-2 calls collected from the pump's synchronous buffer (no workers: a
thread plays the ranks' answers through the pump)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from helpers.executor_rig import Rig
from omni_async.core.errors import ComputeTimeout, RpcFailed
from omni_async.core.messages import DiffusionOutput, Failure, RpcResult
from omni_async.executor.sync_calls import SyncCalls


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig(world_size=2)
    r.pump.start()
    try:
        yield r
    finally:
        r.pump.stop("the test ended", timeout=1.0)


def _calls(rig: Rig, rpc_timeout: float | None = 5.0) -> SyncCalls:
    return SyncCalls(rig.pump, rig.sender, rig.store, lambda: None, world_size=2, reply_rank=0, rpc_timeout=rpc_timeout)


def _answer_when_sent(rig: Rig, answers: list[tuple[int, object, Failure | None]], n_sent: int = 1) -> None:
    """On a thread: once the call is sent, every rank's answer, through the channel."""

    def run() -> None:
        deadline = time.monotonic() + 5
        while len(rig.ranks.sent) < n_sent and time.monotonic() < deadline:
            time.sleep(0.005)
        rpc_id = rig.ranks.sent[-1].rpc_id
        for rank, result, failure in answers:
            rig.ranks.channel.put(RpcResult(rpc_id, result, rank=rank, failure=failure))

    threading.Thread(target=run, daemon=True).start()


def test_every_ranks_answer_in_rank_order(rig: Rig) -> None:
    calls = _calls(rig)
    _answer_when_sent(rig, [(1, "one", None), (0, "zero", None)])
    assert calls.call("whoami", (), None, None) == ["zero", "one"]
    assert calls.stale_answers == 0 and calls.unexpected_answers == 0


def test_a_failed_rank_fails_the_call_naming_it(rig: Rig) -> None:
    calls = _calls(rig)
    carried = DiffusionOutput("r", {"x": 1}, async_output_id="step-out")
    _answer_when_sent(rig, [(0, carried, None), (1, None, Failure("ValueError", "no", ""))])
    with pytest.raises(RpcFailed) as err:
        calls.call("step", (), None, None)
    assert sorted(err.value.failures) == [1]


def test_a_call_without_every_answer_times_out_and_a_late_answer_is_counted_stale(rig: Rig) -> None:
    calls = _calls(rig)
    _answer_when_sent(rig, [(0, "only rank 0", None)])
    with pytest.raises(ComputeTimeout, match=r"no answer from rank\(s\) \[1\]"):
        calls.call("slow", (), None, 0.3)
    late_id = rig.ranks.sent[-1].rpc_id
    rig.ranks.channel.put(RpcResult(late_id, "late", rank=1))
    _answer_when_sent(rig, [(0, "a", None), (1, "b", None)], n_sent=2)
    assert calls.call("next", (), None, None) == ["a", "b"]
    assert calls.stale_answers == 1
