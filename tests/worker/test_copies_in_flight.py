"""The packer keeps two copies in flight (``worker.packer``, ``copies_in_flight``).

The packer thread starts the next output's pack -- its segment leased, its copies
queued -- while the finisher thread still waits for the previous one's, so on a GPU the
copy engine goes from one output to the next without waiting for the packer's host work
(the hand-off and the send).  The finisher ends them in order.  Here the packs are the
real ones (``start_pack_shm`` into a real segment pool); a finish that waits for a gate
stands in for a long copy.  The spec's side is ``PackDepth`` in ``tla/`` (the death of a
packer with two leases is ``buggy/ReclaimHeadOnly.cfg``, bound to
``tests/transport/test_shm.py::test_sigkilled_child_cleanup``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import attrs
import pytest
import torch

from helpers.packer_jobs import WAIT_S, computed, cuda_side_stream, received, ship_on_gpu, wait_for
from helpers.shm_fixtures import no_shm_leak, segment_pool
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput, OutputReady
from omni_async.core.states import RequestState
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.packing import (
    PackInFlight,
    release_packed_output,
    start_pack_shm,
    unpack_diffusion_output_shm,
)
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.transport.shm import SegmentPool
from omni_async.worker.host import WorkerOptions
from omni_async.worker.packer import Packer

__all__ = ["no_shm_leak", "segment_pool"]  # fixtures, used by name


def _image(i: int) -> DiffusionOutput:
    return DiffusionOutput(f"r{i}", {"image": torch.full((1 << 16,), float(i))})


@attrs.define(eq=False)
class _GatedFinish:
    flight: PackInFlight
    starts: Starts

    def finish(self) -> DiffusionOutput:
        rid = self.flight.output.request_id
        if rid == self.starts.gated:
            self.starts.finishing.set()
            assert self.starts.release.wait(WAIT_S)
        out = self.flight.finish()
        self.starts.finished.append(rid)
        return out


class Starts:
    """``start_pack`` over the real ``start_pack_shm``: records which packs started and
    finished, in order; the finish of ``gated`` waits for ``release``."""

    def __init__(self, pool: SegmentPool, gated: str = "r1", fail: str | None = None) -> None:
        self.pool = pool
        self.gated = gated
        self.fail = fail
        self.release = threading.Event()
        self.finishing = threading.Event()
        self.started: list[str] = []
        self.finished: list[str] = []

    def __call__(self, output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> _GatedFinish:
        self.started.append(output.request_id)
        if output.request_id == self.fail:
            output = attrs.evolve(output, output={"image": object()})  # a leaf nothing can pack
        return _GatedFinish(start_pack_shm(output, stream, pool=self.pool, inline_threshold=0), self)


@pytest.fixture
def channel() -> Iterator[InProcessChannel]:
    ch = InProcessChannel(serialize=False)
    yield ch
    ch.close()


def _packer(channel: InProcessChannel, starts: Starts, pool: SegmentPool, copies: int = 2) -> Packer:
    packer = Packer(
        0,
        channel,
        start_pack=starts,
        release=lambda packed: _release(packed, pool),
        copies_in_flight=copies,
        max_outputs=8,
    )
    packer.start()
    return packer


def _release(packed: DiffusionOutput, pool: SegmentPool) -> None:
    release_packed_output(packed, pool=pool)


def _check_and_release(msgs: list[OutputReady], pool: SegmentPool, values: dict[str, int]) -> None:
    for m in msgs:
        if m.async_output_id not in values:
            continue
        assert m.output is not None, m.failure
        out = unpack_diffusion_output_shm(m.output, copy=True, pool=pool)
        assert torch.equal(out.output["image"], torch.full((1 << 16,), float(values[m.async_output_id])))


def test_the_next_pack_starts_before_this_one_finishes(channel: InProcessChannel, segment_pool: SegmentPool) -> None:
    """Fails with one copy in flight: o2's pack would start only once o1's finished."""
    starts = Starts(segment_pool)
    packer = _packer(channel, starts, segment_pool)
    try:
        for i in (1, 2, 3):
            packer.submit(f"o{i}", _image(i), computed(f"o{i}"), nbytes=1 << 18)
        assert starts.finishing.wait(WAIT_S)
        assert wait_for(lambda: starts.started == ["r1", "r2"]), starts.started
        time.sleep(0.05)
        # Two in flight at most: o3 waits for o1's finish, and two segments are leased.
        assert starts.started == ["r1", "r2"] and starts.finished == []
        assert segment_pool.stats().outstanding == 2
        starts.release.set()
        msgs = received(channel, 3)
        assert packer.drain(WAIT_S)
    finally:
        starts.release.set()
        packer.stop()
    assert [m.async_output_id for m in msgs] == ["o1", "o2", "o3"]  # finished in order
    assert starts.finished == ["r1", "r2", "r3"]
    _check_and_release(msgs, segment_pool, {"o1": 1, "o2": 2, "o3": 3})
    assert packer.metrics.packed == 3 and packer.metrics.in_flight_outputs == 0
    assert segment_pool.stats().outstanding == 0


def test_one_copy_in_flight_packs_one_at_a_time(channel: InProcessChannel, segment_pool: SegmentPool) -> None:
    starts = Starts(segment_pool)
    packer = _packer(channel, starts, segment_pool, copies=1)
    try:
        for i in (1, 2):
            packer.submit(f"o{i}", _image(i), computed(f"o{i}"), nbytes=1 << 18)
        assert starts.finishing.wait(WAIT_S)
        time.sleep(0.05)
        assert starts.started == ["r1"]
        assert not any(t.name == "omni-finisher-0" for t in threading.enumerate())
        starts.release.set()
        msgs = received(channel, 2)
    finally:
        starts.release.set()
        packer.stop()
    assert [m.async_output_id for m in msgs] == ["o1", "o2"]
    _check_and_release(msgs, segment_pool, {"o1": 1, "o2": 2})


def test_a_dropped_output_is_cancelled_after_the_copies_in_flight(
    channel: InProcessChannel, segment_pool: SegmentPool
) -> None:
    """The cancel waits for what is in flight (the spec's PackerCancelOutput: nothing
    packing), so the messages keep the queue's order."""
    starts = Starts(segment_pool)
    packer = _packer(channel, starts, segment_pool)
    try:
        packer.submit("o1", _image(1), computed("o1"), nbytes=1 << 18)
        assert starts.finishing.wait(WAIT_S)
        m2 = computed("o2")
        packer.submit("o2", _image(2), m2, nbytes=1 << 18)
        assert packer.drop(["o2"]) == 1
        packer.submit("o3", _image(3), computed("o3"), nbytes=1 << 18)
        time.sleep(0.05)
        assert starts.started == ["r1"]  # o2 waits (cancelled after o1), o3 behind it
        starts.release.set()
        msgs = received(channel, 3)
    finally:
        starts.release.set()
        packer.stop()
    assert [m.async_output_id for m in msgs] == ["o1", "o2", "o3"]
    assert msgs[1].failure is not None and msgs[1].failure.type_name == "Cancelled"
    assert m2.state is RequestState.DROPPED
    _check_and_release(msgs, segment_pool, {"o1": 1, "o3": 3})
    assert packer.metrics.cancelled == 1 and segment_pool.stats().outstanding == 0


