"""Trace validation: TLC confirms that traces recorded by the implementation are behaviours of the spec.

Sources, each checked in one TLC run:

* hand-written traces (the vocabulary of ``omni_async.core.trace``), and corrupted copies
  that must be refused at the right event;
* a few hundred Hypothesis-driven runs of the real ``Dispatcher`` + ``OutputRegistry``
  (tests/_trace_driver.py): early arrival, cancellation (also the F3 claim race),
  drop, failures, timeouts, duplicates, a consumer that leaves, a worker death,
  shutdown;
* runs of the in-process executor (real worker loops, packers and pump threads;
  their traces also hold the worker-side machines), aborted calls, streaming calls
  (CHUNK messages, closed streams, failed chunks and calls, cancels, deadlines) and
  step mode's final-step async;
* runs of ``RayDiffusionExecutor`` on two nodes (actors, the numbered per-rank outbox
  polled one batch at a time; the reply rank on the other node, its outputs through the
  object store): the transport must keep the spec's per-rank FIFO; calls, batches,
  many in flight, a cancelled waiter, a failing forward, aborts (one honoured between
  steps, one ignored), an actor killed mid-forward; skipped without Ray;
* whatever the other test modules collected in this session: the Hypothesis
  stateful runs (tests/core/test_registry_stateful.py) and the multiprocess integration
  tests (tests/_traces.py).  pytest runs this module after them (file order).
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers.executor_harness import on_a_thread
from helpers.executors import executor_class, worker_pids
from helpers.tlc import require_tlc
from helpers.trace_driver import coverage, drive
from omni_async.core.config import Deadlines
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import ComputeTimeout, OmniAsyncError, RequestAborted
from omni_async.core.messages import (
    BatchDiffusionOutput,
    ComputeDone,
    DiffusionOutput,
    DiffusionRequest,
    OutputReady,
    RunnerOutput,
)
from omni_async.core.registry import OutputRegistry, apply_resolutions
from omni_async.core.trace import FieldValue, TraceEvent
from omni_async.executor import RequestHandle
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor
from omni_async.executor.stream import RequestStream
from omni_async.verify.recorder import ListTracer
from omni_async.verify.tracecheck import TraceFormatError, check_traces, encode_traces
from omni_async.worker.cancel import raise_if_cancelled
from omni_async.worker.stream import emit_chunk

HYPOTHESIS_TRACES = 300


def ev(action: str, **fields: FieldValue) -> TraceEvent:
    return TraceEvent(action, fields)


# An output arrives before its COMPUTE_DONE on a two-rank batch; one output is
# delivered, the other fails; shutdown.
EARLY_ARRIVAL: list[TraceEvent] = [
    ev("RpcSubmit", rpc_id="r1", method="execute_model_batch", ranks="0,1", reply_rank=0, consumer=None),
    ev("WorkerFire", output_id="b", event="FORWARD", src="QUEUED", dst="COMPUTING", rank=0),
    ev("WorkerFire", output_id="b", event="COMPUTE_DONE", src="COMPUTING", dst="COMPUTE_DONE", rank=0),
    ev("WorkerFire", output_id="b", event="PACK", src="COMPUTE_DONE", dst="PACKING", rank=0),
    ev("PumpRecv", kind="OUTPUT_READY", rank=0, rpc_id=None, ids="", output_id="b", ok=True),
    ev("Create", output_id="b"),
    ev("Fire", output_id="b", event="OUTPUT_READY", src="COMPUTING", dst="EARLY_READY"),
    ev("WorkerFire", output_id="b", event="OUTPUT_READY", src="PACKING", dst="READY", rank=0),
    ev("PumpRecv", kind="COMPUTE_DONE", rank=0, rpc_id="r1", ids="a,b", output_id=None, ok=True),
    ev("Create", output_id="a"),
    ev("Fire", output_id="a", event="COMPUTE_DONE", src="COMPUTING", dst="COMPUTE_DONE"),
    ev("Fire", output_id="b", event="COMPUTE_DONE", src="EARLY_READY", dst="READY"),
    ev("RpcAnswer", rpc_id="r1", rank=0, ok=True),
    ev("PumpRecv", kind="RPC_RESULT", rank=1, rpc_id="r1", ids="", output_id=None, ok=True),
    ev("RpcAnswer", rpc_id="r1", rank=1, ok=True),
    ev("RpcResolve", rpc_id="r1", outcome="ok"),
    ev("WaiterAdd", output_id="a"),
    ev("WaiterAdd", output_id="b"),
    ev("Fire", output_id="b", event="DELIVER", src="READY", dst="DELIVERED"),
    ev("PayloadDeliver", output_id="b"),
    ev("WaiterResolve", output_id="b", outcome="output"),
    ev("Remove", output_id="b", state="DELIVERED"),
    ev("PumpRecv", kind="OUTPUT_READY", rank=0, rpc_id=None, ids="", output_id="a", ok=False),
    ev("Fire", output_id="a", event="OUTPUT_FAILED", src="COMPUTE_DONE", dst="FAILED"),
    ev("Fire", output_id="a", event="DELIVER", src="FAILED", dst="DELIVERED"),
    ev("WaiterResolve", output_id="a", outcome="failure"),
    ev("Remove", output_id="a", state="DELIVERED"),
    ev("FailAll", outcome="shutdown", close=True),
    ev("Shutdown"),
]

# F12: rank 1 fails after the reply rank's COMPUTE_DONE; the announced id is dropped
# and its output released on arrival.  Then a waiter cancelled before the pump's
# claim (F3): the record is abandoned, the payload released.
FAILED_RANK_AND_CLAIM_RACE: list[TraceEvent] = [
    ev("RpcSubmit", rpc_id="r1", method="execute_model", ranks="0,1", reply_rank=0, consumer=None),
    ev("PumpRecv", kind="COMPUTE_DONE", rank=0, rpc_id="r1", ids="x", output_id=None, ok=True),
    ev("Create", output_id="x"),
    ev("Fire", output_id="x", event="COMPUTE_DONE", src="COMPUTING", dst="COMPUTE_DONE"),
    ev("RpcAnswer", rpc_id="r1", rank=0, ok=True),
    ev("PumpRecv", kind="RPC_RESULT", rank=1, rpc_id="r1", ids="", output_id=None, ok=False),
    ev("RpcAnswer", rpc_id="r1", rank=1, ok=False),
    ev("DispatchDrop", output_id="x", rpc_id="r1", reason="failed"),
    ev("Drop", output_id="x"),
    ev("Fire", output_id="x", event="DROP", src="COMPUTE_DONE", dst="DROPPING"),
    ev("RpcResolve", rpc_id="r1", outcome="failed"),
    ev("PumpRecv", kind="OUTPUT_READY", rank=0, rpc_id=None, ids="", output_id="x", ok=True),
    ev("Fire", output_id="x", event="OUTPUT_READY", src="DROPPING", dst="DROPPED"),
    ev("PayloadRelease", output_id="x"),
    ev("Remove", output_id="x", state="DROPPED"),
    ev("RpcSubmit", rpc_id="r2", method="execute_model", ranks="0,1", reply_rank=0, consumer=None),
    ev("PumpRecv", kind="COMPUTE_DONE", rank=0, rpc_id="r2", ids="y", output_id=None, ok=True),
    ev("Create", output_id="y"),
    ev("Fire", output_id="y", event="COMPUTE_DONE", src="COMPUTING", dst="COMPUTE_DONE"),
    ev("RpcAnswer", rpc_id="r2", rank=0, ok=True),
    ev("PumpRecv", kind="RPC_RESULT", rank=1, rpc_id="r2", ids="", output_id=None, ok=True),
    ev("RpcAnswer", rpc_id="r2", rank=1, ok=True),
    ev("RpcResolve", rpc_id="r2", outcome="ok"),
    ev("WaiterAdd", output_id="y"),
    ev("PumpRecv", kind="OUTPUT_READY", rank=0, rpc_id=None, ids="", output_id="y", ok=True),
    ev("Fire", output_id="y", event="OUTPUT_READY", src="COMPUTE_DONE", dst="READY"),
    ev("WaiterResolve", output_id="y", outcome="cancelled"),
    ev("Fire", output_id="y", event="ABANDON", src="READY", dst="RELEASED"),
    ev("PayloadRelease", output_id="y"),
    ev("Remove", output_id="y", state="RELEASED"),
    ev("FailAll", outcome="shutdown", close=True),
    ev("Shutdown"),
]

# A cancelled waiter and an output deadline abandon the two outputs of a call; a
# worker death (fail_all without closing) force-releases the one still waiting
# for its output, whose late OUTPUT_READY the tombstone then swallows; a repeated
# OUTPUT_READY after that is a protocol error.
WORKER_DEATH_AND_LATE: list[TraceEvent] = [
    ev("RpcSubmit", rpc_id="r1", method="execute_model_batch", ranks="0", reply_rank=0, consumer="c"),
    ev("PumpRecv", kind="COMPUTE_DONE", rank=0, rpc_id="r1", ids="x,y", output_id=None, ok=True),
    ev("Create", output_id="x"),
    ev("Fire", output_id="x", event="COMPUTE_DONE", src="COMPUTING", dst="COMPUTE_DONE"),
    ev("Create", output_id="y"),
    ev("Fire", output_id="y", event="COMPUTE_DONE", src="COMPUTING", dst="COMPUTE_DONE"),
    ev("RpcAnswer", rpc_id="r1", rank=0, ok=True),
    ev("RpcResolve", rpc_id="r1", outcome="ok"),
    ev("WaiterAdd", output_id="x"),
    ev("Cancel", output_id="x"),
    ev("WaiterResolve", output_id="x", outcome="cancelled"),
    ev("Fire", output_id="x", event="ABANDON", src="COMPUTE_DONE", dst="RELEASING"),
    ev("Expire", count=1),
    ev("Fire", output_id="y", event="ABANDON", src="COMPUTE_DONE", dst="RELEASING"),
    ev("PumpRecv", kind="OUTPUT_READY", rank=0, rpc_id=None, ids="", output_id="x", ok=True),
    ev("Fire", output_id="x", event="OUTPUT_READY", src="RELEASING", dst="RELEASED"),
    ev("PayloadRelease", output_id="x"),
    ev("Remove", output_id="x", state="RELEASED"),
    ev("FailAll", outcome="worker_died", close=False),
    ev("Fire", output_id="y", event="FORCE_RELEASE", src="RELEASING", dst="RELEASED"),
    ev("Remove", output_id="y", state="RELEASED"),
    ev("PumpRecv", kind="OUTPUT_READY", rank=0, rpc_id=None, ids="", output_id="y", ok=True),
    ev("Late", output_id="y", kind="out", expected=True),
    ev("PayloadRelease", output_id="y"),
    ev("PumpRecv", kind="OUTPUT_READY", rank=0, rpc_id=None, ids="", output_id="y", ok=True),
    ev("Late", output_id="y", kind="out", expected=False),
    ev("ProtocolError", output_id="y", reason="OUTPUT_READY for an output that already finished"),
    ev("PayloadRelease", output_id="y"),
    ev("FailAll", outcome="shutdown", close=True),
    ev("Shutdown"),
]

# The consumer goes away: its pending call fails, its announced output is
# abandoned; the failed call's late COMPUTE_DONE is an orphan, its id dropped.
CONSUMER_GONE: list[TraceEvent] = [
    ev("RpcSubmit", rpc_id="r1", method="execute_model", ranks="0", reply_rank=0, consumer="c"),
    ev("PumpRecv", kind="COMPUTE_DONE", rank=0, rpc_id="r1", ids="z", output_id=None, ok=True),
    ev("Create", output_id="z"),
    ev("Fire", output_id="z", event="COMPUTE_DONE", src="COMPUTING", dst="COMPUTE_DONE"),
    ev("RpcAnswer", rpc_id="r1", rank=0, ok=True),
    ev("RpcResolve", rpc_id="r1", outcome="ok"),
    ev("RpcSubmit", rpc_id="r2", method="execute_model", ranks="0", reply_rank=0, consumer="c"),
    ev("RpcResolve", rpc_id="r2", outcome="consumer_gone"),
    ev("ReleaseConsumer", consumer="c"),
    ev("Fire", output_id="z", event="ABANDON", src="COMPUTE_DONE", dst="RELEASING"),
    ev("PumpRecv", kind="COMPUTE_DONE", rank=0, rpc_id="r2", ids="w", output_id=None, ok=True),
    ev("Create", output_id="w"),
    ev("Fire", output_id="w", event="COMPUTE_DONE", src="COMPUTING", dst="COMPUTE_DONE"),
    ev("DispatchDrop", output_id="w", rpc_id="r2", reason="orphan"),
    ev("Drop", output_id="w"),
    ev("Fire", output_id="w", event="DROP", src="COMPUTE_DONE", dst="DROPPING"),
    ev("PumpRecv", kind="OUTPUT_READY", rank=0, rpc_id=None, ids="", output_id="z", ok=True),
    ev("Fire", output_id="z", event="OUTPUT_READY", src="RELEASING", dst="RELEASED"),
    ev("PayloadRelease", output_id="z"),
    ev("Remove", output_id="z", state="RELEASED"),
    ev("PumpRecv", kind="OUTPUT_READY", rank=0, rpc_id=None, ids="", output_id="w", ok=True),
    ev("Fire", output_id="w", event="OUTPUT_READY", src="DROPPING", dst="DROPPED"),
    ev("PayloadRelease", output_id="w"),
    ev("Remove", output_id="w", state="DROPPED"),
    ev("FailAll", outcome="shutdown", close=True),
    ev("Shutdown"),
]

HAND_WRITTEN = [EARLY_ARRIVAL, FAILED_RANK_AND_CLAIM_RACE, WORKER_DEATH_AND_LATE, CONSUMER_GONE]


def _replace(trace: Sequence[TraceEvent], n: int, **fields: FieldValue) -> list[TraceEvent]:
    out = list(trace)
    out[n] = TraceEvent(out[n].action, {**out[n].fields, **fields})
    return out


def _without(trace: Sequence[TraceEvent], *drop: int) -> list[TraceEvent]:
    return [e for n, e in enumerate(trace) if n not in drop]


# (name, corrupted trace, index of the event TLC must refuse, None = the end check)
CORRUPTED = [
    # the table has no DELIVER -> DROPPED
    ("illegal transition", _replace(EARLY_ARRIVAL, 18, dst="DROPPED"), 18),
    # a waiter resolved twice
    ("second resolution", [*EARLY_ARRIVAL[:21], EARLY_ARRIVAL[20], *EARLY_ARRIVAL[21:]], 21),
    # F12: the call succeeds although rank 1 failed
    ("success despite a failed rank", _replace(FAILED_RANK_AND_CLAIM_RACE, 10, outcome="ok"), 10),
    # a payload released twice
    (
        "double release",
        [*FAILED_RANK_AND_CLAIM_RACE[:14], FAILED_RANK_AND_CLAIM_RACE[13], *FAILED_RANK_AND_CLAIM_RACE[14:]],
        14,
    ),
    # a terminal record never removed
    ("record left behind", _without(EARLY_ARRIVAL, 26), 26),  # refused when the next call opens
    # --- caught only through the call boundaries, Late and reply_rank:
    # a FORCE_RELEASE outside any fail_all
    ("force release without FailAll", _without(WORKER_DEATH_AND_LATE, 18), 18),
    # a DROP that no drop call made (the dispatcher's drop of the failed call, unrecorded)
    ("drop fire without a Drop call", _without(FAILED_RANK_AND_CLAIM_RACE, 7, 8), 7),
    # the dispatcher drops an id of a call that succeeded
    (
        "dispatcher drop of a successful call",
        _replace(_replace(FAILED_RANK_AND_CLAIM_RACE, 5, ok=True), 6, ok=True),
        7,
    ),
    # a waiter cancelled with no Cancel call (and no claim race): the ABANDON is unjustified
    ("abandon without Cancel", _without(WORKER_DEATH_AND_LATE, 9), 9),
    # an expiry that claims two records but abandons one
    ("expire count mismatch", _replace(WORKER_DEATH_AND_LATE, 12, count=2), 14),
    # a message the tombstone does not expect (both messages arrived), swallowed as expected
    ("unexpected late message claimed expected", _replace(WORKER_DEATH_AND_LATE, 25, expected=True), 25),
    # a late message swallowed without a Late event
    ("late message not reported", _without(WORKER_DEATH_AND_LATE, 22), 22),
    # a fail_all that leaves a record behind
    ("fail_all leaves a record", _without(WORKER_DEATH_AND_LATE, 19, 20), 19),
    # release_consumer abandons a record of another consumer
    ("abandon of another consumer's record", _replace(CONSUMER_GONE, 0, consumer="d"), 9),
    # the COMPUTE_DONE of a rank that is not the call's reply rank answers it well
    ("COMPUTE_DONE from another rank accepted", _replace(EARLY_ARRIVAL, 0, reply_rank=1), 12),
]


# ------------------------------------------------------------------ encoding (no TLC)


def test_encoding_renumbers_ids_per_trace_and_closes_each_trace() -> None:
    enc = encode_traces([EARLY_ARRIVAL, FAILED_RANK_AND_CLAIM_RACE])
    assert "NumIds == 2" in enc.module and "MaxRank == 1" in enc.module
    assert enc.positions[0] == (0, 0)
    assert enc.positions[len(EARLY_ARRIVAL)] == (0, None)
    assert enc.positions[-1] == (1, None)
    assert enc.module.count('[a |-> "End"') == 2
    assert '[a |-> "Create", o |-> 1,' in enc.module  # "b" came first in trace 0


def test_encoding_rejects_unknown_actions_and_missing_fields() -> None:
    with pytest.raises(TraceFormatError, match="unknown trace action"):
        encode_traces([[ev("Teleport", output_id="a")]])
    with pytest.raises(TraceFormatError, match="lacks"):
        encode_traces([[ev("Fire", output_id="a", event="DROP")]])


# ------------------------------------------------------------------ TLC runs


@pytest.mark.tlc
def test_hand_written_traces_are_behaviours() -> None:
    res = check_traces(HAND_WRITTEN, toolchain=require_tlc())
    assert res.ok, res.summary()
    # One state per event, per End, the initial one, and one per step of AsyncOutput that
    # nothing records (the engine cancelling a Future): the replay is deterministic.
    silent = encode_traces(HAND_WRITTEN).silent_steps
    assert silent == 2  # the claim race's waiter, the waiter that Cancel abandons
    assert res.distinct_states == sum(len(t) + 1 for t in HAND_WRITTEN) + 1 + silent


@pytest.mark.tlc
@pytest.mark.parametrize(("name", "trace", "refused"), CORRUPTED, ids=[c[0] for c in CORRUPTED])
@pytest.mark.slow
def test_corrupted_traces_are_refused_at_the_right_event(
    name: str, trace: list[TraceEvent], refused: int | None
) -> None:
    # A good trace first: the failure must point into the second one.
    res = check_traces([EARLY_ARRIVAL, trace], toolchain=require_tlc())
    assert not res.ok and res.failure is not None, name
    assert (res.failure.trace, res.failure.event) == (1, refused), res.summary()


def _hypothesis_traces(n: int) -> list[list[TraceEvent]]:
    traces: list[list[TraceEvent]] = []

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.randoms(use_true_random=True), st.integers(min_value=30, max_value=80))
    def collect(rng: random.Random, steps: int) -> None:
        traces.append(drive(rng, steps))

    collect()
    return traces


@pytest.mark.tlc
@pytest.mark.slow
def test_registry_runs_are_behaviours() -> None:
    tc = require_tlc()
    traces = _hypothesis_traces(HYPOTHESIS_TRACES)
    assert len(traces) >= HYPOTHESIS_TRACES
    cov = coverage(traces)
    for tag in (
        "early arrival",
        "drop",
        "output failure",
        "rpc failure",
        "rpc timeout",
        "waiter output",
        "waiter failure",
        "waiter cancelled",
        "claim race",
        "waiter timeout",
        "waiter dropped",
        "waiter shutdown",
        "duplicate",
        "force release",
        "worker death",
        "late expected",
        "late refused",
        "expire",
        "consumer gone",
        "dispatcher drop orphan",
        "dispatcher drop rejected",
        "dispatcher drop failed",
        "dispatcher drop cancelled",
        "dispatcher drop timeout",
        "dispatcher drop unsent",
        "rpc unsent",
        "compute failed",
        "early output orphaned",
    ):
        assert cov[tag] >= 1, f"no trace shows {tag!r}: {dict(cov)}"
    res = check_traces(traces, toolchain=tc)
    assert res.ok, res.summary()
    print(f"\nregistry runs: {res.summary()}; coverage {dict(cov)}")


class _ToyModel:
    """A worker model: outputs are small plain values; a request may fail on a rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        if request.params.get("fail_rank") == self.rank:
            raise RuntimeError(f"forward failed on rank {self.rank}")
        return DiffusionOutput(request.request_id, output={"pixels": [self.rank, 1, 2]})

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self.execute_model(r) for r in requests))


