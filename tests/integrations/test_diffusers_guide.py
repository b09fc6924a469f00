"""docs/diffusers.md's example ("Serving a diffusers pipeline") runs as written (a fresh interpreter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_MARKER = "<!-- guide: run -->"


def python_blocks(markdown: str) -> list[tuple[str, bool]]:
    """Each python block's body, and whether the run marker precedes it (as tests/cli/test_guide.py reads them)."""
    blocks = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```$", markdown, re.DOTALL | re.MULTILINE):
        if m.group(1) == "python":
            before = markdown[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            blocks.append((m.group(2), before.strip() == RUN_MARKER))
    return blocks


@pytest.mark.slow
def test_the_diffusers_section_runs_as_written(tmp_path: Path) -> None:
    section = (ROOT / "docs" / "diffusers.md").read_text(encoding="utf-8")
    runnable = [body for body, run in python_blocks(section) if run]
    assert len(runnable) == 1 and RUN_MARKER in section
    script = tmp_path / "diffusers_guide.py"
    script.write_text(runnable[0], encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "WanPipelineOutput (1, 5, 16, 16, 3) uint8"
    assert lines[1:3] == ["GenerationChunk 2", "GenerationResult final"]
    assert "request 'bad': parameter 'num_frames' must be 4k + 1" in lines[3] and lines[3].endswith("send 5 or 9")
    assert lines[4:] == [f"d{i} ImagePipelineOutput (1, 3, 16, 16)" for i in range(4)]