def test_a_pack_that_cannot_start_fails_in_its_turn(channel: InProcessChannel, segment_pool: SegmentPool) -> None:
    starts = Starts(segment_pool, fail="r2")
    packer = _packer(channel, starts, segment_pool)
    try:
        for i in (1, 2, 3):
            packer.submit(f"o{i}", _image(i), computed(f"o{i}"), nbytes=1 << 18)
        assert starts.finishing.wait(WAIT_S)
        assert wait_for(lambda: "r2" in starts.started)
        starts.release.set()
        msgs = received(channel, 3)
    finally:
        starts.release.set()
        packer.stop()
    assert [m.async_output_id for m in msgs] == ["o1", "o2", "o3"]
    assert msgs[1].output is None and msgs[1].failure is not None
    assert msgs[1].failure.type_name == "UnsupportedOutputType", msgs[1].failure
    _check_and_release(msgs, segment_pool, {"o1": 1, "o3": 3})
    assert packer.metrics.failed == 1 and segment_pool.stats().outstanding == 0


def test_stop_finishes_the_copies_in_flight_and_the_finisher_leaves(
    channel: InProcessChannel, segment_pool: SegmentPool
) -> None:
    starts = Starts(segment_pool)
    packer = _packer(channel, starts, segment_pool)
    for i in (1, 2):
        packer.submit(f"o{i}", _image(i), computed(f"o{i}"), nbytes=1 << 18)
    assert starts.finishing.wait(WAIT_S)
    threading.Timer(0.1, starts.release.set).start()
    assert packer.stop(WAIT_S)
    assert not any(t.name == "omni-finisher-0" for t in threading.enumerate())
    msgs = received(channel, 2)
    assert [m.async_output_id for m in msgs] == ["o1", "o2"]
    _check_and_release(msgs, segment_pool, {"o1": 1, "o2": 2})


