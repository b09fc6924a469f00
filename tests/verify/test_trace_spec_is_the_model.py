"""Trace validation holds real runs to the model-checked spec itself (tla/AsyncOutput.tla).

tla/TraceAsyncOutput.tla instances AsyncOutput and takes one of its steps per recorded
registry or dispatcher call.  So a change to AsyncOutput's executor half must change
what trace validation accepts: we flip a guard of a pump or registry step in a copy of
the spec (AsyncOutput.tla and the modules it extends, AsyncOutput*.tla), point
``OMNI_ASYNC_TLA_DIR`` at the copy, and check that the same real traces that the
unchanged copy accepts are now refused.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.executor_harness import RELAXED, make_toy, req
from helpers.tlc import require_tlc
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import ExecutorShutdown, ProtocolError
from omni_async.core.messages import ComputeDone, DiffusionOutput, OutputReady, RpcResult
from omni_async.core.registry import OutputRegistry, apply_resolutions
from omni_async.core.trace import TraceEvent
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.verify.locate import tla_dir
from omni_async.verify.recorder import ListTracer
from omni_async.verify.tracecheck import check_traces

# (what the mutation breaks, text of the spec's modules, its replacement): each text occurs once.
MUTATIONS = [
    (
        "wait adds a waiter only where one is already",
        '/\\ ~closed /\\ Wanted(i) /\\ rec[i].waiter = "none"',
        '/\\ ~closed /\\ Wanted(i) /\\ rec[i].waiter # "none"',
    ),
    (
        "COMPUTE_DONE accepted only where it is not awaited",
        "    /\\ Create(x).st \\in RequestAwaitingComputeDone\n",
        "    /\\ Create(x).st \\notin RequestAwaitingComputeDone\n",
    ),
    (
        "a call completes on the first answer",
        '\\A q \\in Ranks : ansk[q] # "none"',
        '\\E q \\in Ranks : ansk[q] # "none"',
    ),
    (
        "an early output is orphaned only while its call is pending",
        "rec[i].st \\in RequestAwaitingComputeDone /\\ ~Pending(RpcOf(i))",
        "rec[i].st \\in RequestAwaitingComputeDone /\\ Pending(RpcOf(i))",
    ),
    (
        "an aborted call that finished anyway keeps what it announced",
        "DropsAnnounced(fail, cancelled, aborted) == fail \\/ cancelled \\/ aborted",
        "DropsAnnounced(fail, cancelled, aborted) == fail \\/ cancelled",
    ),
    (
        "an RPC_RESULT of a call never made is no protocol error",
        "IF k = NoCall THEN perr' = TRUE /\\ UNCHANGED <<rec, rpcs, answers>>",
        "IF k = NoCall THEN perr' = perr /\\ UNCHANGED <<rec, rpcs, answers>>",
    ),
    (
        "a DROPPING record of a call never made is abandoned at its deadline, never given up (M6)",
        'ELSE IF x.ghost /\\ x.st = "DROPPING" THEN ExpireGhost(x)',
        "ELSE IF FALSE THEN ExpireGhost(x)",
    ),
]


def _executor_run() -> list[TraceEvent]:
    """A real run of the in-process executor: a batch on two ranks, both outputs waited for."""
    tracer = ListTracer()
    ex = InProcessExecutor(make_toy, world_size=2, deadlines=RELAXED, tracer=tracer)
    try:
        outs = ex.execute_batch([req("q1"), req("q2")])
        for ro in outs:
            assert ro.async_output_id is not None
            ex.wait_output_ready(ro.async_output_id).result(10)
    finally:
        ex.shutdown()
    return tracer.snapshot()


def _orphan_run() -> list[TraceEvent]:
    """A real run of the dispatcher and the registry: an output arrives before a COMPUTE_DONE
    that never comes; its call times out, then the record's own deadline releases it."""
    tracer = ListTracer()
    reg = OutputRegistry(output_timeout=5.0, tracer=tracer)
    disp = Dispatcher(reg, compute_timeout=8.0, tracer=tracer)
    disp.submit("r1", "execute_model", now=0.0)
    disp.handle(OutputReady("o1", DiffusionOutput("q1")), now=1.0)
    for now in (8.0, 9.0):
        disp.expire(now)
    assert reg.stats.orphaned == 1
    disp.fail_all(lambda oid: ExecutorShutdown("shut down", output_id=oid), close=True)
    apply_resolutions(disp.take_resolutions())
    return tracer.snapshot()


