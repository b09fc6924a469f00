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
            # CogVideoX (precomputed T5-shaped embeddings), sync and async in two alternating
            # rounds (the other workloads run the same functions; DiT's batching, Wan's device
            # decode and PixArt's masks are served in tests/integrations/test_diffusers_*.py).
            "--workloads",
            "cogvideox",
            "--rounds",
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
    runs = report["runs"]
    paths = {(row["workload"], row["path"]) for row in runs}
    assert paths == {("cogvideox", p) for p in ("direct", "engine-sync", "engine-async")}
    # Two rounds, the order reversed in the second: direct, sync, async; async, sync, direct.
    order = [(row["round"], row["path"]) for row in runs]
    assert order == [
        (0, "direct"),
        (0, "engine-sync"),
        (0, "engine-async"),
        (1, "engine-async"),
        (1, "engine-sync"),
        (1, "direct"),
    ], order
    assert all(row["requests_per_s"] > 0 for row in runs)
    for row in runs:
        if row["path"] in ("engine-sync", "engine-async"):
            assert row["first_request_s"] > 0 and row["steady_request_s"] > 0, row
            assert 0 <= row["device_idle_share"] < 1, row
            assert row["bit_for_bit"] is True, row  # every output equal to the direct loop's
            # Where the wall time went: the forwards and the time around them.
            assert row["engine_forward_s"] > 0 and row["lead_s"] >= 0 and row["tail_s"] >= 0, row
    assert "median req/s" in done.stdout
    assert "req/s" in done.stdout
