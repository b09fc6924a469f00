"""Every TLA+ model of tla/ and every buggy variant, against the table in tla/README.md.

A correct model must pass with exactly the recorded number of distinct states (a
regression guard: a spec change that changes the state space must update the
table); a buggy variant must be rejected with the recorded invariant or property.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.tlc import require_tlc
from omni_async.verify.locate import tla_dir
from omni_async.verify.tlc import (
    JAVA_OPTS,
    QUICK_JAVA_OPTS,
    ModelRow,
    cfg_names,
    parse_output,
    read_model_table,
    run_tlc,
    toolchain_problem,
)

ROWS = read_model_table()
# The fast tier (pytest -m "not slow") checks a small correct model (StreamOrder: 10750
# states, safety only, about 5 s; the Live models check liveness and take longer) and the
# buggy variant that CI's self-check runs; the full run checks every row (minutes on 2 cores).
FAST_ROWS = {"AsyncOutputStreamOrder.cfg", "buggy/F12_EarlyRpcResolve.cfg"}
ROW_PARAMS = [pytest.param(r, id=r.cfg, marks=() if r.cfg in FAST_ROWS else pytest.mark.slow) for r in ROWS]


def test_table_covers_every_cfg() -> None:
    cfgs = {str(p.relative_to(tla_dir())) for p in tla_dir().rglob("*.cfg")}
    assert cfgs == {r.cfg for r in ROWS}
    assert FAST_ROWS <= cfgs


def test_buggy_variants_each_name_what_breaks() -> None:
    buggy = [r for r in ROWS if r.cfg.startswith("buggy/")]
    assert len(buggy) >= 6
    for r in buggy:
        assert r.expect != "ok"
        text = (tla_dir() / r.cfg).read_text(encoding="utf-8")
        # What must break is checked by this very cfg (a lone PROPERTY, since TLC
        # does not name a violated temporal property).
        assert r.expect in cfg_names(text, "INVARIANTS") or cfg_names(text, "PROPERTIES") == [r.expect], r


@pytest.mark.tlc
@pytest.mark.timeout(600)  # the largest models took 120-150 s on a loaded 2-core machine
@pytest.mark.parametrize("row", ROW_PARAMS)
def test_model(row: ModelRow) -> None:
    tc = require_tlc()
    # Under pytest-xdist every core already runs a test: one TLC worker thread a model. On two
    # cores, AsyncOutputPipeline.cfg took 62 CPU-s with one worker against 77 with two (the
    # table's count, the fastest alone), so the suite ends sooner; the states are the same.
    workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else row.workers
    res = run_tlc(
        tla_dir() / row.spec, tla_dir() / row.cfg, workers=workers, toolchain=tc, timeout=540, java_opts=row.java_opts
    )
    if row.expect == "ok":
        assert res.ok, "\n".join(res.errors) or res.output[-2000:]
        assert res.distinct_states == row.distinct_states, (
            f"{row.cfg}: {res.distinct_states} distinct states, tla/README.md records {row.distinct_states}"
        )
    else:
        assert not res.ok, f"{row.cfg}: TLC accepted a buggy variant"
        assert res.violation == row.expect, "\n".join(res.errors)
        assert len(res.trace) >= 2, "a counterexample trace"


# ------------------------------------------------------------------ the runner itself (no TLC)

INVARIANT_OUTPUT = """\
TLC2 Version 2.15 of Day Month 20?? (rev: d5b5a7f)
Error: Invariant NoSegmentLeak is violated.
Error: The behavior up to this point is:
State 1: <Initial predicate>
/\\ x = 0
/\\ rec = [ a |-> [ st |-> "NONE",
        seg |-> "none" ] ]

State 2: <PumpRecvOutputReady line 380, col 5 to line 394, col 73 of module AsyncOutput>
/\\ x = 1
/\\ rec = [a |-> [st |-> "NONE", seg |-> "leased"]]

202 states generated, 125 distinct states found, 77 states left on queue.
The depth of the complete state graph search is 6.
"""

TEMPORAL_OUTPUT = """\
Error: Temporal properties were violated.
Error: The following behavior constitutes a counter-example:
State 1: <Initial predicate>
/\\ x = 0

State 2: <EngineSubmitRpc line 414, col 5 to line 418, col 76 of module AsyncOutput>
/\\ x = 1

State 3: Stuttering
2414 states generated, 716 distinct states found, 0 states left on queue.
"""

OK_OUTPUT = """\
Model checking completed. No error has been found.
46286 states generated, 11397 distinct states found, 0 states left on queue.
The depth of the complete state graph search is 20.
"""


def test_parse_invariant_violation_and_trace() -> None:
    res = parse_output(INVARIANT_OUTPUT, cfg_text="INVARIANTS\n TypeOK\n NoSegmentLeak\n")
    assert not res.ok and res.violation == "NoSegmentLeak"
    assert (res.states_generated, res.distinct_states, res.depth) == (202, 125, 6)
    assert [s.action for s in res.trace] == ["Initial predicate", "PumpRecvOutputReady"]
    assert res.trace[1].variables["x"] == "1"
    assert res.trace[0].variables["rec"] == '[ a |-> [ st |-> "NONE", seg |-> "none" ] ]'


def test_parse_temporal_violation_names_a_lone_property() -> None:
    one = parse_output(TEMPORAL_OUTPUT, cfg_text="PROPERTY\n WaitersResolve\n")
    assert one.violation == "WaitersResolve" and one.trace[-1].action == "Stuttering"
    two = parse_output(TEMPORAL_OUTPUT, cfg_text="PROPERTIES\n A\n B\n")
    assert two.temporal_violation and two.violated_property is None and two.violation == "temporal property"


def test_parse_success() -> None:
    res = parse_output(OK_OUTPUT)
    assert res.ok and res.violation is None and res.distinct_states == 11397 and res.trace == ()


def test_cfg_names_reads_sections_and_skips_comments() -> None:
    text = "\\* INVARIANT Nope\nSPECIFICATION Spec\nINVARIANTS\n  A\n  B \\* note\nCONSTRAINT C\nPROPERTY P\n"
    assert cfg_names(text, "INVARIANTS") == ["A", "B"]
    assert cfg_names(text, "PROPERTIES") == ["P"]


def test_missing_jar_skips_on_a_laptop_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TLA2TOOLS_JAR", str(tmp_path / "missing.jar"))
    problem = toolchain_problem()
    assert problem is not None and "tla2tools.jar" in problem
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="tla2tools.jar"):
        require_tlc()
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="tla2tools.jar"):
        require_tlc()


def test_short_runs_take_the_quick_jvm_and_long_ones_the_full_jit() -> None:
    """A buggy variant (it stops at its first violation) and a small model start the JVM
    with the JIT's first tier only (``QUICK_JAVA_OPTS``: a third less start-up); a large
    model keeps the full JIT, which explores faster once warm."""
    by_cfg = {r.cfg: r for r in ROWS}
    assert by_cfg["buggy/F9_LateOutputCached.cfg"].java_opts == QUICK_JAVA_OPTS
    assert by_cfg["AsyncOutputStreamOrder.cfg"].java_opts == QUICK_JAVA_OPTS  # 11,498 states
    assert by_cfg["AsyncOutputStream.cfg"].java_opts == JAVA_OPTS  # 94,572 states
    assert all(r.java_opts == JAVA_OPTS for r in ROWS if r.expect == "ok" and (r.distinct_states or 0) >= 20_000)