def _in_process_run(rng: random.Random) -> list[TraceEvent]:
    tracer = ListTracer()
    ex = InProcessExecutor(
        _ToyModel, world_size=rng.choice([1, 2]), deadlines=Deadlines(30.0, 30.0, 30.0), tracer=tracer
    )
    try:
        # Some calls in the seed's shape (execute_batch, on a thread so that several are in
        # flight, then wait_output_ready by id), the others through handles.
        calls: list[Future[list[RunnerOutput]] | list[RequestHandle]] = []
        for n in range(rng.randint(1, 4)):
            reqs = [
                DiffusionRequest(f"q{n}-{k}", {"fail_rank": 1} if rng.random() < 0.15 else {})
                for k in range(rng.randint(1, 3))
            ]
            if rng.random() < 0.5:
                calls.append(ex.submit_batch(reqs))
            else:
                calls.append(on_a_thread(functools.partial(ex.execute_batch, reqs)))
        waits: list[Future[DiffusionOutput]] = []
        for call in calls:
            if isinstance(call, list):
                for h in call:
                    c = rng.random()
                    if c < 0.15 and h.computed.exception(10) is None:
                        h.drop()
                        continue
                    if c < 0.3:
                        h.output.cancel()
                    waits.append(h.output)
                continue
            try:
                outs = call.result(10)
            except Exception:
                continue
            for ro in outs:
                assert ro.async_output_id is not None
                c = rng.random()
                if c < 0.15:
                    ex.drop_output(ro.async_output_id)
                    continue
                w = ex.wait_output_ready(ro.async_output_id)
                if c < 0.3:
                    w.cancel()
                waits.append(w)
        for w in waits:
            if not w.cancelled():
                try:
                    w.result(10)
                except Exception:
                    pass
    finally:
        ex.shutdown()
    return tracer.snapshot()


