"""Executor side: the API an engine calls, over any transport.

``DiffusionExecutor`` holds the pump, the dispatcher and the registry and implements
the calls (this module), the outputs they announce (``outputs.py``, with the
exactly-once claims in ``claims.py``) and the argument checks (``checks.py``).  An
executor says how an RPC reaches every rank (``_broadcast``) and whether the ranks are
alive (``_worker_failure``): ``InProcessExecutor`` runs each rank on a thread;
``RankedExecutor`` (``ranked.py``) runs them over a rank transport, processes
(``MultiprocDiffusionExecutor``) or Ray actors (``RayDiffusionExecutor``).
"""

from __future__ import annotations

import abc
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Self

from omni_async.core.config import Deadlines
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OmniAsyncError,
    RpcFailed,
    UsageError,
)
from omni_async.core.messages import (
    CancelMessage,
    DiffusionOutput,
    DiffusionRequest,
    Failure,
    RpcRequest,
    RpcResult,
    RunnerOutput,
)
from omni_async.core.methods import ASYNC_METHODS, DROP_OUTPUTS
from omni_async.core.registry import OutputRegistry, ReleaseHook, no_release
from omni_async.core.stream import ChunkFeed, ChunkRef
from omni_async.core.trace import Tracer
from omni_async.executor.batches import BatchKeyer, ExecutorBatches
from omni_async.executor.checks import (
    check_final_step_async,
    requests_in,
    stop_budget,
)
from omni_async.executor.claims import OutputClaims
from omni_async.executor.futures import all_done, map_future
from omni_async.executor.handle import RequestHandle
from omni_async.executor.metrics import ExecutorMetrics
from omni_async.executor.pump import ResultPump
from omni_async.executor.stream import OutputChunk, RequestStream
from omni_async.transport.budget import OutputBudget
from omni_async.transport.channel import ResultReceiver
from omni_async.worker.loop import WorkerInfo

log = logging.getLogger(__name__)


