"""Hypothesis stateful test of the sans-IO protocol core: ``OutputRegistry`` + ``Dispatcher``.

One rule per protocol event (the names match ``RequestEvent`` and the spec's actions), an
in-memory model as the oracle, and the spec's invariants as ``@invariant``s.  Rules are
message arrivals at the pump or engine calls into the registry, in any interleaving:
OUTPUT_READY before COMPUTE_DONE, waiters before and after their output, drops, cancels,
timeouts, duplicates, unknown ids, a consumer that goes away, a worker that dies, shutdown,
and execute RPCs over several ranks where any rank may fail (F12).

The model does not read the transition table: it tracks plain facts per output id (which
of its two messages arrived, whether anyone still wants it, its waiter) and derives the
registry state the protocol requires from them, so it checks the table as well as the code.

Every finished run's protocol trace (``ListTracer``) is appended to ``COLLECTED_TRACES``
so the trace-validation tests can replay these runs against the TLA+ spec.

Settings: ``STATEFUL_SETTINGS`` below, on top of the profile ``tests/conftest.py`` loads
(``ci`` when ``CI`` is set: derandomized, no database).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from helpers.hypo import examples
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OutputDropped,
    OutputError,
    OutputOrphaned,
    OutputTimeout,
    RemoteError,
    RpcFailed,
    WorkerDied,
)
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    ComputeDone,
    DiffusionOutput,
    Failure,
    OutputReady,
    RpcResult,
    RunnerOutput,
)
from omni_async.core.registry import OutputRegistry, apply_resolutions
from omni_async.core.states import RequestState
from omni_async.core.trace import TraceEvent
from omni_async.verify.recorder import ListTracer

# Finished traces, for tests/verify/test_trace_validation.py (bounded).
COLLECTED_TRACES: list[list[TraceEvent]] = []
MAX_COLLECTED_TRACES = 500

# About 10 s on one core of the 2-core CI machine; the budget for this file is 30 s.
# The fast tier (pytest -m "not slow") runs a fifth of the examples (helpers.hypo).
STATEFUL_SETTINGS = settings(max_examples=examples(300), stateful_step_count=50)

S = RequestState
Msg = AsyncDiffusionOutput
CONSUMERS = ("c0", "c1")
GHOST_CONSUMER = "c-ghost"
OUTPUT_TIMEOUT = 5.0
COMPUTE_TIMEOUT = 8.0

# Swarm testing (Groce et al., "Swarm Testing", ISSTA 2012): each run switches some of
# these off, so that runs where nothing goes wrong -- and outputs actually get delivered --
# are as common as runs where every kind of trouble competes for the same few steps.
SWARM = (
    "rank_fails",
    "cancel_rpc",
    "output_failed",
    "cancel",
    "timeout",
    "drop",
    "consumer_gone",
    "duplicate",
    "unknown_id",
    "worker_died",
    "shutdown",
)

# What a future is expected to hold.  ("pending",) | ("cancelled",) | ("output", oid, token)
# | ("remote", oid, Failure) | ("error", type, oid | None) | ("ok", ids) | ("rpc_failed", ranks)
# | ("done",)
Expect = tuple[Any, ...]


@attrs.define(eq=False)
class Out:
    """The model of one output id."""

    oid: str
    rpc_id: str
    cd: bool = False  # COMPUTE_DONE arrived at the registry
    out: str | None = None  # "ok" | "fail": the first OUTPUT_READY arrived
    token: str | None = None  # the payload of the first OUTPUT_READY
    failure: Failure | None = None
    fate: str | None = None  # None (wanted) | "dropped" | "abandoned"
    recorded: bool = False  # the registry holds a record for it now
    ended: str | None = None  # how its record ended (delivered | released | dropped | forced)
    waiter: Future[DiffusionOutput] | None = None
    waiter_cancelled: bool = False  # cancelled without telling the registry (F3)
    deadline: float | None = None
    expired: bool = False  # its output deadline passed: a later wait hears OutputTimeout
    given_up: bool = False  # announced by a COMPUTE_DONE of a call never made (M6)
    consumer: str | None = None
    gone: list[Future[None]] = attrs.field(factory=list)


@attrs.define(eq=False)
class Rpc:
    rpc_id: str
    n: int
    consumer: str | None
    future: Future[tuple[RunnerOutput, ...]]
    deadline: float | None
    pending: bool = True
    cancelled: bool = False
    forwarded: bool = False
    ids: list[str] = attrs.field(factory=list)
    # rank -> "ok" | "cd" | "fail" | "shipped" (a failure naming the ids: compute_failed)
    answered: dict[int, str] = attrs.field(factory=dict)


class ProtocolMachine(RuleBasedStateMachine):
    out_pending = Bundle("out_pending")  # ids whose OUTPUT_READY the packer has still to send
    waiters = Bundle("waiters")  # (oid, future) of pending waiters

    def __init__(self) -> None:
        super().__init__()
        self.seq = itertools.count()
        self.now = 0.0
        self.outs: dict[str, Out] = {}
        self.rpcs: dict[str, Rpc] = {}
        self.expect: dict[Future[Any], Expect] = {}
        self.resolved_count: Counter[int] = Counter()
        self.waiter_oid: dict[Future[Any], str] = {}
        self.expected_releases: Counter[str] = Counter()
        self.released: list[str] = []
        self.payloads_sent = 0
        self.delivered = 0
        self.reg_protocol_errors = 0
        self.d_protocol_errors = 0
        self.timeouts = 0
        self.orphaned = 0
        self.orphan_drops_expired = 0
        self.unknown_calls: Counter[str] = Counter()  # messages of a call never made, by kind (M3)
        self.closed = False
        self.tracer = ListTracer()
        self.initialized = False

    # ------------------------------------------------------------------ setup

    @initialize(
        world_size=st.integers(1, 3),
        reply=st.integers(0, 2),
        output_timeout=st.sampled_from([None, OUTPUT_TIMEOUT]),
        compute_timeout=st.sampled_from([None, COMPUTE_TIMEOUT]),
        off=st.sets(st.sampled_from(SWARM)),
    )
    def setup(
        self,
        world_size: int,
        reply: int,
        output_timeout: float | None,
        compute_timeout: float | None,
        off: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        self.off = frozenset(off)
        self.world_size = world_size
        self.reply_rank = reply % world_size
        self.output_timeout = output_timeout
        self.compute_timeout = compute_timeout
        self.registry = OutputRegistry(
            output_timeout=output_timeout,
            release_hook=lambda p: self.released.append(str(p.output)),
            tracer=self.tracer,
        )
        self.d = Dispatcher(
            self.registry,
            world_size=world_size,
            reply_rank=self.reply_rank,
            compute_timeout=compute_timeout,
            tracer=self.tracer,
            known_call=lambda rpc_id: rpc_id in self.rpcs,  # the calls this "executor" issued
        )
        self.initialized = True

    def teardown(self) -> None:
        if self.initialized and len(COLLECTED_TRACES) < MAX_COLLECTED_TRACES:
            COLLECTED_TRACES.append(self.tracer.snapshot())

    # ------------------------------------------------------------------ helpers

    def on(self, rule_name: str) -> bool:
        return self.initialized and rule_name not in self.off

    def track(self, fut: Future[Any], exp: Expect) -> None:
        if fut not in self.expect:
            fut.add_done_callback(lambda f: self.resolved_count.update([id(f)]))
        self.expect[fut] = exp

    def settle(self) -> None:
        """Apply the claimed resolutions, as the pump does after releasing its lock."""
        apply_resolutions(self.d.take_resolutions())

    def release(self, m: Out) -> None:
        if m.out == "ok":
            assert m.token is not None
            self.expected_releases[m.token] += 1

    def end(self, m: Out, how: str) -> None:
        m.recorded = False
        m.ended = how
        m.deadline = None
        m.waiter = None
        m.waiter_cancelled = False
        for g in m.gone:
            self.expect[g] = ("done",)
        m.gone.clear()

    def fail_waiter(self, m: Out, err: type[BaseException]) -> None:
        if m.waiter is not None:
            if not m.waiter_cancelled:
                self.expect[m.waiter] = ("error", err, m.oid)
            m.waiter = None
            m.waiter_cancelled = False

    def settle_record(self, m: Out) -> None:
        """What the registry does after a change: deliver, or end a record nobody wants."""
        if not m.recorded or not m.cd or m.out is None:
            return
        if m.fate is None and m.waiter is not None:
            if m.waiter_cancelled:  # F3: the claim fails, the output is abandoned
                m.waiter = None
                m.waiter_cancelled = False
                m.fate = "abandoned"
                self.release(m)
                self.end(m, "released")
                return
            if m.out == "ok":
                self.expect[m.waiter] = ("output", m.oid, m.token)
                self.delivered += 1
            else:
                self.expect[m.waiter] = ("remote", m.oid, m.failure)
            self.end(m, "delivered")
        elif m.fate is not None:
            self.end(m, "dropped" if m.fate == "dropped" else "released")

    def abandon(self, m: Out) -> None:
        if m.fate is None:
            m.fate = "abandoned"
            self.release(m)
            self.settle_record(m)

    def drop_model(self, m: Out, gone: Future[None] | None = None) -> None:
        if not m.recorded:
            if gone is not None:
                self.track(gone, ("done",))
            return
        self.fail_waiter(m, OutputDropped)
        if m.fate is None:
            self.release(m)
        m.fate = "dropped"
        if gone is not None:
            self.track(gone, ("pending",))
            m.gone.append(gone)
        self.settle_record(m)

    def receive_cd(self, m: Out, consumer: str | None) -> bool:
        """The registry's side of one id of a COMPUTE_DONE; True if it was accepted."""
        if m.recorded:
            if m.cd:
                self.reg_protocol_errors += 1
                return False
        elif m.ended is not None:
            if m.cd:
                self.reg_protocol_errors += 1
            m.cd = True
            return False
        elif self.closed:
            m.cd = True
            return False
        m.recorded = True
        m.cd = True
        m.consumer = consumer
        m.deadline = None if self.output_timeout is None else self.now + self.output_timeout
        self.settle_record(m)
        return True

    def receive_output(self, m: Out, kind: str) -> AsyncDiffusionOutput:
        token = f"{m.oid}#{next(self.seq)}"
        if kind == "ok":
            self.payloads_sent += 1
            msg = OutputReady(m.oid, DiffusionOutput(request_id=f"req-{m.oid}", output=token))
        else:
            failure = Failure("PackError", f"packing {m.oid} failed ({token})", "Traceback ...")
            msg = OutputReady.failed(m.oid, failure)
        duplicate = m.out is not None
        if kind == "ok" and (duplicate or m.ended is not None or self.closed or m.fate is not None):
            self.expected_releases[token] += 1
        if duplicate:
            if m.recorded or m.ended is not None:
                self.reg_protocol_errors += 1
            return msg
        m.out = kind
        m.token = token if kind == "ok" else None
        m.failure = msg.failure
        if m.recorded:
            self.settle_record(m)
        elif m.ended is None and not self.closed:
            m.recorded = True  # early arrival: held until COMPUTE_DONE, or its deadline (defect 3)
            m.deadline = self.early_deadline()
        return msg

    def early_deadline(self) -> float | None:
        """No earlier than every pending call's compute deadline (Dispatcher._early_deadline)."""
        if self.compute_timeout is None:
            return None
        ds = [r.deadline for r in self.rpcs.values() if r.pending]
        assert all(d is not None for d in ds)
        return max([self.now + self.compute_timeout, *(d for d in ds if d is not None)])

    def complete_if_answered(self, rpc: Rpc) -> None:
        if not rpc.pending or len(rpc.answered) < self.world_size:
            return
        rpc.pending = False
        failures = frozenset(r for r, a in rpc.answered.items() if a in ("fail", "shipped"))
        announced = rpc.ids if rpc.answered.get(self.reply_rank) in ("cd", "shipped") else []
        if failures or rpc.cancelled:
            if not rpc.cancelled:
                self.expect[rpc.future] = ("rpc_failed", failures)
            for oid in announced:
                self.drop_model(self.outs[oid])
        else:
            self.expect[rpc.future] = ("ok", tuple(rpc.ids))

    def force_release_all(self, err: type[BaseException], close: bool) -> None:
        for rpc in self.rpcs.values():
            if rpc.pending:
                rpc.pending = False
                if not rpc.cancelled:
                    self.expect[rpc.future] = ("error", err, None)
        for m in self.outs.values():
            if m.recorded:
                self.fail_waiter(m, err)
                if m.fate is None:
                    self.release(m)
                self.end(m, "forced")
        if close:
            self.closed = True

    def handle(self, msg: AsyncDiffusionOutput) -> AsyncDiffusionOutput | None:
        routed = self.d.handle(msg, now=self.now)
        self.settle()
        return routed

    # ------------------------------------------------------------------ RPC rules

    # A few calls in flight at once; more only spreads the steps thin.
    @precondition(lambda self: sum(r.pending for r in self.rpcs.values()) < 3)
    @rule(n=st.integers(1, 3), consumer=st.sampled_from([*CONSUMERS, None]))
    def submit(self, n: int, consumer: str | None) -> None:
        rpc_id = f"rpc{next(self.seq)}"
        fut = self.d.submit(
            rpc_id, "execute_model_batch" if n > 1 else "execute_model", now=self.now, consumer=consumer
        )
        self.settle()
        deadline = None if self.compute_timeout is None else self.now + self.compute_timeout
        rpc = Rpc(rpc_id, n, consumer, fut, deadline)
        self.rpcs[rpc_id] = rpc
        if self.closed:
            rpc.pending = False
            self.track(fut, ("error", ExecutorShutdown, None))
        else:
            self.track(fut, ("pending",))

    def _forwardable(self) -> list[Rpc]:
        return [r for r in self.rpcs.values() if not r.forwarded and self.reply_rank not in r.answered]

    @precondition(lambda self: bool(self._forwardable()))
    @rule(target=out_pending, data=st.data())
    def forward(self, data: st.DataObject) -> MultipleResults[str]:
        """The reply rank's forward finished: it names one output id per request (F6)."""
        rpc = data.draw(st.sampled_from(self._forwardable()))
        rpc.forwarded = True
        rpc.ids = [f"{rpc.rpc_id}-o{i}" for i in range(rpc.n)]
        for oid in rpc.ids:
            self.outs[oid] = Out(oid, rpc.rpc_id)
        return multiple(*rpc.ids)

    def _cd_ready(self) -> list[Rpc]:
        return [r for r in self.rpcs.values() if r.forwarded and self.reply_rank not in r.answered]

    @precondition(lambda self: bool(self._cd_ready()))
    @rule(data=st.data())
    def compute_done(self, data: st.DataObject) -> None:
        rpc = data.draw(st.sampled_from(self._cd_ready()))
        req_ids = tuple(f"req-{i}" for i in rpc.ids)
        self._announce(rpc, ComputeDone(rpc.rpc_id, tuple(rpc.ids), req_ids, rank=self.reply_rank), "cd")

    @precondition(lambda self: self.on("rank_fails") and bool(self._cd_ready()))
    @rule(data=st.data())
    def compute_failed(self, data: st.DataObject) -> None:
        """The reply rank could not send COMPUTE_DONE after handing its outputs to the packer:
        its failure names them (defect 3), so they are registered and dropped with the call."""
        rpc = data.draw(st.sampled_from(self._cd_ready()))
        failure = Failure("ChannelFull", f"cannot send COMPUTE_DONE of {rpc.rpc_id}", "Traceback ...")
        self._announce(
            rpc, RpcResult.compute_failed(rpc.rpc_id, tuple(rpc.ids), failure, rank=self.reply_rank), "shipped"
        )

    def _announce(self, rpc: Rpc, msg: Msg, answer: str) -> None:
        """The reply rank's message naming ``rpc``'s ids (COMPUTE_DONE, or the failure that
        names what it shipped): the model's side of the registration it makes."""
        was_pending = rpc.pending
        consumer = rpc.consumer if was_pending else None
        accepted = [oid for oid in rpc.ids if self.receive_cd(self.outs[oid], consumer)]
        assert self.handle(msg) is None
        if not was_pending:
            rpc.answered[self.reply_rank] = answer
            for oid in accepted:  # an orphan: nobody will claim these ids
                self.drop_model(self.outs[oid])
            return
        if len(accepted) != len(rpc.ids):
            self.d_protocol_errors += 1
            for oid in accepted:
                self.drop_model(self.outs[oid])
            rpc.answered[self.reply_rank] = "fail"
        else:
            rpc.answered[self.reply_rank] = answer
        self.complete_if_answered(rpc)

    def _slots(self, failing: bool) -> list[tuple[str, int]]:
        return [
            (r.rpc_id, rank)
            for r in self.rpcs.values()
            for rank in range(self.world_size)
            if rank not in r.answered and (rank != self.reply_rank or (failing and not r.forwarded))
        ]

    def _answer(self, rpc_id: str, rank: int, ok: bool) -> None:
        rpc = self.rpcs[rpc_id]
        failure = Failure("ValueError", f"rank {rank} failed {rpc_id}", "Traceback ...")
        msg = RpcResult(rpc_id, None, rank=rank) if ok else RpcResult.failed(rpc_id, failure, rank=rank)
        was_pending = rpc.pending
        routed = self.handle(msg)
        rpc.answered[rank] = "ok" if ok else "fail"
        if was_pending:
            assert routed is None
            self.complete_if_answered(rpc)
        else:
            # A late (empty or failed) answer of a call that ended: discarded, never kept
            # in the synchronous buffer, which only collective_rpc reads (defect 15).
            assert routed is None, "a late answer of an ended call is discarded"

    @precondition(lambda self: bool(self._slots(failing=False)))
    @rule(data=st.data())
    def rank_answer(self, data: st.DataObject) -> None:
        """A non-reply rank finished the forward (its copy is not shipped)."""
        rpc_id, rank = data.draw(st.sampled_from(self._slots(failing=False)))
        self._answer(rpc_id, rank, ok=True)

    @precondition(lambda self: self.on("rank_fails") and bool(self._slots(failing=True)))
    @rule(data=st.data())
    def rank_fails(self, data: st.DataObject) -> None:
        """Any rank's forward failed (F12): the call must fail whatever the others said."""
        rpc_id, rank = data.draw(st.sampled_from(self._slots(failing=True)))
        self._answer(rpc_id, rank, ok=False)

    def _cancellable_rpcs(self) -> list[Rpc]:
        return [r for r in self.rpcs.values() if r.pending and not r.cancelled]

    @precondition(lambda self: self.on("cancel_rpc") and bool(self._cancellable_rpcs()))
    @rule(data=st.data())
    def cancel_rpc(self, data: st.DataObject) -> None:
        rpc = data.draw(st.sampled_from(self._cancellable_rpcs()))
        assert rpc.future.cancel()
        rpc.cancelled = True
        self.expect[rpc.future] = ("cancelled",)

    # ------------------------------------------------------------------ output rules

    @rule(oid=consumes(out_pending))
    def output_ready(self, oid: str) -> None:
        self.handle(self.receive_output(self.outs[oid], "ok"))

    @precondition(lambda self: self.on("output_failed"))
    @rule(oid=consumes(out_pending))
    def output_failed(self, oid: str) -> None:
        self.handle(self.receive_output(self.outs[oid], "fail"))

    # ------------------------------------------------------------------ engine rules

    def _claimable(self) -> list[str]:
        """Ids the engine learned from a resolved call and has not waited for yet."""
        return sorted(
            oid
            for r in self.rpcs.values()
            if self.expect.get(r.future, ("",))[0] == "ok"
            for oid in r.ids
            if self.outs[oid].recorded and self.outs[oid].waiter is None
        )

    @precondition(lambda self: bool(self.outs))
    @rule(target=waiters, data=st.data())
    def wait(self, data: st.DataObject) -> MultipleResults[tuple[str, Future[DiffusionOutput]]]:
        # Mostly what an engine does (wait for an id a call returned), sometimes any id at all.
        claimable = self._claimable()
        anything = st.sampled_from(sorted(self.outs))
        oid = data.draw(st.one_of(st.sampled_from(claimable), anything) if claimable else anything)
        fut = self.registry.wait(oid)
        self.settle()
        m = self.outs.get(oid)
        self.waiter_oid[fut] = oid
        if self.closed:
            self.track(fut, ("error", ExecutorShutdown, oid))
        elif m is not None and m.expired:
            self.track(fut, ("error", OutputTimeout, oid))
        elif m is None or not m.recorded:
            self.track(fut, ("error", OutputError, oid))
        elif m.fate is not None:
            self.track(fut, ("error", OutputDropped, oid))
        elif m.waiter is not None:
            assert fut is m.waiter, "a second wait returns the same future"
        else:
            m.waiter = fut
            self.track(fut, ("pending",))
            self.settle_record(m)
            if self.expect[fut] == ("pending",):
                return multiple((oid, fut))
        return multiple()

    @precondition(lambda self: self.on("cancel"))
    @rule(w=consumes(waiters), notify=st.booleans())
    def cancel(self, w: tuple[str, Future[DiffusionOutput]], notify: bool) -> None:
        """The engine cancels a waiter; ``notify=False`` is the F3 race (the registry has not heard yet)."""
        oid, fut = w
        m = self.outs[oid]
        if not fut.cancel():
            assert fut.done() or fut.running()
            return
        self.expect[fut] = ("cancelled",)
        assert m.waiter is fut
        if notify:
            self.registry.cancel(oid, fut)
            self.settle()
            m.waiter = None
            m.waiter_cancelled = False
            self.abandon(m)
        else:
            m.waiter_cancelled = True

    def _deadlines(self) -> list[float]:
        ds = [m.deadline for m in self.outs.values() if m.recorded and m.deadline is not None]
        ds += [r.deadline for r in self.rpcs.values() if r.pending and r.deadline is not None]
        return ds

    @precondition(lambda self: self.on("timeout") and bool(self._deadlines()))
    @rule()
    def timeout(self) -> None:
        """Advance the clock to the next deadline and expire (F4: compute and output deadlines)."""
        assert self.d.next_deadline() == min(self._deadlines())
        self.now = min(self._deadlines())
        self.d.expire(self.now)
        self.settle()
        for rpc in self.rpcs.values():
            if rpc.pending and rpc.deadline is not None and rpc.deadline <= self.now:
                rpc.pending = False
                if not rpc.cancelled:
                    self.expect[rpc.future] = ("error", ComputeTimeout, None)
                if rpc.answered.get(self.reply_rank) in ("cd", "shipped"):
                    for oid in rpc.ids:
                        self.drop_model(self.outs[oid])
        for m in self.outs.values():
            if m.recorded and m.deadline is not None and m.deadline <= self.now:
                m.deadline = None
                if m.given_up and m.fate == "dropped" and m.out is None:
                    # DROPPING for a call never made: force-released; the tombstone expects the output.
                    self.orphan_drops_expired += 1
                    self.end(m, "forced")
                    continue
                if not m.cd:
                    # An early record whose COMPUTE_DONE never came: its call has ended
                    # (defect 3's backstop).  Force-released; the tombstone expects the CD.
                    owner = self.rpcs.get(m.rpc_id)
                    assert owner is None or not owner.pending
                    self.orphaned += 1
                    self.fail_waiter(m, OutputOrphaned)
                    if m.fate is None:
                        self.release(m)
                    self.end(m, "forced")
                    continue
                m.expired = True
                self.timeouts += 1
                self.fail_waiter(m, OutputTimeout)
                self.abandon(m)

    @precondition(lambda self: self.on("drop") and bool(self.outs))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """Drop/abort: valid in every state (F10); the future acknowledges when the id is gone."""
        oid = data.draw(st.sampled_from(sorted(self.outs)))
        gone = self.registry.drop(oid)
        self.settle()
        m = self.outs.get(oid)
        if m is None:
            self.track(gone, ("done",))
        else:
            self.drop_model(m, gone)

    def _consumers(self) -> list[str]:
        return sorted({m.consumer for m in self.outs.values() if m.recorded and m.consumer is not None})

    @precondition(lambda self: self.on("consumer_gone") and bool(self._consumers()))
    @rule(data=st.data())
    def consumer_gone(self, data: st.DataObject) -> None:
        """The consumer's stream vanished without an abort (F11)."""
        consumer = data.draw(st.sampled_from(self._consumers()))
        n = self.registry.release_consumer(consumer)
        self.settle()
        mine = [m for m in self.outs.values() if m.recorded and m.consumer == consumer]
        assert n == len(mine)
        for m in mine:
            self.fail_waiter(m, OutputDropped)
            self.abandon(m)

    def _duplicable(self) -> list[tuple[str, str]]:
        cds = [("cd", r.rpc_id) for r in self.rpcs.values() if r.answered.get(self.reply_rank) in ("cd", "shipped")]
        outs = [("out", m.oid) for m in self.outs.values() if m.out is not None]
        return cds + outs

    @precondition(lambda self: self.on("duplicate") and bool(self._duplicable()))
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        """Re-send a COMPUTE_DONE or an OUTPUT_READY already seen: counted, never raised, never kept."""
        kind, key = data.draw(st.sampled_from(self._duplicable()))
        if kind == "out":
            m = self.outs[key]
            self.handle(self.receive_output(m, data.draw(st.sampled_from(["ok", "fail"]))))
            return
        rpc = self.rpcs[key]
        msg = ComputeDone(rpc.rpc_id, tuple(rpc.ids), tuple(f"req-{i}" for i in rpc.ids), rank=self.reply_rank)
        for oid in rpc.ids:
            m = self.outs[oid]
            if m.recorded or m.ended is not None:
                self.reg_protocol_errors += 1
        if rpc.pending:
            self.d_protocol_errors += 1
        assert self.handle(msg) is None

    @precondition(lambda self: self.on("unknown_id"))
    @rule(
        target=out_pending,
        what=st.sampled_from(["wait", "drop", "cancel", "consumer", "rpc_result", "compute_done"]),
    )
    def unknown_id(self, what: str) -> MultipleResults[str]:
        """Messages and calls for ids never announced: answered, counted or ignored, never raised."""
        ghost = f"ghost{next(self.seq)}"
        if what == "wait":
            fut = self.registry.wait(ghost)
            self.track(fut, ("error", ExecutorShutdown if self.closed else OutputError, ghost))
        elif what == "drop":
            self.track(self.registry.drop(ghost), ("done",))
        elif what == "cancel":
            self.registry.cancel(ghost)
        elif what == "consumer":
            assert self.registry.release_consumer(GHOST_CONSUMER) == 0
        elif what == "rpc_result":
            # An answer of a call nobody made: counted and discarded, not buffered (M3).
            assert self.handle(RpcResult(ghost, "x", rank=0)) is None
            self.d_protocol_errors += 1
            self.unknown_calls["unknown_call_rpc_result"] += 1
        else:
            # A COMPUTE_DONE for a call nobody made: its ids are announced and dropped at once.
            m = Out(f"{ghost}-o0", ghost)
            self.outs[m.oid] = m
            accepted = self.receive_cd(m, None)
            assert self.handle(ComputeDone(ghost, (m.oid,), ("req",))) is None
            self.d_protocol_errors += 1  # a call never made (M3)
            self.unknown_calls["unknown_call_compute_done"] += 1
            if accepted:
                self.drop_model(m)
                if m.recorded:  # DROPPING: given up at a deadline, its output may never come (M6)
                    m.given_up = True
                    if self.compute_timeout is not None:
                        d = self.now + self.compute_timeout
                        m.deadline = d if m.deadline is None else min(m.deadline, d)
            return multiple(m.oid)  # its packer will still send the output
        self.settle()
        return multiple()

    # Shutdown and worker death end most of the interesting behaviour: only after some work.
    @precondition(lambda self: self.on("worker_died") and len(self.rpcs) >= 3)
    @rule()
    def worker_died(self) -> None:
        """A worker process died: everything pending fails, the registry stays open."""
        self.d.fail_all(lambda oid: WorkerDied(1, -9, output_id=oid), outcome="worker_died")
        self.settle()
        self.force_release_all(WorkerDied, close=False)

    @precondition(lambda self: self.on("shutdown") and len(self.rpcs) >= 4)
    @rule()
    def shutdown(self) -> None:
        """Idempotent: every pending waiter and call fails, the registry closes and ends empty (F16)."""
        self.d.fail_all(lambda oid: ExecutorShutdown("the executor shut down", output_id=oid), close=True)
        self.settle()
        self.force_release_all(ExecutorShutdown, close=True)

    # ------------------------------------------------------------------ invariants

    def expected_state(self, m: Out) -> RequestState:
        if m.fate is None:
            if m.cd:
                return {None: S.COMPUTE_DONE, "ok": S.READY, "fail": S.FAILED}[m.out]
            return S.EARLY_READY if m.out == "ok" else S.EARLY_FAILED
        if m.fate == "dropped":
            return S.DROPPING if m.cd else S.DROPPING_EARLY
        return S.RELEASING if m.cd else S.RELEASING_EARLY

    @invariant()
    def registry_matches_model(self) -> None:
        if not self.initialized:
            return
        expected = {m.oid: self.expected_state(m) for m in self.outs.values() if m.recorded}
        actual = {r.output_id: r.state for r in self.registry}
        assert actual == expected
        for rec in self.registry:
            m = self.outs[rec.output_id]
            assert (rec.waiter is m.waiter) and rec.deadline == m.deadline and rec.consumer == m.consumer
        assert Counter(self.released) == self.expected_releases, "every payload released exactly when due"
        assert self.registry.stats.protocol_errors == self.reg_protocol_errors
        assert self.d.counters["protocol_errors"] == self.d_protocol_errors
        for key in ("unknown_call_rpc_result", "unknown_call_compute_done"):
            assert self.d.counters[key] == self.unknown_calls[key], key
        assert self.registry.stats.timeouts == self.timeouts
        assert self.registry.stats.orphaned == self.orphaned
        assert self.registry.stats.orphan_drops_expired == self.orphan_drops_expired
        assert self.registry.stats.delivered == self.delivered
        assert {r for r in self.rpcs if self.rpcs[r].pending} == set(self.d._pending)
        assert self.registry.closed == self.closed
        for fut, exp in self.expect.items():
            check_future(fut, exp)

    @invariant()
    def waiter_resolved_at_most_once_with_its_own_payload(self) -> None:
        assert all(n == 1 for n in self.resolved_count.values())
        for fut, oid in self.waiter_oid.items():
            if fut.done() and not fut.cancelled() and fut.exception(timeout=0) is None:
                out = fut.result(timeout=0)
                assert out.async_output_id == oid and out.request_id == f"req-{oid}"
                assert out.output == self.outs[oid].token

    @invariant()
    def no_record_survives_a_terminal_state(self) -> None:
        if self.initialized:
            assert not any(r.machine.terminal for r in self.registry)

    def quiescent(self) -> bool:
        """Every id got both messages and was claimed, dropped or expired -- or we shut down.

        Read from the protocol facts (messages seen, who wants the output), not from the
        model's idea of which records exist, so the invariants below check that too.
        """
        if self.closed:
            return True

        def settled(m: Out) -> bool:
            if m.ended == "forced" or (not m.cd and m.out is None):
                return True
            return m.cd and m.out is not None and (m.fate is not None or m.ended == "delivered")

        return all(settled(m) for m in self.outs.values())

    @invariant()
    def registry_empty_at_quiescence(self) -> None:
        if self.initialized and self.quiescent():
            assert len(self.registry) == 0
            assert self.registry.held_payloads() == 0 and self.registry.pending_waiters() == 0

    @invariant()
    def payloads_accounted_at_quiescence(self) -> None:
        if self.initialized and self.quiescent():
            assert len(self.released) + self.registry.stats.delivered == self.payloads_sent

    @invariant()
    def failed_rpc_never_resolves_as_success(self) -> None:
        """F12: a call with any failed rank never resolves with a result."""
        for rpc in self.rpcs.values():
            if "fail" in rpc.answered.values() and rpc.future.done() and not rpc.future.cancelled():
                assert rpc.future.exception(timeout=0) is not None