@pytest.mark.tlc
@pytest.mark.slow
def test_in_process_executor_runs_are_behaviours() -> None:
    tc = require_tlc()
    t0 = time.monotonic()
    traces = [_in_process_run(random.Random(seed)) for seed in range(30)]
    assert any(e.action == "WorkerFire" for t in traces for e in t)
    res = check_traces(traces, toolchain=tc)
    assert res.ok, res.summary()
    print(f"\nin-process executor runs ({time.monotonic() - t0:.1f}s with the runs): {res.summary()}")


class _StepModel:
    """A worker model with denoising steps of 10 ms that honours cancellation between them."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        for _ in range(int(request.params.get("steps", 1))):
            raise_if_cancelled()
            time.sleep(0.01)
        return DiffusionOutput(request.request_id, output={"pixels": [self.rank, 7]})

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self.execute_model(r) for r in requests))


def _abort_runs() -> list[list[TraceEvent]]:
    """Recorded runs of every way a call in flight is aborted (cancel_requests, a compute deadline)."""

    def rq(rid: str, steps: int) -> DiffusionRequest:
        return DiffusionRequest(rid, {"steps": steps})

    def consume(ex: InProcessExecutor, ro: RunnerOutput) -> None:
        assert ro.async_output_id is not None
        ex.wait_output_ready(ro.async_output_id).result(10)

    traces: list[list[TraceEvent]] = []
    for world in (1, 2):
        tracer = ListTracer()
        ex = InProcessExecutor(_StepModel, world_size=world, deadlines=Deadlines(30.0, 30.0, 30.0), tracer=tracer)
        try:
            # Stopped while computing.
            running = ex.submit(rq("run", 300)).computed
            time.sleep(0.1)
            ex.cancel_requests(["run"])
            assert isinstance(running.exception(10), RequestAborted)
            # Never started: cancelled while queued behind another call.
            first = ex.submit(rq("first", 300)).computed
            queued = ex.submit(rq("queued", 1)).computed
            time.sleep(0.05)
            ex.cancel_requests(["queued"])
            ex.cancel_requests(["first"])
            assert isinstance(first.exception(10), RequestAborted)
            assert isinstance(queued.exception(10), RequestAborted)
            # One request of a batch: the rest goes on, its output is dropped.
            b1, b2 = ex.submit_batch([rq("b1", 30), rq("b2", 1)])
            time.sleep(0.05)
            ex.cancel_requests(["b1"])
            assert isinstance(b1.computed.exception(10), RequestAborted)
            assert isinstance(b1.output.exception(10), RequestAborted)
            b2.output.result(10)
            # A compute deadline cancels the forward; the late answer is an orphan.
            late = ex.submit(rq("late", 300), deadlines=Deadlines(compute_timeout=0.1)).computed
            assert isinstance(late.exception(10), ComputeTimeout)
            deadline = time.monotonic() + 10
            while ex.metrics().overdue_calls and time.monotonic() < deadline:
                time.sleep(0.01)
            consume(ex, ex.execute_request(rq("after", 1)))
        finally:
            ex.shutdown()
        traces.append(tracer.snapshot())
    # The forward finished before the cancel reached the worker (sans-IO: the order is ours).
    tracer = ListTracer()
    registry = OutputRegistry(output_timeout=30.0, tracer=tracer)
    disp = Dispatcher(registry, compute_timeout=30.0, tracer=tracer)
    fut = disp.submit("c1", "execute_model", now=0.0, request_ids=("a",))
    assert disp.cancel(["a"]) == 1
    disp.handle(ComputeDone("c1", ("o1",), ("a",)), now=0.1)
    disp.handle(OutputReady("o1", DiffusionOutput("a", "x")), now=0.2)
    apply_resolutions(disp.take_resolutions())
    assert isinstance(fut.exception(0), RequestAborted) and len(registry) == 0
    traces.append(tracer.snapshot())
    return traces


@pytest.mark.tlc
@pytest.mark.slow
def test_aborted_calls_are_behaviours() -> None:
    tc = require_tlc()
    traces = _abort_runs()
    actions = {e.action for t in traces for e in t}
    outcomes = {e.fields.get("outcome") for t in traces for e in t if e.action == "RpcResolve"}
    assert "RpcCancel" in actions and {"aborted", "timeout", "ok"} <= outcomes, (actions, outcomes)
    res = check_traces(traces, toolchain=tc)
    assert res.ok, res.summary()
    print(f"\naborted calls: {res.summary()}")


class _StreamModel:
    """Denoising steps of 10 ms, a chunk after each (``emit_chunk``), cancellation honoured;
    ``bad_chunk``: the chunks cannot travel (a lambda: the put fails, the chunk fails
    typed); ``raise_at``: the forward raises after that step; ``intermediate``: a step of
    step mode that returns no output; ``ignore_cancel``: no cancellation checks."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput | None:
        p = request.params
        for step in range(int(p.get("steps", 1))):
            if not p.get("ignore_cancel"):
                raise_if_cancelled()
            time.sleep(0.01)
            emit_chunk(request.request_id, {"step": step, "bad": (lambda: None) if p.get("bad_chunk") else None})
            if p.get("raise_at") == step:
                raise RuntimeError(f"forward failed at step {step}")
        if p.get("intermediate"):
            return None
        return DiffusionOutput(request.request_id, output={"pixels": [self.rank, 9]})


