"""``SyncCalls``: the executor's synchronous calls (path 2): every rank answers on the
pump's synchronous buffer, and the caller collects the answers.

``collective_rpc``'s calls, step mode's execute calls and the synchronous output path
(``sync_output=True``) take it.  Their answers come through one shared FIFO buffer, so
at most one such call is in flight (``_lock``): two would read each other's answers.
An answer that belongs to no waiting call is counted: a late one of an earlier call of
ours (``stale_answers``, its outputs given back through the store's ``discard_answer``)
or a protocol error (``unexpected_answers``, M3).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from omni_async.core.errors import ComputeTimeout, RpcFailed
from omni_async.core.messages import DiffusionRequest, Failure, RpcRequest, RpcResult, RunnerOutput
from omni_async.executor.pump import ResultPump
from omni_async.executor.sender import RpcSender
from omni_async.executor.store import OutputStore

__all__ = ["SyncCalls"]

log = logging.getLogger("omni_async.executor.api")


class SyncCalls:
    """Path-2 calls (module docstring)."""

    def __init__(
        self,
        pump: ResultPump,
        sender: RpcSender,
        store: OutputStore,
        check_health: Callable[[], None],
        *,
        world_size: int,
        reply_rank: int,
        rpc_timeout: float | None,
    ) -> None:
        self._pump = pump
        self._sender = sender
        self._store = store
        self._check_health = check_health
        self._world_size = world_size
        self._reply_rank = reply_rank
        self._rpc_timeout = rpc_timeout
        self._lock = threading.Lock()
        self.stale_answers = 0
        self.unexpected_answers = 0

    def call(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None, timeout: float | None
    ) -> list[Any]:
        """Send ``method`` with ``async_output=False``; every rank's answer, in rank order."""
        self._check_health()
        limit = self._rpc_timeout if timeout is None else timeout
        with self._lock:
            rpc_id = self._sender.ids.next()
            self._sender.send(RpcRequest(rpc_id, method, args, dict(kwargs or {}), async_output=False))
            answers = self._collect(rpc_id, method, None if limit is None else time.monotonic() + limit)
        failures: dict[int, Failure] = {r: a.failure for r, a in answers.items() if a.failure is not None}
        if failures:
            # The call failed (F12): what the other ranks returned has no owner, an
            # output packed in step mode included.
            for a in answers.values():
                self._store.discard_answer(a.result)
            raise RpcFailed(rpc_id, method, failures)
        return [answers[r].result for r in range(self._world_size)]

    def execute(self, method: str, args: tuple[Any, ...], requests: Sequence[DiffusionRequest]) -> list[RunnerOutput]:
        """An execute call answered synchronously: its outputs in ``result``, received
        through the store as ``wait_output_ready`` delivers them."""
        reply = self.call(method, args, None, None)[self._reply_rank]
        if reply is None:
            # An intermediate step of a model run step by step: no output yet.
            return [RunnerOutput(request_id=r.request_id, finished=False) for r in requests]
        outputs = list(reply.per_request()) if hasattr(reply, "per_request") else [reply]
        return [RunnerOutput(request_id=o.request_id, finished=True, result=self._store.receive(o)) for o in outputs]

    def _collect(self, rpc_id: str, method: str, deadline: float | None) -> dict[int, RpcResult]:
        answers: dict[int, RpcResult] = {}
        while len(answers) < self._world_size:
            wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if wait <= 0:
                for a in answers.values():
                    self._store.discard_answer(a.result)
                missing = sorted(set(range(self._world_size)) - answers.keys())
                raise ComputeTimeout(f"rpc {method} ({rpc_id}): no answer from rank(s) {missing} in time")
            try:
                msg = self._pump.sync_buffer.get(timeout=wait)
            except queue.Empty:
                self._check_health()
                continue
            if msg.rpc_id != rpc_id or msg.rank in answers:
                if msg.rpc_id != rpc_id and self._sender.ids.issued_here(msg.rpc_id):
                    # The answer of an earlier call that timed out: discard it, and what it carries.
                    self.stale_answers += 1
                    self._store.discard_answer(msg.result)
                else:
                    # A call never made, or a rank answering twice: a protocol error.
                    self.unexpected_answers += 1
                    log.warning("discarded an unexpected answer of rpc %s from rank %s", msg.rpc_id, msg.rank)
                continue
            answers[msg.rank] = msg
        return answers
