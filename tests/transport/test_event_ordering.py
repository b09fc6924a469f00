"""F1 without a GPU: the copy of an output is ordered after the forward's device event.

The CUDA tests (test_gpu_transport.py) show the ordering with real kernels, which CI
cannot run.  Here the "device" is a thread: the event (or the sync marker's stream)
completes only when that thread says so, and the thread writes the output's final
values just before it does.  A pack that copies without waiting for the event copies
the stale values; one that waits copies the final ones.  This runs the same code path
as a non-CUDA accelerator: ``pack_diffusion_output_shm`` -> ``wait_device_event`` ->
``GenericEvent.event.synchronize()`` or ``DeviceSync.stream.synchronize()``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from helpers.shm_fixtures import no_shm_leak, segment_pool
from omni_async.core.messages import AsyncDiffusionOutput, AsyncOutputKind, DiffusionOutput
from omni_async.core.states import RequestEvent, request_machine
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.packing import (
    pack_diffusion_output_shm,
    release_packed_output,
    unpack_diffusion_output_shm,
)
from omni_async.transport.platform import DeviceSync, GenericEvent
from omni_async.transport.shm import SegmentPool
from omni_async.worker.packer import Packer

__all__ = ["no_shm_leak", "segment_pool"]

STALE, FINAL = 1.0, 7.0
NUMEL = 1 << 18  # 1 MiB of float32: travels through shared memory
# How long the "device" waits for the packer to start waiting before it finishes anyway.
# Only a pack that never waits lets this run out (and it then copies stale values).
GRACE = 0.5


class ControlledDevice:
    """An event and a stream of a fake accelerator, completed by ``finish_forward``."""

    def __init__(self, out: torch.Tensor) -> None:
        self._out = out
        self.waiting = threading.Event()
        self.done = threading.Event()

    def synchronize(self) -> None:
        """What the packer calls to wait for the event (or to sync the stream)."""
        self.waiting.set()
        assert self.done.wait(10.0), "the forward never completed"

    def finish_forward(self) -> None:
        """The device thread: the last kernel writes the final values, then the event completes."""
        self.waiting.wait(GRACE)
        self._out.fill_(FINAL)
        self.done.set()


def marker_for(kind: str, dev: ControlledDevice) -> Any:
    device = torch.device("privateuseone")
    if kind == "event":
        return GenericEvent(device, dev)
    return DeviceSync(device, dev)


def run_forward(dev: ControlledDevice) -> threading.Thread:
    t = threading.Thread(target=dev.finish_forward, name="fake-device", daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("kind", ["event", "device_sync"])
def test_pack_copies_the_final_values_of_the_forward(segment_pool: SegmentPool, kind: str) -> None:
    out = torch.full((NUMEL,), STALE)  # the forward is still running: partial values
    dev = ControlledDevice(out)
    device_thread = run_forward(dev)
    packed = pack_diffusion_output_shm(
        DiffusionOutput("r", {"x": out}), pool=segment_pool, ready_event=marker_for(kind, dev)
    )
    device_thread.join(10.0)
    got = unpack_diffusion_output_shm(packed, copy=True).output["x"]
    assert bool((got == FINAL).all()), f"the copy read the output before the forward finished: {got[:4].tolist()}"


@pytest.mark.parametrize("kind", ["event", "device_sync"])
def test_the_packer_orders_its_copy_after_the_event_it_was_given(segment_pool: SegmentPool, kind: str) -> None:
    """The worker's path: the main thread submits the output with its event, the packer packs."""
    channel = InProcessChannel()

    def pack(output: DiffusionOutput, stream: Any, event: Any) -> DiffusionOutput:
        return pack_diffusion_output_shm(output, stream, pool=segment_pool, ready_event=event)

    def release(packed: DiffusionOutput) -> None:
        release_packed_output(packed, pool=segment_pool)

    packer = Packer(0, channel, pack=pack, release=release)
    packer.start()
    try:
        out = torch.full((NUMEL,), STALE)
        dev = ControlledDevice(out)
        m = request_machine("o1")
        m.fire(RequestEvent.FORWARD)
        m.fire(RequestEvent.COMPUTE_DONE)
        device_thread = run_forward(dev)
        packer.submit("o1", DiffusionOutput("r", {"x": out}), m, event=marker_for(kind, dev), nbytes=out.nbytes)
        msg = channel.get(10.0)
        device_thread.join(10.0)
        assert isinstance(msg, AsyncDiffusionOutput) and msg.kind is AsyncOutputKind.OUTPUT_READY, msg
        assert msg.failure is None and msg.output is not None, msg.failure
        got = unpack_diffusion_output_shm(msg.output, copy=True).output["x"]
        assert bool((got == FINAL).all()), f"the packer copied before the forward finished: {got[:4].tolist()}"
    finally:
        assert packer.stop(10.0)
