"""Batched calls of the executor API: which requests may share a forward
(``batch_key``), and the calls that send several requests as one
``execute_model_batch`` (``submit_batch``, ``submit_batch_handles``, ``execute_batch``).

``DiffusionExecutor`` (``executor/api.py``) is built on this class; the transport and
the single-request calls live there.  A batch is one call on the workers, but each of
its requests keeps what it has alone: its own output id (the worker names one per
request in COMPUTE_DONE, F6), its own abort (``cancel_requests`` of one member lets the
others go on: that member comes back ``aborted``), its own stream and its own output.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any

from omni_async.core.config import Deadlines
from omni_async.core.errors import RequestAborted, UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest, RunnerOutput
from omni_async.core.stream import ChunkFeed
from omni_async.executor.handle import RequestHandle
from omni_async.executor.outputs import ExecutorOutputs
from omni_async.executor.stream import RequestStream
from omni_async.worker.validation import BatchKeyer

__all__ = ["BatchKeyer", "ExecutorBatches"]

# BatchKeyer: a model's batch key (requests with equal keys may share one
# ``execute_model_batch``; None: this request is never batched), from the worker room.


class ExecutorBatches(ExecutorOutputs):
    """The batched calls (see the module docstring)."""

    step_mode: bool
    _batch_keyer: BatchKeyer | None

    # What the calls below need of DiffusionExecutor.
    @abc.abstractmethod
    def _check_batch(self, requests: object, method: str) -> list[DiffusionRequest]: ...

    @abc.abstractmethod
    def _submit(
        self,
        method: str,
        args: tuple[Any, ...],
        consumer: str | None,
        requests: Sequence[DiffusionRequest] = (),
        deadlines: Deadlines | None = None,
        *,
        streams: Sequence[ChunkFeed] = (),
        step: bool = False,
        first: Callable[[Future[tuple[RunnerOutput, ...]]], None] | None = None,
    ) -> Future[list[RunnerOutput]]: ...

    @abc.abstractmethod
    def _final_async(self, per_call: object, method: str) -> bool: ...

    @abc.abstractmethod
    def _execute_sync(
        self, method: str, args: tuple[Any, ...], requests: Sequence[DiffusionRequest]
    ) -> list[RunnerOutput]: ...

    @abc.abstractmethod
    def _drop_runner_outputs(self, outputs: list[RunnerOutput]) -> None: ...

    @abc.abstractmethod
    def _stream_of(self, feed: ChunkFeed) -> RequestStream: ...

    # ----------------------------------------------------------------- batch keys

    def batch_key(self, request: DiffusionRequest) -> Hashable | None:
        """Which requests may share one ``execute_model_batch`` with ``request``: those
        whose key is equal; None (the default, and for a model without a ``batch_key``):
        never batched.  The model's static (or class) method ``batch_key(request)``
        (``WorkerSpec.batch_keyer``; ``InProcessExecutor``: its model's), run in the
        caller's thread.  ``AsyncDiffusionEngine(max_batch_size=...)`` asks it of every
        request it admits."""
        keyer = self._batch_keyer
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

    # ----------------------------------------------------------------- batched calls

    def submit_batch(
        self,
        requests: Sequence[DiffusionRequest],
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
    ) -> Future[list[RunnerOutput]]:
        """Start a batched forward; the future resolves on COMPUTE_DONE (request mode).

        ``deadlines``: this call's ``compute_timeout`` and ``output_timeout`` instead of
        the executor's (its ``rpc_timeout`` and ``cancel_grace`` are not used).  A request
        cancelled (``cancel_requests``) while the rest of the batch goes on comes back as
        ``RunnerOutput(aborted=True)``; with every request cancelled the future fails with
        ``RequestAborted``.
        """
        reqs = self._check_batch(requests, "submit_batch")
        self._check_consumer(consumer)
        self._check_deadlines(deadlines, "submit_batch")
        return self._submit("execute_model_batch", (reqs,), consumer, reqs, deadlines)

    def submit_batch_handles(
        self,
        requests: Sequence[DiffusionRequest],
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
        stream: bool = False,
    ) -> list[RequestHandle]:
        """Start a batched forward; one ``RequestHandle`` per request, in order (request mode).

        Each handle is ``submit_handle``'s for its request: ``computed`` resolves with its
        own ``RunnerOutput`` at the call's COMPUTE_DONE, and fails with
        ``RequestAborted`` when that request alone was cancelled (``cancel_requests``)
        while the rest of the batch went on; ``output`` is its output, claimed for the
        handle by the pump.  Cancelling one handle's futures abandons that request's
        output only (released on arrival, F9), never the call: the others go on.
        ``stream=True``: every request is a stream (``handle.stream``, as
        ``submit_stream`` gives; its ``result`` is ``computed``).  ``deadlines``: as
        ``submit_batch`` (one call: one compute deadline).
        """
        reqs = self._check_batch(requests, "submit_batch_handles")
        self._check_consumer(consumer)
        self._check_deadlines(deadlines, "submit_batch_handles")
        if not isinstance(stream, bool):
            raise UsageError(f"submit_batch_handles: stream must be a bool, got {stream!r:.80}")
        feeds = [ChunkFeed(r.request_id) for r in reqs] if stream else []
        outputs: list[Future[DiffusionOutput]] = [Future() for _ in reqs]
        computed: list[Future[RunnerOutput]] = [Future() for _ in reqs]

        def first(call: Future[tuple[RunnerOutput, ...]]) -> None:
            # On the pump's thread, right after the call's COMPUTE_DONE: every member's
            # output is claimed before anyone sees its id.
            for i, out in enumerate(outputs):
                self._claim_for(call, out, i)

        call = self._submit("execute_model_batch", (reqs,), consumer, reqs, deadlines, streams=feeds, first=first)
        call.add_done_callback(lambda f: self._settle_members(f, reqs, computed))
        handles = []
        for i, r in enumerate(reqs):
            member_stream = None
            if feeds:
                member_stream = self._stream_of(feeds[i])
                member_stream.result = computed[i]
            handles.append(
                RequestHandle(r.request_id, computed[i], outputs[i], member_stream, drop_fn=self.drop_output)
            )
        return handles

    def _settle_members(
        self, call: Future[list[RunnerOutput]], reqs: Sequence[DiffusionRequest], members: list[Future[RunnerOutput]]
    ) -> None:
        """The call resolved: each member's future gets its own ``RunnerOutput`` (or the
        call's error, or ``RequestAborted`` for a member cancelled alone).  A member whose
        future was cancelled meanwhile has its output dropped."""
        exc = None if call.cancelled() else call.exception()
        outs = None if call.cancelled() or exc is not None else call.result()
        for i, fut in enumerate(members):
            ro = None if outs is None else outs[i]
            if not fut.set_running_or_notify_cancel():
                if ro is not None:
                    self._drop_runner_outputs([ro])
                continue
            if ro is None:
                fut.set_exception(
                    exc if exc is not None else RequestAborted(reqs[i].request_id, detail="its call was cancelled")
                )
            elif ro.aborted:
                fut.set_exception(RequestAborted(ro.request_id, detail="cancelled while the rest of its batch went on"))
            else:
                fut.set_result(ro)

    def execute_batch(
        self,
        requests: Sequence[DiffusionRequest],
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
        final_step_async: bool | None = None,
        sync_output: bool = False,
    ) -> list[RunnerOutput]:
        """``submit_batch(...).result()``; step mode (and ``final_step_async``) as
        ``execute_request``.  ``sync_output=True``: the synchronous output path, as
        ``execute_request(sync_output=True)`` (each ``RunnerOutput`` carries its output in
        ``result``; release each with ``release_output``)."""
        reqs = self._check_batch(requests, "execute_batch")
        self._check_consumer(consumer)
        self._check_deadlines(deadlines, "execute_batch")
        if not isinstance(sync_output, bool):
            raise UsageError(f"execute_batch: sync_output must be a bool, got {sync_output!r:.80}")
        if sync_output:
            if final_step_async:
                raise UsageError("execute_batch: sync_output=True and final_step_async=True exclude each other")
            return self._execute_sync("execute_model_batch", (reqs,), reqs)
        if self._final_async(final_step_async, "execute_batch"):
            return self._submit("execute_model_batch", (reqs,), consumer, reqs, deadlines, step=True).result()
        if self.step_mode:
            return self._execute_sync("execute_model_batch", (reqs,), reqs)
        return self._submit("execute_model_batch", (reqs,), consumer, reqs, deadlines).result()
