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

The dispatcher registers COMPUTE_DONE's ids in the registry *before* it resolves
the RPC future: the engine learns an id only from that future, so every
``wait_output_ready`` finds its record.  Swapping the two would let a waiter
arrive for an id the registry has not seen.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import assert_never

import attrs

from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OutputDropped,
    OutputError,
    ProtocolError,
    RpcFailed,
)
from omni_async.core.messages import AsyncDiffusionOutput, AsyncOutputKind, Failure, RunnerOutput
from omni_async.core.methods import ASYNC_METHODS
from omni_async.core.registry import OutputRegistry, Resolution
from omni_async.core.trace import Tracer, emit

K = AsyncOutputKind


@attrs.define(eq=False)
class PendingRpc:
    rpc_id: str
    method: str
    ranks: frozenset[int]
    reply_rank: int
    future: Future[tuple[RunnerOutput, ...]]
    deadline: float | None
    consumer: str | None
    answers: dict[int, AsyncDiffusionOutput] = attrs.field(factory=dict)


class Dispatcher:
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
        self._outbox: list[Resolution] = []
        self._worker_drops: list[str] = []
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
        self, rpc_id: str, method: str, *, now: float, consumer: str | None = None, timeout: float | None = None
    ) -> Future[tuple[RunnerOutput, ...]]:
        """Register an execute RPC before it is broadcast; its future resolves on COMPUTE_DONE."""
        if method not in ASYNC_METHODS:
            raise ValueError(f"{method!r} does not take the async path")
        if rpc_id in self._pending:
            raise ValueError(f"rpc id {rpc_id!r} is already pending")
        limit = self._compute_timeout if timeout is None else timeout
        fut: Future[tuple[RunnerOutput, ...]] = Future()
        if self.registry.closed:
            # After fail_all(close=True) nothing would ever resolve a new entry: a submit
            # that raced a pump stop (check_health passed just before) fails at once.
            fut.set_exception(ExecutorShutdown(f"rpc {method} ({rpc_id}): the executor shut down"))
            self._remember_ended(rpc_id)
            return fut
        self._pending[rpc_id] = PendingRpc(
            rpc_id,
            method,
            frozenset(range(self.world_size)),
            self.reply_rank,
            fut,
            None if limit is None else now + limit,
            consumer,
        )
        emit(
            self._trace,
            "RpcSubmit",
            rpc_id=rpc_id,
            method=method,
            ranks=",".join(map(str, range(self.world_size))),
            reply_rank=self.reply_rank,
            consumer=consumer,
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
        if rpc.future.set_running_or_notify_cancel():
            self._outbox.append(Resolution(rpc.future, error=error))
        emit(self._trace, "RpcResolve", rpc_id=rpc_id, outcome="unsent")

    # ---------------------------------------------------------------- messages

    def handle(self, msg: AsyncDiffusionOutput, *, now: float) -> AsyncDiffusionOutput | None:
        """Route one message; returns it when it belongs in the synchronous buffer (path 2)."""
        made = self._made(msg)
        emit(
            self._trace,
            "PumpRecv",
            kind=msg.kind.name,
            rank=msg.rank,
            rpc_id=msg.rpc_id,
            ids=",".join(msg.async_output_ids),
            output_id=msg.async_output_id,
            ok=msg.failure is None,
            known=made,
        )
        match msg.kind:
            case K.OUTPUT_READY:
                assert msg.async_output_id is not None
                self.registry.on_output(
                    msg.async_output_id,
                    output=msg.output,
                    failure=msg.failure,
                    rank=msg.rank,
                    early_deadline=self._early_deadline(now),
                )
                return None
            case K.COMPUTE_DONE:
                self._on_compute_done(msg, now, made)
                return None
            case K.RPC_RESULT:
                if msg.names_outputs:
                    # The failure that replaces a COMPUTE_DONE the worker could not send
                    # after handing the outputs to its packer (compute_failed): it
                    # registers the ids it names like a COMPUTE_DONE, then fails the
                    # call, whose end drops them like any failed call's ids (defect 3).
                    self._on_compute_done(msg, now, made)
                    return None
                assert msg.rpc_id is not None
                if not made:
                    # Nobody issued this call: a protocol error (M3), discarded here,
                    # never put in the synchronous buffer.
                    self.counters["unknown_call_rpc_result"] += 1
                    self._protocol_error(f"RPC_RESULT of rpc {msg.rpc_id}, a call never made")
                    return None
                rpc = self._pending.get(msg.rpc_id)
                if rpc is None:
                    return msg  # path 2, or a late answer of a call that ended
                if msg.rank == rpc.reply_rank and msg.failure is None and msg.rank not in rpc.answers:
                    # The reply rank answers an execute call with COMPUTE_DONE or a failure;
                    # a plain answer is a protocol error (M3), counted as it arrives.  The
                    # call fails with a ProtocolError once every rank has answered.
                    self.counters["answers_without_compute_done"] += 1
                    self._protocol_error(f"rpc {rpc.rpc_id}: reply rank {rpc.reply_rank} answered without COMPUTE_DONE")
                self._answer(rpc, msg, now)
                return None
            case _:
                assert_never(msg.kind)

    def _made(self, msg: AsyncDiffusionOutput) -> bool:
        """Whether ``msg`` belongs to a call this executor made (recorded in the trace:
        AsyncOutput's Handle takes a message of a call never made as a faulty peer's).

        An OUTPUT_READY names no call.  A message that names output ids (COMPUTE_DONE,
        or the failure that replaces one) answers an execute call: one pending, or one
        of the last ``_max_ended`` that ended (older ones count as never made).  A plain
        RPC_RESULT: a call pending, or any the executor issued (``known_call``, path 2
        included; without it, every one).
        """
        if msg.kind is K.OUTPUT_READY or msg.rpc_id in self._pending:
            return True
        assert msg.rpc_id is not None
        if msg.kind is K.COMPUTE_DONE or msg.names_outputs:
            return msg.rpc_id in self._ended
        return self._known_call is None or self._known_call(msg.rpc_id)

    def _on_compute_done(self, msg: AsyncDiffusionOutput, now: float, made: bool) -> None:
        assert msg.rpc_id is not None
        rpc = self._pending.get(msg.rpc_id)
        announced = self.registry.on_compute_done(
            msg.async_output_ids,
            now=now,
            rank=msg.rank,
            request_ids=msg.request_ids,
            consumer=None if rpc is None else rpc.consumer,
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
            msg = AsyncDiffusionOutput.rpc_failed(rpc.rpc_id, Failure("ProtocolError", reason), rank=msg.rank)
        self._answer(rpc, msg, now)

    def _answer(self, rpc: PendingRpc, msg: AsyncDiffusionOutput, now: float) -> None:
        if msg.rank in rpc.answers or msg.rank not in rpc.ranks:
            self._protocol_error(f"rpc {rpc.rpc_id}: unexpected or duplicate answer from rank {msg.rank}")
            return
        rpc.answers[msg.rank] = msg
        emit(self._trace, "RpcAnswer", rpc_id=rpc.rpc_id, rank=msg.rank, ok=msg.failure is None)
        if len(rpc.answers) == len(rpc.ranks):
            self._complete(rpc, now)

    def _complete(self, rpc: PendingRpc, now: float) -> None:
        del self._pending[rpc.rpc_id]
        self._remember_ended(rpc.rpc_id)
        reply = rpc.answers[rpc.reply_rank]
        announced = reply.async_output_ids
        failures: dict[int, Failure] = {r: a.failure for r, a in rpc.answers.items() if a.failure is not None}
        error: BaseException | None = None
        if failures:
            error = RpcFailed(rpc.rpc_id, rpc.method, failures)
        elif reply.kind is not K.COMPUTE_DONE:
            # Counted when the answer arrived (handle).
            error = ProtocolError(f"rpc {rpc.rpc_id}: reply rank {rpc.reply_rank} answered without COMPUTE_DONE")
        if error is None and rpc.future.set_running_or_notify_cancel():
            result = tuple(
                RunnerOutput(request_id=rid, finished=True, result=None, async_output_id=oid)
                for rid, oid in zip(reply.request_ids, announced, strict=True)
            )
            self._outbox.append(Resolution(rpc.future, output=result))
            # The engine learns the ids only now: with several ranks the reply rank's
            # COMPUTE_DONE can precede the last answer, so the delivery deadline is
            # measured from here (F4).
            self.registry.rearm_deadlines(announced, now)
            emit(self._trace, "RpcResolve", rpc_id=rpc.rpc_id, outcome="ok")
            return
        # Failed, or the caller cancelled: the announced outputs have no owner (F12).
        self._drop_all(announced, rpc.rpc_id, "failed" if error is not None else "cancelled")
        if error is not None and rpc.future.set_running_or_notify_cancel():
            self._outbox.append(Resolution(rpc.future, error=error))
        emit(self._trace, "RpcResolve", rpc_id=rpc.rpc_id, outcome="failed" if error is not None else "cancelled")

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
            if rpc.future.set_running_or_notify_cancel():
                self._outbox.append(Resolution(rpc.future, error=OutputDropped(f"consumer {consumer!r} went away")))
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
            if rpc.future.set_running_or_notify_cancel():
                self._outbox.append(
                    Resolution(
                        rpc.future,
                        error=ComputeTimeout(
                            f"rpc {rpc.method} ({rpc.rpc_id}): no answer from rank(s) {missing} in time"
                        ),
                    )
                )
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
        if self._compute_timeout is None:
            return None
        ds = [r.deadline for r in self._pending.values()]
        if any(d is None for d in ds):
            return None
        return max([now + self._compute_timeout, *(d for d in ds if d is not None)])

    def _orphan_deadline(self, now: float) -> float | None:
        """When the DROPPING records of a COMPUTE_DONE of an unknown call are given up on:
        ``compute_timeout`` from now (no worker computes for that call), else the
        output deadline (None: kept until its OUTPUT_READY or shutdown)."""
        return None if self._compute_timeout is None else now + self._compute_timeout

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
            if rpc.future.set_running_or_notify_cancel():
                self._outbox.append(Resolution(rpc.future, error=make_error(None)))
            emit(self._trace, "RpcResolve", rpc_id=rpc.rpc_id, outcome=outcome)
        self.registry.fail_all(make_error, outcome=outcome, close=close)

    def take_resolutions(self) -> list[Resolution]:
        out, self._outbox = self._outbox, []
        out.extend(self.registry.take_resolutions())
        return out

    # ---------------------------------------------------------------- internals

    def _drop_all(self, output_ids: Iterable[str], rpc_id: str, reason: str) -> None:
        # rpc_id and reason are for the trace only: why the dispatcher drops these ids.
        for oid in output_ids:
            emit(self._trace, "DispatchDrop", output_id=oid, rpc_id=rpc_id, reason=reason)
            self.registry.drop(oid)
            if oid in self.registry:
                # Still expected from the worker: tell its packer, which can skip it (F15).
                self._worker_drops.append(oid)

    def take_worker_drops(self) -> list[str]:
        """Ids this dispatcher dropped whose output a worker may still be packing."""
        out, self._worker_drops = self._worker_drops, []
        return out

    def _remember_ended(self, rpc_id: str) -> None:
        self._ended[rpc_id] = None
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)

    def _protocol_error(self, reason: str) -> None:
        self.counters["protocol_errors"] += 1
        self.registry.errors.append(ProtocolError(reason))
        emit(self._trace, "ProtocolError", output_id=None, reason=reason)
