"""``bench/encoded_video.py --tiny``: the CI's smoke run of the encoded-video bench (every
mode through the engine, its JSON rows and the command that made them; no timing
assertions: this 2-core machine says nothing about the H200's rates)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 30 s on a loaded 2-core machine (three engines, their encoder processes); the engine tests cover the layer
def test_the_tiny_preset_serves_every_mode_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "video.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    argv = ["--tiny", "--requests", "2", "--warmup", "0", "--encode-workers", "1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "encoded_video.py"), *argv],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["command"].endswith(" ".join(argv))
    rows = {row["mode"]: row for row in report["runs"]}
    assert sorted(rows) == ["omni-mp4", "omni-mp4-parts", "sync-mp4"]
    for mode, row in rows.items():
        assert "mp4" in mode and row["format"] == "mp4" and row["video"] == [16, 64, 96, 3]
        for key in ("requests_per_s", "forward_bound_ratio", "tail_ms_p50", "tail_over_forward_p50"):
            assert math.isfinite(row[key]) and row[key] > 0, (mode, key, row[key])
        assert row["bytes_per_video"] > 0
    assert rows["omni-mp4-parts"]["container"] == "fragmented" and rows["omni-mp4"]["container"] == "plain"
    assert all(mode in done.stdout for mode in rows)  # the table
