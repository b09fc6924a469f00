"""README's two set-up commands are the ones CI runs (a missing install step must fail CI)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```\n(.+?)\n```", text)


def test_readme_has_demo_and_test_commands() -> None:
    cmds = _readme_commands()
    assert any(c.endswith("omni-async demo") for c in cmds), cmds
    assert any(c.endswith("python3 -m pytest") for c in cmds), cmds


def test_ci_runs_readme_test_command_verbatim() -> None:
    test_cmd = next(c for c in _readme_commands() if c.endswith("python3 -m pytest"))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci
    assert any(line.startswith("python3 -m mypy --strict src tests") for line in ci)
