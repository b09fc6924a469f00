"""``Lifecycle``: the engine's start/close machine, and the start-up and close tasks.

The machine is ``engine_machine`` (``omni_async.core.engine_states``).  The start-up
and the close each run as a task of their own: a caller that cancels its ``start`` or
``close`` stops waiting, never the work (what the start-up built is shut down when the
factory returns, whoever waits).  A close during the start wins: the start-up sees it
after each await (``check_start_wanted``) and shuts down what it built.  What a start
or a close does is passed in (``start``'s ``build``, ``close``'s ``shut_down``); this
class decides when, and in which state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from omni_async.core.engine_states import EngineEvent, EngineObserver, EngineState, engine_machine
from omni_async.core.errors import UsageError
from omni_async.engine.errors import EngineClosed
from omni_async.engine.record import retrieve

__all__ = ["Lifecycle"]

log = logging.getLogger("omni_async.engine.engine")

EE = EngineEvent
ES = EngineState

#: What a close does once no start is under way: it gets the close's deadline
#: (``time.monotonic()``) and whether the engine had started.
ShutDown = Callable[[float, bool], Awaitable[None]]


class Lifecycle:
    """The start/close machine and its tasks (see the module docstring)."""

    def __init__(self, name: str, observer: EngineObserver | None) -> None:
        self.machine = engine_machine(name, observer)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread = 0
        self._starting: asyncio.Task[None] | None = None
        self._start_given_up = False
        self._closing: asyncio.Task[None] | None = None

    @property
    def state(self) -> EngineState:
        return self.machine.state

    def check_start_wanted(self) -> None:
        """Inside the start-up, after each await: has the caller or a close given it up?"""
        if self.machine.state is not ES.STARTING:  # CLOSING, or CLOSED by a close that timed out
            raise EngineClosed("the engine was closed while it started")
        if self._start_given_up:
            raise EngineClosed("the engine's start was cancelled")

    async def start(self, build: Callable[[], Awaitable[None]]) -> None:
        """Run ``build`` as the start-up task (STARTED when it returns, START_FAILED when
        it raises: it shuts down what it built first).  Idempotent while it runs."""
        state = self.machine.state
        if state is ES.RUNNING:
            return
        if state is ES.STARTING and self._starting is not None:
            await asyncio.shield(self._starting)
            return
        if state is ES.FAILED:
            raise EngineClosed("the engine failed to start; build a new one")
        if state is not ES.NEW:
            raise EngineClosed("the engine is closed; build a new one")
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.machine.fire(EE.START)
        self._starting = self.loop.create_task(self._start_up(build), name="omni-engine-start")
        self._starting.add_done_callback(retrieve)
        try:
            await asyncio.shield(self._starting)
        except asyncio.CancelledError:
            if not self._starting.done():
                self._start_given_up = True  # the start-up sees it when its awaits return
            raise

    async def _start_up(self, build: Callable[[], Awaitable[None]]) -> None:
        try:
            await build()
        except BaseException:
            if not self.machine.terminal:  # CLOSED already: a close gave up waiting for the factory
                self.machine.fire(EE.START_FAILED)
            raise
        self.machine.fire(EE.STARTED)

    async def close(self, timeout: float, shut_down: ShutDown) -> None:
        """Close once (a second caller waits for the first): ``shut_down`` runs as the
        close task, bounded by ``timeout`` seconds; CLOSED when it returns."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise UsageError(f"close: timeout must be a finite number of seconds > 0, got {timeout!r}")
        state = self.machine.state
        if self.machine.terminal:
            return  # closed already, or a failed start (which shut down what it built)
        if state is ES.CLOSING and self._closing is not None:
            self.machine.fire(EE.CLOSE)  # CLOSING stays CLOSING: wait for the first close
            await asyncio.shield(self._closing)
            return
        self.machine.fire(EE.CLOSE)
        if self.machine.state is not ES.CLOSING:
            return  # NEW -> CLOSED: nothing to release
        assert self.loop is not None
        deadline = time.monotonic() + timeout
        self._closing = self.loop.create_task(self._close(deadline, shut_down), name="omni-engine-close")
        self._closing.add_done_callback(retrieve)
        await asyncio.shield(self._closing)

    async def _close(self, deadline: float, shut_down: ShutDown) -> None:
        try:
            starting = self._starting
            if starting is not None and not starting.done():
                # The start sees CLOSING after its await and shuts down what it built.
                await asyncio.wait([starting], timeout=max(0.0, deadline - time.monotonic()))
                if not starting.done():
                    log.warning(
                        "engine close: the executor factory did not return within the close timeout; the "
                        "executor it builds is shut down when it returns"
                    )
                await shut_down(deadline, False)
                return
            await shut_down(deadline, True)
        finally:
            self.machine.fire(EE.CLOSED)