def check_future(fut: Future[Any], exp: Expect) -> None:
    kind = exp[0]
    if kind == "pending":
        assert not fut.done(), f"expected pending, got {fut}"
        return
    if kind == "cancelled":
        assert fut.cancelled()
        return
    assert fut.done() and not fut.cancelled(), f"expected {exp}, got {fut}"
    exc = fut.exception(timeout=0)
    if kind == "done":
        assert exc is None and fut.result(timeout=0) is None
    elif kind == "output":
        assert exc is None, exc
        out = fut.result(timeout=0)
        assert out.async_output_id == exp[1] and out.output == exp[2]
    elif kind == "remote":
        assert isinstance(exc, RemoteError) and exc.output_id == exp[1] and exc.failure == exp[2]
    elif kind == "error":
        err_type, oid = exp[1], exp[2]
        assert type(exc) is err_type, f"expected {err_type.__name__}, got {exc!r}"
        if oid is not None:
            assert isinstance(exc, OutputError) and exc.output_id == oid
    elif kind == "ok":
        assert exc is None, exc
        assert tuple(ro.async_output_id for ro in fut.result(timeout=0)) == exp[1]
    elif kind == "rpc_failed":
        assert isinstance(exc, RpcFailed) and frozenset(exc.failures) == exp[1]
    else:  # pragma: no cover
        raise AssertionError(f"unknown expectation {exp}")


ProtocolMachine.TestCase.settings = STATEFUL_SETTINGS
TestProtocol = ProtocolMachine.TestCase


def run_once_for_traces(seed_steps: Callable[[ProtocolMachine], None] | None = None) -> list[TraceEvent]:
    """Build one machine by hand (for other tests that want a trace without Hypothesis)."""
    m = ProtocolMachine()
    m.setup(world_size=2, reply=0, output_timeout=OUTPUT_TIMEOUT, compute_timeout=COMPUTE_TIMEOUT)
    if seed_steps is not None:
        seed_steps(m)
    m.teardown()
    return m.tracer.snapshot()


def test_traces_are_collected() -> None:
    """The hook the trace-validation tests use: every finished run leaves its trace."""

    def steps(m: ProtocolMachine) -> None:
        m.submit(1, "c0")
        m.shutdown()

    before = len(COLLECTED_TRACES)
    trace = run_once_for_traces(steps)
    assert trace and trace[0].action == "RpcSubmit"
    assert len(COLLECTED_TRACES) == min(before + 1, MAX_COLLECTED_TRACES)
