"""The engine's start-up and close, each a task of its own.

A caller that cancels its ``start`` or ``close`` stops waiting, never the work: what
the start-up built is shut down when the factory returns, whoever waits; the close
fails every request not finished, shuts down an executor the engine owns, waits for
the drivers to release everything (bounded by its deadline) and stops the engine's
threads.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

from omni_async.core.engine_states import EngineEvent, EngineState, StageEvent
from omni_async.core.errors import UsageError
from omni_async.engine.base import log
from omni_async.engine.driver import EngineDriver
from omni_async.engine.errors import EngineClosed
from omni_async.engine.record import RequestRecord
from omni_async.engine.scheduler import Scheduler
from omni_async.executor.api import DiffusionExecutor

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "EngineLifecycle"]

SE = StageEvent
EE = EngineEvent
ES = EngineState

# Without a budget reported by the executor (InProcessExecutor): how many requests may
# be running or holding an output at once.
DEFAULT_MAX_IN_FLIGHT = 64


class EngineLifecycle(EngineDriver):
    """The start-up and close tasks (see the module docstring)."""

    def _check_start_wanted(self) -> None:
        """Inside the start-up, after each await: has the caller or a close given it up?"""
        if self._life.state is not ES.STARTING:  # CLOSING, or CLOSED by a close that timed out
            raise EngineClosed("the engine was closed while it started")
        if self._start_given_up:
            raise EngineClosed("the engine's start was cancelled")

    async def _start_up(self) -> None:
        assert self._loop is not None
        try:
            if self._executor is None:
                assert self._factory is not None
                # The factory runs to its end on its thread, whatever happens here.
                built = await asyncio.to_thread(self._factory)
                if not isinstance(built, DiffusionExecutor):
                    raise UsageError(f"the executor factory returned {type(built).__name__}, not a DiffusionExecutor")
                self._executor = built
            self._check_start_wanted()
            ex = self._executor
            if ex.step_mode and self._async_output:
                raise UsageError(
                    "AsyncDiffusionEngine needs an executor in request mode (step_mode=False): it overlaps each "
                    "output's copy with the next forward (a step-mode executor serves only the synchronous "
                    "baseline, async_output=False)"
                )
            budget = ex.budget
            self._check_start_wanted()
        except BaseException:
            # What the start built goes before the lifecycle says FAILED: a failed start
            # never leaves a live executor behind.
            if self._owns_executor and self._executor is not None:
                await asyncio.to_thread(self._executor.shutdown, "the engine failed to start")
            if not self._life.terminal:  # CLOSED already: a close gave up waiting for the factory
                self._life.fire(EE.START_FAILED)
            raise
        cap = self._max_in_flight
        if cap is None and budget is None:
            cap = DEFAULT_MAX_IN_FLIGHT
        self._scheduler = Scheduler(
            max_waiting=self._max_waiting,
            max_running=self._max_running,
            max_in_flight=cap,
            budget=budget,
            max_batch_size=self._max_batch_size,
            batch_wait_s=self._batch_wait_s,
        )
        self._io = ThreadPoolExecutor(1, thread_name_prefix="omni-engine-send")
        self._control = ThreadPoolExecutor(1, thread_name_prefix="omni-engine-control")
        self._post = ThreadPoolExecutor(self._postprocess_workers, thread_name_prefix="omni-postprocess")
        if not self._async_output:
            self._sync = ThreadPoolExecutor(self._max_running, thread_name_prefix="omni-engine-sync")
        self._loop_task = self._loop.create_task(self._run(), name="omni-engine-loop")
        self._loop_task.add_done_callback(self._on_loop_end)
        self._life.fire(EE.STARTED)

    async def _shut_down(self, deadline: float) -> None:
        try:
            if self._starting is not None and not self._starting.done():
                # The start sees CLOSING after its await and shuts down what it built.
                await asyncio.wait([self._starting], timeout=max(0.0, deadline - time.monotonic()))
                if not self._starting.done():
                    log.warning(
                        "engine close: the executor factory did not return within the close timeout; the "
                        "executor it builds is shut down when it returns"
                    )
                return
            for rec in list(self._records.values()):
                self._end_early(rec, SE.CLOSE)
            if self._owns_executor:
                # Shutting the executor down fails every pending future at once and
                # unlinks every segment: the drivers only have to notice.
                await asyncio.to_thread(
                    functools.partial(
                        self.executor.shutdown, "the engine closed", timeout=max(0.1, deadline - time.monotonic())
                    )
                )
            await self._await_gone(list(self._records.values()), deadline)
            if self._loop_task is not None:
                self._loop_task.cancel()
                await asyncio.gather(self._loop_task, return_exceptions=True)
            self._stop_threads()
        finally:
            # Whatever ended the engine: no encoder process outlives it.
            await asyncio.to_thread(self._encoders.shutdown, max(0.1, deadline - time.monotonic()))
            self._life.fire(EE.CLOSED)

    def _stop_threads(self) -> None:
        """The engine's threads, without waiting: a host stage still running is abandoned
        (its output is released when it returns), with a warning."""
        with self._host_lock:
            running = sorted(self._host_running)
        if running:
            log.warning(
                "engine close: the host stage of %d request(s) still running (%s); abandoned: their outputs are "
                "released when they return",
                len(running),
                running[:10],
            )
        # Queued sends and synchronous calls are dropped (the executor is closing or
        # gone); queued releases, drops and cancels still run: they give memory back.
        for pool, drop_queued in ((self._io, True), (self._sync, True), (self._control, False), (self._post, False)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=drop_queued)

    async def _await_gone(self, recs: list[RequestRecord], deadline: float) -> None:
        if not recs:
            return
        waits = [asyncio.ensure_future(r.gone.wait()) for r in recs]
        limit = max(0.0, deadline - time.monotonic())
        _, pending = await asyncio.wait(waits, timeout=limit)
        for w in pending:
            w.cancel()
        left = [r for r in recs if not r.gone.is_set()]
        if left:
            log.warning(
                "engine close: %d request(s) still on a worker after %.1f s (%s); abandoning them to the "
                "executor, which releases their outputs as they arrive",
                len(left),
                limit,
                [r.request_id for r in left][:10],
            )
            for r in left:
                if r.driver is not None:
                    r.driver.cancel()  # cancels the executor futures it awaits: abandoned (F9)
            # A driver stuck in a host stage returns from its cancel at once (the
            # stage's thread is abandoned): this gather does not wait for the stage.
            await asyncio.gather(*(r.driver for r in left if r.driver is not None), return_exceptions=True)
