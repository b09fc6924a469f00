"""A Hypothesis state machine over the whole engine: random interleavings of submit
(plain, failing, with a held forward, a held packing, a short compute deadline, a
stream read to its end, a stream closed after its first item), abort (with and
without wait), cancelled callers (a stream's consumer included), letting time pass
and opening the gates.  The engine runs on its own event loop over InProcessExecutor (real threads,
the real protocol); each rule runs the loop briefly.

Invariants: every request ends in exactly one outcome -- a result, a typed error,
aborted, or cancelled (its caller's, or a stream closed early) -- and the engine's
per-outcome counters agree with what the callers saw; a stream read to its end got
its chunks in order, then its result; the scheduler's limits hold at every step; at quiescence
nothing is held: no request in the engine, no record in the executor's registry,
nothing in a packer.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from helpers.engine_harness import assert_quiescent
from helpers.executor_harness import GATES, RELAXED, gate_name, make_toy, req
from helpers.hypo import examples
from omni_async.core.config import Deadlines
from omni_async.core.errors import ComputeTimeout, OmniAsyncError, RequestAborted, RpcFailed
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EngineOverloaded
from omni_async.engine.metrics import GenerationChunk, GenerationResult
from omni_async.executor.inprocess import InProcessExecutor

KINDS = ("plain", "fails", "held_forward", "held_packing", "deadline", "stream", "stream_close")
CHUNKS = 3


class EngineMachine(RuleBasedStateMachine):
    MAX_RUNNING, MAX_WAITING, MAX_IN_FLIGHT = 2, 4, 3

    def make_engine(self) -> AsyncDiffusionEngine:
        return AsyncDiffusionEngine(
            self.ex, max_running=self.MAX_RUNNING, max_waiting=self.MAX_WAITING, max_in_flight=self.MAX_IN_FLIGHT
        )

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.ex = InProcessExecutor(make_toy, deadlines=RELAXED)
        self.engine = self.make_engine()
        self.loop.run_until_complete(self.engine.start())
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.kinds: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.cancelled: set[str] = set()
        self.gates: list[str] = []
        self.n = 0

    def _spin(self, seconds: float = 0.0) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))

    # -- rules ---------------------------------------------------------------------------

    @rule(kind=st.sampled_from(KINDS))
    def submit(self, kind: str) -> None:
        rid = f"r{self.n}"
        self.n += 1
        params: dict[str, Any] = {}
        deadlines = None
        if kind == "fails":
            params["fail_on"] = [0]
        elif kind in ("held_forward", "deadline"):
            params["gate"] = gate_name()
            self.gates.append(params["gate"])
            if kind == "deadline":
                deadlines = Deadlines(compute_timeout=0.05, output_timeout=60)
        elif kind == "held_packing":
            params["pickle_gate"] = gate_name()
            self.gates.append(params["pickle_gate"])
        if kind.startswith("stream"):
            # The chunks come first, then the forward waits at its gate.
            params.update(chunks=CHUNKS, gate=gate_name())
            self.gates.append(params["gate"])
            self.tasks[rid] = self.loop.create_task(self._stream(rid, params, close=kind == "stream_close"))
        else:
            self.tasks[rid] = self.loop.create_task(self.engine.generate(req(rid, **params), deadlines=deadlines))
        self.kinds[rid] = kind
        self._spin()

    async def _stream(self, rid: str, params: dict[str, Any], *, close: bool) -> Any:
        """Read a stream to its end (its items), or close it after its first item ("closed")."""
        items: list[Any] = []
        it = self.engine.generate_stream(req(rid, **params))
        async with contextlib.aclosing(it):
            async for item in it:
                items.append(item)
                if close:
                    return "closed"
        return items

    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data(), wait=st.booleans())
    def abort(self, data: st.DataObject, wait: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tasks)))
        self.aborted.add(rid)
        aborting = self.loop.create_task(self.engine.abort(rid, wait=wait))
        if wait:
            # It returns once nothing of the request remains: give it a moment (a held
            # gate may keep it), never block the machine on it.
            self.loop.run_until_complete(asyncio.wait([aborting], timeout=0.05))
        else:
            self.loop.run_until_complete(aborting)

    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data())
    def cancel_caller(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tasks)))
        if self.tasks[rid].cancel():
            self.cancelled.add(rid)
        self._spin()

    @rule(ms=st.integers(0, 30))
    def let_time_pass(self, ms: int) -> None:
        self._spin(ms / 1000)

    @precondition(lambda self: bool(self.gates))
    @rule(data=st.data())
    def open_gate(self, data: st.DataObject) -> None:
        GATES.open(data.draw(st.sampled_from(self.gates)))
        self._spin(0.005)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def limits_hold(self) -> None:
        s = self.engine._admission.scheduler
        assert s is not None
        # The queue's bound is beyond the running slots free now (a batch waiting for
        # members keeps its requests queued while slots are free).
        assert s.running <= self.MAX_RUNNING and s.in_flight <= self.MAX_IN_FLIGHT
        assert s.waiting <= self.MAX_WAITING + s.free_slots

    @invariant()
    def every_finished_caller_saw_one_typed_outcome(self) -> None:
        for rid, task in self.tasks.items():
            if not task.done():
                continue
            if task.cancelled():
                assert rid in self.cancelled, f"{rid} cancelled without its caller's cancel"
                continue
            exc = task.exception()
            if exc is None and self.kinds[rid] == "stream_close":
                assert task.result() == "closed", (rid, task.result())
            elif exc is None and self.kinds[rid] == "stream":
                *chunks, result = task.result()
                assert [c.seq for c in chunks if isinstance(c, GenerationChunk)] == list(range(CHUNKS)), chunks
                assert len(chunks) == CHUNKS and isinstance(result, GenerationResult), (rid, task.result())
            elif exc is None:
                assert isinstance(task.result(), GenerationResult)
                assert self.kinds[rid] != "fails", rid  # (a "deadline" request may make it in time)
            else:
                assert isinstance(exc, OmniAsyncError), f"{rid}: untyped {exc!r}"
                if isinstance(exc, RequestAborted):
                    assert rid in self.aborted or self.kinds[rid] == "deadline", (rid, exc)
                elif not isinstance(exc, EngineOverloaded):
                    expected = {"fails": RpcFailed, "deadline": ComputeTimeout}.get(self.kinds[rid])
                    assert expected is not None and isinstance(exc, expected), (rid, self.kinds[rid], exc)
                if isinstance(exc, RequestAborted) and rid not in self.aborted:
                    assert exc.by == "deadline", (rid, exc)

    def teardown(self) -> None:
        try:
            for g in self.gates:
                GATES.open(g)
            pending = [t for t in self.tasks.values() if not t.done()]
            if pending:
                self.loop.run_until_complete(asyncio.wait(pending, timeout=30))
            assert all(t.done() for t in self.tasks.values()), "a request never ended"
            self.loop.run_until_complete(asyncio.wait_for(assert_quiescent(self.engine), 30))
            self.every_finished_caller_saw_one_typed_outcome()
            counts = self.engine.metrics().requests
            # One outcome per request, counted once: the counters add up to the requests.
            assert sum(counts.values()) == len(self.tasks), (counts, len(self.tasks))
            ok = [rid for rid, t in self.tasks.items() if not t.cancelled() and t.exception() is None]
            closed = sum(1 for rid in ok if self.kinds[rid] == "stream_close")
            results = len(ok) - closed
            cancelled = sum(1 for t in self.tasks.values() if t.cancelled())
            # A caller cancelled after its result was decided sees CancelledError, and a
            # stream closed after its result was decided was finished; the engine counts
            # what it decided.
            assert results <= counts["finished"] <= results + cancelled + closed, (counts, results, cancelled)
            assert counts["cancelled"] <= cancelled + closed
            assert self.ex.packers[0].metrics.in_flight_outputs == 0
        finally:
            for g in self.gates:
                GATES.open(g)
            self.loop.run_until_complete(self.engine.close())
            self.ex.shutdown()
            self.loop.close()


# 40 examples in the full run, 8 in the fast tier (pytest -m "not slow"; helpers.hypo).
TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=examples(40),
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class BatchingEngineMachine(EngineMachine):
    """The same machine with batching on (issue 19): compatible requests go to the worker
    in batches of up to three (a stream with streams, a short deadline with its own
    kind), a member's abort, failure, deadline and cancelled caller are its own, and the
    limits count members."""

    MAX_RUNNING, MAX_WAITING, MAX_IN_FLIGHT = 4, 6, 5

    def make_engine(self) -> AsyncDiffusionEngine:
        return AsyncDiffusionEngine(
            self.ex,
            max_running=self.MAX_RUNNING,
            max_waiting=self.MAX_WAITING,
            max_in_flight=self.MAX_IN_FLIGHT,
            max_batch_size=3,
            batch_wait_s=0.03,
            batch_key=lambda r: "k",
        )

    @rule(kinds=st.lists(st.sampled_from(KINDS), min_size=2, max_size=4))
    def submit_together(self, kinds: list[str]) -> None:
        """Several requests in one tick of the loop: they may share a batch."""
        for kind in kinds:
            self.submit(kind)

    @invariant()
    def batches_stay_within_max_batch_size(self) -> None:
        assert self.engine.metrics().batch_size_max <= 3


TestBatchingEngineMachine = BatchingEngineMachine.TestCase
TestBatchingEngineMachine.settings = TestEngineMachine.settings
