"""Hypothesis drives the packer with copies in flight through every order of submits,
drops, packs that cannot start and copies that end late (``worker.packer``).

The packs are real (``start_pack_shm`` into a real segment pool); each one's finish
waits for a gate the test opens, in any order, standing in for a copy that ends when the
device says.  At every step: no more than ``copies_in_flight`` packs are started and
unfinished, no more segments are leased than that, and the messages so far came in the
order the outputs were submitted.  At the end: every output got exactly one message --
its bytes, a ``Cancelled`` failure for a drop that came before its pack started, or the
typed failure of a pack that could not start -- its request machine is in a terminal
state, and no segment is left leased.  The spec's side is ``PackDepth`` in ``tla/``.
"""

from __future__ import annotations

import threading

import attrs
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers.packer_jobs import WAIT_S, computed, wait_for
from omni_async.core.messages import DiffusionOutput, OutputReady
from omni_async.core.states import Machine, RequestEvent, RequestState
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.packing import (
    PackInFlight,
    release_packed_output,
    start_pack_shm,
    unpack_diffusion_output_shm,
)
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.transport.shm import SegmentPool, list_segments
from omni_async.worker.packer import Packer

N = 1 << 12  # elements of each output: 16 KiB, into a segment (inline_threshold=0)


@attrs.define(eq=False)
class _Gated:
    flight: PackInFlight
    gate: threading.Event
    machine: PackerMachine

    def finish(self) -> DiffusionOutput:
        assert self.gate.wait(WAIT_S), "a gate was never opened"
        out = self.flight.finish()
        with self.machine.lock:
            self.machine.live -= 1
        return out


class PackerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.started: list[str] = []  # every start_pack call, in order
        self.live = 0  # started and not finished (a pack that failed to start never was)
        self.gates: dict[str, threading.Event] = {}
        self.submitted: list[str] = []
        self.bad: set[str] = set()
        self.dropped: set[str] = set()
        self.machines: dict[str, Machine[RequestState, RequestEvent]] = {}
        self.got: list[OutputReady] = []

    @initialize(depth=st.integers(1, 3))
    def start(self, depth: int) -> None:
        self.depth = depth
        self.pool = SegmentPool(max_bytes=8 << 20, max_segments=16, lease_timeout=WAIT_S)
        self.channel = InProcessChannel(serialize=False)
        self.packer = Packer(
            0,
            self.channel,
            start_pack=self._start,
            release=self._release,
            copies_in_flight=depth,
            max_outputs=64,
        )
        self.packer.start()

    def _start(self, output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> _Gated:
        rid = output.request_id
        with self.lock:
            self.started.append(rid)
            gate = self.gates.setdefault(rid, threading.Event())
        if rid in self.bad:
            output = attrs.evolve(output, output={"image": object()})  # nothing can pack it
        flight = start_pack_shm(output, stream, pool=self.pool, inline_threshold=0)  # raises for a bad one
        with self.lock:
            self.live += 1
        return _Gated(flight, gate, self)

    def _release(self, packed: DiffusionOutput) -> None:
        release_packed_output(packed, pool=self.pool)

    def _take_messages(self) -> None:
        while (msg := self.channel.get(0.0)) is not None:
            assert isinstance(msg, OutputReady), msg
            self.got.append(msg)
            if msg.output is not None:
                out = unpack_diffusion_output_shm(msg.output, copy=True, pool=self.pool)
                value = float(self.submitted.index(msg.async_output_id))
                assert torch.equal(out.output["image"], torch.full((N,), value)), msg.async_output_id

    # ------------------------------------------------------------------ rules

    @rule(bad=st.booleans())
    def submit(self, bad: bool) -> None:
        oid = f"o{len(self.submitted)}"
        if bad:
            self.bad.add(f"r{len(self.submitted)}")
        m = computed(oid)
        self.machines[oid] = m
        out = DiffusionOutput(f"r{len(self.submitted)}", {"image": torch.full((N,), float(len(self.submitted)))})
        self.submitted.append(oid)
        self.packer.submit(oid, out, m, nbytes=N * 4)

    @precondition(lambda self: bool(self.submitted))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        oid = data.draw(st.sampled_from(self.submitted))
        self.dropped.add(oid)
        self.packer.drop([oid])

    @rule(pick=st.integers(0, 99))
    def end_a_copy(self, pick: int) -> None:
        # Which packs have started depends on the threads: draw first, then choose.
        with self.lock:
            waiting = [rid for rid in self.started if not self.gates[rid].is_set()]
        if waiting:
            self.gates[waiting[pick % len(waiting)]].set()

    # ------------------------------------------------------------- invariants

    @invariant()
    def at_most_depth_in_flight(self) -> None:
        if not hasattr(self, "packer"):
            return
        with self.lock:
            assert 0 <= self.live <= self.depth, (self.started, self.live, self.depth)
        self._take_messages()
        # Leased and not yet handed off: only what is in flight.
        assert sum(1 for info in self.pool.outstanding() if info.owner_pid > 0) <= self.depth

    @invariant()
    def messages_keep_the_queue_order(self) -> None:
        ids = [m.async_output_id for m in self.got]
        assert ids == self.submitted[: len(ids)], (ids, self.submitted)

    def teardown(self) -> None:
        if not hasattr(self, "packer"):
            return
        try:
            # Open every gate as packs start, until every output has its message.
            def settled() -> bool:
                with self.lock:
                    for rid in self.started:
                        self.gates[rid].set()
                self._take_messages()
                return len(self.got) == len(self.submitted)

            assert wait_for(settled), (len(self.got), self.submitted)
            assert self.packer.drain(WAIT_S)
            self.messages_keep_the_queue_order()
            for msg, oid in zip(self.got, self.submitted, strict=True):
                rid = "r" + oid[1:]
                m = self.machines[oid]
                if msg.failure is not None and msg.failure.type_name == "Cancelled":
                    assert oid in self.dropped and rid not in self.started, oid
                    assert m.state is RequestState.DROPPED
                elif rid in self.bad:
                    assert msg.failure is not None and msg.failure.type_name == "UnsupportedOutputType", msg.failure
                    assert m.state is RequestState.FAILED
                else:
                    assert msg.output is not None, (oid, msg.failure)
                    assert m.state is RequestState.READY, m.state
            assert self.pool.stats().outstanding == 0, self.pool.outstanding()
            assert self.packer.metrics.in_flight_outputs == 0
        finally:
            with self.lock:
                for gate in self.gates.values():
                    gate.set()
            self.packer.stop(WAIT_S)
            self.channel.close()
            prefix = self.pool.prefix
            self.pool.close()
            assert list_segments(prefix) == []


PackerMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
TestCopiesInFlight = PackerMachine.TestCase
