"""spec/FAILURES.md stays true: a row per failure mode and per defect, and every test it
cites exists (so a renamed or deleted test cannot leave a row proving nothing)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "spec" / "FAILURES.md"


def _rows() -> dict[str, str]:
    """The first cell of every table row -> the row."""
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| (\w+) \|.*$", TABLE.read_text(encoding="utf-8"), re.M)}


def cited_tests(text: str) -> list[tuple[str, str]]:
    """(test file under tests/, test name) for every `file.py::test` and every `::test` after one."""
    found, current = [], None
    for span in re.findall(r"`([^`\n]+)`", text):
        m = re.match(r"^(?:([\w/]+\.py))?(?:::(\w+))?", span)
        if m is None or not (m.group(1) or m.group(2)):
            continue
        if m.group(1):
            current = m.group(1)
        if m.group(2) and current is not None:
            found.append((current, m.group(2)))
    return found


def test_the_parser_carries_the_file_to_the_next_test() -> None:
    text = "`a/test_x.py::test_one`, `::test_two[case]`; `b/test_y.py` and `::test_three`; `plain`"
    assert cited_tests(text) == [
        ("a/test_x.py", "test_one"),
        ("a/test_x.py", "test_two"),
        ("b/test_y.py", "test_three"),
    ]


def test_one_row_per_failure_mode_and_per_defect() -> None:
    rows = _rows()
    expected = [f"F{i}" for i in range(1, 17)] + ["1", "2", "3", "4", "5", "6a", "6b", "6c", "6d", "7", "8"]
    assert [r for r in expected if r not in rows] == []
    for name in expected:
        assert "`" in rows[name] or "pending merge" in rows[name], f"row {name} cites no test"


def test_every_cited_test_exists() -> None:
    cited = cited_tests(TABLE.read_text(encoding="utf-8"))
    assert len(cited) > 80
    missing = []
    for path, name in cited:
        source = ROOT / "tests" / path
        if not source.exists() or not re.search(rf"^(?:async )?def {name}\(", source.read_text(encoding="utf-8"), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"spec/FAILURES.md cites tests that do not exist: {missing}"
