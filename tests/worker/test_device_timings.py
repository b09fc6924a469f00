"""Timings true to the device (issue 19): a forward that returns on the host while its
kernels still run (a real pipeline's) must not count its tail as the pack's time, nor
as the worker's idle time; its own time must include it.

Without CUDA such a forward is a ``FakeDevice`` (``helpers.fake_device``): the model
queues a kernel of ``TAIL`` seconds and returns at once; the ready event the worker
records is reached when the kernel has run, and the copy waits for it on the host (as
the transport waits for an accelerator's event).  The worker's clock marks on the same
fake device.  The same loop and packer, with the host's clock on CPU, keep their stamps
in order and ``pack_s`` their difference.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from helpers.fake_device import FakeDevice
from helpers.shipped import shipped_outputs
from helpers.shm_fixtures import no_shm_leak, segment_pool
from omni_async.core.messages import (
    DiffusionOutput,
    DiffusionRequest,
    RpcRequest,
)
from omni_async.core.stats import OutputStats
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.packing import (
    pack_diffusion_output_shm,
    release_packed_output,
)
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.transport.shm import SegmentPool
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.packer import Packer, PackFn

__all__ = ["no_shm_leak", "segment_pool"]

TAIL = 0.25  # the forward's kernels still run this long after it returned on the host
NUMEL = 1 << 16


class TailModel:
    """Queues a kernel of ``TAIL`` seconds on the fake device and returns at once."""

    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        self.dev.launch(TAIL)
        return DiffusionOutput(request.request_id, {"x": torch.ones(NUMEL)})


@pytest.fixture
def channel() -> Iterator[InProcessChannel]:
    ch = InProcessChannel()
    yield ch
    ch.close()


def _pack_with(pool: SegmentPool) -> PackFn:
    def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        return pack_diffusion_output_shm(output, stream, pool=pool, ready_event=event)

    return pack


def _request(rid: str, *, async_output: bool) -> RpcRequest:
    return RpcRequest(f"rpc-{rid}", "execute_model", (DiffusionRequest(rid, {}),), async_output=async_output)


def _check_one(o: DiffusionOutput) -> None:
    m = o.metrics
    assert m.forward_started_at is not None and m.forward_ended_at is not None
    assert m.forward_returned_at is not None and m.pack_started_at is not None and m.pack_ended_at is not None
    assert m.pack_s is not None
    # The forward's time includes its device tail; the host returned long before.
    # (At least TAIL: a forward queued behind another one's tail waits for it too.)
    assert m.forward_ended_at - m.forward_returned_at >= TAIL * 0.8
    assert m.forward_ended_at - m.forward_started_at >= TAIL * 0.8
    # The pack starts where the copy could: after the tail, and takes the copy alone.
    assert m.pack_started_at >= m.forward_ended_at
    assert m.pack_s == pytest.approx(m.pack_ended_at - m.pack_started_at)
    assert m.pack_s < TAIL / 2, f"pack_s={m.pack_s:.3f} s holds the forward's device tail ({TAIL} s)"


def _two_checked(channel: InProcessChannel, pool: SegmentPool) -> tuple[OutputStats, OutputStats]:
    """The next two outputs' stamps, each checked (``_check_one``), their segments released."""
    outs = shipped_outputs(channel, 2)
    for o in outs:
        release_packed_output(o, pool=pool)
    for o in outs:
        _check_one(o)
    return outs[0].metrics, outs[1].metrics


def test_the_packer_times_the_copy_not_the_forwards_tail(channel: InProcessChannel, segment_pool: SegmentPool) -> None:
    dev = FakeDevice()
    clock = dev.clock()
    packer = Packer(0, channel, pack=_pack_with(segment_pool), clock=clock)
    loop = WorkerLoop(0, TailModel(dev), channel, packer=packer, record_event=dev.ready_event, clock=clock)
    packer.start()
    try:
        for i in range(2):
            loop.handle_rpc(_request(f"a{i}", async_output=True))
        first, second = _two_checked(channel, segment_pool)
        assert second.forward_started_at is not None and first.forward_ended_at is not None
        # The second forward queued behind the first one's tail: the device never idled.
        assert second.forward_started_at >= first.forward_ended_at - 1e-3
        assert packer.metrics.pack_seconds == pytest.approx((first.pack_s or 0.0) + (second.pack_s or 0.0))
        assert packer.metrics.pack_seconds < TAIL
    finally:
        assert packer.stop(10.0)


def test_the_synchronous_path_times_the_same_way(channel: InProcessChannel, segment_pool: SegmentPool) -> None:
    """The "sync" baseline's shape (forward and copy on the main thread): the copy waits
    for the tail, which is the forward's time, not the pack's, and not idle time."""
    dev = FakeDevice()
    clock = dev.clock()
    loop = WorkerLoop(0, TailModel(dev), channel, pack_sync=_pack_with(segment_pool), record_event=dev.ready_event,
                      clock=clock)  # fmt: skip
    for i in range(2):
        loop.handle_rpc(_request(f"s{i}", async_output=False))
    first, second = _two_checked(channel, segment_pool)
    assert second.forward_started_at is not None and first.forward_ended_at is not None
    # The device idled only for the copy and the answer, not for its own tail.
    idle = second.forward_started_at - first.forward_ended_at
    assert 0 <= idle < TAIL / 2, f"idle between forwards {idle:.3f} s holds the device tail ({TAIL} s)"


def test_on_cpu_the_stamps_are_in_order_and_pack_s_is_their_difference(channel: InProcessChannel) -> None:
    class Model:
        def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
            return DiffusionOutput(request.request_id, {"x": torch.ones(8)})

    packer = Packer(0, channel)  # the host's clock
    loop = WorkerLoop(0, Model(), channel, packer=packer)
    packer.start()
    try:
        for i in range(3):
            loop.handle_rpc(_request(f"c{i}", async_output=True))
        outs = shipped_outputs(channel, 3)
    finally:
        assert packer.stop(10.0)
    for o in outs:
        m = o.metrics
        assert m.forward_started_at is not None and m.forward_returned_at is not None
        assert m.forward_ended_at == m.forward_returned_at  # CPU: no device tail
        assert m.pack_started_at is not None and m.pack_ended_at is not None
        assert m.forward_started_at <= m.forward_ended_at <= m.pack_started_at <= m.pack_ended_at
        assert m.pack_s is None  # a pack that copies nothing says nothing of a copy
    assert packer.metrics.pack_seconds == 0.0
