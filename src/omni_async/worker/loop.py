"""The worker side: one loop per rank that executes RPCs from the executor.

``WorkerLoop.handle_rpc`` is the whole protocol of a worker:

* ``execute_model`` / ``execute_model_batch`` with ``async_output`` (request
  mode): the loop names one output id per request, waits for room in the
  packer (back-pressure, before the forward), runs the forward, records a
  device event, hands each request's output to the packer and sends
  COMPUTE_DONE naming every id -- then returns to take the next request while
  the packer copies in the background.  Only the reply rank announces outputs;
  the other ranks answer with an empty RPC_RESULT, so the executor resolves the
  call only once every rank has answered (F12).  If the COMPUTE_DONE cannot be
  sent, the failure that answers the call instead names the ids already handed
  to the packer (``RpcResult.compute_failed``), so the executor drops
  them rather than hold what the packer ships for nobody.
* Everything else (and execute in step mode): the ordinary synchronous answer,
  an RPC_RESULT, packed on the main thread when it carries an output.
* Streaming (``RpcRequest.stream``): while the forward runs, the model may ship
  intermediate outputs with ``omni_async.worker.emit_chunk``; each gets an output id of
  its own, waits for room in the packer like any output, and is announced with a CHUNK
  message *before* it goes to the packer (so its OUTPUT_READY never overtakes it).
* Final-step async (``RpcRequest.step``, step mode): a forward that returns no output
  (an intermediate step) is answered with an ordinary RPC_RESULT; one that returns its
  output (the final step) takes the asynchronous path above.
* ``drop_outputs``: cancel packing of outputs that have not started (F15); no answer.
* Cancellation (``omni_async.worker.cancel``): the executor's ``CancelMessage``s reach
  ``cancels`` (a ``CancelTable``) from another thread while the forward runs; the model
  sees them through ``cancel_requested``.  A call whose requests are all cancelled is
  not started; one whose forward raises, or returns, once they all are is answered
  with a ``RequestAborted`` failure and ships nothing; the cancelled requests of a
  batch that goes on are not packed (their ids are announced, and the executor drops
  them).
* ``loop_info`` (pid, packer metrics) and ``drain_outputs`` (wait for in-flight
  packs, F8) are answered by the loop itself; model methods that release device
  memory (``DRAIN_BEFORE``) drain the packer first.

Failures travel as a typed ``Failure`` in the answer (F2), never as a string.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import attrs

from omni_async.core.errors import UsageError
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    BatchDiffusionOutput,
    CancelMessage,
    Chunk,
    ComputeDone,
    DiffusionOutput,
    DiffusionRequest,
    Failure,
    OutputReady,
    RpcRequest,
    RpcResult,
)
from omni_async.core.methods import (
    ASYNC_METHODS,
    CONTROL_METHODS,
    DRAIN_BEFORE,
    DRAIN_OUTPUTS,
    DROP_OUTPUTS,
    LOOP_INFO,
)
from omni_async.core.states import Machine, RequestEvent, RequestState, request_machine
from omni_async.core.trace import Tracer
from omni_async.transport.channel import ResultSender
from omni_async.transport.clock import ClockMark, DeviceClock
from omni_async.transport.errors import ChannelClosed
from omni_async.transport.platform import DeviceEvent
from omni_async.worker.cancel import CallScope, CancelTable
from omni_async.worker.packer import Packer, PackerMetrics, PackFn, budget_nbytes, fire_traced
from omni_async.worker.postprocess import DeviceStage, launch_device_stage, with_stage_time
from omni_async.worker.stamps import ForwardMarks, timed
from omni_async.worker.stream import ChunkScope, streaming

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT = 60.0


class DiffusionWorkerModel(Protocol):
    """What a real pipeline implements on the worker: forwards that return device tensors."""

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput: ...

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput: ...


def _no_event() -> DeviceEvent | None:
    return None


@attrs.frozen
class WorkerInfo:
    """One rank's answer to ``loop_info`` (``DiffusionExecutor.worker_metrics()``)."""

    rank: int
    pid: int
    reply_rank: int
    # Execute calls answered with ``RequestAborted``; cancel messages the rank received.
    aborted_calls: int
    cancels_received: int
    # Intermediate outputs shipped (``emit_chunk``).
    chunks_sent: int
    # The shared-memory segments this rank mapped (and, on CUDA, pinned) while starting:
    # only the rank that packs does (``SegmentPool.map_segments``); 0 elsewhere.
    mapped_segments: int = 0
    pinned_segments: int = 0
    # The packer's counters (all 0 for a loop without a packer) and lifecycle state
    # (None: no packer).
    packer: PackerMetrics = attrs.field(factory=PackerMetrics)
    packer_state: str | None = None


