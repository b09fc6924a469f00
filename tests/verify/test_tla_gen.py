"""The TLA+ table module and the diagrams are generated from ``omni_async.core.states`` (golden check)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omni_async.core.engine_states import ENGINE_TABLE, ENGINE_TERMINAL, STAGE_TABLE, STAGE_TERMINAL, StageState
from omni_async.core.states import (
    LIFECYCLE_TABLE,
    REQUEST_TABLE,
    REQUEST_TERMINAL,
    LifecycleState,
    RequestEvent,
    RequestState,
)
from omni_async.verify import tla_gen
from omni_async.verify.locate import source_root


def test_checked_in_files_match_the_tables() -> None:
    """Regenerate everything in memory; any difference means someone forgot ``python -m omni_async.verify.tla_gen``."""
    stale = tla_gen.stale_files()
    assert not stale, (
        f"out of date: {[str(p.relative_to(source_root())) for p in stale]}; "
        "run `python -m omni_async.verify.tla_gen` and commit the result"
    )


def test_module_lists_every_transition_once() -> None:
    text = tla_gen.render_request_table_module()
    request_part, lifecycle_part = text.split("LifecycleTransitions ==")
    triple = r'<<"(\w+)", "(\w+)", "(\w+)">>'
    request = re.findall(triple, request_part)
    lifecycle = re.findall(triple, lifecycle_part)
    assert sorted(request) == sorted((s.name, e.name, d.name) for (s, e), d in REQUEST_TABLE.items())
    assert sorted(lifecycle) == sorted((s.name, e.name, d.name) for (s, e), d in LIFECYCLE_TABLE.items())
    assert {s for s, _, _ in request} <= set(RequestState.__members__)
    assert {s for s, _, _ in lifecycle} <= set(LifecycleState.__members__)
    for name in ("RequestTable", "RequestCan", "RequestNext", "RequestTerminal", "RegistryInitial", "LifecycleNext"):
        assert re.search(rf"^{name}\b", text, re.M), name


def test_diagram_has_every_edge_and_terminal() -> None:
    diagram = tla_gen.render_request_diagram()
    labels: dict[tuple[str, str], list[str]] = {}
    for line in diagram.splitlines():
        m = re.match(r"\s+(\w+) --> (\w+): (.+)$", line)
        if m:
            labels[(m[1], m[2])] = m[3].split(" / ")
    for (src, ev), dst in REQUEST_TABLE.items():
        assert ev.name in labels[(src.name, dst.name)], (src, ev, dst)
    assert sum(map(len, labels.values())) == len(REQUEST_TABLE)
    for s in REQUEST_TERMINAL:
        assert f"{s.name} --> [*]" in diagram


def test_matrix_has_a_row_per_state_and_a_column_per_event() -> None:
    rows = tla_gen.render_request_matrix().splitlines()
    assert len(rows) == 2 + len(RequestState)
    assert rows[0].count("|") == 2 + len(RequestEvent)


def test_fill_markers_replaces_bodies_and_requires_every_block(tmp_path: Path) -> None:
    text = "a\n<!-- BEGIN GENERATED x (gen) -->\nold\n<!-- END GENERATED x -->\nb\n"
    assert (
        tla_gen.fill_markers(text, {"x": "new"})
        == "a\n<!-- BEGIN GENERATED x (gen) -->\nnew\n<!-- END GENERATED x -->\nb\n"
    )
    with pytest.raises(ValueError, match="missing"):
        tla_gen.fill_markers(text, {"x": "new", "y": "other"})
    with pytest.raises(ValueError, match="unknown"):
        tla_gen.fill_markers(text, {})


def test_main_writes_then_checks_clean(tmp_path: Path) -> None:
    (tmp_path / "spec").mkdir()
    src = (source_root() / tla_gen.PROTOCOL_PATH).read_text(encoding="utf-8")
    (tmp_path / tla_gen.PROTOCOL_PATH).write_text(src.replace("stateDiagram-v2", "stale"), encoding="utf-8")
    engine_doc = (source_root() / tla_gen.ENGINE_DOC_PATH).read_text(encoding="utf-8")
    (tmp_path / tla_gen.ENGINE_DOC_PATH).write_text(engine_doc, encoding="utf-8")
    assert tla_gen.main(["--root", str(tmp_path), "--check"]) == 1
    assert tla_gen.main(["--root", str(tmp_path)]) == 0
    assert tla_gen.main(["--root", str(tmp_path), "--check"]) == 0
    assert (tmp_path / tla_gen.REQUEST_TABLE_PATH).read_text(encoding="utf-8") == tla_gen.render_request_table_module()


def test_engine_module_lists_every_transition_once() -> None:
    text = tla_gen.render_engine_table_module()
    engine_part, stage_part = text.split("StageStates ==")
    triple = r'<<"(\w+)", "(\w+)", "(\w+)">>'
    assert sorted(re.findall(triple, engine_part)) == sorted(
        (s.name, e.name, d.name) for (s, e), d in ENGINE_TABLE.items()
    )
    assert sorted(re.findall(triple, stage_part)) == sorted(
        (s.name, e.name, d.name) for (s, e), d in STAGE_TABLE.items()
    )
    for name in (
        "EngineTable",
        "EngineCan",
        "EngineNext",
        "EngineTerminal",
        "StageNext",
        "StageCan",
        "StageTerminal",
        "StageInitial",
        "StageEnding",
        "StageOutcomeOf",
    ):
        assert re.search(rf"^{name}\b", text, re.M), name
    for s in (*ENGINE_TERMINAL, *STAGE_TERMINAL):
        assert f'"{s.name}"' in text


def test_engine_diagrams_have_every_edge() -> None:
    for diagram, table in (
        (tla_gen.render_engine_diagram(), ENGINE_TABLE),
        (tla_gen.render_stage_diagram(), STAGE_TABLE),
    ):
        labels: dict[tuple[str, str], list[str]] = {}
        for line in diagram.splitlines():
            m = re.match(r"\s+(\w+) --> (\w+): (.+)$", line)
            if m:
                labels[(m[1], m[2])] = m[3].split(" / ")
        for (src, ev), dst in table.items():
            assert ev.name in labels[(src.name, dst.name)], (src, ev, dst)
        assert sum(map(len, labels.values())) == len(table)
    rows = tla_gen.render_stage_matrix().splitlines()
    assert len(rows) == 2 + len(StageState)


def test_main_writes_the_engine_files(tmp_path: Path) -> None:
    (tmp_path / "spec").mkdir()
    for rel in (tla_gen.PROTOCOL_PATH, tla_gen.ENGINE_DOC_PATH):
        src = (source_root() / rel).read_text(encoding="utf-8")
        (tmp_path / rel).write_text(src.replace("stateDiagram-v2", "stale"), encoding="utf-8")
    assert tla_gen.main(["--root", str(tmp_path), "--check"]) == 1
    assert tla_gen.main(["--root", str(tmp_path)]) == 0
    assert tla_gen.main(["--root", str(tmp_path), "--check"]) == 0
    assert (tmp_path / tla_gen.ENGINE_TABLE_PATH).read_text(encoding="utf-8") == tla_gen.render_engine_table_module()
