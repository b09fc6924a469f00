"""``bench/serve_load.py --tiny`` runs end to end (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a server and an engine start (~20 s each here); tests/serve/test_serve_api.py covers the server
def test_the_load_bench_smoke_run_serves_every_request(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--tiny", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Strict JSON: a figure nothing was measured for is null, never NaN.
    report = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the report"))
    assert [r["mode"] for r in report["runs"]] == ["http", "http-mp4", "direct", "direct-mp4"]
    assert [(r["requests"], r["failures"]) for r in report["runs"]] == [(24, 0), (2, 0)] * 2, report["runs"]
    assert report["server_exit"] == 0 and report["runs"][0]["health_probes"] > 0
    assert "http_over_direct =" in done.stdout and "--tiny" in report["command"]
