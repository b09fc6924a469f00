"""The packer runs the device stage one output ahead of the copy (``worker.packer``).

A second thread, the stager, runs the next output's device stage while the packer
copies the one before it; on a GPU the stage's kernels and the copy then overlap, which
is what lets a copy-bound worker ship uint8 outputs at the copy's rate.  Here, on the
CPU, a pack that blocks stands in for a long copy: the next output's stage must run
while it blocks.  The GPU side (two streams, the copy waiting for the stage's event) is
``tests/worker/test_finalize.py``'s CUDA test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from helpers.packer_jobs import WAIT_S, computed, cuda_side_stream, received, ship_on_gpu, wait_for
from omni_async.core.messages import DiffusionOutput
from omni_async.core.states import RequestState
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.worker.packer import Packer


def _image(value: float) -> DiffusionOutput:
    return DiffusionOutput(f"r{int(value)}", {"image": torch.full((256,), value)})


def _to_u8(output: DiffusionOutput) -> DiffusionOutput:
    return DiffusionOutput(output.request_id, {"image": output.output["image"].to(torch.uint8)})


class Gates:
    """A pack that blocks on the first output until ``release``, and records which
    outputs were staged (by which thread) and packed, in order."""

    def __init__(self, stage_s: float = 0.0) -> None:
        self.release = threading.Event()
        self.packing_first = threading.Event()
        self.staged: list[tuple[str, str]] = []
        self.packed: list[str] = []
        self.stage_s = stage_s

    def stage(self, output: DiffusionOutput) -> DiffusionOutput:
        time.sleep(self.stage_s)
        self.staged.append((output.request_id, threading.current_thread().name))
        return _to_u8(output)

    def pack(self, output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        self.packed.append(output.request_id)
        if len(self.packed) == 1:
            self.packing_first.set()
            assert self.release.wait(WAIT_S)
        return output


@pytest.fixture
def channel() -> Iterator[InProcessChannel]:
    ch = InProcessChannel(serialize=False)
    yield ch
    ch.close()


def _packer(channel: InProcessChannel, gates: Gates) -> Packer:
    packer = Packer(0, channel, pack=gates.pack, device_stage=gates.stage)
    packer.start()
    return packer


def test_the_next_outputs_stage_runs_while_this_one_is_copied(channel: InProcessChannel) -> None:
    """Fails without the stager: the packer then stages an output only once the copy
    before it has ended."""
    gates = Gates()
    packer = _packer(channel, gates)
    try:
        for i in (1, 2):
            packer.submit(f"o{i}", _image(i), computed(f"o{i}"), nbytes=1024)
        assert gates.packing_first.wait(WAIT_S)
        assert wait_for(lambda: len(gates.staged) == 2), f"staged while o1 was copied: {gates.staged}"
        # r2 by the stager (r1 by whichever thread claimed it first: either may finish first).
        assert dict(gates.staged)["r2"] == "omni-stager-0", gates.staged
        assert gates.packed == ["r1"]
        # What o2 counts against the byte budget is already its uint8 size.
        assert wait_for(lambda: packer.metrics.in_flight_bytes == 256 + 256), packer.metrics
        gates.release.set()
        msgs = received(channel, 2)
    finally:
        gates.release.set()
        packer.stop()
    assert [m.async_output_id for m in msgs] == ["o1", "o2"]  # in order, as submitted
    for m, value in zip(msgs, (1, 2), strict=True):
        assert m.output is not None
        assert torch.equal(m.output.output["image"], torch.full((256,), value).to(torch.uint8))
    assert packer.metrics.packed == 2 and packer.metrics.in_flight_bytes == 0


def test_a_staged_output_dropped_before_its_copy_is_cancelled(channel: InProcessChannel) -> None:
    gates = Gates()
    packer = _packer(channel, gates)
    try:
        m1, m2 = computed("o1"), computed("o2")
        packer.submit("o1", _image(1), m1, nbytes=1024)
        packer.submit("o2", _image(2), m2, nbytes=1024)
        assert wait_for(lambda: len(gates.staged) == 2)
        assert packer.drop(["o2"]) == 1
        gates.release.set()
        msgs = received(channel, 2)
        assert packer.drain(WAIT_S)
    finally:
        gates.release.set()
        packer.stop()
    assert msgs[0].output is not None
    assert msgs[1].failure is not None and msgs[1].failure.type_name == "Cancelled"
    assert gates.packed == ["r1"]
    assert m2.state is RequestState.DROPPED
    assert packer.metrics.cancelled == 1 and packer.metrics.in_flight_bytes == 0


def test_a_stage_that_fails_ahead_fails_only_its_output(channel: InProcessChannel) -> None:
    gates = Gates()

    def stage(output: DiffusionOutput) -> DiffusionOutput:
        if output.request_id == "r2":
            raise ValueError("the decode ran out of memory")
        return gates.stage(output)

    packer = Packer(0, channel, pack=gates.pack, device_stage=stage)
    packer.start()
    try:
        for i in (1, 2, 3):
            packer.submit(f"o{i}", _image(i), computed(f"o{i}"), nbytes=1024)
        gates.release.set()
        msgs = received(channel, 3)
    finally:
        gates.release.set()
        packer.stop()
    assert [m.async_output_id for m in msgs] == ["o1", "o2", "o3"]
    assert msgs[0].output is not None and msgs[2].output is not None
    failure = msgs[1].failure
    assert failure is not None and failure.type_name == "ValueError" and "out of memory" in failure.message
    assert packer.metrics.failed == 1 and packer.metrics.in_flight_bytes == 0


def test_a_held_output_is_not_staged_ahead(channel: InProcessChannel) -> None:
    """A hold keeps the stager off the queued outputs too: in one interpreter its Python
    would compete with the main thread's way to the next forward."""
    gates = Gates()
    gates.release.set()
    packer = _packer(channel, gates)
    try:
        packer.hold()
        packer.submit("o1", _image(1), computed("o1"), nbytes=1024)
        time.sleep(0.2)
        assert gates.staged == []
        packer.unhold()
        msgs = received(channel, 1)
    finally:
        packer.stop()
    assert msgs[0].output is not None and gates.staged and gates.packed == ["r1"]