def _stream_runs() -> list[list[TraceEvent]]:
    """Recorded runs of streaming calls, every way a stream ends, and step mode's final-step async."""

    def rq(rid: str, steps: int, **params: object) -> DiffusionRequest:
        return DiffusionRequest(rid, {"steps": steps, **params})

    def streamed(
        ex: InProcessExecutor,
        request: DiffusionRequest,
        *,
        consumer: str | None = None,
        deadlines: Deadlines | None = None,
    ) -> tuple[RequestHandle, RequestStream]:
        h = ex.submit(request, consumer=consumer, deadlines=deadlines, stream=True)
        assert h.stream is not None
        return h, h.stream

    def finish(h: RequestHandle) -> None:
        """The final output, claimed for the handle at COMPUTE_DONE (if the call got there)."""
        if h.computed.exception(10) is None:
            h.output.result(10)

    traces: list[list[TraceEvent]] = []
    for world in (1, 2):
        tracer = ListTracer()
        ex = InProcessExecutor(_StreamModel, world_size=world, deadlines=Deadlines(30.0, 30.0, 30.0), tracer=tracer)
        try:
            # Every chunk taken, in order, then the final output.
            h, s = streamed(ex, rq("all", 3))
            assert [c.output["step"] for c in s] == [0, 1, 2]
            finish(h)
            # Closed after the first chunk: the rest dropped, the call goes on.
            h, s = streamed(ex, rq("closed", 6))
            first = s.next_chunk(10)
            assert first is not None
            first.output.result(10)
            time.sleep(0.05)  # more chunks announced meanwhile, not taken
            s.close().result(10)
            finish(h)
            # A chunk that cannot travel fails typed, and ends the iteration.
            h, s = streamed(ex, rq("bad", 2, bad_chunk=True))
            with pytest.raises(OmniAsyncError):
                list(s)
            finish(h)
            # The forward fails after a chunk: the stream ends with the call's error.  The
            # call's failure is awaited first, so its chunk is still untaken when the failure
            # arrives and is dropped as "failed" (taking it first raced the failure: CI once
            # saw no "failed" drop).
            h, s = streamed(ex, rq("fails", 3, raise_at=1))
            with pytest.raises(OmniAsyncError):
                s.result.result(10)
            with pytest.raises(OmniAsyncError):
                list(s)
            # Aborted mid-stream (cancel_requests).
            h, s = streamed(ex, rq("abort", 300))
            assert s.next_chunk(10) is not None
            time.sleep(0.05)  # chunks announced and not taken: dropped when the call ends
            ex.cancel_requests(["abort"])
            assert isinstance(s.result.exception(10), RequestAborted)
            # The call's future cancelled mid-stream: later chunks dropped on arrival.
            h, s = streamed(ex, rq("cancel", 8))
            assert s.next_chunk(10) is not None
            s.result.cancel()
            time.sleep(0.15)
            # The consumer goes away mid-stream: the call fails, its later chunks are orphans.
            h, s = streamed(ex, rq("gone", 8), consumer="leaving")
            assert s.next_chunk(10) is not None
            ex.release_consumer("leaving")
            time.sleep(0.15)
            # A compute deadline ends the call (what it announced is dropped).
            h, s = streamed(ex, rq("late", 20, ignore_cancel=True), deadlines=Deadlines(compute_timeout=0.1))
            with pytest.raises(ComputeTimeout):
                s.result.result(10)
            deadline = time.monotonic() + 10
            while ex.metrics().overdue_calls and time.monotonic() < deadline:
                time.sleep(0.01)
            finish(streamed(ex, rq("after", 1))[0])
        finally:
            ex.shutdown()
        traces.append(tracer.snapshot())
    # Step mode, final-step async: intermediate steps answered plainly, the final one in two phases.
    tracer = ListTracer()
    ex = InProcessExecutor(
        _StreamModel,
        world_size=2,
        step_mode=True,
        final_step_async=True,
        deadlines=Deadlines(30.0, 30.0, 30.0),
        tracer=tracer,
    )
    try:
        assert not ex.execute_request(rq("s", 1, intermediate=True)).finished
        ro = ex.execute_request(rq("s", 1))
        assert ro.async_output_id is not None
        ex.wait_output_ready(ro.async_output_id).result(10)
    finally:
        ex.shutdown()
    traces.append(tracer.snapshot())
    return traces