def _abort_run() -> list[TraceEvent]:
    """A real run of the dispatcher and the registry: a call aborted (cancel_requests) after
    its forward ended; its COMPUTE_DONE's id is dropped, its output released on arrival."""
    tracer = ListTracer()
    reg = OutputRegistry(output_timeout=5.0, tracer=tracer)
    disp = Dispatcher(reg, compute_timeout=8.0, tracer=tracer)
    fut = disp.submit("r1", "execute_model", now=0.0, request_ids=("q1",))
    disp.cancel(["q1"])
    disp.handle(ComputeDone("r1", ("o1",), ("q1",)), now=1.0)
    disp.handle(OutputReady("o1", DiffusionOutput("q1")), now=2.0)
    apply_resolutions(disp.take_resolutions())
    assert fut.exception(0) is not None and len(reg) == 0
    return tracer.snapshot()


def _unknown_calls_run() -> list[TraceEvent]:
    """A real run of the dispatcher and the registry fed what a broken worker sends (M3, M6):
    an RPC_RESULT of a call nobody made; a COMPUTE_DONE of one, whose DROPPING record is given
    up at its deadline and whose late OUTPUT_READY its tombstone swallows; the reply rank
    answering an execute call without COMPUTE_DONE."""
    tracer = ListTracer()
    reg = OutputRegistry(output_timeout=5.0, tracer=tracer)
    disp = Dispatcher(reg, compute_timeout=8.0, tracer=tracer, known_call=lambda rpc_id: rpc_id == "r1")
    fut = disp.submit("r1", "execute_model", now=0.0)
    assert disp.handle(RpcResult("nobody-1", None), now=1.0) is None
    disp.handle(ComputeDone("nobody-2", ("g1",), ("q0",)), now=1.0)
    disp.handle(RpcResult("r1", None), now=2.0)
    disp.expire(6.5)  # g1's deadline: its output deadline, before now + compute_timeout
    assert reg.stats.orphan_drops_expired == 1 and len(reg) == 0
    disp.handle(OutputReady("g1", DiffusionOutput("q0")), now=7.0)
    apply_resolutions(disp.take_resolutions())
    assert isinstance(fut.exception(0), ProtocolError)
    assert disp.counters["protocol_errors"] == 3 and reg.stats.released == 1
    disp.fail_all(lambda oid: ExecutorShutdown("shut down", output_id=oid), close=True)
    apply_resolutions(disp.take_resolutions())
    return tracer.snapshot()


@pytest.fixture(scope="module")
def real_traces() -> list[list[TraceEvent]]:
    return [_executor_run(), _orphan_run(), _abort_run(), _unknown_calls_run()]


@pytest.fixture
def tla_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    copy = tmp_path / "tla"
    shutil.copytree(tla_dir(), copy)
    monkeypatch.setenv("OMNI_ASYNC_TLA_DIR", str(copy))
    tla_dir.cache_clear()
    try:
        yield copy
    finally:
        monkeypatch.delenv("OMNI_ASYNC_TLA_DIR")
        tla_dir.cache_clear()


@pytest.mark.tlc
def test_the_copy_accepts_the_real_traces(tla_copy: Path, real_traces: list[list[TraceEvent]]) -> None:
    assert tla_dir() == tla_copy
    res = check_traces(real_traces, toolchain=require_tlc())
    assert res.ok, res.summary()


@pytest.mark.tlc
@pytest.mark.parametrize(("name", "text", "mutant"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
@pytest.mark.slow
def test_a_mutated_model_refuses_the_real_traces(
    tla_copy: Path, real_traces: list[list[TraceEvent]], name: str, text: str, mutant: str
) -> None:
    modules = sorted(tla_copy.glob("AsyncOutput*.tla"))
    hits = [m for m in modules for _ in range(m.read_text(encoding="utf-8").count(text))]
    assert len(hits) == 1, f"{name}: the guard to flip is not in the AsyncOutput modules (once)"
    spec = hits[0]
    spec.write_text(spec.read_text(encoding="utf-8").replace(text, mutant), encoding="utf-8")
    res = check_traces(real_traces, toolchain=require_tlc())
    assert not res.ok, f"{name}: trace validation accepted the real traces against the mutated AsyncOutput"
    # Refused as a step that is not the spec's (a deadlock of the replay), not a TLC error.
    assert res.tlc is not None and res.tlc.deadlock, res.summary()
    assert res.failure is not None and res.failure.trace >= 0, res.summary()
    print(f"\n{name}: {res.failure}")
