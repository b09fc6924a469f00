"""``bench/diffusers_serving.py --preset tiny`` runs on the CPU and writes its figures."""

from __future__ import annotations

import importlib.util
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
            # CogVideoX (precomputed T5-shaped embeddings), sync and async, and async again with
            # its worker pinned to one CPU, in one round (the order of later rounds: below;
            # the other workloads run the same functions; DiT's batching, Wan's device decode
            # and PixArt's masks are served in tests/integrations/test_diffusers_*.py).
            "--workloads",
            "cogvideox",
            "--rounds",
            "1",
            "--cpu-affinity",
            str(min(os.sched_getaffinity(0))),
            # And the direct loop again in a process of its own.
            "--fresh-direct",
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
    assert report["complete"] is True
    engine_paths = ("engine-sync", "engine-async", "engine-async-pinned")
    order = [(row["round"], row["path"]) for row in runs]
    assert order == [(0, p) for p in ("direct", "direct-fresh", *engine_paths)], order
    assert all(row["workload"] == "cogvideox" and row["requests_per_s"] > 0 for row in runs)
    allowed = {str(c) for c in os.sched_getaffinity(0)}
    for row in runs:
        # Where the launching thread ran: CPUs of this machine; the pinned workers' on theirs.
        assert row["launching_cpus"] and set(row["launching_cpus"]) <= allowed, row
        if row["path"].endswith("-pinned"):
            assert set(row["launching_cpus"]) == {str(min(os.sched_getaffinity(0)))}, row
        if row["path"].startswith("direct"):
            assert row["host_call_s"] > 0, row
            if row["path"] == "direct-fresh":  # its outputs, made in its own process, by digest
                assert row["bit_for_bit"] is True, row
            continue
        assert row["first_request_s"] > 0 and row["steady_request_s"] > 0, row
        assert 0 <= row["device_idle_share"] < 1, row
        assert row["bit_for_bit"] is True, row  # every output equal to the direct loop's
        # Where the wall time went: the forwards and the time around them, and the lone
        # request's forward and pack.
        assert row["engine_forward_s"] > 0 and row["lead_s"] >= 0 and row["tail_s"] >= 0, row
        assert len(row["engine_forwards_s"]) == 2 and row["engine_device_behind_s"] >= 0, row
        assert 0 < row["steady_forward_s"] <= row["steady_request_s"], row
        assert 0 <= row["steady_pack_s"] <= row["steady_after_forward_s"], row
    # Each row was printed as it was made, and written: a run cut short keeps them.
    assert done.stdout.count(" req/s, forward ") == len(runs)
    assert "median req/s" in done.stdout
    assert "req/s" in done.stdout


def test_the_rounds_alternate_their_order() -> None:
    """Each round runs every path, the order reversed every other round (direct, sync,
    async; async, sync, direct; ...), with the pinned paths or without."""
    spec = importlib.util.spec_from_file_location("diffusers_serving", ROOT / "bench" / "diffusers_serving.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.round_order(0, pinned=False) == ["direct", "sync", "async"]
    assert bench.round_order(1, pinned=False) == ["async", "sync", "direct"]
    assert bench.round_order(2, pinned=True) == ["direct", "sync", "async", "async-pinned"]
    assert bench.round_order(3, pinned=True) == ["async-pinned", "async", "sync", "direct"]
    assert bench.round_order(1, pinned=False, fresh=True) == ["async", "sync", "direct-fresh", "direct"]
    assert bench.round_order(1, pinned=False, graphs=True) == ["async-graphs", "sync-graphs", "async", "sync", "direct"]
