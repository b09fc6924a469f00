"""What the packer tests share: a request machine in COMPUTE_DONE (what the worker's loop
hands the packer), the packer's messages off an in-process channel, a wait with a
deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

from omni_async.core.messages import OutputReady
from omni_async.core.states import Machine, RequestEvent, RequestState, request_machine
from omni_async.transport.channel import InProcessChannel

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
