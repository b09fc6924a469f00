"""Streaming chunks and step calls in the dispatcher, sans-IO (``omni_async.core.stream``).

A CHUNK registers its id like a COMPUTE_DONE and hands it to its request's feed,
never answering the call; a chunk nobody wants is released on arrival; a call's end
ends its feeds (dropping what was not taken when it failed); a step call accepts the
reply rank's plain answer as an intermediate step.  Every test ends with an empty
registry once the outputs are consumed or released.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from omni_async.core.config import Deadlines
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    MessageValidationError,
    OutputDropped,
    ProtocolError,
    RequestAborted,
    RpcFailed,
)
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    AsyncOutputKind,
    Chunk,
    ComputeDone,
    DiffusionOutput,
    Failure,
    OutputReady,
    RpcResult,
    RunnerOutput,
)
from omni_async.core.registry import OutputRegistry, apply_resolutions
from omni_async.core.states import RequestState
from omni_async.core.stream import ChunkFeed, ChunkRef
from omni_async.verify.recorder import ListTracer

Msg = AsyncDiffusionOutput
S = RequestState
BOOM = Failure("ValueError", "forward exploded", "Traceback ...")


class Harness:
    def __init__(self, world_size: int = 1, compute_timeout: float | None = None) -> None:
        self.released: list[Any] = []
        self.tracer = ListTracer()
        self.registry = OutputRegistry(release_hook=lambda p: self.released.append(p.output), tracer=self.tracer)
        self.d = Dispatcher(self.registry, world_size=world_size, compute_timeout=compute_timeout, tracer=self.tracer)
        self.wakes = 0

    def settle(self) -> None:
        apply_resolutions(self.d.take_resolutions())

    def feed(self, rid: str = "r") -> ChunkFeed:
        def wake() -> None:
            self.wakes += 1

        return ChunkFeed(rid, listener=wake)

    def submit(self, rpc_id: str, rids: tuple[str, ...] = ("r",), **kw: Any) -> Future[tuple[RunnerOutput, ...]]:
        fut = self.d.submit(rpc_id, "execute_model", now=0.0, request_ids=rids, **kw)
        self.settle()
        return fut

    def handle(self, msg: AsyncDiffusionOutput, now: float = 0.0) -> None:
        self.d.handle(msg, now=now)
        self.settle()

    def chunk(self, rpc_id: str, seq: int, oid: str, rid: str = "r", rank: int = 0) -> None:
        self.handle(Chunk(rpc_id, rid, seq, oid, rank=rank))

    def output(self, oid: str) -> None:
        self.handle(OutputReady(oid, DiffusionOutput("r", output=f"payload-{oid}")))

    def take(self, feed: ChunkFeed) -> Future[DiffusionOutput] | None:
        ref = self.d.take_chunk(feed)
        if ref is None:
            return None
        fut = self.registry.wait(ref.output_id)
        self.settle()
        return fut


def cd(rpc_id: str, oid: str, rid: str = "r") -> AsyncDiffusionOutput:
    return ComputeDone(rpc_id, (oid,), (rid,))


def test_chunks_are_announced_in_order_and_never_answer_the_call() -> None:
    h = Harness()
    feed = h.feed()
    fut = h.submit("c1", streams=[feed])
    for seq in range(3):
        h.chunk("c1", seq, f"p{seq}")
        assert not fut.done(), "a CHUNK must never resolve its call"
    assert [r.seq for r in feed.announced] == [0, 1, 2]
    assert all(h.registry.state_of(f"p{i}") is S.COMPUTE_DONE for i in range(3))
    h.output("p1")  # out of order on arrival: still taken in seq order
    futs = [h.take(feed) for _ in range(3)]
    assert h.take(feed) is None and not fut.done()
    h.output("p0")
    h.output("p2")
    assert [f.result(timeout=0).output for f in futs if f is not None] == ["payload-p0", "payload-p1", "payload-p2"]
    h.handle(cd("c1", "final"))
    assert fut.result(timeout=0)[0].async_output_id == "final"
    assert feed.ended and feed.error is None and not feed.announced
    assert h.wakes == 4  # three chunks, one end
    h.registry.drop("final")
    h.output("final")
    assert len(h.registry) == 0


def test_untaken_chunks_survive_a_successful_call() -> None:
    h = Harness()
    feed = h.feed()
    h.submit("c1", streams=[feed])
    h.chunk("c1", 0, "p0")
    h.handle(cd("c1", "final"))
    assert feed.ended and not feed.exhausted
    assert h.take(feed) is not None and feed.exhausted


def test_a_chunk_of_a_call_that_ended_is_released_on_arrival() -> None:
    h = Harness(compute_timeout=1.0)
    feed = h.feed()
    fut = h.submit("c1", streams=[feed])
    h.d.expire(5.0)  # the compute deadline ends the call
    h.settle()
    assert isinstance(fut.exception(timeout=0), ComputeTimeout)
    assert feed.ended and isinstance(feed.error, ComputeTimeout)
    h.chunk("c1", 0, "late")  # its forward went on: an orphan
    assert h.d.counters["orphan_chunks"] == 1 and h.registry.state_of("late") is S.DROPPING
    h.output("late")
    assert h.released == ["payload-late"] and len(h.registry) == 0


def test_a_chunk_of_a_call_never_made_is_a_counted_protocol_error_given_up_at_a_deadline() -> None:
    """M3 and M6 for chunks: a CHUNK naming a call the executor never issued is a
    protocol error, and its DROPPING record is given up at now + compute_timeout (no
    worker is packing it); a chunk of a call that ended is only an orphan."""
    h = Harness(compute_timeout=2.0)
    h.submit("ended", streams=[h.feed()])
    h.d.expire(2.0)
    h.settle()
    h.handle(Chunk("ended", "r", 0, "late"), now=2.0)
    h.handle(Chunk("never", "r", 0, "g1"), now=2.0)
    assert h.d.counters["unknown_call_chunk"] == 1 and h.d.counters["protocol_errors"] == 1
    assert h.d.counters["orphan_chunks"] == 2
    assert [e.fields.get("known") for e in h.tracer.events if e.action == "PumpRecv"] == [True, False]
    h.d.expire(3.9)
    assert h.registry.state_of("g1") is S.DROPPING
    h.d.expire(4.0)
    h.settle()
    assert h.registry.state_of("g1") is None, "the chunk of a call never made must be given up"
    assert h.registry.state_of("late") is S.DROPPING, "a late chunk waits for its OUTPUT_READY"
    h.output("late")
    assert len(h.registry) == 0


def test_chunks_not_taken_are_dropped_when_the_call_fails() -> None:
    h = Harness(world_size=2)
    feed = h.feed()
    fut = h.submit("c1", streams=[feed])
    h.chunk("c1", 0, "p0")
    h.chunk("c1", 1, "p1")
    taken = h.take(feed)
    h.handle(RpcResult.failed("c1", BOOM, rank=1))
    h.handle(RpcResult.failed("c1", BOOM, rank=0))
    assert isinstance(fut.exception(timeout=0), RpcFailed)
    assert feed.ended and isinstance(feed.error, RpcFailed) and feed.exhausted and feed.dropped == 1
    assert h.registry.state_of("p1") is S.DROPPING  # released when it arrives
    h.output("p1")
    h.output("p0")
    assert taken is not None and taken.result(timeout=0).output == "payload-p0"  # taken: the consumer's
    assert h.released == ["payload-p1"] and len(h.registry) == 0


def test_chunks_of_a_cancelled_call_future_are_released_on_arrival() -> None:
    h = Harness()
    feed = h.feed()
    fut = h.submit("c1", streams=[feed])
    h.chunk("c1", 0, "p0")
    assert fut.cancel()
    h.chunk("c1", 1, "p1")
    assert h.registry.state_of("p1") is S.DROPPING and [r.seq for r in feed.announced] == [0]
    h.handle(cd("c1", "final"))
    assert feed.ended and isinstance(feed.error, OutputDropped) and feed.exhausted
    for oid in ("p0", "p1", "final"):
        h.output(oid)
    assert sorted(h.released) == ["payload-final", "payload-p0", "payload-p1"] and len(h.registry) == 0


def test_cancel_requests_drops_later_chunks_and_the_abort_waits_for_every_one() -> None:
    h = Harness()
    feed = h.feed()
    fut = h.submit("c1", streams=[feed])
    h.chunk("c1", 0, "p0")
    assert h.d.cancel(["r"]) == 1
    h.chunk("c1", 1, "p1")  # the forward had not seen the cancel yet
    assert h.registry.state_of("p1") is S.DROPPING
    h.handle(RpcResult.failed("c1", Failure("RequestAborted", "stopped")))
    assert feed.ended and isinstance(feed.error, RequestAborted) and feed.exhausted
    assert not fut.done(), "the abort is acknowledged only once nothing of the call remains"
    h.output("p0")
    assert not fut.done()
    h.output("p1")
    assert isinstance(fut.exception(timeout=0), RequestAborted) and len(h.registry) == 0


def test_closing_a_feed_drops_what_was_not_taken_and_everything_still_to_come() -> None:
    h = Harness()
    feed = h.feed()
    fut = h.submit("c1", streams=[feed])
    h.chunk("c1", 0, "p0")
    h.output("p0")  # arrived, not taken: held
    h.chunk("c1", 1, "p1")
    acks = h.d.close_stream(feed)
    h.settle()
    assert feed.closed and feed.exhausted and h.released == ["payload-p0"]
    assert [a.done() for a in acks] == [True, False]
    assert h.d.take_worker_drops() == ["p1"]  # still in the packer: skip it (F15)
    h.chunk("c1", 2, "p2")
    h.handle(cd("c1", "final"))
    assert fut.result(timeout=0)[0].async_output_id == "final", "closing the stream does not stop the call"
    h.output("p1")
    h.output("p2")
    assert acks[1].done() and h.released == ["payload-p0", "payload-p1", "payload-p2"]
    h.registry.drop("final")
    h.output("final")
    assert len(h.registry) == 0


@pytest.mark.parametrize("case", ["other-rank", "skips-a-place", "no-stream"])
def test_a_chunk_out_of_place_is_a_protocol_error_and_released(case: str) -> None:
    h = Harness(world_size=2)
    feed = h.feed()
    h.submit("c1", rids=("r", "s"), streams=[feed])
    h.chunk("c1", 0, "p0")
    bad = {
        "other-rank": Chunk("c1", "r", 1, "x", rank=1),
        "skips-a-place": Chunk("c1", "r", 2, "x"),
        "no-stream": Chunk("c1", "s", 0, "x"),
    }[case]
    h.handle(bad)
    assert h.d.counters["protocol_errors"] == 1 and h.registry.state_of("x") is S.DROPPING
    assert [r.seq for r in feed.announced] == [0]
    h.output("x")
    assert h.released == ["payload-x"]


def test_a_shutdown_ends_every_feed() -> None:
    h = Harness()
    feed = h.feed()
    h.submit("c1", streams=[feed])
    h.chunk("c1", 0, "p0")
    h.output("p0")
    h.d.fail_all(lambda oid: ExecutorShutdown("down", output_id=oid), close=True)
    h.settle()
    assert feed.ended and isinstance(feed.error, ExecutorShutdown) and feed.exhausted
    assert h.released == ["payload-p0"] and len(h.registry) == 0
    late = h.feed("z")
    h.d.submit("c2", "execute_model", now=0.0, request_ids=("z",), streams=[late])
    assert late.ended and isinstance(late.error, ExecutorShutdown)


def test_a_consumer_going_away_abandons_its_untaken_chunks() -> None:
    h = Harness()
    feed = h.feed()
    h.submit("c1", streams=[feed], consumer="eng")
    h.chunk("c1", 0, "p0")
    h.d.release_consumer("eng")
    h.settle()
    assert feed.ended and feed.exhausted and h.registry.state_of("p0") is S.RELEASING
    h.output("p0")
    assert h.released == ["payload-p0"] and len(h.registry) == 0


def test_a_chunk_deadline_is_the_calls_output_deadline() -> None:
    h = Harness()
    feed = h.feed()
    h.submit("c1", streams=[feed], deadlines=Deadlines(compute_timeout=None, output_timeout=2.0))
    h.chunk("c1", 0, "p0")
    h.output("p0")
    h.d.expire(3.0)
    h.settle()
    assert h.released == ["payload-p0"], "an announced chunk nobody took expires like any output"
    fut = h.take(feed)
    assert fut is not None and fut.exception(timeout=0) is not None


def test_streams_must_belong_to_the_calls_requests() -> None:
    h = Harness()
    with pytest.raises(ValueError, match="does not make"):
        h.d.submit("c1", "execute_model", now=0.0, request_ids=("r",), streams=[ChunkFeed("other")])


# ------------------------------------------------------------------------- step calls


def test_a_step_calls_plain_answer_is_an_intermediate_step() -> None:
    h = Harness(world_size=2)
    fut = h.submit("s1", rids=("r",), step=True)
    h.handle(RpcResult("s1", None, rank=1))
    h.handle(RpcResult("s1", None, rank=0))
    assert fut.result(timeout=0) == (RunnerOutput("r", finished=False),)
    final = h.submit("s2", rids=("r",), step=True)
    h.handle(RpcResult("s2", None, rank=1))
    h.handle(cd("s2", "o"))
    assert final.result(timeout=0) == (RunnerOutput("r", finished=True, async_output_id="o"),)
    assert h.d.counters["protocol_errors"] == 0, "an intermediate step's plain answer is no protocol error"
    assert h.d.counters["answers_without_compute_done"] == 0


def test_a_request_mode_call_answered_without_compute_done_still_fails() -> None:
    h = Harness()
    fut = h.submit("c1")
    h.handle(RpcResult("c1", None))
    assert isinstance(fut.exception(timeout=0), ProtocolError)
    assert h.d.counters["answers_without_compute_done"] == 1


# --------------------------------------------------------------------------- messages


def test_chunk_message_validation() -> None:
    m = Chunk("c1", "r", 3, "p3", rank=1)
    assert m.kind is AsyncOutputKind.CHUNK and m.seq == 3 and m.request_id == "r"
    ok: dict[str, Any] = dict(rpc_id="c1", request_id="r", async_output_id="p", seq=0)
    for bad in (
        dict(seq=-1),
        dict(seq=None),
        dict(seq=True),
        dict(request_id=""),
        dict(request_id=None),
        dict(request_id=("a", "b")),
        dict(async_output_id=None),
        dict(rpc_id=None),
    ):
        fields = {**ok, **bad}
        with pytest.raises(MessageValidationError):
            Chunk(**fields)
    # A field of another kind is no field of a CHUNK (nor seq of an OUTPUT_READY): refused.
    with pytest.raises(TypeError, match="failure"):
        Chunk(**ok, failure=BOOM)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="seq"):
        OutputReady("o", failure=BOOM, seq=1)  # type: ignore[call-arg]


def test_chunk_refs_are_values() -> None:
    assert ChunkRef(0, "a") == ChunkRef(0, "a")