@pytest.mark.tlc
@pytest.mark.slow
def test_streaming_and_step_calls_are_behaviours() -> None:
    tc = require_tlc()
    traces = _stream_runs()
    kinds = {e.fields.get("kind") for t in traces for e in t if e.action == "PumpRecv"}
    reasons = {e.fields.get("reason") for t in traces for e in t if e.action == "DispatchDrop"}
    actions = {e.action for t in traces for e in t}
    assert "CHUNK" in kinds and "StreamClose" in actions, (kinds, actions)
    assert {"closed", "failed", "aborted", "cancelled", "orphan"} <= reasons, reasons
    res = check_traces(traces, toolchain=tc)
    assert res.ok, res.summary()
    print(f"\nstreaming and step calls: {res.summary()}")


def _ray_runs(ray_executor: type[MultiprocDiffusionExecutor]) -> list[list[TraceEvent]]:
    """Two recorded RayDiffusionExecutor runs on the session's two-node cluster, the reply
    rank on the other node (outputs through the object store; tests/helpers/executors.py),
    see the module docstring."""
    import os
    import signal

    from omni_async.core.errors import RpcFailed, WorkerDied
    from omni_async.executor.multiproc import WorkerSpec

    deadlines = Deadlines(compute_timeout=30, output_timeout=30, rpc_timeout=30, cancel_grace=0.5)

    def rq(rid: str, **params: object) -> DiffusionRequest:
        return DiffusionRequest(rid, params)

    def consume(ex: MultiprocDiffusionExecutor, ro: RunnerOutput) -> None:
        assert ro.async_output_id is not None
        out = ex.wait_output_ready(ro.async_output_id).result(30)
        ex.release_output(out)

    traces: list[list[TraceEvent]] = []
    tracer = ListTracer()
    spec = WorkerSpec("helpers.mp_workers:ScriptedWorker", pass_rank=True)
    ex = ray_executor(spec, world_size=2, deadlines=deadlines, tracer=tracer)
    try:
        consume(ex, ex.execute_request(rq("one", numel=1 << 17)))
        for ro in ex.execute_batch([rq(f"b{i}", numel=1 << 12, seed=i) for i in range(3)]):
            consume(ex, ro)
        handles = [ex.submit(rq(f"m{i}", numel=1 << 16, seed=i)) for i in range(12)]
        for i, h in enumerate(handles):
            if i % 4 == 0:  # a consumer that leaves: the output is abandoned
                h.computed.result(30)
                if not h.output.cancel():  # delivered already: the engine's to release
                    ex.release_output(h.output.result(30))
            else:
                ex.release_output(h.output.result(30))
        with pytest.raises(RpcFailed, match="RuntimeError"):
            ex.execute_request(rq("boom", **{"raise": True}))
        ignored = ex.submit(rq("ignored", sleep=1.0)).computed  # no cancellation checks: a late answer
        time.sleep(0.2)
        ex.cancel_requests(["ignored"])
        assert isinstance(ignored.exception(30), RequestAborted)
        consume(ex, ex.execute_request(rq("after", numel=1 << 12)))
    finally:
        ex.shutdown()
    traces.append(tracer.snapshot())

    tracer = ListTracer()
    tiny = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 64, "steps": 2})
    ex = ray_executor(tiny, deadlines=deadlines, tracer=tracer)
    try:
        stopped = ex.submit(rq("stopped", height=64, steps=200, step_ms=20)).computed
        time.sleep(0.3)
        ex.cancel_requests(["stopped"])
        assert isinstance(stopped.exception(30), RequestAborted)
        consume(ex, ex.execute_request(rq("ok", height=64)))
        done = ex.execute_request(rq("unclaimed", height=64))
        doomed = ex.submit(rq("doomed", height=64, steps=200, step_ms=20)).computed
        time.sleep(0.3)
        os.kill(worker_pids(ex)[0], signal.SIGKILL)
        assert isinstance(doomed.exception(30), WorkerDied)
        assert done.async_output_id is not None
        assert isinstance(ex.wait_output_ready(done.async_output_id).exception(30), WorkerDied)
    finally:
        ex.shutdown()
    traces.append(tracer.snapshot())
    return traces


