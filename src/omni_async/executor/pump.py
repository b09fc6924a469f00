"""The result pump: the one thread that reads the result channel.

It feeds every message to the ``Dispatcher`` (registry + RPC table) under one
lock, then sets the futures the dispatcher claimed *after* releasing the lock
(see ``omni_async.core.registry``), and moves path-2 answers into the synchronous
buffer.  Callers (the executor) reach the dispatcher through ``call``, which
takes the same lock and applies resolutions the same way.

Nothing raised while handling one message can stop the loop (F3): the error is
counted and logged, the message is dropped, and the next one is read.  If the
loop ends anyway -- stopped, the channel closed, or a bug -- every pending waiter
and RPC fails at once with ``ExecutorShutdown`` naming why, and the registry is
closed.  ``healthy`` reports the thread's liveness for ``check_health``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import ExecutorShutdown, OutputError
from omni_async.core.messages import AsyncDiffusionOutput, CancelMessage, RpcResult
from omni_async.core.registry import Settle
from omni_async.core.states import LifecycleEvent, LifecycleState, lifecycle_machine
from omni_async.transport.channel import ResultReceiver
from omni_async.transport.errors import ChannelClosed

log = logging.getLogger(__name__)

T = TypeVar("T")


class ResultPump:
    def __init__(
        self,
        channel: ResultReceiver,
        dispatcher: Dispatcher,
        *,
        name: str = "omni-pump",
        poll_interval: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        on_cancel: Callable[[list[CancelMessage]], None] | None = None,
    ) -> None:
        """``on_cancel``: sends the dispatcher's cancel messages to the workers; called
        outside the lock, on whichever thread made them (the pump's, for a compute
        deadline), so it must not block."""
        self._on_cancel = on_cancel
        self._channel = channel
        self._dispatcher = dispatcher
        self._poll = poll_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._machine = lifecycle_machine(name)
        self._stop_reason = "the result pump stopped"
        # Path-2 answers (RPC_RESULT of non-execute RPCs, step mode), in arrival order.
        self.sync_buffer: queue.Queue[RpcResult] = queue.Queue()
        self.dispatch_errors = 0
        self.messages = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread.start()

    @property
    def state(self) -> LifecycleState:
        with self._lock:
            return self._machine.state

    def healthy(self) -> bool:
        return self._thread.is_alive() and self.state is LifecycleState.RUNNING

    def stop(self, reason: str = "the executor shut down", timeout: float | None = 5.0) -> None:
        """Stop reading; every pending waiter fails with ``ExecutorShutdown(reason)``. Idempotent."""
        with self._lock:
            if self._machine.can(LifecycleEvent.DRAIN):
                self._machine.fire(LifecycleEvent.DRAIN)
                self._stop_reason = reason
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        # Whether the thread is gone, never started, or still stuck in a user callback
        # (outside the lock): fail what is pending now.  Idempotent with the thread's own.
        self._finish(LifecycleEvent.STOPPED)

    def fail_all(self, make_error: Callable[[str | None], OutputError], outcome: str, *, close: bool = False) -> None:
        """Fail everything pending now (a worker died) without stopping the pump.

        With ``close`` the registry also refuses new records: what still arrives is
        released at once (see ``OutputRegistry.fail_all``).
        """
        self.call(lambda d: d.fail_all(make_error, outcome=outcome, close=close))

    # ---------------------------------------------------------------- callers

    def call(self, fn: Callable[[Dispatcher], T]) -> T:
        """Run ``fn`` on the dispatcher under the pump's lock; resolve futures after."""
        resolutions: list[Settle] = []
        cancels: list[CancelMessage] = []
        try:
            with self._lock:
                try:
                    return fn(self._dispatcher)
                finally:
                    resolutions = self._dispatcher.take_resolutions()
                    cancels = self._dispatcher.take_cancels()
        finally:
            # Even when fn raised: a future it claimed must still be resolved.
            self._send_cancels(cancels)
            self._apply(resolutions)

    def now(self) -> float:
        return self._clock()

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        with self._lock:
            if self._machine.can(LifecycleEvent.STARTED):
                self._machine.fire(LifecycleEvent.STARTED)
        crashed = False
        try:
            while not self._stop.is_set():
                try:
                    msg = self._channel.get(self._poll)
                except ChannelClosed:
                    self._stop_reason = "the result channel closed"
                    break
                except Exception:
                    # An undecodable message or a torn pipe: count it and keep reading.
                    self.dispatch_errors += 1
                    log.exception("result pump: reading the channel failed")
                    continue
                self._step(msg)
        except BaseException:
            crashed = True
            self._stop_reason = "the result pump crashed"
            log.exception("result pump crashed")
            raise
        finally:
            self._finish(LifecycleEvent.CRASH if crashed else LifecycleEvent.STOPPED)

    def _step(self, msg: AsyncDiffusionOutput | None) -> None:
        routed = None
        with self._lock:
            now = self._clock()
            try:
                if msg is not None:
                    self.messages += 1
                    routed = self._dispatcher.handle(msg, now=now)
                self._dispatcher.expire(now)
            except Exception:
                self.dispatch_errors += 1
                log.exception("result pump: dispatching %r failed; message dropped", msg)
            resolutions = self._dispatcher.take_resolutions()
            cancels = self._dispatcher.take_cancels()
        self._send_cancels(cancels)
        self._apply(resolutions)
        if routed is not None:
            self.sync_buffer.put(routed)

    def _send_cancels(self, cancels: list[CancelMessage]) -> None:
        if not cancels or self._on_cancel is None:
            return
        try:
            self._on_cancel(cancels)
        except Exception:
            # The executor side already ended or marked the calls: a worker that never
            # hears of it finishes the forward, and its outputs are dropped on arrival.
            self.dispatch_errors += 1
            log.exception("result pump: sending cancel messages to the workers failed")

    def _apply(self, resolutions: list[Settle]) -> None:
        for r in resolutions:
            try:
                r.apply()
            except Exception:
                self.dispatch_errors += 1
                log.exception("result pump: resolving a future failed")

    def _finish(self, event: LifecycleEvent) -> None:
        reason = self._stop_reason
        with self._lock:
            if self._machine.terminal:
                return
            self._machine.fire(event)
            self._dispatcher.fail_all(
                lambda oid: ExecutorShutdown(reason, output_id=oid), outcome="shutdown", close=True
            )
            resolutions = self._dispatcher.take_resolutions()
        self._apply(resolutions)
