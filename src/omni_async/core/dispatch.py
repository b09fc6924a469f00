"""RPC dispatch on the executor side (sans-IO, like the registry).

Two paths, as in the RFC:

* Path 1 -- ``execute_model`` / ``execute_model_batch`` in request mode: the
  caller gets a future from ``submit``; it resolves when *every* rank has
  answered (F12): the reply rank with COMPUTE_DONE, the others with an empty
  RPC_RESULT.  Any rank's failure fails the call, and the output ids that the
  reply rank announced are dropped so nothing leaks.
* Path 2 -- every other RPC and step mode: ``handle`` returns the RPC_RESULT
  message to the caller (the pump), which puts it in the synchronous buffer
  that ``collective_rpc`` reads.

Aborting a call in flight (``cancel``, and ``expire`` for a compute deadline): the
dispatcher marks the call's cancelled requests and queues a ``CancelMessage`` per call
(``take_cancels``) for the caller to send on the workers' control channel; it never
ends the call itself.  A fully cancelled call ends by its ranks' answers: it fails
with ``RequestAborted`` once the ids it announced anyway (the forward finished before
the cancel arrived) are gone from the registry.  A call ended by its compute deadline
stays *overdue* until every rank answered; ``stuck`` names a rank that has not within
a grace period.

The dispatcher registers COMPUTE_DONE's ids in the registry *before* it resolves
the RPC future: the engine learns an id only from that future, so every
``wait_output_ready`` finds its record.  Swapping the two would let a waiter
arrive for an id the registry has not seen.

Streaming calls: a ``CHUNK`` registers its one id the same way and hands it to its
request's ``ChunkFeed`` (``omni_async.core.stream``), never answering the call; when
the call ends, so do its feeds (``omni_async.core.dispatch_stream``, the base class).
What the dispatcher records of each call is ``omni_async.core.calls``.  Step calls (final-step async, ``step=True`` in
``submit``): the reply rank may answer with a plain RPC_RESULT instead of
COMPUTE_DONE -- an intermediate step, which announces nothing.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import assert_never

from omni_async.core.calls import Aborting, Answer, ClaimSlots, OverdueRpc, PendingRpc, answer_failure
from omni_async.core.config import Deadlines
from omni_async.core.dispatch_stream import StreamDispatch
from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OutputDropped,
    OutputError,
    ProtocolError,
    RequestAborted,
    RpcFailed,
    WorkerStuck,
)
from omni_async.core.messages import (
    AbortCause,
    AsyncDiffusionOutput,
    CancelMessage,
    Chunk,
    ComputeDone,
    Failure,
    OutputReady,
    RpcResult,
    RunnerOutput,
)
from omni_async.core.methods import ASYNC_METHODS
from omni_async.core.registry import DEFAULT, OutputRegistry, Resolution, Settle
from omni_async.core.stream import ChunkFeed
from omni_async.core.trace import Tracer, emit

__all__ = ["Aborting", "ClaimSlots", "Dispatcher", "OverdueRpc", "PendingRpc"]


class Dispatcher(StreamDispatch):
    def __init__(
        self,
        registry: OutputRegistry,
        *,
        world_size: int = 1,
        reply_rank: int = 0,
        compute_timeout: float | None = None,
        tracer: Tracer | None = None,
        known_call: Callable[[str], bool] | None = None,
    ) -> None:
        """``known_call``: whether an rpc id is one the executor issued (any path); a
        plain RPC_RESULT of any other call that is not pending is then counted as a
        protocol error and discarded here, not put in the synchronous buffer (M3).
        None: every one is buffered."""
        if not 0 <= reply_rank < world_size:
            raise ValueError(f"reply_rank {reply_rank} outside world of {world_size}")
        self.registry = registry
        self.world_size = world_size
        self.reply_rank = reply_rank
        self._compute_timeout = compute_timeout
        self._trace = tracer
        self._known_call = known_call
        self._pending: dict[str, PendingRpc] = {}
        self._outbox: list[Settle] = []
        self._worker_drops: list[str] = []
        self._cancels: list[CancelMessage] = []
        self._overdue: dict[str, OverdueRpc] = {}
        self._aborting: list[Aborting] = []
        self.counters: Counter[str] = Counter()
        # The calls that ended (resolved, failed, timed out, unsent, their consumer gone),
        # the most recent ones: a COMPUTE_DONE of one of them is late (the worker
        # answered after the call ended), one of any other call is a protocol error
        # (a call never made, M3), whose DROPPING records are bounded (M6).
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._max_ended = 4096

    def __len__(self) -> int:
        return len(self._pending)

    def pending_rpcs(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ path 1

    def submit(
        self,
        rpc_id: str,
        method: str,
        *,
        now: float,
        consumer: str | None = None,
        timeout: float | None = None,
        request_ids: tuple[str, ...] = (),
        deadlines: Deadlines | None = None,
        streams: Iterable[ChunkFeed] = (),
        step: bool = False,
        claims: ClaimSlots | None = None,
    ) -> Future[tuple[RunnerOutput, ...]]:
        """Register an execute RPC before it is broadcast; its future resolves on COMPUTE_DONE.

        ``request_ids``: the call's requests (what ``cancel`` finds it by).  ``deadlines``:
        this call's compute and output timeouts, replacing the executor's (None in them
        means no deadline); ``timeout`` is the older way to set the compute timeout alone.
        ``streams``: a feed per request whose chunks the caller wants (each names a
        request of ``request_ids``); ``step``: a step of step mode (see the module docstring).
        ``claims``: one slot per request, filled with the waiter of its output when the
        call's COMPUTE_DONE is dispatched (``ClaimSlots``).
        """
        if claims is not None and len(claims.waiters) != len(request_ids):
            raise ValueError(f"rpc {rpc_id}: {len(claims.waiters)} claim slot(s) for {len(request_ids)} request(s)")
        if method not in ASYNC_METHODS:
            raise ValueError(f"{method!r} does not take the async path")
        if rpc_id in self._pending:
            raise ValueError(f"rpc id {rpc_id!r} is already pending")
        if deadlines is not None:
            limit = deadlines.compute_timeout
            output_timeout = deadlines.output_timeout
        else:
            limit = self._compute_timeout if timeout is None else timeout
            output_timeout = self.registry.output_timeout
        feeds = {f.request_id: f for f in streams}
        unknown = sorted(set(feeds) - set(request_ids))
        if unknown:
            raise ValueError(f"rpc {rpc_id}: streams of requests {unknown} that the call does not make")
        fut: Future[tuple[RunnerOutput, ...]] = Future()
        if self.registry.closed:
            # After fail_all(close=True) nothing would ever resolve a new entry: a submit
            # that raced a pump stop (check_health passed just before) fails at once.
            err = ExecutorShutdown(f"rpc {method} ({rpc_id}): the executor shut down")
            fut.set_exception(err)
            for feed in feeds.values():
                self._end_feed(feed, err)
            self._remember_ended(rpc_id)
            return fut
        for feed in feeds.values():
            feed.rpc_id = rpc_id
        self._pending[rpc_id] = PendingRpc(
            rpc_id,
            method,
            frozenset(range(self.world_size)),
            self.reply_rank,
            fut,
            None if limit is None else now + limit,
            consumer,
            request_ids=tuple(request_ids),
            output_timeout=output_timeout,
            compute_timeout=limit,
            streams=feeds,
            step=step,
            claims=claims,
        )
        emit(
            self._trace,
            "RpcSubmit",
            rpc_id=rpc_id,
            method=method,
            ranks=",".join(map(str, range(self.world_size))),
            reply_rank=self.reply_rank,
            consumer=consumer,
            step=step,
            streams=len(feeds),
        )
        return fut

    def forget(self, rpc_id: str, error: BaseException) -> None:
        """The broadcast of a submitted RPC failed: fail the call with ``error``.

        The ranks before the failing one did get it, and the reply rank may already
        have announced its ids (the pump runs meanwhile): those have no owner now, so
        they are dropped, as on a timeout.  What such ranks send later is an orphan.
        """
        rpc = self._pending.pop(rpc_id, None)
        if rpc is None:
            return
        self._remember_ended(rpc_id)
        for a in rpc.answers.values():
            self._drop_all(a.async_output_ids, rpc_id, "unsent")
        self._end_streams(rpc, error, "unsent")
        if rpc.future.set_running_or_notify_cancel():
            self._outbox.append(Resolution(rpc.future, error=error))
        emit(self._trace, "RpcResolve", rpc_id=rpc_id, outcome="unsent")

    # ---------------------------------------------------------------- messages

    def handle(self, msg: AsyncDiffusionOutput, *, now: float) -> RpcResult | None:
        """Route one message; returns it when it belongs in the synchronous buffer (path 2)."""
        made = self._made(msg)
        self._trace_recv(msg, made)
        match msg:
            case OutputReady():
                self.registry.on_output(
                    msg.async_output_id,
                    output=msg.output,
                    failure=msg.failure,
                    rank=msg.rank,
                    early_deadline=self._early_deadline(now),
                )
                return None
            case ComputeDone():
                self._on_compute_done(msg, now, made)
                return None
            case Chunk():
                self._on_chunk(msg, now, made)
                return None
            case RpcResult():
                return self._on_rpc_result(msg, now, made)
            case _:
                assert_never(msg)

    def _trace_recv(self, msg: AsyncDiffusionOutput, made: bool) -> None:
        """The pump dequeued ``msg`` (AsyncOutput's PumpRecv): the same fields for every kind,
        empty where a kind has none."""
        rpc_id: str | None = None
        ids: tuple[str, ...] = ()
        output_id: str | None = None
        failure: Failure | None = None
        seq: int | None = None
        match msg:
            case OutputReady():
                output_id, failure = msg.async_output_id, msg.failure
            case ComputeDone():
                rpc_id, ids = msg.rpc_id, msg.async_output_ids
            case Chunk():
                rpc_id, output_id, seq = msg.rpc_id, msg.async_output_id, msg.seq
            case RpcResult():
                rpc_id, ids, failure = msg.rpc_id, msg.async_output_ids, msg.failure
            case _:
                assert_never(msg)
        emit(
            self._trace,
            "PumpRecv",
            kind=msg.kind.name,
            rank=msg.rank,
            rpc_id=rpc_id,
            ids=",".join(ids),
            output_id=output_id,
            ok=failure is None,
            seq=seq,
            known=made,
        )

    def _on_rpc_result(self, msg: RpcResult, now: float, made: bool) -> RpcResult | None:
        self._answered_overdue(msg)
        if msg.names_outputs:
            # The failure that replaces a COMPUTE_DONE the worker could not send
            # after handing the outputs to its packer (compute_failed): it
            # registers the ids it names like a COMPUTE_DONE, then fails the
            # call, whose end drops them like any failed call's ids (defect 3).
            self._on_compute_done(msg, now, made)
            return None
        if not made:
            # Nobody issued this call: a protocol error (M3), discarded here,
            # never put in the synchronous buffer.
            self.counters["unknown_call_rpc_result"] += 1
            self._protocol_error(f"RPC_RESULT of rpc {msg.rpc_id}, a call never made")
            return None
        rpc = self._pending.get(msg.rpc_id)
        if rpc is None:
            if msg.result is None and msg.rpc_id in self._ended:
                # A late answer of an execute call that ended (its compute
                # deadline, a cancel, an abort): the worker's RequestAborted, or
                # a non-reply rank's empty answer.  Nobody will read it, and it
                # carries nothing to give back: counted and discarded here.  In
                # the synchronous buffer it would stay until the next
                # collective_rpc, which an engine may never make: one message
                # (with its traceback text) kept per such call, without bound.
                self.counters["late_rpc_results"] += 1
                return None
            return msg  # path 2, or a late answer that carries a result (the caller discards it)
        if msg.rank == rpc.reply_rank and msg.failure is None and msg.rank not in rpc.answers and not rpc.step:
            # The reply rank answers an execute call with COMPUTE_DONE or a failure;
            # a plain answer is a protocol error (M3), counted as it arrives (not
            # for a step call: its intermediate steps announce nothing).  The
            # call fails with a ProtocolError once every rank has answered.
            self.counters["answers_without_compute_done"] += 1
            self._protocol_error(f"rpc {rpc.rpc_id}: reply rank {rpc.reply_rank} answered without COMPUTE_DONE")
        self._answer(rpc, msg, now)
        return None

    def _made(self, msg: AsyncDiffusionOutput) -> bool:
        """Whether ``msg`` belongs to a call this executor made (recorded in the trace:
        AsyncOutput's Handle takes a message of a call never made as a faulty peer's).

        An OUTPUT_READY names no call.  A message that names output ids (COMPUTE_DONE,
        or the failure that replaces one) or a CHUNK belongs to an execute call: one
        pending, or one of the last ``_max_ended`` that ended (older ones count as never
        made).  A plain RPC_RESULT: a call pending, or any the executor issued
        (``known_call``, path 2 included; without it, every one).
        """
        match msg:
            case OutputReady():
                return True
            case _ if msg.rpc_id in self._pending:
                return True
            case ComputeDone() | Chunk():
                return msg.rpc_id in self._ended
            case RpcResult():
                if msg.names_outputs:
                    return msg.rpc_id in self._ended
                return self._known_call is None or self._known_call(msg.rpc_id)
            case _:
                assert_never(msg)

    def _on_compute_done(self, msg: Answer, now: float, made: bool) -> None:
        """A COMPUTE_DONE, or the failed RPC_RESULT that replaces one (``compute_failed``,
        which names ids but no requests)."""
        self._answered_overdue(msg)
        rpc = self._pending.get(msg.rpc_id)
        announced = self.registry.on_compute_done(
            msg.async_output_ids,
            now=now,
            rank=msg.rank,
            request_ids=msg.request_ids if isinstance(msg, ComputeDone) else (),
            consumer=None if rpc is None else rpc.consumer,
            output_timeout=DEFAULT if rpc is None else rpc.output_timeout,
        )
        if rpc is None:
            # Late (the call timed out or was cancelled), or of a call never made:
            # nobody will claim these ids.
            self.counters["orphan_compute_done"] += 1
            self._drop_all(announced, msg.rpc_id, "orphan")
            if not made:
                # A call never made (or ended longer ago than remembered): a protocol
                # error (M3).  No worker is packing for it, so its OUTPUT_READY may never
                # come: its DROPPING records are given up at a deadline (M6).
                self.counters["unknown_call_compute_done"] += 1
                self._protocol_error(
                    f"COMPUTE_DONE of rpc {msg.rpc_id}, a call never made (a broken worker?); "
                    f"the {len(announced)} id(s) it announced are dropped"
                )
                self.registry.give_up_dropping(announced, self._orphan_deadline(now))
            return
        rejected = len(announced) != len(msg.async_output_ids)
        if msg.rank != rpc.reply_rank or msg.rank in rpc.answers or rejected:
            # Only the reply rank announces outputs, once: count it, drop what it
            # announced, and let the offending rank's answer fail the call.
            # An id the registry refused (already announced, or finished) belongs to
            # another call: never hand it out as this call's, never drop it on this
            # call's failure.  Such a COMPUTE_DONE fails the call like any bad answer.
            self._drop_all(announced, rpc.rpc_id, "rejected")
            if rejected and msg.rank == rpc.reply_rank and msg.rank not in rpc.answers:
                reason = f"rpc {rpc.rpc_id}: COMPUTE_DONE names output ids already announced or finished"
            else:
                reason = f"rpc {rpc.rpc_id}: COMPUTE_DONE from rank {msg.rank} (reply rank {rpc.reply_rank})"
            self._protocol_error(reason)
            if msg.rank in rpc.answers:
                return
            msg = RpcResult.failed(rpc.rpc_id, Failure("ProtocolError", reason), rank=msg.rank)
        self._answer(rpc, msg, now)

    def _answer(self, rpc: PendingRpc, msg: Answer, now: float) -> None:
        if msg.rank in rpc.answers or msg.rank not in rpc.ranks:
            self._protocol_error(f"rpc {rpc.rpc_id}: unexpected or duplicate answer from rank {msg.rank}")
            return
        rpc.answers[msg.rank] = msg
        emit(self._trace, "RpcAnswer", rpc_id=rpc.rpc_id, rank=msg.rank, ok=answer_failure(msg) is None)
        if len(rpc.answers) == len(rpc.ranks):
            self._complete(rpc, now)

    def _complete(self, rpc: PendingRpc, now: float) -> None:
        del self._pending[rpc.rpc_id]
        self._remember_ended(rpc.rpc_id)
        reply = rpc.answers[rpc.reply_rank]
        announced = reply.async_output_ids
        if rpc.fully_cancelled:
            self._complete_aborted(rpc, announced)
            return
        failures = {r: f for r, a in rpc.answers.items() if (f := answer_failure(a)) is not None}
        error: BaseException | None = None
        # A step of step mode (final-step async) whose forward returned no output: an
        # intermediate step, answered like any other rank's (it announces nothing).
        intermediate = rpc.step and isinstance(reply, RpcResult) and reply.failure is None
        if failures:
            error = RpcFailed(rpc.rpc_id, rpc.method, failures)
        elif not isinstance(reply, ComputeDone) and not intermediate:
            # Counted when the answer arrived (handle).
            error = ProtocolError(f"rpc {rpc.rpc_id}: reply rank {rpc.reply_rank} answered without COMPUTE_DONE")
        if error is None and rpc.future.set_running_or_notify_cancel():
            # A request cancelled while the rest of its batch went on: its RunnerOutput
            # says aborted, and its output is dropped as the engine would drop it
            # (a drop after the call resolved; released on arrival).
            outputs: list[RunnerOutput] = []
            kept: list[str] = []
            unwanted: list[str] = []
            for rid, oid in zip(reply.request_ids if isinstance(reply, ComputeDone) else (), announced, strict=True):
                if rid in rpc.cancelled:
                    unwanted.append(oid)
                    outputs.append(RunnerOutput(request_id=rid, finished=True, aborted=True))
                else:
                    kept.append(oid)
                    outputs.append(RunnerOutput(request_id=rid, finished=True, result=None, async_output_id=oid))
            if intermediate:
                outputs = [RunnerOutput(rid, finished=False, aborted=rid in rpc.cancelled) for rid in rpc.request_ids]
            for rid, feed in rpc.streams.items():
                # The feed of a request cancelled while its batch went on ends like the
                # request: what it did not take is dropped below, with its output.
                if rid in rpc.cancelled:
                    unwanted.extend(ref.output_id for ref in feed.announced)
                    feed.dropped += len(feed.announced)
                    feed.announced.clear()
                    self._end_feed(feed, self._stream_error(rpc, "aborted"))
                else:
                    self._end_feed(feed, None)
            self._outbox.append(Resolution(rpc.future, output=tuple(outputs)))
            # The engine learns the ids only now: with several ranks the reply rank's
            # COMPUTE_DONE can precede the last answer, so the delivery deadline is
            # measured from here (F4).
            self.registry.rearm_deadlines(kept, now)
            emit(self._trace, "RpcResolve", rpc_id=rpc.rpc_id, outcome="ok")
            for oid in unwanted:
                self.registry.drop(oid)
                if oid in self.registry:
                    self._worker_drops.append(oid)  # its packer may skip it (F15)
            if rpc.claims is not None and not intermediate:
                # Under the lock already held, after the call resolved in the registry's
                # eyes (its ids are known now, F4), before the caller's future is set:
                # the caller's first look at the call finds its outputs claimed.
                rpc.claims.waiters[:] = [
                    None if ro.async_output_id is None else self.registry.wait(ro.async_output_id) for ro in outputs
                ]
            return
        # Failed, or the caller cancelled: the announced outputs have no owner (F12).
        why = "failed" if error is not None else "cancelled"
        self._drop_all(announced, rpc.rpc_id, why)
        self._end_streams(rpc, error if error is not None else self._stream_error(rpc, why), why)
        if error is not None and rpc.future.set_running_or_notify_cancel():
            self._outbox.append(Resolution(rpc.future, error=error))
        emit(self._trace, "RpcResolve", rpc_id=rpc.rpc_id, outcome=why)

    def _complete_aborted(self, rpc: PendingRpc, announced: tuple[str, ...]) -> None:
        """Every request of ``rpc`` was cancelled and every rank has answered.

        The ranks stopped (a ``RequestAborted`` failure), or finished anyway and the
        reply rank announced ids: those are dropped now, released when their output
        arrives.  The call's future fails with ``RequestAborted`` once none of them is
        left in the registry: then nothing of the call remains on a worker or here.
        """
        self._drop_all(announced, rpc.rpc_id, "aborted")
        chunks = tuple(rpc.unwanted) + tuple(ref.output_id for feed in rpc.streams.values() for ref in feed.announced)
        cause = next(iter(rpc.cancelled.values()))
        self._end_streams(rpc, self._stream_error(rpc, "aborted"), "aborted")
        emit(self._trace, "RpcResolve", rpc_id=rpc.rpc_id, outcome="aborted")
        if not rpc.future.set_running_or_notify_cancel():
            return
        stages = sorted(
            {f"rank {r}: {f.message}" for r, a in rpc.answers.items() if (f := answer_failure(a)) is not None}
        )
        if announced:
            stages.append("the forward finished before it saw the cancel; its outputs were dropped")
        err = RequestAborted(
            rpc.request_ids[0],
            by=cause.value,
            detail="; ".join(stages),
            request_ids=rpc.request_ids,
            rpc_id=rpc.rpc_id,
        )
        self._aborting.append(Aborting(rpc.future, err, tuple(announced) + chunks))

    # ------------------------------------------------------------------ cancel

    def cancel(self, request_ids: Iterable[str], *, cause: AbortCause = AbortCause.ABORT) -> int:
        """Cancel these requests in every pending call that holds them; returns how many were found.

        Each call they belong to is marked, and a ``CancelMessage`` per call waits in
        ``take_cancels`` for the caller to send on the control channel (the worker stops
        the forward at its next cancellation check, or never starts it).  The call still
        ends by its ranks' answers: fully cancelled, it fails with ``RequestAborted``;
        partly (some requests of a batch), its cancelled requests' outputs are dropped.
        A request not in a pending call (unknown, or its call already resolved) is
        ignored: drop its output instead.
        """
        wanted = set(request_ids)
        found = 0
        for rpc in self._pending.values():
            hit = tuple(r for r in rpc.request_ids if r in wanted and r not in rpc.cancelled)
            if not hit:
                continue
            found += len(hit)
            for r in hit:
                rpc.cancelled[r] = cause
            self._cancels.append(CancelMessage(rpc.rpc_id, hit, cause))
            if rpc.fully_cancelled:
                # The call as a whole is aborted now (AsyncOutput's AbortRpc); a part of
                # a batch is not a step of its own (its drops follow the call's end).
                emit(self._trace, "RpcCancel", rpc_id=rpc.rpc_id, cause=cause.value)
        return found

    def take_cancels(self) -> list[CancelMessage]:
        """Cancel messages to send to every worker (control channel), oldest first."""
        out, self._cancels = self._cancels, []
        return out

    def _answered_overdue(self, msg: Answer) -> None:
        late = self._overdue.get(msg.rpc_id)
        if late is None:
            return
        late.missing.discard(msg.rank)
        if not late.missing:
            del self._overdue[late.rpc_id]

    def stuck(self, now: float, grace: float | None) -> WorkerStuck | None:
        """A rank still computing a call ``grace`` seconds after its compute deadline cancelled it."""
        if grace is None:
            return None
        for late in self._overdue.values():
            if late.missing and now - late.expired_at >= grace:
                return WorkerStuck(min(late.missing), late.rpc_id, late.request_ids, now - late.expired_at)
        return None

    def overdue_calls(self) -> int:
        """Calls that ended by their compute deadline and that some rank has not answered yet."""
        return len(self._overdue)

    def release_consumer(self, consumer: str) -> int:
        """The consumer went away (F11): fail its pending calls, abandon its outputs.

        A pending call is failed rather than left to resolve: the ids it would
        announce would belong to nobody.  Its late COMPUTE_DONE is then an orphan
        and its ids are dropped on arrival.
        """
        gone = [r for r in self._pending.values() if r.consumer == consumer]
        for rpc in gone:
            del self._pending[rpc.rpc_id]
            self._remember_ended(rpc.rpc_id)
            err = OutputDropped(f"consumer {consumer!r} went away")
            # Its chunks not taken are the consumer's records: release_consumer abandons them below.
            for feed in rpc.streams.values():
                feed.announced.clear()
            self._end_streams(rpc, err, None)
            if rpc.future.set_running_or_notify_cancel():
                self._outbox.append(Resolution(rpc.future, error=err))
            emit(self._trace, "RpcResolve", rpc_id=rpc.rpc_id, outcome="consumer_gone")
        return len(gone) + self.registry.release_consumer(consumer)

    # --------------------------------------------------------------- deadlines

    def expire(self, now: float) -> None:
        for rpc in [r for r in self._pending.values() if r.deadline is not None and r.deadline <= now]:
            del self._pending[rpc.rpc_id]
            self._remember_ended(rpc.rpc_id)
            self.counters["compute_timeouts"] += 1
            missing = sorted(rpc.ranks - rpc.answers.keys())
            for a in rpc.answers.values():
                self._drop_all(a.async_output_ids, rpc.rpc_id, "timeout")
            stopping = ""
            if rpc.request_ids:
                # Stop the forward on the ranks still computing it (or never start it).
                hit = tuple(r for r in rpc.request_ids if r not in rpc.cancelled)
                if hit:
                    self._cancels.append(CancelMessage(rpc.rpc_id, hit, AbortCause.DEADLINE))
                self._overdue[rpc.rpc_id] = OverdueRpc(rpc.rpc_id, rpc.request_ids, now, set(missing))
                stopping = f"; its forward of request(s) {list(rpc.request_ids)} was cancelled on the workers"
            timeout = ComputeTimeout(
                f"rpc {rpc.method} ({rpc.rpc_id}): no answer from rank(s) {missing} within its "
                f"compute deadline (compute_timeout={rpc.compute_timeout} s){stopping}"
            )
            self._end_streams(rpc, timeout, "timeout")
            if rpc.future.set_running_or_notify_cancel():
                self._outbox.append(Resolution(rpc.future, error=timeout))
            emit(self._trace, "RpcResolve", rpc_id=rpc.rpc_id, outcome="timeout")
        self.registry.expire(now)

    def _early_deadline(self, now: float) -> float | None:
        """The deadline of a record an early OUTPUT_READY creates (defect 3's backstop).

        Its COMPUTE_DONE answers a call that is pending now (or already ended): no later
        than the compute deadline of every pending call, and ``compute_timeout`` from
        now.  Once that passes, the COMPUTE_DONE can only be an orphan, so the registry
        gives up on it and releases the output.  None (unbounded) when compute
        deadlines are off.
        """
        ds = [r.deadline for r in self._pending.values()]
        if any(d is None for d in ds):
            return None
        if self._compute_timeout is None:
            # Only calls with their own deadline are pending: their COMPUTE_DONE is due by
            # the last of those; with none pending the record waits without a bound.
            return max((d for d in ds if d is not None), default=None)
        return max([now + self._compute_timeout, *(d for d in ds if d is not None)])

    def next_deadline(self) -> float | None:
        ds = [r.deadline for r in self._pending.values() if r.deadline is not None]
        reg = self.registry.next_deadline()
        if reg is not None:
            ds.append(reg)
        return min(ds) if ds else None

    # ---------------------------------------------------------------- shutdown

    def fail_all(
        self, make_error: Callable[[str | None], OutputError], *, outcome: str = "shutdown", close: bool = False
    ) -> None:
        """Fail every pending RPC and every output (shutdown, pump stop, worker death)."""
        for rpc in list(self._pending.values()):
            del self._pending[rpc.rpc_id]
            self._remember_ended(rpc.rpc_id)
            err = make_error(None)
            # The registry's fail_all below releases every record, the chunks' included.
            for feed in rpc.streams.values():
                feed.announced.clear()
            self._end_streams(rpc, err, None)
            if rpc.future.set_running_or_notify_cancel():
                self._outbox.append(Resolution(rpc.future, error=err))
            emit(self._trace, "RpcResolve", rpc_id=rpc.rpc_id, outcome=outcome)
        self.registry.fail_all(make_error, outcome=outcome, close=close)
        # Nothing more will come from the workers: no call is overdue any more.
        self._overdue.clear()

    def take_resolutions(self) -> list[Settle]:
        out, self._outbox = self._outbox, []
        if self._aborting:
            still: list[Aborting] = []
            for a in self._aborting:
                if any(oid in self.registry for oid in a.output_ids):
                    still.append(a)
                else:
                    out.append(Resolution(a.future, error=a.error))
            self._aborting = still
        out.extend(self.registry.take_resolutions())
        return out

    # ---------------------------------------------------------------- internals

    def _remember_ended(self, rpc_id: str) -> None:
        self._ended[rpc_id] = None
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)
