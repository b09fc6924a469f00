"""Helpers for the engine tests (tests/engine).

* ``run``: runs a test's coroutine on a fresh event loop, bounded (no pytest-asyncio
  here: ``asyncio.run`` inside the test).
* ``eventually``: awaits a condition without blocking the loop, bounded.
* ``assert_quiescent``: nothing of any request left in the engine or the executor
  (registry empty, no held payload, no pending call, no output held in shared memory).
* ``in_thread``: a blocking call (a gate's ``wait_entered``) off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.executor.api import DiffusionExecutor
from omni_async.transport.packing import settle_releases

T = TypeVar("T")

TIMEOUT = 30.0


def run(coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def eventually(pred: Callable[[], bool], timeout: float = TIMEOUT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.005)


async def in_thread(fn: Callable[[], T]) -> T:
    return await asyncio.to_thread(fn)


def executor_quiet(ex: DiffusionExecutor) -> dict[str, float]:
    """The executor metrics that must be 0 once nothing is in flight, with their values."""
    m = ex.metrics().as_dict()
    keys = ["pending_rpcs", "pending_outputs", "pending_waiters", "held_payloads", "held_outputs"]
    return {k: m[k] for k in keys if k in m}


async def assert_quiescent(engine: AsyncDiffusionEngine, timeout: float = TIMEOUT) -> None:
    """Nothing of any request remains: in the engine, in the executor's registry, in shared memory."""
    ex = engine.executor

    def quiet() -> bool:
        return len(engine) == 0 and not any(executor_quiet(ex).values())

    try:
        await eventually(quiet, timeout, "quiescence")
    except AssertionError:
        raise AssertionError(
            f"not quiescent: engine holds {len(engine)} request(s), executor {executor_quiet(ex)}"
        ) from None
    await in_thread(settle_releases)
    assert len(ex.registry) == 0
