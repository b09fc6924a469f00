"""``bench/diffusers_serving.py --preset tiny`` runs on the CPU and writes its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_diffusers_benchmark_runs_its_tiny_preset(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "diffusers_serving.py"),
            "--preset",
            "tiny",
            "--requests",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text(encoding="utf-8"))
    paths = {(row["workload"], row["path"]) for row in report["runs"]}
    for workload in ("dit", "wan"):
        assert {(workload, p) for p in ("direct", "engine-sync", "engine-async")} <= paths
    assert ("wan", "engine-decode") in paths  # the VAE decode in the device stage
    batched = {p for w, p in paths if w == "dit" and "batch" in p}
    assert len(batched) == 2, paths  # batch 1 against batch 4, by the engine
    assert all(row["requests_per_s"] > 0 for row in report["runs"])
    for row in report["runs"]:
        if row["path"] in ("engine-sync", "engine-async"):
            assert row["first_request_s"] > 0 and row["steady_request_s"] > 0, row
            assert 0 <= row["device_idle_share"] < 1, row
    assert "req/s" in done.stdout
