"""``omni-async demo``'s files, from a real run (worker processes, shared memory) in a
tiny configuration: the images, the timeline pictures, the Chrome trace and the summary JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from omni_async.cli import demo as cli_demo

REQUESTS = 5
HEIGHT, WIDTH = 128, 192  # 72 KiB of RGB: through shared memory


@pytest.mark.slow
def test_the_demo_writes_images_timelines_a_trace_and_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "omni_async.cli", "demo", "--requests", str(REQUESTS),
        "--height", str(HEIGHT), "--width", str(WIDTH), "--steps", "1", "--out", str(out), "--json", str(summary),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    ids = {f"req-{i}" for i in range(REQUESTS)}

    # The images: one PNG per request, the requested size, not blank.
    pngs = sorted((out / "images").glob("*.png"))
    assert {p.stem for p in pngs} == ids
    for p in pngs:
        with Image.open(p) as img:
            assert img.format == "PNG" and img.mode == "RGB" and img.size == (WIDTH, HEIGHT)
            pixels = np.asarray(img)
        assert pixels.shape == (HEIGHT, WIDTH, 3) and pixels.min() != pixels.max()

    # A timeline picture per run.
    for mode in ("sync", "async"):
        with Image.open(out / f"timeline-{mode}.png") as img:
            assert img.format == "PNG" and img.size[0] > 300 and img.size[1] > 200
            img.load()

    # The Chrome trace: a process per run, every request of each run named in its events.
    trace = json.loads((out / "timeline.json").read_text())
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(processes.values()) == ["before (seed)", "omni_async"]
    for pid in processes:
        complete = [e for e in events if e["pid"] == pid and e["ph"] == "X"]
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
        named = {rid for rid in ids for e in complete if rid in e["name"].split()}
        assert named == ids, (processes[pid], named)
        phases = {e["cat"] for e in complete}
        assert {"forward", "pack", "wait", "postprocess"} <= phases, phases

    # The summary: both runs, positive throughput, p50 <= p95.
    data = json.loads(summary.read_text())
    assert set(data["modes"]) == {"sync", "async"} and data["ok"] is True
    for s in data["modes"].values():
        assert s["requests"] == REQUESTS and s["throughput"] > 0 and 0 < s["p50_s"] <= s["p95_s"]
        assert s["idle_total_s"] >= 0 and s["forward_total_s"] > 0
    assert data["speedup"] > 0 and data["out"] == str(out)
    # One executor per run: the seed's (step mode, fresh segments) delivers through its answers.
    ours = data["executor_metrics"]["async"]
    assert ours["pending_outputs"] == 0 and ours["delivered"] > 0
    assert data["executor_metrics"]["sync"]["pending_outputs"] == 0
    assert data["config"]["frames"] == 1 and data["config"]["output"] == "pixels"
    assert data["labels"] == {"sync": "before (seed)", "async": "omni_async"}
    assert data["note"] == cli_demo.CPU_NOTE
    assert "speed-up (omni_async over before):" in done.stdout and str(out) in done.stdout
    # On CPU the summary says plainly what the run does and does not show.
    assert " ".join(cli_demo.CPU_NOTE.split()) in " ".join(done.stdout.split())
