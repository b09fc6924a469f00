"""What a worker loop shipped on an in-process channel: its outputs, in arrival order."""

from __future__ import annotations

from omni_async.core.messages import AsyncDiffusionOutput, AsyncOutputKind, DiffusionOutput
from omni_async.transport.channel import InProcessChannel


def shipped_outputs(ch: InProcessChannel, n: int, timeout: float = 30.0) -> list[DiffusionOutput]:
    """The next ``n`` outputs on ``ch``: each OUTPUT_READY's (the asynchronous path) and each
    RPC_RESULT's that carries one (the synchronous path); a failure fails the test."""
    got: list[DiffusionOutput] = []
    while len(got) < n:
        msg = ch.get(timeout=timeout)
        assert isinstance(msg, AsyncDiffusionOutput), msg
        if msg.kind is AsyncOutputKind.OUTPUT_READY:
            assert msg.failure is None and msg.output is not None, msg.failure
            got.append(msg.output)
        elif msg.kind is AsyncOutputKind.RPC_RESULT:
            assert msg.failure is None, msg.failure
            if isinstance(msg.result, DiffusionOutput):
                got.append(msg.result)
    return got
