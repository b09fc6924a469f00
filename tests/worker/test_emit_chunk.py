"""Streaming on the worker: ``emit_chunk`` inside a forward run by a real ``WorkerLoop`` and
``Packer`` (threads, a real channel): a CHUNK always comes before its chunk's OUTPUT_READY
and every CHUNK before the call's COMPUTE_DONE, a chunk waits for room in the packer
(back-pressure stalls the forward, nothing is dropped), only the reply rank ships,
and a step call's intermediate step is answered synchronously."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from omni_async.core.errors import UsageError
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    AsyncOutputKind,
    Chunk,
    DiffusionOutput,
    DiffusionRequest,
    OutputReady,
    RpcRequest,
    RpcResult,
)
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.worker import emit_chunk, streaming_requested
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.packer import Packer

K = AsyncOutputKind


class Streamer:
    """Emits ``params["chunks"]`` chunks during its forward, recording when each returned."""

    def __init__(self) -> None:
        self.emitted: list[tuple[int | None, float]] = []

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput | None:
        for i in range(int(request.params.get("chunks", 0))):
            self.emitted.append((emit_chunk(request.request_id, {"i": i}), time.monotonic()))
        if request.params.get("intermediate"):
            return None  # a step of a model run step by step: no output yet
        return DiffusionOutput(request.request_id, {"final": True})


class SlowFirstChunkPut(InProcessChannel):
    """Delays the main thread's put of every CHUNK: an OUTPUT_READY of a chunk handed to the
    packer before its CHUNK was put would overtake it."""

    def put(self, msg: AsyncDiffusionOutput, timeout: float | None = None) -> None:
        if msg.kind is K.CHUNK:
            time.sleep(0.05)
        super().put(msg, timeout)


@pytest.fixture
def channel() -> Iterator[InProcessChannel]:
    ch = SlowFirstChunkPut()
    yield ch
    ch.close()


def _drain(ch: InProcessChannel, until: K) -> list[AsyncDiffusionOutput]:
    out: list[AsyncDiffusionOutput] = []
    while True:
        msg = ch.get(timeout=5.0)
        assert msg is not None, f"no {until.name} within 5 s: {out}"
        out.append(msg)
        if msg.kind is until:
            return out


def _collect(ch: InProcessChannel, ready: int) -> list[AsyncDiffusionOutput]:
    """Messages until COMPUTE_DONE and ``ready`` OUTPUT_READYs have come."""
    out: list[AsyncDiffusionOutput] = []
    while not (any(m.kind is K.COMPUTE_DONE for m in out) and sum(m.kind is K.OUTPUT_READY for m in out) == ready):
        msg = ch.get(timeout=5.0)
        assert msg is not None, f"incomplete after 5 s: {out}"
        out.append(msg)
    return out


def _stream(rid: str, **params: object) -> RpcRequest:
    return RpcRequest(f"rpc-{rid}", "execute_model", (DiffusionRequest(rid, params),), async_output=True, stream=True)


def _loop(ch: InProcessChannel, model: object, packer: Packer, **kw: Any) -> WorkerLoop:
    return WorkerLoop(0, model, ch, packer=packer, **kw)


def test_each_chunk_is_announced_before_its_output_and_before_compute_done(channel: InProcessChannel) -> None:
    packer = Packer(0, channel, max_outputs=8)
    packer.start()
    model = Streamer()
    try:
        _loop(channel, model, packer).handle_rpc(_stream("a", chunks=3))
        msgs = _collect(channel, 4)  # three chunks and the final output
    finally:
        packer.stop()
    chunks = [m for m in msgs if m.kind is K.CHUNK]
    assert [(c.seq, (c.request_id,)) for c in chunks] == [(0, ("a",)), (1, ("a",)), (2, ("a",))]
    assert [s for s, _ in model.emitted] == [0, 1, 2]
    order = [(m.kind, m.async_output_id if isinstance(m, OutputReady | Chunk) else None) for m in msgs]
    cd = order.index((K.COMPUTE_DONE, None))
    for c in chunks:
        announced = order.index((K.CHUNK, c.async_output_id))
        ready = order.index((K.OUTPUT_READY, c.async_output_id))
        assert announced < ready, f"chunk {c.seq}'s OUTPUT_READY overtook its CHUNK: {order}"
        assert announced < cd
    ready_outputs = {m.async_output_id: m.output for m in msgs if m.kind is K.OUTPUT_READY}
    assert [ready_outputs[c.async_output_id].output for c in chunks] == [{"i": 0}, {"i": 1}, {"i": 2}]  # type: ignore[union-attr]


def test_a_chunk_waits_for_room_in_the_packer_and_stalls_the_forward(channel: InProcessChannel) -> None:
    """Back-pressure: with room for one output, the second chunk's emit_chunk blocks until
    the packer has shipped the first; nothing is dropped."""
    gate = threading.Event()

    def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        gate.wait(10.0)
        return output

    packer = Packer(0, channel, pack=pack, max_outputs=1)
    packer.start()
    model = Streamer()
    loop = _loop(channel, model, packer)
    t = threading.Thread(target=loop.handle_rpc, args=(_stream("a", chunks=2),))
    t.start()
    try:
        time.sleep(0.5)
        assert len(model.emitted) == 1, "the second chunk must wait for the packer (back-pressure)"
        assert packer.metrics.in_flight_outputs == 1
        released = time.monotonic()
        gate.set()
        t.join(10.0)
        assert not t.is_alive()
        assert model.emitted[1][1] >= released
        msgs = _collect(channel, 3)
    finally:
        gate.set()
        packer.stop()
    assert [m.seq for m in msgs if m.kind is K.CHUNK] == [0, 1]
    assert packer.metrics.packed == 3 and packer.metrics.backpressure_waits >= 1


def test_no_stream_asked_no_chunk_shipped(channel: InProcessChannel) -> None:
    packer = Packer(0, channel)
    packer.start()
    model = Streamer()
    try:
        req = RpcRequest("rpc-a", "execute_model", (DiffusionRequest("a", {"chunks": 2}),), async_output=True)
        _loop(channel, model, packer).handle_rpc(req)
        msgs = _drain(channel, K.COMPUTE_DONE)
    finally:
        packer.stop()
    assert [s for s, _ in model.emitted] == [None, None]
    assert not [m for m in msgs if m.kind is K.CHUNK]


def test_only_the_reply_rank_ships_chunks(channel: InProcessChannel) -> None:
    packer = Packer(1, channel)
    packer.start()
    model = Streamer()
    try:
        WorkerLoop(1, model, channel, packer=packer, reply_rank=0).handle_rpc(_stream("a", chunks=2))
        msgs = _drain(channel, K.RPC_RESULT)
    finally:
        packer.stop()
    assert [s for s, _ in model.emitted] == [None, None]
    assert [m.kind for m in msgs] == [K.RPC_RESULT]


def test_emit_chunk_outside_a_worker_is_a_no_op_and_checks_its_arguments() -> None:
    assert emit_chunk("a", {"x": 1}) is None
    assert not streaming_requested() and not streaming_requested("a")
    with pytest.raises(UsageError, match="DiffusionOutput or a mapping"):
        emit_chunk("a", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="request 'b'"):
        emit_chunk("a", DiffusionOutput("b"))
    with pytest.raises(UsageError, match="non-empty str"):
        emit_chunk("", {})


def test_emit_chunk_for_a_request_the_call_does_not_make_is_a_usage_error(channel: InProcessChannel) -> None:
    class Wrong:
        def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
            emit_chunk("other", {"x": 1})
            return DiffusionOutput(request.request_id)

    packer = Packer(0, channel)
    packer.start()
    try:
        _loop(channel, Wrong(), packer).handle_rpc(_stream("a"))
        (msg,) = _drain(channel, K.RPC_RESULT)
    finally:
        packer.stop()
    assert isinstance(msg, RpcResult)
    assert msg.failure is not None and msg.failure.type_name == "UsageError"
    assert "computes ['a'], not that request" in msg.failure.message


def test_a_step_calls_intermediate_step_is_answered_without_outputs(channel: InProcessChannel) -> None:
    packer = Packer(0, channel)
    packer.start()
    try:
        loop = _loop(channel, Streamer(), packer)
        args = (DiffusionRequest("a", {"intermediate": True}),)
        step = RpcRequest("s1", "execute_model", args, async_output=True, step=True)
        loop.handle_rpc(step)
        (msg,) = _drain(channel, K.RPC_RESULT)
        assert isinstance(msg, RpcResult)
        assert msg.failure is None and msg.result is None
        final = RpcRequest("s2", "execute_model", (DiffusionRequest("a", {}),), async_output=True, step=True)
        loop.handle_rpc(final)
        msgs = _collect(channel, 1)
    finally:
        packer.stop()
    assert any(m.kind is K.COMPUTE_DONE for m in msgs) and packer.metrics.packed == 1
