"""The engine's timings of a forward that returns before its kernels end (issue 19): its
``forward`` runs to the forward's end on the device, not to COMPUTE_DONE, and
``transfer_wait`` starts there (``helpers.fake_device`` stands in for the device)."""

from __future__ import annotations

import pytest
import torch

from helpers.engine_harness import run
from helpers.executor_harness import RELAXED
from helpers.fake_device import FakeDevice
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import forward_end
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.transport.channel import ResultSender
from omni_async.worker.packer import Packer

TAIL = 0.2


def test_forward_end_is_compute_done_or_the_devices_end_whichever_is_later() -> None:
    assert forward_end(10.0, None) == 10.0
    assert forward_end(10.0, 9.5) == 10.0  # the message took longer than the device
    assert forward_end(10.0, 10.3) == 10.3  # the device's tail ran past COMPUTE_DONE


def test_a_requests_forward_includes_its_device_tail() -> None:
    dev = FakeDevice()
    clock = dev.clock()

    class TailModel:
        def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
            dev.launch(TAIL)
            return DiffusionOutput(request.request_id, {"x": torch.ones(4)})

    def packer(rank: int, sender: ResultSender) -> Packer:
        return Packer(rank, sender, clock=clock)

    ex = InProcessExecutor(
        lambda rank: TailModel(),
        deadlines=RELAXED,
        make_packer=packer,
        loop_options={"clock": clock, "record_event": dev.ready_event},
    )
    try:

        async def body() -> None:
            async with AsyncDiffusionEngine(ex) as engine:
                r = await engine.generate(DiffusionRequest("r0", {}))
            t = r.timings
            assert t.forward_returned_at is not None and t.forward_ended_at is not None
            assert t.forward_ended_at - t.forward_returned_at >= TAIL * 0.8
            assert t.compute_done_at < t.forward_ended_at  # COMPUTE_DONE left at the host's return
            assert t.forward == pytest.approx(t.forward_ended_at - t.submitted_at)
            assert t.forward >= TAIL * 0.8
            assert t.transfer_wait == pytest.approx(t.output_ready_at - t.forward_ended_at)
            assert t.total >= t.queued + t.forward + t.transfer_wait

        run(body())
    finally:
        ex.shutdown()
