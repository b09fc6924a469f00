"""The worker loop on its own: every failed call answered with a typed failure (F2), and
each output counted against the packer's byte budget as the packer copies it (F5)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from omni_async.core.errors import UsageError
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    AsyncOutputKind,
    DiffusionOutput,
    DiffusionRequest,
    RpcRequest,
    RpcResult,
)
from omni_async.core.states import RequestEvent, request_machine
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.packing import pack_diffusion_output_shm, packed_nbytes
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.packer import Packer


class Model:
    """Returns ``value`` as every output; ``params["fail"]`` makes the forward raise."""

    def __init__(self, value: object = None) -> None:
        self.value = value

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        if request.params.get("fail"):
            raise RuntimeError("the forward failed")
        return DiffusionOutput(request.request_id, self.value)

    def boom(self) -> None:
        raise ValueError("boom")


def _broken_event() -> DeviceEvent | None:
    raise RuntimeError("cudaEventRecord failed")


def _no_event() -> DeviceEvent | None:
    return None


@pytest.fixture
def channel() -> Iterator[InProcessChannel]:
    ch = InProcessChannel()
    yield ch
    ch.close()


def _next(ch: InProcessChannel) -> AsyncDiffusionOutput:
    msg = ch.get(timeout=5.0)
    assert msg is not None
    return msg


def _execute(rid: str, **params: object) -> RpcRequest:
    return RpcRequest(f"rpc-{rid}", "execute_model", (DiffusionRequest(rid, params),), async_output=True)


def _fill(packer: Packer) -> None:
    """Leave one output in flight in a packer that never runs."""
    m = request_machine("held")
    m.fire(RequestEvent.FORWARD)
    m.fire(RequestEvent.COMPUTE_DONE)
    packer.submit("held", DiffusionOutput("held"), m)


# (what fails, the request, the failure's type and a part of its message)
FAILED_CALLS: list[tuple[str, RpcRequest, str, str]] = [
    ("the method raises", RpcRequest("r1", "boom"), "ValueError", "boom"),
    ("no such method", RpcRequest("r1", "nope"), "UsageError", "worker has no RPC method 'nope'"),
    ("a control call raises", RpcRequest("r1", "drain_outputs", ("soon",)), "ValueError", "could not convert"),
    (
        "not a request",
        RpcRequest("r1", "execute_model", ("x",), async_output=True),
        "UsageError",
        "execute_model takes DiffusionRequest(s)",
    ),
    ("the forward raises", _execute("q1", fail=True), "RuntimeError", "the forward failed"),
    ("the event cannot be recorded", _execute("q1"), "RuntimeError", "cudaEventRecord failed"),
    ("no room in the packer", _execute("q1"), "RuntimeError", "has no room"),
]


@pytest.mark.parametrize(("what", "req", "type_name", "message"), FAILED_CALLS, ids=[c[0] for c in FAILED_CALLS])
def test_a_failed_call_is_answered_with_its_typed_failure(
    channel: InProcessChannel, what: str, req: RpcRequest, type_name: str, message: str
) -> None:
    packer = Packer(0, channel, max_outputs=1)  # never started: what it is given stays in flight
    full = what == "no room in the packer"
    if full:
        _fill(packer)
    loop = WorkerLoop(
        0,
        Model(),
        channel,
        packer=packer,
        record_event=_broken_event if what == "the event cannot be recorded" else _no_event,
        backpressure_timeout=0.01 if full else None,
    )
    loop.handle_rpc(req)
    msg = _next(channel)
    assert isinstance(msg, RpcResult)
    assert (msg.kind, msg.rpc_id, msg.result) == (AsyncOutputKind.RPC_RESULT, req.rpc_id, None)
    assert msg.failure is not None and msg.failure.type_name == type_name and message in msg.failure.message
    assert type_name in msg.failure.traceback
    assert channel.get(timeout=0.05) is None, "one answer, no COMPUTE_DONE"
    assert packer.metrics.in_flight_outputs == (1 if full else 0), "nothing of the failed call reaches the packer"


def test_an_unsendable_answer_becomes_a_typed_failure() -> None:
    small = InProcessChannel(max_message_bytes=10_000, max_bytes=20_000)
    loop = WorkerLoop(0, Model(b"x" * 50_000), small)
    loop.handle_rpc(RpcRequest("r1", "execute_model", (DiffusionRequest("q1"),)))
    msg = _next(small)
    assert isinstance(msg, RpcResult)
    assert msg.rpc_id == "r1" and msg.failure is not None and msg.failure.type_name == "MessageTooLarge"
    small.close()


def test_the_packer_budget_counts_the_bytes_packing_copies(channel: InProcessChannel) -> None:
    value = {
        "image": torch.ones(16, 16),  # 1024
        "view": torch.zeros(1_000_000)[:2],  # its own 8 bytes, not the storage's 4 MB (F5)
        "latents": [np.zeros(10, dtype=np.int16), (torch.ones(3, dtype=torch.float64),)],  # 20 + 24
        "png": b"\x89PNG" * 4,  # 16: bytes are copied too
        "seed": np.int64(7),  # a plain value in the skeleton: 0
    }
    packer = Packer(0, channel, max_outputs=8)  # never started: the output stays in flight
    loop = WorkerLoop(0, Model(value), channel, packer=packer)
    loop.handle_rpc(_execute("q1"))
    assert _next(channel).kind is AsyncOutputKind.COMPUTE_DONE
    assert packed_nbytes(DiffusionOutput("q1", value)) == 1024 + 8 + 20 + 24 + 16
    assert packer.metrics.in_flight_bytes == 1024 + 8 + 20 + 24 + 16


def _shm_pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
    return pack_diffusion_output_shm(output, stream, ready_event=event)


def test_an_output_the_packer_refuses_counts_nothing_and_fails_typed(channel: InProcessChannel) -> None:
    """Sizing never fails the call: the packer refuses the output itself and says why (F2)."""
    value = {"image": torch.ones(16, 16), "handle": object()}
    with pytest.raises(UsageError):
        packed_nbytes(DiffusionOutput("q1", value))
    held = Packer(0, channel, pack=_shm_pack)
    loop = WorkerLoop(0, Model(value), channel, packer=held)
    loop.handle_rpc(_execute("q1"))
    done = _next(channel)
    assert done.kind is AsyncOutputKind.COMPUTE_DONE
    assert held.metrics.in_flight_outputs == 1 and held.metrics.in_flight_bytes == 0
    held.start()
    try:
        ready = _next(channel)
        assert ready.kind is AsyncOutputKind.OUTPUT_READY and ready.async_output_id == done.async_output_ids[0]
        assert ready.failure is not None and ready.failure.type_name == "UnsupportedOutputType"
        assert "output['handle']" in ready.failure.message
    finally:
        assert held.stop()
    assert held.metrics.failed == 1 and held.metrics.in_flight_bytes == 0


def test_the_packer_starts_on_a_forwards_outputs_only_after_its_compute_done(channel: InProcessChannel) -> None:
    """``Packer.held``: the loop hands a forward's outputs to the packer before it sends
    COMPUTE_DONE (the spec's order), but the packer thread starts on them only once the
    COMPUTE_DONE is out, so that it does not take the interpreter from the main thread
    while the announcement is being sent.  A slow pack function shows it: nothing is
    packed while the block is open."""
    started: list[str] = []

    def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        started.append(output.request_id)
        return output

    packer = Packer(0, channel, pack=pack)
    packer.start()
    try:
        machine = request_machine("h1")
        for event in (RequestEvent.FORWARD, RequestEvent.COMPUTE_DONE):
            machine.fire(event)
        with packer.held():
            packer.submit("h1", DiffusionOutput("h1", {"x": 1}), machine)
            time.sleep(0.2)  # a packer woken by the submit would have packed by now
            assert started == [], "the packer started while the hand-off was held"
        assert _next(channel).kind is AsyncOutputKind.OUTPUT_READY and started == ["h1"]
        # And through the loop: each COMPUTE_DONE is put before its output's OUTPUT_READY.
        loop = WorkerLoop(0, Model(torch.ones(4)), channel, packer=packer)
        for i in range(20):
            loop.handle_rpc(_execute(f"q{i}"))
            assert [_next(channel).kind for _ in range(2)] == [
                AsyncOutputKind.COMPUTE_DONE,
                AsyncOutputKind.OUTPUT_READY,
            ]
    finally:
        packer.stop()


def test_a_deferred_packer_waits_for_the_next_forward_or_idle(channel: InProcessChannel) -> None:
    """``defer_packing`` (the worker process sets it): the packer starts on a forward's
    output only once the next forward has started or the loop is told it idles, so its
    Python never takes the GIL on the main thread's way to the next launch.  Held, the
    packer cannot run at all: nothing is packed however long the test waits."""
    started: list[str] = []
    seen_at_forward: list[list[str]] = []

    class Recording(Model):
        def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
            seen_at_forward.append(list(started))
            return super().execute_model(request)

    def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        started.append(output.request_id)
        return output

    packer = Packer(0, channel, pack=pack)
    packer.start()
    try:
        loop = WorkerLoop(0, Recording(torch.ones(4)), channel, packer=packer)
        loop.defer_packing = True
        loop.handle_rpc(_execute("a"))
        assert _next(channel).kind is AsyncOutputKind.COMPUTE_DONE
        time.sleep(0.2)  # an undeferred packer has packed by now (the test below)
        assert started == [], "the packer started before the next forward or idle()"
        loop.handle_rpc(_execute("b"))  # its forward's start ends a's hold
        assert _next(channel).kind is AsyncOutputKind.COMPUTE_DONE
        assert _next(channel).kind is AsyncOutputKind.OUTPUT_READY and started == ["a"]
        time.sleep(0.1)
        assert started == ["a"], "b's output was packed before the next forward or idle()"
        loop.idle()
        assert _next(channel).kind is AsyncOutputKind.OUTPUT_READY and started == ["a", "b"]
        # A call that ends before its forward (not a request) ends the hold too.
        loop.handle_rpc(_execute("c"))
        assert _next(channel).kind is AsyncOutputKind.COMPUTE_DONE
        loop.handle_rpc(RpcRequest("bad", "execute_model", ("x",), async_output=True))
        kinds = {_next(channel).kind for _ in range(2)}
        assert kinds == {AsyncOutputKind.OUTPUT_READY, AsyncOutputKind.RPC_RESULT} and started == ["a", "b", "c"]
        # A control call (a drain: it waits for the packer) is never behind a hold.
        loop.handle_rpc(_execute("e"))
        assert _next(channel).kind is AsyncOutputKind.COMPUTE_DONE
        loop.handle_rpc(RpcRequest("d1", "drain_outputs", (5.0,)))
        kinds = {_next(channel).kind for _ in range(2)}
        assert kinds == {AsyncOutputKind.OUTPUT_READY, AsyncOutputKind.RPC_RESULT} and started == ["a", "b", "c", "e"]
        assert seen_at_forward[0] == [] and len(seen_at_forward) == 4
    finally:
        packer.stop()


def test_an_undeferred_packer_starts_once_compute_done_is_out(channel: InProcessChannel) -> None:
    """Without ``defer_packing`` (in-process and Ray hosts, which never call ``idle``) the
    packer starts as soon as COMPUTE_DONE is out, with no next request."""
    packer = Packer(0, channel)
    packer.start()
    try:
        loop = WorkerLoop(0, Model(torch.ones(4)), channel, packer=packer)
        loop.handle_rpc(_execute("a"))
        assert [_next(channel).kind for _ in range(2)] == [AsyncOutputKind.COMPUTE_DONE, AsyncOutputKind.OUTPUT_READY]
    finally:
        packer.stop()