@pytest.mark.tlc
@pytest.mark.slow
def test_ray_executor_runs_are_behaviours(request: pytest.FixtureRequest) -> None:
    tc = require_tlc()
    ray_executor = executor_class("ray", request)  # skips where Ray is not installed
    t0 = time.monotonic()
    traces = _ray_runs(ray_executor)
    runs_s = time.monotonic() - t0
    outcomes = {e.fields.get("outcome") for t in traces for e in t if e.action in ("RpcResolve", "FailAll")}
    assert {"ok", "failed", "aborted", "worker_died"} <= outcomes, outcomes
    res = check_traces(traces, toolchain=tc)
    assert res.ok, res.summary()
    print(f"\nRay executor runs ({runs_s:.1f} s of runs): {res.summary()}")


def _collected() -> dict[str, list[list[TraceEvent]]]:
    import sys

    import helpers.traces as _traces

    found = {name: list(ts) for name, ts in _traces.COLLECTED.items() if ts}
    # Collected in this session only if pytest imported it (tests/core is then on sys.path):
    # importing it here fails when tests/core was not collected.
    stateful = sys.modules.get("test_registry_stateful")
    if stateful is not None and stateful.COLLECTED_TRACES:
        found["stateful"] = list(stateful.COLLECTED_TRACES)
    return found


@pytest.mark.tlc
@pytest.mark.slow
def test_traces_collected_by_other_tests_are_behaviours() -> None:
    tc = require_tlc()
    collected = _collected()
    if not collected:
        # On a laptop, a lone run of this file has nothing to check; in CI (the whole
        # suite, this test last in the collection: tests/conftest.py) it must have.
        if os.environ.get("CI"):
            pytest.fail("no other test recorded traces before this one in this session (or xdist worker)")
        pytest.skip("no other test module recorded traces in this session (run the whole suite)")
    for source, traces in sorted(collected.items()):
        res = check_traces(traces, toolchain=tc)
        assert res.ok, f"{source}: {res.summary()}"
        print(f"\n{source}: {res.summary()}")