def test_the_stage_has_its_own_time_apart_from_the_copys(channel: InProcessChannel) -> None:
    """``device_postprocess_s``: the stage's time; ``pack_s``: the copy's, from its start
    after the stage (``worker.stamps``)."""
    gates = Gates(stage_s=0.3)
    gates.release.set()
    packer = _packer(channel, gates)
    try:
        packer.submit("o1", _image(1), computed("o1"), nbytes=1024)
        (msg,) = received(channel, 1)
    finally:
        packer.stop()
    assert msg.output is not None
    metrics = msg.output.metrics
    assert metrics.device_postprocess_s is not None and metrics.device_postprocess_s >= 0.3
    assert metrics.pack_started_at is not None and metrics.pack_ended_at is not None
    assert metrics.pack_ended_at - metrics.pack_started_at < 0.2  # the copy alone, not the stage


def test_the_stager_leaves_with_the_packer(channel: InProcessChannel) -> None:
    gates = Gates()
    gates.release.set()
    before = set(threading.enumerate())
    packer = _packer(channel, gates)
    started = set(threading.enumerate()) - before
    assert {t.name for t in started} == {"omni-packer-0", "omni-stager-0"}
    packer.submit("o1", _image(1), computed("o1"), nbytes=1024)
    assert packer.stop(WAIT_S)
    assert not [t.name for t in started if t.is_alive()]
    assert received(channel, 1)[0].output is not None


# ------------------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.cuda
def test_on_the_gpu_the_next_stage_overlaps_this_copy_and_each_copy_waits_for_its_stage(
    channel: InProcessChannel,
) -> None:
    """Three 512 MiB bf16 outputs through the real pack into shared memory, with the
    uint8 stage (``to_uint8``, fused) behind ~25 ms of GPU sleep each: the next output's
    stage must start on the device before this output's copy has ended (fails without
    the stager: the packer would queue it only after the copy), and each copy must wait
    for its own stage (a copy that did not would read the uint8 buffer before the stage
    wrote it): the pixels are eager's, bit for bit."""
    from omni_async.models.synthetic import U8, to_uint8, u8_eager
    from omni_async.transport.clock import ClockMark, DeviceClock
    from omni_async.transport.packing import pack_diffusion_output_shm, release_packed_output
    from omni_async.transport.shm import SegmentPool
    from omni_async.transport.unpacking import unpack_diffusion_output_shm

    U8.warm_up("cuda", [torch.bfloat16])
    clock = DeviceClock("cuda")
    stage_started: dict[str, ClockMark] = {}

    def stage(output: DiffusionOutput) -> DiffusionOutput:
        stage_started[output.request_id] = clock.mark(torch.cuda.current_stream())
        torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]  # unannotated in torch
        return to_uint8(output)

    pool = SegmentPool(max_bytes=2 << 30, max_segments=8, lease_timeout=30.0)

    def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        return pack_diffusion_output_shm(output, stream, pool=pool, ready_event=event, lease_timeout=30.0)

    def release(packed: DiffusionOutput) -> None:
        release_packed_output(packed, pool=pool)

    packer = Packer(
        0,
        channel,
        pack=pack,
        release=release,
        make_stream=cuda_side_stream,
        device_stage=stage,
        clock=clock,
        max_outputs=4,
    )
    packer.start()
    try:
        gen = torch.Generator(device="cuda").manual_seed(3)
        inputs = [(torch.rand(1 << 28, device="cuda", generator=gen) * 2.4 - 1.2).to(torch.bfloat16) for _ in range(3)]
        wants = [u8_eager(x).cpu() for x in inputs]
        got = ship_on_gpu(packer, channel, inputs)
        ended = [o.metrics.pack_ended_at for o in got]
        pixels = [unpack_diffusion_output_shm(o, copy=True).output["x"] for o in got]
    finally:
        packer.stop(60)
        pool.close()
    for i in (1, 2):
        started = clock.time_of(stage_started[f"r{i}"])
        prev_end = ended[i - 1]
        assert prev_end is not None
        assert started < prev_end, f"r{i}'s stage started {started - prev_end:+.4f} s after r{i - 1}'s copy ended"
    for i, (p, want) in enumerate(zip(pixels, wants, strict=True)):
        assert p.dtype == torch.uint8 and torch.equal(p, want), f"r{i}'s pixels are not the stage's"
