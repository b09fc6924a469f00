"""``BatchSubmitter``: the executor's asynchronous calls (path 1) and the handles they return.

Every request-mode submission goes through ``submit``: the call is registered with the
dispatcher (its requests, their deadlines, their streams, the slots where the
dispatcher claims their outputs at COMPUTE_DONE), encoded, then sent; a call that cannot
travel leaves nothing behind.  ``handles`` makes one ``RequestHandle`` per request of a
call, single or batched: each keeps what it has alone in a batch -- its own
``RunnerOutput``, its own abort (``cancel_requests`` of one member lets the others go
on: that member fails with ``RequestAborted``), its own stream and its own output.
The submitter is handed the pump, the sender, the output desk and the executor's
health check; it owns the model's batch key.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any

from omni_async.core.calls import ClaimSlots
from omni_async.core.config import Deadlines
from omni_async.core.errors import ExecutorShutdown, RequestAborted, UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest, RpcRequest, RunnerOutput
from omni_async.core.stream import ChunkFeed
from omni_async.executor.desk import OutputDesk
from omni_async.executor.futures import map_future
from omni_async.executor.handle import RequestHandle
from omni_async.executor.pump import ResultPump
from omni_async.executor.sender import RpcSender
from omni_async.worker.validation import BatchKeyer

__all__ = ["BatchKeyer", "BatchSubmitter"]


class BatchSubmitter:
    """Sends execute calls down the asynchronous path (module docstring)."""

    def __init__(
        self,
        pump: ResultPump,
        sender: RpcSender,
        desk: OutputDesk,
        check_health: Callable[[], None],
        *,
        step_mode: bool,
        batch_key: BatchKeyer | None,
    ) -> None:
        self._pump = pump
        self._sender = sender
        self._desk = desk
        self._check_health = check_health
        self._step_mode = step_mode
        self.batch_keyer = batch_key

    def batch_key(self, request: DiffusionRequest) -> Hashable | None:
        """The model's batch key of ``request`` (``DiffusionExecutor.batch_key``)."""
        keyer = self.batch_keyer
        if keyer is None:
            return None
        key = keyer(request)
        try:
            hash(key)
        except TypeError as exc:
            raise UsageError(
                f"request {request.request_id!r}: the model's batch_key returned an unhashable "
                f"{type(key).__name__} ({key!r:.60}); return a tuple of plain values (or None: never batched)"
            ) from exc
        return key

    def submit(
        self,
        method: str,
        args: tuple[Any, ...],
        consumer: str | None,
        requests: Sequence[DiffusionRequest] = (),
        deadlines: Deadlines | None = None,
        *,
        streams: Sequence[ChunkFeed] = (),
        step: bool = False,
        claims: ClaimSlots | None = None,
    ) -> Future[list[RunnerOutput]]:
        """Register, encode and send one execute call; its future resolves at COMPUTE_DONE.

        ``claims``: where the dispatcher claims the call's outputs (``ClaimSlots``)."""
        inner, _ = self._start(method, args, consumer, requests, deadlines, streams=streams, step=step, claims=claims)
        # A caller that cancels after the pump claimed the call's future (inner RUNNING,
        # outer still cancellable) never sees its RunnerOutputs: nobody else can claim
        # or drop their outputs, so drop them here (F9/F10).
        return map_future(inner, list, discard=self._desk.drop_runner_outputs)

    def _start(
        self,
        method: str,
        args: tuple[Any, ...],
        consumer: str | None,
        requests: Sequence[DiffusionRequest],
        deadlines: Deadlines | None,
        *,
        streams: Sequence[ChunkFeed] = (),
        step: bool = False,
        claims: ClaimSlots | None = None,
        outputs: Sequence[Future[DiffusionOutput]] = (),
    ) -> tuple[Future[tuple[RunnerOutput, ...]], str]:
        if self._step_mode and not step:
            raise UsageError("submit_* is the request-mode path; step mode uses execute_request/collective_rpc")
        self._check_health()
        rpc_id = self._sender.ids.next()
        req = RpcRequest(rpc_id, method, args, async_output=True, stream=bool(streams), step=step)
        # Encoded before the dispatcher hears of the call: one that cannot travel
        # (RequestNotSendable) leaves nothing behind, and no rank got any of it.
        wire = self._sender.encode(req)
        now = self._pump.now()
        rids = tuple(r.request_id for r in requests)
        inner = self._pump.call(
            lambda d: d.submit(
                rpc_id,
                method,
                now=now,
                consumer=consumer,
                request_ids=rids,
                deadlines=deadlines,
                streams=streams,
                step=step,
                claims=claims,
            )
        )
        if claims is not None:
            self._desk.attach(inner, claims, outputs)  # ahead of every other callback
        try:
            self._sender.send(req, wire)
        except BaseException as exc:
            err = ExecutorShutdown(f"cannot send {method} to the workers: {exc}")
            self._pump.call(lambda d: d.forget(rpc_id, err))
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt (Ctrl-C), SystemExit: the caller's, as they are
            raise err from exc
        return inner, rpc_id

    def handles(
        self,
        requests: Sequence[DiffusionRequest],
        consumer: str | None,
        deadlines: Deadlines | None,
        *,
        batch: bool,
        stream: bool,
    ) -> list[RequestHandle]:
        """One call for ``requests`` (``execute_model_batch`` when ``batch``, else the one
        request's ``execute_model``); a ``RequestHandle`` per request, in order, each output
        claimed for its handle by the dispatcher at COMPUTE_DONE."""
        reqs = list(requests)
        feeds = [ChunkFeed(r.request_id) for r in reqs] if stream else []
        outputs: list[Future[DiffusionOutput]] = [Future() for _ in reqs]
        computed: list[Future[RunnerOutput]] = [Future() for _ in reqs]
        slots = ClaimSlots([None] * len(reqs))
        method, args = ("execute_model_batch", (reqs,)) if batch else ("execute_model", (reqs[0],))
        call, _ = self._start(method, args, consumer, reqs, deadlines, streams=feeds, claims=slots, outputs=outputs)
        call.add_done_callback(lambda f: self._settle_members(f, reqs, computed))
        handles = []
        for i, r in enumerate(reqs):
            member_stream = None
            if feeds:
                member_stream = self._desk.stream_of(feeds[i])
                member_stream.result = computed[i]
            handles.append(
                RequestHandle(r.request_id, computed[i], outputs[i], member_stream, drop_fn=self._desk.drop_output)
            )
        if not batch:
            self._link_cancel(call, computed[0])
        return handles

    @staticmethod
    def _link_cancel(call: Future[tuple[RunnerOutput, ...]], computed: Future[RunnerOutput]) -> None:
        """Cancelling a single request's ``computed`` before its call started cancels the
        call (a batch goes on for its other members)."""
        # Weakly, as map_future: the two futures must not hold each other until a
        # garbage collection (the engine's ceiling showed its pauses).
        ref = weakref.ref(call)

        def on_computed(c: Future[RunnerOutput]) -> None:
            inner = ref()
            if c.cancelled() and inner is not None:
                inner.cancel()

        computed.add_done_callback(on_computed)

    def _settle_members(
        self,
        call: Future[tuple[RunnerOutput, ...]],
        reqs: Sequence[DiffusionRequest],
        members: list[Future[RunnerOutput]],
    ) -> None:
        """The call resolved: each member's future gets its own ``RunnerOutput`` (or the
        call's error, or ``RequestAborted`` for a member cancelled alone).  A member whose
        future was cancelled meanwhile has its output dropped."""
        exc = None if call.cancelled() else call.exception()
        outs = None if call.cancelled() or exc is not None else call.result()
        for i, fut in enumerate(members):
            ro = None if outs is None or i >= len(outs) else outs[i]
            if not fut.set_running_or_notify_cancel():
                if ro is not None:
                    self._desk.drop_runner_outputs([ro])
                continue
            if ro is None:
                fut.set_exception(
                    exc if exc is not None else RequestAborted(reqs[i].request_id, detail="its call was cancelled")
                )
            elif ro.aborted:
                fut.set_exception(RequestAborted(ro.request_id, detail="cancelled while the rest of its batch went on"))
            else:
                fut.set_result(ro)