class WorkerLoop:
    def __init__(
        self,
        rank: int,
        worker: object,
        sender: ResultSender,
        *,
        reply_rank: int = 0,
        packer: Packer | None = None,
        pack_sync: PackFn | None = None,
        record_event: Callable[[], DeviceEvent | None] = _no_event,
        backpressure_timeout: float | None = None,
        tracer: Tracer | None = None,
        device_stage: DeviceStage | None = None,
        clock: DeviceClock | None = None,
        forward_mode: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        """``device_stage``: a post-process's device stage, run on step mode's outputs
        before ``pack_sync`` (request mode's run in the packer, which has its own).
        ``clock``: the worker's ``DeviceClock`` (the packer's too; None: the host's clock),
        with which the reply rank marks each forward's start and end on the device
        (``omni_async.worker.stamps``): recorded here, never waited for.
        ``forward_mode``: a context the forwards (``ASYNC_METHODS``) run in, with their
        streamed chunks and step mode's pack (the worker process's ``torch.inference_mode``,
        ``WorkerOptions.inference_mode``); other calls run without it."""
        self._forward_mode = forward_mode
        self._device_stage = device_stage
        self._clock = clock if clock is not None else DeviceClock("cpu")
        # The segments the process that hosts the loop mapped and pinned while starting
        # (``build_worker``), for ``loop_info``.
        self.mapped_segments = 0
        self.pinned_segments = 0
        self.rank = rank
        self.worker = worker
        self._sender = sender
        self._reply_rank = reply_rank
        self._packer = packer
        self._pack_sync = pack_sync
        self._record_event = record_event
        self._backpressure_timeout = backpressure_timeout
        self._trace = tracer
        self._prefix = f"r{rank}-{uuid.uuid4().hex[:12]}"
        self._seq = itertools.count()
        self.cancels = CancelTable()
        self.aborted_calls = 0
        self.chunks_sent = 0
        # Set by a host that calls ``idle()`` whenever it has no RPC to hand the loop (the
        # worker process does): the packer then starts on a forward's outputs only once
        # the next forward has started or the loop idles (``_deferred``).
        self.defer_packing = False
        # A hold on the packer kept from the last COMPUTE_DONE (defer_packing); ``_kept``:
        # the call being handled kept a new one.
        self._deferred = False
        self._kept = False

    @property
    def is_reply_rank(self) -> bool:
        return self.rank == self._reply_rank

    def new_output_id(self) -> str:
        return f"{self._prefix}-{next(self._seq)}"

    def cancel(self, msg: CancelMessage) -> None:
        """A cancel from the executor (any thread; the main thread may be in a forward)."""
        self.cancels.cancel(msg)

    def idle(self) -> None:
        """The host has no RPC for the loop now: the packer starts on what is queued.

        Why the packer waits for this (``defer_packing``): from a forward's end to the next
        forward's start, the main thread sends COMPUTE_DONE, takes the next RPC off the
        pipe and launches the next forward; a packer woken meanwhile takes the GIL for its
        own Python (the device stage's launches, the pack walk, OUTPUT_READY), and the
        main thread waits for it -- up to the interpreter's switch interval (5 ms) each
        time -- while the device idles.  Deferred, the packer runs while the next forward
        computes (a device forward blocks the host in a synchronize; a sleeping CPU one
        releases the GIL), which is where its copy overlaps anyway."""
        self._resume_packer()

    def handle_rpc(self, req: RpcRequest) -> None:
        if req.method in ASYNC_METHODS:
            with self._forward_mode():
                self._handle_rpc(req)
        else:
            self._handle_rpc(req)

    def _handle_rpc(self, req: RpcRequest) -> None:
        if not (req.async_output and req.method in ASYNC_METHODS):
            self._resume_packer()  # a drain, a control call, a synchronous call: never behind a hold
        if req.method == DROP_OUTPUTS:
            if self._packer is not None:
                self._packer.drop(req.args[0] if req.args else ())
            return
        if req.method in (LOOP_INFO, DRAIN_OUTPUTS):
            self._answer(req, self._control)
            return
        if req.async_output and req.method in ASYNC_METHODS and self._packer is not None:
            self._execute_async(req)
            return
        self._answer(req, self._call_sync)

    # ------------------------------------------------------------- internals

    def _answer(self, req: RpcRequest, compute: Callable[[RpcRequest], object]) -> None:
        """Answer ``req`` with ``compute(req)``, or with what it raised as a typed failure (F2)."""
        try:
            msg = RpcResult(req.rpc_id, compute(req), rank=self.rank)
        except Exception as exc:
            msg = RpcResult.error(req.rpc_id, exc, rank=self.rank)
        self._send(msg, req.rpc_id)

    def _fail_call(
        self, req: RpcRequest, exc: Exception, machines: Sequence[Machine[RequestState, RequestEvent]] = ()
    ) -> None:
        """Answer ``req`` with ``exc`` as a typed failure (F2), ending its outputs' machines first."""
        self._abort(machines)
        self._send(RpcResult.error(req.rpc_id, exc, rank=self.rank), req.rpc_id)

    def _control(self, req: RpcRequest) -> object:
        if req.method == LOOP_INFO:
            packer = self._packer
            return WorkerInfo(
                rank=self.rank,
                pid=os.getpid(),
                reply_rank=self._reply_rank,
                aborted_calls=self.aborted_calls,
                cancels_received=self.cancels.received,
                chunks_sent=self.chunks_sent,
                mapped_segments=self.mapped_segments,
                pinned_segments=self.pinned_segments,
                packer=PackerMetrics() if packer is None else attrs.evolve(packer.metrics),
                packer_state=None if packer is None else packer.state.name,
            )
        timeout = float(req.args[0]) if req.args else DEFAULT_DRAIN_TIMEOUT
        return self._drain(timeout)

    def _drain(self, timeout: float) -> bool:
        """Wait for every in-flight pack (F8); raise when it does not finish in time."""
        if self._packer is None:
            return True
        if not self._packer.drain(timeout):
            raise TimeoutError(
                f"rank {self.rank}: {self._packer.metrics.in_flight_outputs} output(s) still packing after {timeout}s"
            )
        return True

    def _mark(self) -> ClockMark:
        """A mark on the compute stream; the host's clock on ranks that ship nothing (their
        marks would never be read)."""
        return self._clock.mark() if self.is_reply_rank else ClockMark(time.monotonic())

    def _call_sync(self, req: RpcRequest) -> object:
        if req.method not in ASYNC_METHODS:
            return self._call(req)
        started = self._mark()
        result = self._call(req)
        return self._step_result(result, ForwardMarks(started, self._mark()))

    def _call(self, req: RpcRequest) -> object:
        """Call the model's method; its result is whatever that method returns (any RPC result)."""
        if req.method in DRAIN_BEFORE:
            self._drain(float(req.kwargs.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT)))
            req = attrs.evolve(req, kwargs={k: v for k, v in req.kwargs.items() if k != "drain_timeout"})
        if req.method.startswith("_") or req.method in CONTROL_METHODS:
            raise UsageError(f"{req.method!r} is not an RPC method")
        fn = getattr(self.worker, req.method, None)
        if fn is None or not callable(fn):
            raise UsageError(f"worker has no RPC method {req.method!r}")
        return fn(*req.args, **req.kwargs)

    def _step_result(self, result: object, forward: ForwardMarks) -> object:
        """The synchronous output path (step mode, ``sync_output``): only the reply rank
        ships its output, packed here on the main thread; ``forward``: the forward's
        marks, read into each output's stamps with the pack's (``omni_async.worker.stamps``:
        the same definitions as the packer's, so the baselines compare like with like)."""
        if not self.is_reply_rank:
            return None
        pack = self._pack_sync
        stage = self._device_stage
        event = self._record_event() if pack is not None or stage is not None else None

        def ship(o: DiffusionOutput) -> DiffusionOutput:
            # Marks on the compute stream, behind the forward: the device stage's start,
            # then where this path's copy starts (the packer's definitions: ``worker.stamps``).
            started = self._clock.mark()
            if stage is not None:
                o = launch_device_stage(stage, o, None, event)
            copy = self._clock.mark()
            if pack is not None:
                o = pack(o, None, event)
            if stage is not None:
                # Read after the pack synchronized the stream: the stage's device time.
                o = with_stage_time(o, self._clock.time_of(copy) - self._clock.time_of(started))
            return timed(o, self._clock, forward, copy, time.monotonic())

        if isinstance(result, BatchDiffusionOutput):
            return BatchDiffusionOutput(tuple(ship(o) for o in result.per_request()))
        if isinstance(result, DiffusionOutput):
            return ship(result)
        return result

    def _execute_async(self, req: RpcRequest) -> None:
        assert self._packer is not None
        batch = req.method == "execute_model_batch"
        self._kept = False
        try:
            try:
                requests: list[DiffusionRequest] = list(req.args[0]) if batch else [req.args[0]]
                if not requests or not all(isinstance(r, DiffusionRequest) for r in requests):
                    raise UsageError(f"{req.method} takes DiffusionRequest(s), got {req.args!r}")
            except Exception as exc:
                self.cancels.end(req.rpc_id)
                self._fail_call(req, exc)
                return
            with self.cancels.running(req.rpc_id, tuple(r.request_id for r in requests)) as scope:
                self._run_async(req, requests, scope)
        finally:
            if not self._kept:
                # No new hold was kept: this call ended before its forward started (or
                # after it failed), and a hold from the last call must not outlive it.
                self._resume_packer()

    def _resume_packer(self) -> None:
        """End the hold kept from the last COMPUTE_DONE, if any (``idle``)."""
        if self._deferred:
            self._deferred = False
            assert self._packer is not None
            self._packer.unhold()

    def _run_async(self, req: RpcRequest, requests: list[DiffusionRequest], scope: CallScope) -> None:
        assert self._packer is not None
        machines = [request_machine(self.new_output_id()) for _ in requests]
        if scope.all_cancelled():
            self._abort_call(req, scope, machines, "before its forward started; it never ran")
            return
        # Back-pressure: wait for the packer *before* the forward, never drop.  A packer
        # still held for this forward's start must first ship what it has.
        if not self._packer.has_room(len(requests)):
            self._resume_packer()
        if not self._packer.wait_for_room(len(requests), timeout=self._backpressure_timeout):
            err = RuntimeError(f"packer on rank {self.rank} has no room (stopped or back-pressure timeout)")
            self._fail_call(req, err, machines)
            return
        if scope.all_cancelled():
            self._abort_call(
                req, scope, machines, "before its forward started (it waited for the packer); it never ran"
            )
            return
        for m in machines:
            self._fire(m, RequestEvent.FORWARD)
        try:
            # Marks on the compute stream around the call (recorded, never waited for):
            # the packer reads when the device began and ended the forward.
            forward_started = self._mark()
            self._resume_packer()  # the next forward is on its way: the packer may run (``idle``)
            with self._streaming(req, requests, scope):
                result = self._call(req)
            forward = ForwardMarks(forward_started, self._mark())
            # A step call whose forward returned nothing: an intermediate step.
            outputs = None if req.step and result is None else self._split(result, requests)
        except Exception as exc:
            if scope.all_cancelled():
                # The model stopped at a cancellation check (whatever it raised).
                self._abort_call(req, scope, machines, "while computing; its forward stopped")
            else:
                self._fail_call(req, exc, machines)
            return
        if scope.all_cancelled():
            self._abort_call(
                req, scope, machines, "while computing; its forward ran to the end and its outputs were discarded"
            )
            return
        if not self.is_reply_rank or outputs is None:
            # Non-reply ranks computed the same forward (tensor parallel); their copy is not
            # shipped.  An intermediate step (final-step async) has nothing to ship.
            self._abort(machines)
            self._send(RpcResult(req.rpc_id, None, rank=self.rank), req.rpc_id)
            return
        # Recorded on the forward's stream without blocking the host (F14); the packer's
        # side stream waits on it before reading the output (F1).
        try:
            event = self._record_event()
        except Exception as exc:
            # Answer with the error at once: escaping handle_rpc unanswered would make the
            # call wait out its compute deadline and report a timeout instead (F2).
            self._fail_call(req, exc, machines)
            return
        # A request of the batch cancelled meanwhile: its output is not packed (the
        # packer reports it cancelled; the executor drops its id with the call's end).
        cancelled = scope.cancelled()
        # The packer starts on the outputs once COMPUTE_DONE is out (Packer.held), or, with
        # ``defer_packing``, once the next forward has started or the loop idles.
        self._packer.hold()
        try:
            for m, out, request in zip(machines, outputs, requests, strict=True):
                self._fire(m, RequestEvent.COMPUTE_DONE)
                skip = out.request_id in cancelled
                self._packer.submit(
                    m.key,
                    out,
                    m,
                    event=event,
                    nbytes=0 if skip else budget_nbytes(out),
                    cancelled=skip,
                    forward=forward,
                    encoding=request.encoding,
                )
            ids = tuple(m.key for m in machines)
            try:
                self._sender.put(ComputeDone(req.rpc_id, ids, tuple(r.request_id for r in requests), rank=self.rank))
            except ChannelClosed as exc:
                # The executor closed its end (shutdown) or is gone: nobody reads the answer.
                log.debug(
                    "rank %d: no COMPUTE_DONE for %s, the result channel is closed: %s", self.rank, req.rpc_id, exc
                )
            except Exception as exc:
                # The outputs are with the packer already: their OUTPUT_READY will come.  The
                # failure that answers the call names them, so the executor registers and drops
                # them (what arrives is released) instead of holding them for nobody (defect 3;
                # tla/AsyncOutputWorker.tla: WorkerMainComputeDoneFails, buggy/SendFailKeepsShipped).
                log.warning("rank %d: cannot send COMPUTE_DONE of %s: %s", self.rank, req.rpc_id, exc)
                self._send(
                    RpcResult.compute_failed(req.rpc_id, ids, Failure.from_exception(exc), rank=self.rank),
                    req.rpc_id,
                )
        finally:
            if self.defer_packing:
                self._deferred = self._kept = True  # ended by the next forward's start, or idle()
            else:
                self._packer.unhold()

    @contextlib.contextmanager
    def _streaming(self, req: RpcRequest, requests: list[DiffusionRequest], call: CallScope) -> Iterator[None]:
        """Around a streaming call's forward: ``emit_chunk`` ships through ``_emit_chunk``."""
        if not req.stream:
            yield
            return
        seqs: dict[str, int] = {}
        emit = functools.partial(self._emit_chunk, req.rpc_id, call, seqs)
        with streaming(ChunkScope(req.rpc_id, tuple(r.request_id for r in requests), emit)):
            yield

    def _emit_chunk(
        self, rpc_id: str, call: CallScope, seqs: dict[str, int], request_id: str, output: DiffusionOutput
    ) -> int | None:
        """One chunk of ``request_id`` (see ``omni_async.worker.stream``): room in the packer,
        the device event, the CHUNK announcement, then the hand-off -- in that order, so
        the chunk's OUTPUT_READY (the packer's) always follows its CHUNK on the channel."""
        assert self._packer is not None
        if not self.is_reply_rank or request_id in call.cancelled():
            return None
        m = request_machine(self.new_output_id())
        self._fire(m, RequestEvent.FORWARD)
        self._fire(m, RequestEvent.COMPUTE_DONE)
        seq = seqs.get(request_id, 0)
        nbytes = budget_nbytes(output)
        try:
            # Back-pressure, as before a forward: a slow consumer slows the forward here.
            if not self._packer.wait_for_room(1, nbytes, timeout=self._backpressure_timeout):
                raise RuntimeError(
                    f"packer on rank {self.rank} has no room for chunk {seq} of request {request_id!r} "
                    "(stopped or back-pressure timeout)"
                )
            event = self._record_event()
            self._sender.put(Chunk(rpc_id, request_id, seq, m.key, rank=self.rank))
        except BaseException:
            self._fire(m, RequestEvent.FORCE_RELEASE)  # nothing of it left the worker
            raise
        seqs[request_id] = seq + 1
        try:
            self._packer.submit(m.key, output, m, event=event, nbytes=nbytes)
        except Exception as exc:
            # Announced, but the packer is gone (the worker is stopping): end its record
            # with a typed failure instead of leaving it to its deadline.
            self._fire(m, RequestEvent.OUTPUT_FAILED)
            try:
                self._sender.put(OutputReady.failed(m.key, Failure.from_exception(exc), rank=self.rank))
            except Exception:
                log.debug("rank %d: cannot report the failure of chunk %s", self.rank, m.key, exc_info=True)
            raise
        self.chunks_sent += 1
        return seq

    def _abort_call(
        self,
        req: RpcRequest,
        scope: CallScope,
        machines: Sequence[Machine[RequestState, RequestEvent]],
        stage: str,
    ) -> None:
        """Answer a call whose requests are all cancelled: a ``RequestAborted`` failure, no ids."""
        self.aborted_calls += 1
        cause = scope.cause()
        log.debug("rank %d: call %s aborted %s %s", self.rank, req.rpc_id, cause.phrase, stage)
        self._abort(machines)
        failure = Failure("RequestAborted", f"aborted {cause.phrase} {stage}")
        self._send(RpcResult.failed(req.rpc_id, failure, rank=self.rank), req.rpc_id)

    @staticmethod
    def _split(result: Any, requests: list[DiffusionRequest]) -> list[DiffusionOutput]:
        # ``result``: whatever the forward returned (Any: checked here, not trusted).
        outs = list(result.per_request()) if isinstance(result, BatchDiffusionOutput) else [result]
        if not all(isinstance(o, DiffusionOutput) for o in outs):
            raise UsageError(f"the forward must return DiffusionOutput(s), got {type(result).__qualname__}")
        if [o.request_id for o in outs] != [r.request_id for r in requests]:
            raise UsageError(
                f"the forward returned outputs for {[o.request_id for o in outs]}, "
                f"expected {[r.request_id for r in requests]}"
            )
        return outs

    def _abort(self, machines: Sequence[Machine[RequestState, RequestEvent]]) -> None:
        for m in machines:
            self._fire(m, RequestEvent.FORCE_RELEASE)

    def _send(self, msg: AsyncDiffusionOutput, rpc_id: str) -> None:
        try:
            self._sender.put(msg)
        except ChannelClosed as exc:
            # The executor closed its end (shutdown) or is gone: nobody reads the answer.
            log.debug("rank %d: no answer to %s, the result channel is closed: %s", self.rank, rpc_id, exc)
        except Exception as exc:
            # The answer itself could not travel (unpicklable result, oversize): send a
            # small typed failure instead, so the caller is not left waiting (F5).
            log.warning("rank %d: cannot send the answer to %s: %s", self.rank, rpc_id, exc)
            self._sender.put(RpcResult.error(rpc_id, exc, rank=self.rank))

    def _fire(self, m: Machine[RequestState, RequestEvent], event: RequestEvent) -> None:
        fire_traced(m, event, self._trace, self.rank)