def test_copies_in_flight_is_checked(channel: InProcessChannel) -> None:
    with pytest.raises(UsageError, match="copies_in_flight"):
        WorkerOptions(copies_in_flight=0)
    with pytest.raises(UsageError, match="copies_in_flight"):
        WorkerOptions(copies_in_flight=True)
    with pytest.raises(ValueError, match="copies_in_flight"):
        Packer(0, channel, copies_in_flight=0)


def test_a_pack_in_flight_ends_once(segment_pool: SegmentPool) -> None:
    flight = start_pack_shm(_image(1), pool=segment_pool, inline_threshold=0)
    assert segment_pool.stats().outstanding == 1
    flight.abandon()  # the segment goes back: nothing was sent
    assert segment_pool.stats().outstanding == 0
    with pytest.raises(UsageError, match="once"):
        flight.finish()


# ------------------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.cuda
def test_on_the_gpu_the_next_copy_is_queued_behind_this_one(channel: InProcessChannel) -> None:
    """Three 256 MiB outputs through the real pack into shared memory with two copies in
    flight: the next output's copy is queued before this one's finish returns (its
    device start mark is no later than this one's end), and every byte arrives."""
    from omni_async.transport.clock import DeviceClock

    clock = DeviceClock("cuda")
    pool = SegmentPool(max_bytes=2 << 30, max_segments=8, lease_timeout=30.0)
    started_before_finish: list[bool] = []
    starts: list[str] = []
    finished: list[str] = []

    @attrs.define(eq=False)
    class Recorded:
        flight: PackInFlight

        def finish(self) -> DiffusionOutput:
            out = self.flight.finish()
            finished.append(out.request_id)
            return out

    def start(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> Recorded:
        starts.append(output.request_id)
        started_before_finish.append(len(starts) - len(finished) >= 2)
        return Recorded(start_pack_shm(output, stream, pool=pool, ready_event=event, lease_timeout=30.0))

    packer = Packer(
        0,
        channel,
        start_pack=start,
        release=lambda packed: _release(packed, pool),
        make_stream=cuda_side_stream,
        clock=clock,
        max_outputs=4,
    )
    packer.start()
    try:
        gen = torch.Generator(device="cuda").manual_seed(5)
        inputs = [torch.randint(0, 255, (1 << 28,), device="cuda", dtype=torch.uint8, generator=gen) for _ in range(3)]
        torch.cuda.synchronize()
        got = ship_on_gpu(packer, channel, inputs)
        stamps = [(o.metrics.pack_started_at, o.metrics.pack_ended_at) for o in got]
        same = [
            torch.equal(unpack_diffusion_output_shm(o, copy=True, pool=pool).output["x"], x.cpu())
            for o, x in zip(got, inputs, strict=True)
        ]
    finally:
        packer.stop(60)
        pool.close()
    assert all(same)
    assert any(started_before_finish[1:]), "no copy was queued while the one before it was in flight"
    for i in (1, 2):
        start_i, prev_end = stamps[i][0], stamps[i - 1][1]
        assert start_i is not None and prev_end is not None
        assert start_i <= prev_end + 1e-4, (
            f"o{i}'s copy started {start_i - prev_end:+.5f} s after o{i - 1}'s pack ended"
        )
