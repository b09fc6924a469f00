"""Executor side: the API an engine calls, over any rank link.

``DiffusionExecutor`` is the face: argument checks, then each call handed to the
collaborator that owns it.  It owns, and hands to each other, the pump with its
dispatcher and registry (``executor/pump.py``, ``core/``), and:

* the rank link (``link``, ``executor/link.py``): how the ranks are reached;
* the output store (``store``, ``executor/store.py``): where packed outputs live;
* the sender (``executor/sender.py``): RPC ids, and drops ahead of each RPC;
* the output desk (``executor/desk.py``): claims, deliveries, drops, releases;
* the batch submitter (``executor/submitter.py``): the asynchronous calls and their
  ``RequestHandle``s;
* the synchronous calls (``executor/sync_calls.py``): ``collective_rpc`` and step mode.

The executors are siblings over this class, each built with its link and store:
``InProcessExecutor`` (threads), ``MultiprocDiffusionExecutor`` (worker processes),
``RayDiffusionExecutor`` (Ray actors).

Submitting, one way per shape: ``submit`` (one request -> ``RequestHandle``, its output
claimed for it at COMPUTE_DONE, its chunks on ``handle.stream`` with ``stream=True``),
``submit_batch`` (one batched forward -> a ``RequestHandle`` per request),
``execute_request``/``execute_batch`` (the seed's blocking shape: ``RunnerOutput``s
whose outputs ``wait_output_ready`` claims by id), ``collective_rpc`` (any method on
every rank).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Self

from omni_async.core.config import Deadlines
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import ExecutorShutdown, UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest, RunnerOutput
from omni_async.core.methods import ASYNC_METHODS, DROP_OUTPUTS
from omni_async.core.registry import OutputRegistry
from omni_async.core.trace import Tracer
from omni_async.executor.checks import (
    check_batch,
    check_consumer,
    check_deadlines,
    check_final_step_async,
    check_request_ids,
    final_async,
    requests_in,
    stop_budget,
)
from omni_async.executor.desk import OutputDesk
from omni_async.executor.handle import RequestHandle
from omni_async.executor.link import RankEvents, RankLink
from omni_async.executor.metrics import ExecutorMetrics, read_metrics
from omni_async.executor.pump import ResultPump
from omni_async.executor.sender import RpcIds, RpcSender
from omni_async.executor.store import OutputStore
from omni_async.executor.submitter import BatchKeyer, BatchSubmitter
from omni_async.executor.sync_calls import SyncCalls
from omni_async.transport.budget import OutputBudget
from omni_async.worker.loop import WorkerInfo

__all__ = ["DiffusionExecutor", "stop_budget"]


class DiffusionExecutor:
    """The executor API over a rank link and an output store (module docstring)."""

    def __init__(
        self,
        link: RankLink,
        store: OutputStore,
        *,
        world_size: int = 1,
        reply_rank: int = 0,
        step_mode: bool = False,
        deadlines: Deadlines | None = None,
        tracer: Tracer | None = None,
        validate_request: Callable[[DiffusionRequest], None] | None = None,
        final_step_async: bool = False,
        batch_key: BatchKeyer | None = None,
    ) -> None:
        """``validate_request``: the model's parameter check, run on every request in the
        caller's thread before it is sent (a bad request raises there, no worker sees it).
        ``batch_key``: the model's batch key (None: no request is batched).
        ``final_step_async`` (step mode only): the default of ``execute_request`` /
        ``execute_batch``'s ``final_step_async`` (see there)."""
        if world_size < 1:
            raise UsageError(f"world_size must be >= 1, got {world_size}")
        check_final_step_async(final_step_async, step_mode)
        self.final_step_async = final_step_async
        self.world_size = world_size
        self.reply_rank = reply_rank
        self.step_mode = step_mode
        self.deadlines = deadlines if deadlines is not None else Deadlines.from_env()
        self._validate_request = validate_request
        self._closed = False
        self._shutdown_lock = threading.Lock()
        self._link = link
        self._store = store
        ids = RpcIds()
        self.token = ids.token
        self.registry = OutputRegistry(
            output_timeout=self.deadlines.output_timeout, release_hook=store.release_packed, tracer=tracer
        )
        self.dispatcher = Dispatcher(
            self.registry,
            world_size=world_size,
            reply_rank=reply_rank,
            compute_timeout=self.deadlines.compute_timeout,
            tracer=tracer,
            known_call=ids.issued_here,
        )
        self.pump = ResultPump(link.receiver, self.dispatcher, on_cancel=link.deliver_cancels)
        self._sender = RpcSender(self.pump, link, ids)
        self._desk = OutputDesk(self.pump, store, self._sender.notify_drop)
        self._submitter = BatchSubmitter(
            self.pump, self._sender, self._desk, self.check_health, step_mode=step_mode, batch_key=batch_key
        )
        self._sync = SyncCalls(
            self.pump,
            self._sender,
            store,
            self.check_health,
            world_size=world_size,
            reply_rank=reply_rank,
            rpc_timeout=self.deadlines.rpc_timeout,
        )

    def _start(self, events: RankEvents | None, start_timeout: float, *, probe: bool) -> None:
        """Start the ranks, the pump, then (``probe``) check that every rank answers; on any
        failure shut down (nothing of the executor stays behind) and raise it."""
        try:
            deadline = time.monotonic() + start_timeout
            self._link.start(events, deadline, start_timeout)
            self.pump.start()
            self._link.started()
            if probe:
                self.collective_rpc("loop_info", timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.shutdown("the executor failed to start")
            raise

    @property
    def stale_sync_answers(self) -> int:
        """Late answers of an earlier synchronous call of ours, discarded with what they carried."""
        return self._sync.stale_answers

    @property
    def unexpected_sync_answers(self) -> int:
        """Synchronous answers of no call of ours, or a rank's second: protocol errors (M3)."""
        return self._sync.unexpected_answers

    # --------------------------------------------------------------- submit

    def submit(
        self,
        request: DiffusionRequest,
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
        stream: bool = False,
    ) -> RequestHandle:
        """Start a forward; a ``RequestHandle`` with both phases of its output (request mode):
        ``computed`` at COMPUTE_DONE (or the forward's typed error), ``output`` claimed for
        the handle as the pump dispatches that COMPUTE_DONE (``RequestHandle`` says the
        rest).  ``stream=True``: ``handle.stream`` gives the intermediate outputs the model
        emits.  ``deadlines``: this call's compute and output timeouts instead of the
        executor's."""
        self._check_request(request, "submit")
        self._check_args(consumer, deadlines, stream, "submit")
        return self._submitter.handles([request], consumer, deadlines, batch=False, stream=stream)[0]

    def submit_batch(
        self,
        requests: Sequence[DiffusionRequest],
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
        stream: bool = False,
    ) -> list[RequestHandle]:
        """Start one batched forward; a ``RequestHandle`` per request, in order, each as
        ``submit``'s: ``computed`` fails with ``RequestAborted`` when that request alone was
        cancelled while the rest of the batch went on; cancelling one handle's futures
        abandons its output only, never the call.  One call: one compute deadline."""
        reqs = self._check_batch(requests, "submit_batch")
        self._check_args(consumer, deadlines, stream, "submit_batch")
        return self._submitter.handles(reqs, consumer, deadlines, batch=True, stream=stream)

    def batch_key(self, request: DiffusionRequest) -> Hashable | None:
        """Which requests may share one ``execute_model_batch`` with ``request``: those
        whose key is equal; None (the default, and for a model without a ``batch_key``):
        never batched.  The model's ``batch_key(request)``, run in the caller's thread."""
        return self._submitter.batch_key(request)

    # -------------------------------------------------------------- execute

    def execute_request(
        self,
        request: DiffusionRequest,
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
        final_step_async: bool | None = None,
        sync_output: bool = False,
    ) -> RunnerOutput:
        """Run one forward, blocking (the seed's shape): its ``RunnerOutput`` at COMPUTE_DONE,
        the output taken with ``wait_output_ready``; in step mode the synchronous answer
        (bounded by ``rpc_timeout``; an intermediate step: ``finished=False``).
        ``sync_output=True``: the worker copies the output before it answers and
        ``result`` holds it (one call at a time, not cancellable).  ``final_step_async``
        (step mode; default the executor's): the final step's output is packed behind the
        next step and the call returns at COMPUTE_DONE with its ``async_output_id``."""
        self._check_request(request, "execute_request")
        return self._execute(
            "execute_model", (request,), [request], consumer, deadlines, final_step_async, sync_output
        )[0]

    def execute_batch(
        self,
        requests: Sequence[DiffusionRequest],
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
        final_step_async: bool | None = None,
        sync_output: bool = False,
    ) -> list[RunnerOutput]:
        """One batched forward, blocking: a ``RunnerOutput`` per request, as
        ``execute_request`` (a request cancelled alone comes back ``aborted``)."""
        reqs = self._check_batch(requests, "execute_batch")
        return self._execute("execute_model_batch", (reqs,), reqs, consumer, deadlines, final_step_async, sync_output)

    def _execute(
        self,
        method: str,
        args: tuple[Any, ...],
        reqs: Sequence[DiffusionRequest],
        consumer: str | None,
        deadlines: Deadlines | None,
        final_step_async: bool | None,
        sync_output: bool,
    ) -> list[RunnerOutput]:
        name = "execute_request" if method == "execute_model" else "execute_batch"
        check_consumer(consumer)
        check_deadlines(deadlines, name)
        if not isinstance(sync_output, bool):
            raise UsageError(f"{name}: sync_output must be a bool, got {sync_output!r:.80}")
        if sync_output:
            if final_step_async:
                raise UsageError(f"{name}: sync_output=True and final_step_async=True exclude each other")
            outs = self._sync.execute(method, args, reqs)
        elif final_async(final_step_async, name, self.step_mode, self.final_step_async):
            outs = self._submitter.submit(method, args, consumer, reqs, deadlines, step=True).result()
        elif self.step_mode:
            outs = self._sync.execute(method, args, reqs)
        else:
            outs = self._submitter.submit(method, args, consumer, reqs, deadlines).result()
        return outs

    def cancel_requests(self, request_ids: Iterable[str]) -> None:
        """Abort the forwards of these requests wherever they are; returns at once.  A model
        stops at its next ``cancel_requested()`` check, a call not started never runs, and
        the call fails with ``RequestAborted`` once nothing of it remains; a batch stops
        only when all its requests are cancelled (the others go on).  An id not in flight
        is ignored (drop its output instead).  Idempotent; a no-op after shutdown."""
        ids = check_request_ids(request_ids)
        if not ids or self._closed:
            return
        self.pump.call(lambda d: d.cancel(ids))

    # -------------------------------------------------------------- outputs

    def wait_output_ready(self, async_output_id: str) -> Future[DiffusionOutput]:
        """The future of an output announced by COMPUTE_DONE (the seed's shape).  **Exactly
        one waiter per id**: the first claim (this call, or a ``RequestHandle``) is the only
        one to get it; a later one fails at once with ``OutputAlreadyClaimed`` naming what
        became of the first.  Cancelling the future abandons the output (released on
        arrival, F9)."""
        return self._desk.wait_output_ready(async_output_id)

    def drop_output(self, async_output_id: str) -> Future[None]:
        """Drop/abort an output in any state (F10); the future resolves once nothing of it
        remains in the executor (a packing not started is cancelled, F15)."""
        return self._desk.drop_output(async_output_id)

    def abort_outputs(self, async_output_ids: Iterable[str], timeout: float | None = None) -> None:
        """Drop several outputs and return only when all of them are gone (before a weight update)."""
        self._desk.abort_outputs(async_output_ids, timeout)

    def release_output(self, output: DiffusionOutput) -> int:
        """The engine is done with a delivered output: how many segments went back (0
        without shared memory).  A zero-copy output's own views are taken back; another
        view still alive raises ``OutputStillViewed`` (the segment goes back once it is gone)."""
        return self._desk.release_output(output)

    def release_consumer(self, consumer: str) -> int:
        """The consumer went away without aborting (F11): release everything it owned."""
        return self._desk.release_consumer(consumer)

    @property
    def budget(self) -> OutputBudget | None:
        """The budget of held outputs in force (None: no bounded store); admission reads it."""
        return self._store.budget

    @property
    def lends_segments(self) -> bool:
        """Whether a delivered output views a shared-memory segment of this host, held
        until ``release_output`` (what the engine's ``sink="segment"`` lends).  False for
        ``InProcessExecutor`` (no segment), Ray (outputs of other nodes) and
        ``copy_outputs=True`` (copied out)."""
        return self._store.lends_segments

    # ---------------------------------------------------------------- checks

    def validate_request(self, request: DiffusionRequest) -> None:
        """Check ``request`` as ``submit`` would, without sending it."""
        self._check_request(request, "validate_request")

    def _check_request(self, request: object, method: str, argument: str = "request") -> None:
        if not isinstance(request, DiffusionRequest):
            raise UsageError(
                f"{method}: {argument} must be a DiffusionRequest, got {type(request).__name__} {request!r:.80}"
            )
        if self._validate_request is not None:
            self._validate_request(request)

    @staticmethod
    def _check_args(consumer: object, deadlines: object, stream: object, method: str) -> None:
        check_consumer(consumer)
        check_deadlines(deadlines, method)
        if not isinstance(stream, bool):
            raise UsageError(f"{method}: stream must be a bool, got {stream!r:.80}")

    def _check_batch(self, requests: object, method: str) -> list[DiffusionRequest]:
        return check_batch(requests, method, self._check_request)

    # ------------------------------------------------------------------ rpc

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call ``method`` on every rank; the answers in rank order (path 2).  In request
        mode ``execute_model``/``execute_model_batch`` take path 1 and return
        ``RunnerOutput``s (one per request) from the reply rank."""
        if method in ASYNC_METHODS and not self.step_mode:
            return list(self._submitter.submit(method, args, None, requests_in(method, args)).result())
        if method == DROP_OUTPUTS:
            # The workers never answer this control message: waiting for an answer
            # would only end in a ComputeTimeout after the whole rpc_timeout.
            raise UsageError(f"{method!r} has no answer; use drop_output/abort_outputs")
        return self._sync.call(method, args, kwargs, timeout)

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every worker has sent every output it is packing (F8); raises on timeout."""
        self.collective_rpc("drain_outputs", (timeout,), timeout=timeout + 5.0)

    def worker_metrics(self) -> list[WorkerInfo]:
        """Per rank, a ``WorkerInfo``: its pid, its call counters and its packer's."""
        infos = self.collective_rpc("loop_info")
        for rank, info in enumerate(infos):
            if not isinstance(info, WorkerInfo):
                raise TypeError(f"rank {rank} answered loop_info with {type(info).__qualname__}, not a WorkerInfo")
        return infos

    # --------------------------------------------------------------- health

    def check_health(self) -> None:
        """Raise if the executor cannot make progress (shut down, pump dead, worker dead,
        or a worker stuck: ``WorkerStuck``, still computing a call ``Deadlines.cancel_grace``
        seconds after its compute deadline cancelled it)."""
        if self._closed:
            raise ExecutorShutdown("the executor is shut down")
        failure = self._link.failure()
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
        waits, wait_total, wait_max = self._desk.wait_stats()
        unexpected, stale = self._sync.unexpected_answers, self._sync.stale_answers

        pump = self.pump
        return pump.call(lambda d: read_metrics(d, pump, (waits, wait_total, wait_max), unexpected, stale))

    # -------------------------------------------------------------- shutdown

    def shutdown(self, reason: str = "the executor shut down", *, timeout: float | None = None) -> None:
        """Idempotent: fail every pending waiter (F16), stop the pump, stop the ranks, close
        the output store.  ``timeout`` bounds all of it (ranks asked, then killed, in parallel
        against one deadline); None: each step's default (a worker process gets 5 s to exit,
        then 2 s after SIGKILL; a worker ignores the SIGTERM and SIGINT that reach the whole
        process group; after a rank's death the others get 1 s: their calls failed with it)."""
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
        # it gets a fifth of the time at most, the ranks the rest.
        self.pump.stop(reason, timeout=stop_budget(deadline, 5.0, 0.2))
        self._link.stop(deadline)
        self._store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