class DiffusionExecutor(ExecutorBatches):
    def __init__(
        self,
        receiver: ResultReceiver,
        *,
        world_size: int = 1,
        reply_rank: int = 0,
        step_mode: bool = False,
        deadlines: Deadlines | None = None,
        release_hook: ReleaseHook = no_release,
        tracer: Tracer | None = None,
        validate_request: Callable[[DiffusionRequest], None] | None = None,
        final_step_async: bool = False,
        batch_key: BatchKeyer | None = None,
    ) -> None:
        """``validate_request``: the model's parameter check, run on every request in the
        caller's thread before it is sent (a bad request raises there, no worker sees it).
        ``batch_key``: the model's batch key (``batch_key``; None: no request is batched).
        ``final_step_async`` (step mode only): the default of ``execute_request`` /
        ``execute_batch``'s ``final_step_async`` (see there)."""
        if world_size < 1:
            raise UsageError(f"world_size must be >= 1, got {world_size}")
        check_final_step_async(final_step_async, step_mode)
        self.final_step_async = final_step_async
        self.world_size = world_size
        self.token = uuid.uuid4().hex[:8]
        self._rpc_seq = itertools.count()
        self._issued = 0  # rpc ids "{token}-{n}" with n below this were issued
        self._issue_lock = threading.Lock()  # callers on several threads: no lost update
        self._validate_request = validate_request
        self._batch_keyer = batch_key
        self.reply_rank = reply_rank
        self.step_mode = step_mode
        self.deadlines = deadlines if deadlines is not None else Deadlines.from_env()
        self.registry = OutputRegistry(
            output_timeout=self.deadlines.output_timeout, release_hook=release_hook, tracer=tracer
        )
        self.dispatcher = Dispatcher(
            self.registry,
            world_size=world_size,
            reply_rank=reply_rank,
            compute_timeout=self.deadlines.compute_timeout,
            tracer=tracer,
            known_call=self._issued_here,
        )
        self.pump = ResultPump(receiver, self.dispatcher, on_cancel=self._deliver_cancels)
        # Path-2 answers come through one shared FIFO buffer, so at most one such RPC
        # may be in flight: two would read each other's answers.
        self._sync_lock = threading.Lock()
        self._shutdown_lock = threading.Lock()
        self._closed = False
        # Answers read from the synchronous buffer that belong to no waiting call: late
        # ones of an earlier call of ours (stale_sync_answers), and protocol errors (M3):
        # a second answer of a rank.  (An answer of a call this executor never made does
        # not get there: the dispatcher counts and discards it, known_call.)
        self.stale_sync_answers = 0
        self.unexpected_sync_answers = 0
        # Exactly-once delivery of each output to one wait_output_ready call, and how long
        # the engines waited for what was delivered (executor/claims.py).
        self._output_claims = OutputClaims()

    # --------------------------------------------------------------- transport

    @abc.abstractmethod
    def _broadcast(self, req: RpcRequest, wire: list[bytes] | None = None) -> None:
        """Deliver ``req`` to every rank (raises if it cannot); ``wire``: what ``_encode``
        made of it, when the caller encoded it already."""

    def _encode(self, req: RpcRequest) -> list[bytes] | None:
        """``req`` as each rank gets it, for a transport that pickles (None: one that does
        not).  Raises ``RequestNotSendable`` when it cannot travel, before any rank got it."""
        return None

    def _worker_failure(self) -> OmniAsyncError | None:
        """An error naming a dead worker, or None while all are alive."""
        return None

    def _send_rpc(self, req: RpcRequest, wire: list[bytes] | None = None) -> None:
        """Broadcast ``req``, preceded by the drops the workers have not heard of yet.

        Drops the dispatcher makes itself (a failed or timed-out call, an orphan
        COMPUTE_DONE) happen on the pump thread, which must never block on a worker's
        pipe; they travel with the next RPC instead, still ahead of its forward.
        """
        drops = self.pump.call(lambda d: d.take_worker_drops())
        if drops:
            self._notify_drop(drops)
        self._broadcast(req, wire)

    def _stop_workers(self, deadline: float | None) -> None:
        """Stop the workers (after the pump stopped). Must be idempotent.

        ``deadline`` (``time.monotonic()``): when the whole shutdown must be over; None:
        the transport's own defaults.  Ask every rank to stop, then force the ones still
        running, all ranks at once against that one deadline (never one rank's wait
        after another's).
        """

    def _deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        """Send ``cancels`` to every rank on the control channel; must not block.

        Called from any thread (the pump's, for a compute deadline).  A transport
        without a control channel leaves this as it is: its workers then finish the
        forward, and the executor drops the cancelled requests' outputs on arrival.
        """
        log.debug("%s cannot reach a running forward; %d cancel(s) not sent", type(self).__name__, len(cancels))

    # --------------------------------------------------------------- execute

    def next_rpc_id(self) -> str:
        with self._issue_lock:
            n = next(self._rpc_seq)
            self._issued = n + 1
        return f"{self.token}-{n}"

    def _issued_here(self, rpc_id: str | None) -> bool:
        """Whether ``rpc_id`` is one this executor issued."""
        if rpc_id is None:
            return False
        token, _, n = rpc_id.rpartition("-")
        return token == self.token and n.isdigit() and int(n) < self._issued

    def submit_request(
        self, request: DiffusionRequest, *, consumer: str | None = None, deadlines: Deadlines | None = None
    ) -> Future[RunnerOutput]:
        """Start a forward; the future resolves on COMPUTE_DONE (request mode), or fails
        with ``RequestAborted`` once ``cancel_requests`` stopped it (``deadlines``: see
        ``submit_batch``)."""
        self._check_request(request, "submit_request")
        self._check_consumer(consumer)
        self._check_deadlines(deadlines, "submit_request")
        return self._submit_one(request, consumer, deadlines)

    def submit_stream(
        self, request: DiffusionRequest, *, consumer: str | None = None, deadlines: Deadlines | None = None
    ) -> RequestStream:
        """Start a forward whose intermediate outputs you want: a ``RequestStream``.

        The model ships them with ``omni_async.worker.emit_chunk`` while its forward runs
        (``TinyDiffusionWorker``: ``preview_every``).  ``stream.next_chunk()`` gives each
        as an ``OutputChunk`` in order, its ``output`` a future of the chunk's
        ``DiffusionOutput`` (claimed for you: exactly one taker, as with
        ``wait_output_ready``; release it the same way); iterating the stream gives the
        outputs themselves.  The stream ends when the call resolves: ``stream.result`` is
        ``submit_request``'s future (the final output's id, at COMPUTE_DONE), and every
        chunk comes before it.  A call that fails ends the stream with its error (the
        chunks not taken are dropped); ``stream.close()`` drops what was not taken and
        every chunk still to come.  Request mode only (``UsageError`` in step mode).
        """
        self._check_request(request, "submit_stream")
        self._check_consumer(consumer)
        self._check_deadlines(deadlines, "submit_stream")
        feed = ChunkFeed(request.request_id)
        stream = self._stream_of(feed)
        inner = self._submit("execute_model", (request,), consumer, [request], deadlines, streams=[feed])
        stream.result = map_future(inner, lambda outs: outs[0], discard=lambda ro: self._drop_runner_outputs([ro]))
        return stream

    def _stream_of(self, feed: ChunkFeed) -> RequestStream:
        return RequestStream(feed, self._take_chunk, self._peek_stream, self._close_stream)

    def _take_chunk(self, feed: ChunkFeed) -> tuple[OutputChunk | None, bool, BaseException | None]:
        """The next chunk of ``feed``, claimed (or None), whether the feed is finished, and
        how it ended: one look under the pump's lock."""
        t0 = time.monotonic()
        status = ["waiting"]

        def take(d: Dispatcher) -> tuple[ChunkRef | None, Future[DiffusionOutput] | None, bool, BaseException | None]:
            ref = d.take_chunk(feed)
            fut = None if ref is None else self._claim(d, ref.output_id, status)
            return ref, fut, feed.exhausted, feed.error

        ref, fut, finished, error = self.pump.call(take)
        if ref is None or fut is None:
            return None, finished, error
        chunk = OutputChunk(feed.request_id, ref.seq, ref.output_id, self._watch_claim(fut, ref.output_id, t0, status))
        return chunk, False, error

    def _peek_stream(self, feed: ChunkFeed) -> tuple[bool, BaseException | None]:
        return self.pump.call(lambda _: (feed.exhausted, feed.error))

    def _close_stream(self, feed: ChunkFeed) -> Future[None]:
        def close(d: Dispatcher) -> tuple[list[Future[None]], list[str]]:
            return d.close_stream(feed), d.take_worker_drops()

        acks, drops = self.pump.call(close)
        if drops:
            self._notify_drop(drops)  # a chunk still queued in a packer is skipped (F15)
        return all_done(acks)

    def _submit_one(
        self,
        request: DiffusionRequest,
        consumer: str | None,
        deadlines: Deadlines | None,
        first: Callable[[Future[tuple[RunnerOutput, ...]]], None] | None = None,
    ) -> Future[RunnerOutput]:
        inner = self._submit("execute_model", (request,), consumer, [request], deadlines, first=first)
        return map_future(inner, lambda outs: outs[0], discard=lambda ro: self._drop_runner_outputs([ro]))

    def submit_handle(
        self, request: DiffusionRequest, *, consumer: str | None = None, deadlines: Deadlines | None = None
    ) -> RequestHandle:
        """Start a forward; a ``RequestHandle`` with both phases of its output (request mode).

        ``handle.computed`` is ``submit_request``'s future; ``handle.output`` the output,
        claimed for the handle when the pump dispatches the call's COMPUTE_DONE -- before
        ``computed`` resolves, so no ``wait_output_ready`` is needed (one for the same id
        gets ``OutputAlreadyClaimed``).  ``output`` fails with the forward's error when
        the forward fails; cancelling it abandons the output (released on arrival, F9);
        ``drop_output`` of its id fails it.  Delivered as ``wait_output_ready`` delivers
        (release it with ``release_output``).
        """
        self._check_request(request, "submit_handle")
        self._check_consumer(consumer)
        self._check_deadlines(deadlines, "submit_handle")
        output: Future[DiffusionOutput] = Future()
        computed = self._submit_one(request, consumer, deadlines, first=lambda f: self._claim_for(f, output))
        return RequestHandle(request.request_id, computed, output, drop_fn=self.drop_output)

    def submit(
        self,
        request: DiffusionRequest,
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
        stream: bool = False,
    ) -> RequestHandle:
        """Start a forward; a ``RequestHandle`` with both phases of its output (request mode).

        ``handle.computed`` resolves at COMPUTE_DONE; ``handle.output`` is the output,
        claimed for the handle when the pump dispatches that COMPUTE_DONE, so no output
        id travels back to claim it.  ``stream=True``: ``handle.stream`` gives the
        intermediate outputs the model emits (see ``RequestStream``); ``handle.output`` is
        still the final one.  ``handle.drop()`` drops the output after COMPUTE_DONE.
        """
        self._check_request(request, "submit")
        self._check_consumer(consumer)
        self._check_deadlines(deadlines, "submit")
        if not isinstance(stream, bool):
            raise UsageError(f"submit: stream must be a bool, got {stream!r:.80}")
        feeds = [ChunkFeed(request.request_id)] if stream else []
        output: Future[DiffusionOutput] = Future()
        inner = self._submit(
            "execute_model",
            (request,),
            consumer,
            [request],
            deadlines,
            streams=feeds,
            first=lambda f: self._claim_for(f, output),
        )
        computed = map_future(inner, lambda outs: outs[0], discard=lambda ro: self._drop_runner_outputs([ro]))
        member_stream = None
        if feeds:
            member_stream = self._stream_of(feeds[0])
            member_stream.result = computed
        return RequestHandle(request.request_id, computed, output, member_stream, drop_fn=self.drop_output)

    def execute_request(
        self,
        request: DiffusionRequest,
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
        final_step_async: bool | None = None,
        sync_output: bool = False,
    ) -> RunnerOutput:
        """``submit_request(...).result()``; in step mode the synchronous answer, which
        ``deadlines`` does not bound (step mode's calls are bounded by ``rpc_timeout``).

        ``sync_output=True`` (request mode too): the synchronous output path, the one an
        executor without an asynchronous output path takes -- the worker copies the
        output on its main thread before it answers, and the call returns with the
        output in ``result`` (unpacked as ``wait_output_ready`` delivers it: give it
        back with ``release_output``).  Such calls run one at a time (their answers come
        through one buffer, as ``collective_rpc``'s), are bounded by ``rpc_timeout``, not
        by ``deadlines``, and cannot be cancelled (``cancel_requests`` ignores them).
        For comparisons (``AsyncDiffusionEngine(async_output=False)``, ``omni-async
        demo``); ``UsageError`` with ``final_step_async=True``.

        Step mode: a forward that returns no output (None: an intermediate step of a
        model run step by step) gives ``RunnerOutput(finished=False)``; one that returns
        its output gives it in ``result``, packed by the worker before it answered.
        ``final_step_async=True`` (default: the executor's ``final_step_async``) sends the
        call down the asynchronous path instead: an intermediate step is answered as
        before, but the final step's output is handed to the worker's packer and the call
        returns at COMPUTE_DONE with its ``async_output_id`` (take the output with
        ``wait_output_ready``, as in request mode), so the copy overlaps whatever the
        worker runs next.  Such a call is bounded by ``deadlines`` (its compute deadline),
        not by ``rpc_timeout``.  ``UsageError`` outside step mode.
        """
        self._check_request(request, "execute_request")
        self._check_consumer(consumer)
        self._check_deadlines(deadlines, "execute_request")
        if not isinstance(sync_output, bool):
            raise UsageError(f"execute_request: sync_output must be a bool, got {sync_output!r:.80}")
        if sync_output:
            if final_step_async:
                raise UsageError("execute_request: sync_output=True and final_step_async=True exclude each other")
            return self._execute_sync("execute_model", (request,), [request])[0]
        if self._final_async(final_step_async, "execute_request"):
            return self._submit("execute_model", (request,), consumer, [request], deadlines, step=True).result()[0]
        if self.step_mode:
            return self._execute_sync("execute_model", (request,), [request])[0]
        return self._submit_one(request, consumer, deadlines).result()

    def _final_async(self, per_call: object, method: str) -> bool:
        """Whether a step-mode execute call takes the final-step asynchronous path."""
        if per_call is None:
            return self.step_mode and self.final_step_async
        if not isinstance(per_call, bool):
            raise UsageError(f"{method}: final_step_async must be a bool or None, got {per_call!r}")
        if per_call and not self.step_mode:
            raise UsageError(
                f"{method}: final_step_async=True is an option of step mode; request mode always takes the "
                "asynchronous path"
            )
        return per_call

    def cancel_requests(self, request_ids: Iterable[str]) -> None:
        """Abort the forwards of these requests, wherever they are; returns at once.

        Reaches every request-mode execute call still in flight that holds one of them
        (queued on the workers, or computing): a worker whose main thread is in the
        forward hears of it on a control channel, and the model stops at its next
        cancellation check (``omni_async.worker.cancel_requested``); a call not started
        yet never runs.  Such a call then fails with ``RequestAborted`` (``by="abort"``),
        once nothing of it remains on any worker or in the executor; no output id is
        handed out.  A model that ignores the check finishes its forward; its outputs
        are discarded all the same (not packed, or released on arrival).

        A batch stops only when all its requests are cancelled; with some cancelled it
        goes on, and those come back as ``RunnerOutput(aborted=True)`` without an output.
        An id not in a call in flight -- unknown, or its call already resolved -- is
        ignored: drop its output (``drop_output``) instead.  Idempotent; a no-op after
        shutdown.  Raises ``UsageError`` for anything but an iterable of non-empty str.
        """
        if isinstance(request_ids, (str, bytes, Mapping)) or not isinstance(request_ids, Iterable):
            raise UsageError(
                f"cancel_requests: request_ids must be an iterable of request ids (str), got "
                f"{type(request_ids).__name__} {request_ids!r:.80}"
                + (" (wrap one id in a list)" if isinstance(request_ids, str) else "")
            )
        ids = list(request_ids)
        bad = [r for r in ids if not isinstance(r, str) or not r]
        if bad:
            raise UsageError(f"cancel_requests: request ids must be non-empty str, got {bad!r:.80}")
        if not ids or self._closed:
            return
        self.pump.call(lambda d: d.cancel(ids))

    # Argument checks: API misuse fails here, at once, with a UsageError naming the
    # argument -- never after a round trip to a worker.

    def validate_request(self, request: DiffusionRequest) -> None:
        """Check ``request`` as ``submit_*`` would, without sending it: a ``UsageError``
        for a non-request, the model's ``validate_request`` (``InvalidRequest``) for bad
        parameters.  An engine calls it before queueing, so a bad request fails at the
        call instead of when a running slot frees."""
        self._check_request(request, "validate_request")

    def _check_request(self, request: object, method: str, argument: str = "request") -> None:
        if not isinstance(request, DiffusionRequest):
            raise UsageError(
                f"{method}: {argument} must be a DiffusionRequest, got {type(request).__name__} {request!r:.80}"
            )
        if self._validate_request is not None:
            self._validate_request(request)

    def _check_batch(self, requests: object, method: str) -> list[DiffusionRequest]:
        if isinstance(requests, (DiffusionRequest, str, bytes, Mapping)) or not isinstance(requests, Iterable):
            raise UsageError(
                f"{method}: requests must be a sequence of DiffusionRequest, got {type(requests).__name__}"
                + (
                    " (for one request use execute_request/submit_request)"
                    if isinstance(requests, DiffusionRequest)
                    else ""
                )
            )
        reqs = list(requests)
        if not reqs:
            raise UsageError(f"{method} needs at least one request")
        seen: set[str] = set()
        for i, r in enumerate(reqs):
            self._check_request(r, method, f"requests[{i}]")
            assert isinstance(r, DiffusionRequest)
            if r.request_id in seen:
                raise UsageError(f"{method}: request id {r.request_id!r} appears more than once in the batch")
            seen.add(r.request_id)
        return reqs

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
    ) -> Future[list[RunnerOutput]]:
        """``first``: a callback on the call's own future, run before any other (on the
        thread that resolves it: the pump's, for a COMPUTE_DONE)."""
        if self.step_mode and not step:
            raise UsageError("submit_* is the request-mode path; step mode uses execute_request/collective_rpc")
        self.check_health()
        rpc_id = self.next_rpc_id()
        req = RpcRequest(rpc_id, method, args, async_output=True, stream=bool(streams), step=step)
        # Encoded before the dispatcher hears of the call: one that cannot travel
        # (RequestNotSendable) leaves nothing behind, and no rank got any of it.
        wire = self._encode(req)
        now = self.pump.now()
        rids = tuple(r.request_id for r in requests)
        inner = self.pump.call(
            lambda d: d.submit(
                rpc_id,
                method,
                now=now,
                consumer=consumer,
                request_ids=rids,
                deadlines=deadlines,
                streams=streams,
                step=step,
            )
        )
        if first is not None:
            inner.add_done_callback(first)  # ahead of map_future's below
        try:
            self._send_rpc(req, wire)
        except BaseException as exc:
            err = ExecutorShutdown(f"cannot send {method} to the workers: {exc}")
            self.pump.call(lambda d: d.forget(rpc_id, err))
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt (Ctrl-C), SystemExit: the caller's, as they are
            raise err from exc
        # A caller that cancels after the pump claimed the call's future (inner RUNNING,
        # outer still cancellable) never sees its RunnerOutputs: nobody else can claim
        # or drop their outputs, so drop them here (F9/F10).
        return map_future(inner, list, discard=self._drop_runner_outputs)

    def _drop_runner_outputs(self, outputs: list[RunnerOutput]) -> None:
        for ro in outputs:
            if ro.async_output_id is not None:
                self.drop_output(ro.async_output_id)

    def _execute_sync(
        self, method: str, args: tuple[Any, ...], requests: Sequence[DiffusionRequest]
    ) -> list[RunnerOutput]:
        results = self._call_every_rank(method, args, None, None)
        reply = results[self.reply_rank]
        if reply is None:
            # An intermediate step of a model run step by step: no output yet.
            return [RunnerOutput(request_id=r.request_id, finished=False) for r in requests]
        outputs = list(reply.per_request()) if hasattr(reply, "per_request") else [reply]
        return [RunnerOutput(request_id=o.request_id, finished=True, result=self._receive(o)) for o in outputs]

    def _discard_answer(self, result: object) -> None:
        """A plain answer nobody will take (its call failed or timed out): give back what it
        holds.  Nothing to do in process; ``MultiprocDiffusionExecutor`` frees the segments
        of the outputs a synchronous answer carries (step mode, ``sync_output=True``)."""

    def _receive(self, output: DiffusionOutput) -> DiffusionOutput:
        """Turn an output as it travelled into what the engine gets (identity in process)."""
        return output

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every worker has sent every output it is packing (F8); raises on timeout."""
        self.collective_rpc("drain_outputs", (timeout,), timeout=timeout + 5.0)

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call ``method`` on every rank; returns the answers in rank order (path 2).

        In request mode ``execute_model``/``execute_model_batch`` take path 1 and
        return ``RunnerOutput``s (one per request) from the reply rank.
        """
        if method in ASYNC_METHODS and not self.step_mode:
            fut = self._submit(method, args, None, requests_in(method, args))
            return list(fut.result())
        if method == DROP_OUTPUTS:
            # The workers never answer this control message: waiting for an answer
            # would only end in a ComputeTimeout after the whole rpc_timeout.
            raise UsageError(f"{method!r} has no answer; use drop_output/abort_outputs")
        return self._call_every_rank(method, args, kwargs, timeout)

    def _call_every_rank(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None, timeout: float | None
    ) -> list[Any]:
        """Path 2: send ``method`` with ``async_output=False`` and collect every rank's answer."""
        self.check_health()
        limit = self.deadlines.rpc_timeout if timeout is None else timeout
        with self._sync_lock:
            rpc_id = self.next_rpc_id()
            self._send_rpc(RpcRequest(rpc_id, method, args, dict(kwargs or {}), async_output=False))
            answers = self._collect(rpc_id, method, None if limit is None else time.monotonic() + limit)
        failures: dict[int, Failure] = {r: a.failure for r, a in answers.items() if a.failure is not None}
        if failures:
            # The call failed (F12): what the other ranks returned has no owner, an
            # output packed in step mode included.
            for a in answers.values():
                self._discard_answer(a.result)
            raise RpcFailed(rpc_id, method, failures)
        return [answers[r].result for r in range(self.world_size)]

    def _collect(self, rpc_id: str, method: str, deadline: float | None) -> dict[int, RpcResult]:
        answers: dict[int, RpcResult] = {}
        while len(answers) < self.world_size:
            wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if wait <= 0:
                for a in answers.values():
                    self._discard_answer(a.result)
                missing = sorted(set(range(self.world_size)) - answers.keys())
                raise ComputeTimeout(f"rpc {method} ({rpc_id}): no answer from rank(s) {missing} in time")
            try:
                msg = self.pump.sync_buffer.get(timeout=wait)
            except queue.Empty:
                self.check_health()
                continue
            if msg.rpc_id != rpc_id or msg.rank in answers:
                if msg.rpc_id != rpc_id and self._issued_here(msg.rpc_id):
                    # The answer of an earlier call that timed out: discard it, and
                    # what it carries.
                    self.stale_sync_answers += 1
                    self._discard_answer(msg.result)
                else:
                    # A call never made, or a rank answering twice: a protocol error.
                    self.unexpected_sync_answers += 1
                    log.warning("discarded an unexpected answer of rpc %s from rank %s", msg.rpc_id, msg.rank)
                continue
            answers[msg.rank] = msg
        return answers

    # ----------------------------------------------------------------- health

    def check_health(self) -> None:
        """Raise if the executor cannot make progress (shut down, pump dead, worker dead,
        or a worker stuck: ``WorkerStuck``, still computing a call ``Deadlines.cancel_grace``
        seconds after its compute deadline cancelled it)."""
        if self._closed:
            raise ExecutorShutdown("the executor is shut down")
        failure = self._worker_failure()
        if failure is not None:
            raise failure
        if not self.pump.healthy():
            raise ExecutorShutdown(f"the result pump is not running ({self.pump.state})")
        now = self.pump.now()
        grace = self.deadlines.cancel_grace
        stuck = self.pump.call(lambda d: d.stuck(now, grace))
        if stuck is not None:
            raise stuck

    def metrics(self) -> ExecutorMetrics:
        """The executor side's counters (``ExecutorMetrics``, whose docstring says what each is)."""
        waits, wait_total, wait_max = self._output_claims.wait_stats()

        def read(d: Dispatcher) -> ExecutorMetrics:
            s = d.registry.stats
            c = d.counters
            return ExecutorMetrics(
                pending_rpcs=d.pending_rpcs(),
                pending_outputs=len(d.registry),
                pending_waiters=d.registry.pending_waiters(),
                held_payloads=d.registry.held_payloads(),
                delivered=s.delivered,
                released=s.released,
                timeouts=s.timeouts,
                orphaned_outputs=s.orphaned,
                protocol_errors=s.protocol_errors + c["protocol_errors"] + self.unexpected_sync_answers,
                answers_without_compute_done=c["answers_without_compute_done"],
                unknown_call_compute_done=c["unknown_call_compute_done"],
                unknown_call_chunk=c["unknown_call_chunk"],
                unknown_call_rpc_result=c["unknown_call_rpc_result"],
                unexpected_sync_answers=self.unexpected_sync_answers,
                orphan_compute_done=c["orphan_compute_done"],
                stale_sync_answers=self.stale_sync_answers,
                late_rpc_results=c["late_rpc_results"],
                orphan_drops_expired=s.orphan_drops_expired,
                compute_timeouts=c["compute_timeouts"],
                overdue_calls=d.overdue_calls(),
                dispatch_errors=self.pump.dispatch_errors,
                messages=self.pump.messages,
                output_waits=waits,
                output_wait_s_total=wait_total,
                output_wait_s_max=wait_max,
            )

        return self.pump.call(read)

    @property
    def budget(self) -> OutputBudget | None:
        """The budget of held outputs in force (None: this executor holds outputs in no
        bounded store); the engine's admission control reads it."""
        return None

    def worker_metrics(self) -> list[WorkerInfo]:
        """Per rank, a ``WorkerInfo``: its pid, its call counters and its packer's
        (``PackerMetrics``: outputs and bytes in flight, pack time, back-pressure waits and
        the time spent in them)."""
        infos = self.collective_rpc("loop_info")
        for rank, info in enumerate(infos):
            if not isinstance(info, WorkerInfo):
                raise TypeError(f"rank {rank} answered loop_info with {type(info).__qualname__}, not a WorkerInfo")
        return infos

    # --------------------------------------------------------------- shutdown

    def shutdown(self, reason: str = "the executor shut down", *, timeout: float | None = None) -> None:
        """Idempotent: fail every pending waiter (F16), stop the pump, stop the workers.

        ``timeout`` bounds the whole call (seconds): the pump's stop, then every rank asked
        to stop, terminated, killed, in parallel, against one deadline; the shared memory
        is unlinked all the same.  A rank still in a forward that ignores cancellation is
        not waited for beyond it.  None: each step's default (a worker process gets 5 s to
        exit by itself, then 2 s after SIGTERM, then 2 s after SIGKILL).  A second call
        returns at once.
        """
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0
        ):
            raise UsageError(f"shutdown: timeout must be a number of seconds >= 0 or None, got {timeout!r:.80}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        # The pump's thread leaves within its poll interval unless a callback holds it;
        # it gets a fifth of the time at most, the workers the rest.
        self.pump.stop(reason, timeout=stop_budget(deadline, 5.0, 0.2))
        self._stop_workers(deadline)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["DiffusionExecutor", "stop_budget"]
