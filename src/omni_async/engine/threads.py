"""``EngineThreads``: the engine's threads for executor calls that may block.

Sends (a request's data: a write that blocks on a full pipe) go on ``omni-engine-send``;
control (cancels, drops, stream closes) on ``omni-engine-control``, so an abort never
waits behind a send; with ``async_output=False`` the blocking synchronous calls go on
``omni-engine-sync`` threads, one per running slot.  Each method hands a call to its
thread and returns the asyncio future of its result.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["EngineThreads", "log_failure"]

log = logging.getLogger("omni_async.engine.engine")

T = TypeVar("T")


class EngineThreads:
    """The send, control and sync threads (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, sync_threads: int = 0) -> None:
        """``sync_threads``: threads for the synchronous output path (0: none)."""
        self._loop = loop
        self._send = ThreadPoolExecutor(1, thread_name_prefix="omni-engine-send")
        self._control = ThreadPoolExecutor(1, thread_name_prefix="omni-engine-control")
        self._sync = ThreadPoolExecutor(sync_threads, thread_name_prefix="omni-engine-sync") if sync_threads else None

    def send(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        return self._loop.run_in_executor(self._send, fn)

    def control(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        return self._loop.run_in_executor(self._control, fn)

    def sync(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        assert self._sync is not None, "the synchronous path's threads exist with async_output=False only"
        return self._loop.run_in_executor(self._sync, fn)

    def control_logged(self, fn: Callable[[], object], what: str, request_id: str) -> None:
        """``fn`` on the control thread, fire and forget: a failure is logged (the executor
        shut down meanwhile, which released everything anyway)."""
        self.control(fn).add_done_callback(functools.partial(log_failure, what, request_id))

    def stop(self) -> None:
        """Without waiting: queued sends and synchronous calls are dropped (the executor is
        closing or gone); queued controls still run: they give memory back."""
        self._send.shutdown(wait=False, cancel_futures=True)
        if self._sync is not None:
            self._sync.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False, cancel_futures=False)


def log_failure(what: str, request_id: str, fut: asyncio.Future[object]) -> None:
    if not fut.cancelled() and (exc := fut.exception()) is not None:
        log.debug("engine: %s for request %r failed: %s", what, request_id, exc)
