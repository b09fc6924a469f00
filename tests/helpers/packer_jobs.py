"""What the packer tests share: a request machine in COMPUTE_DONE (what the worker's loop
hands the packer), the packer's messages off an in-process channel, a wait with a
deadline; on CUDA, the packer's side stream and outputs shipped behind their events."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from omni_async.core.messages import DiffusionOutput, OutputReady
from omni_async.core.states import Machine, RequestEvent, RequestState, request_machine
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.platform import CopyStream
from omni_async.worker.packer import Packer

WAIT_S = 10.0


def computed(output_id: str) -> Machine[RequestState, RequestEvent]:
    """A request machine in COMPUTE_DONE, as the worker's loop submits it."""
    m = request_machine(output_id)
    m.fire(RequestEvent.FORWARD)
    m.fire(RequestEvent.COMPUTE_DONE)
    return m


def received(channel: InProcessChannel, n: int) -> list[OutputReady]:
    """The next ``n`` messages, each an OUTPUT_READY (``WAIT_S`` for each)."""
    got: list[OutputReady] = []
    while len(got) < n:
        msg = channel.get(WAIT_S)
        assert isinstance(msg, OutputReady), msg
        got.append(msg)
    return got


def wait_for(cond: Callable[[], bool]) -> bool:
    """Whether ``cond`` held within ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def cuda_side_stream() -> CopyStream:
    """A packer's ``make_stream`` on CUDA device 0 (it runs on the packer's thread)."""
    torch.cuda.set_device(0)
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch


def ship_on_gpu(packer: Packer, channel: InProcessChannel, inputs: list[torch.Tensor]) -> list[DiffusionOutput]:
    """Submit each CUDA tensor as output ``o<i>`` (request ``r<i>``) behind an event recorded
    after it, as the worker's loop does; returns the packed outputs, in order, once the
    packer has drained (each one must have succeeded)."""
    for i, x in enumerate(inputs):
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record()
        packer.submit(f"o{i}", DiffusionOutput(f"r{i}", {"x": x}), computed(f"o{i}"), event=event, nbytes=x.nbytes)
    msgs = received(channel, len(inputs))
    assert packer.drain(60)
    assert [m.async_output_id for m in msgs] == [f"o{i}" for i in range(len(inputs))]
    got = []
    for m in msgs:
        assert m.output is not None, m.failure
        got.append(m.output)
    return got
