"""``omni-async bench``: the CI preset as a user runs it, its report, its plot, and a machine without matplotlib."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from omni_async.cli.bench import MODES, TINY_SIZES
from omni_async.cli.bench_report import COLUMNS, CPU_NOTE, TABLE_WIDTH
from omni_async.transport.shm.files import entries

FIELDS = {
    "mode", "size", "shape", "dtype", "output_bytes", "copied_bytes", "forward_label", "forward_ms", "concurrency",
    "requests", "warmup", "throughput_rps", "latency_ms_p50", "latency_ms_p95", "latency_ms_max", "copy_GBps",
    "pack_ms_p50", "idle_gap_ms_p50", "idle_gap_ms_mean", "idle_fraction", "forward_alone_ms", "forward_alone_before_ms", "copy_alone_ms",
    "copy_alone_GBps", "ideal_rps", "bound", "efficiency", "wall_s", "gpu", "fresh_segments_left",
    "client_ms_p50", "client_ms_p95", "client_efficiency",
}  # fmt: skip


def _bench(*argv: str, timeout: float = 300, code: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "omni_async.cli"]
    return subprocess.run([*cmd, "bench", *argv], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("bench") / "tiny.json"
    done = _bench("--tiny", "--device", "cpu", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return done, out


@pytest.mark.slow
def test_the_tiny_preset_reports_every_mode_and_field_with_plausible_values(
    tiny: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """The CI preset (seconds on CPU): every mode on every case, every field, and values a
    run can have: throughput > 0, p50 <= p95, efficiency in (0, 1.5], no fresh segment
    left after any case, the forward and copy measured alone."""
    done, out = tiny
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["command"].startswith("omni-async bench --tiny")
    env = report["environment"]
    assert env["torch"] and env["device"] == "cpu" and env["cpu_count"] >= 1 and "device_name" in env
    cases = report["cases"]
    assert {c["mode"] for c in cases} == set(MODES)
    assert {c["size"] for c in cases} == set(TINY_SIZES)
    assert {c["forward_label"] for c in cases} == {"20ms", "copy-bound"}
    per_mode = {m: sum(c["mode"] == m for c in cases) for m in MODES}
    assert set(per_mode.values()) == {len(TINY_SIZES) * 2 + 2}, per_mode  # sizes x c=1,2, + copy-bound x c=1,2
    for c in cases:
        assert FIELDS <= set(c), FIELDS - set(c)
        assert c["throughput_rps"] > 0 and c["requests"] >= 1 and c["warmup"] >= 1
        assert 0 < c["latency_ms_p50"] <= c["latency_ms_p95"] <= c["latency_ms_max"]
        assert 0 < c["efficiency"] <= 1.5, c
        assert c["forward_alone_ms"] > 0 and c["copy_alone_GBps"] > 0 and c["ideal_rps"] > 0
        assert c["copy_GBps"] is not None and c["copy_GBps"] > 0
        assert c["idle_gap_ms_p50"] >= 0 and 0 <= c["idle_fraction"] < 1
        assert c["fresh_segments_left"] == 0
        # To the client's bytes: after the output was in hand; its ideal is the forward alone.
        assert c["latency_ms_p50"] <= c["client_ms_p50"] <= c["client_ms_p95"], c
        assert c["client_efficiency"] == pytest.approx(c["forward_alone_ms"] / c["client_ms_p50"])
        assert c["gpu"] is None  # CPU
        if c["forward_label"] == "20ms":
            assert 18 <= c["forward_alone_ms"] <= 200 and c["bound"] == "forward"
        if c["mode"] == "omni-u8":
            # uint8 on the device: one byte per element crosses, not four (fp32) or two (bf16).
            assert c["copied_bytes"] * {"float32": 4, "bfloat16": 2}[c["dtype"]] == c["output_bytes"]
        elif c["mode"] == "reference" and c["dtype"] == "bfloat16":
            assert c["copied_bytes"] == 2 * c["output_bytes"]  # upcast to fp32
        else:
            assert c["copied_bytes"] == c["output_bytes"]
    pump = report["pump"]
    assert pump["requests"] == 200 and pump["messages"] >= 2 * 200 and pump["messages_per_s"] > 0
    assert 0 < pump["compute_done_latency_us_p50"] <= pump["compute_done_latency_us_p99"]
    # The printed table: one row per case, the columns named, every line within 100 columns.
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("mode "))
    assert header.split() == [h for h, _, _ in COLUMNS]
    assert sum(any(line.startswith(f"{m} ") for m in MODES) for line in lines) == len(cases)
    assert max(len(line) for line in lines) <= TABLE_WIDTH
    assert "…" not in done.stdout  # nothing cut short
    # On CPU, the paragraph that says why omni is no better than sync and the copy-bound low.
    assert " ".join(CPU_NOTE.split()) in " ".join(done.stdout.split())
    assert "pump (CPU" in done.stdout and "messages/s" in done.stdout
    # The engine's event loop while 16 PNG encodes ran (issue 31): measured and printed.
    loop = report["loop_stall"]
    assert loop["encodes"] == 16 and loop["format"] == "png" and loop["size"] == "256x256" and loop["samples"] > 0
    assert 0 <= loop["stall_ms_p50"] <= loop["stall_ms_p99"] <= loop["stall_ms_max"] and loop["encode_on_loop_ms"] > 0
    assert "event loop while 16 png encodes (256x256) ran: max stall" in done.stdout
    assert report["config"]["client_path"] == "pooled"


@pytest.mark.slow
def test_the_plot_decodes_and_redraws_from_the_json(
    tiny: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path
) -> None:
    _, out = tiny
    with Image.open(out.with_suffix(".png")) as png:
        png.verify()
        assert png.size[0] >= 800 and png.size[1] >= 600
    again = tmp_path / "again.png"
    done = _bench("--plot-from", str(out), "--plot", str(again), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with Image.open(again) as png:
        png.load()
        assert png.mode in ("RGBA", "RGB")


@pytest.mark.slow
def test_without_matplotlib_the_bench_says_so_instead_of_drawing(
    tiny: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path
) -> None:
    """The GPU machine has no matplotlib: the plot is skipped with a note, exit status 0."""
    _, out = tiny
    hide = "import sys; sys.modules['matplotlib'] = None; from omni_async.cli import main; sys.exit(main(sys.argv[1:]))"
    target = tmp_path / "none.png"
    done = _bench("--plot-from", str(out), "--plot", str(target), code=hide, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "matplotlib is not installed" in done.stdout and "--plot-from" in done.stdout
    assert not target.exists()


@pytest.mark.slow
def test_nothing_of_the_run_is_left_in_dev_shm(tiny: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    assert [n for n in entries("omni-") if "fresh-" in n] == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "fast"], "unknown mode 'fast'"),
        (["--sizes", "huge"], "unknown size 'huge'"),
        (["--forward-ms", "-3"], "must be from 0"),
        (["--concurrency", "0"], "must be >= 1"),
    ],
)
@pytest.mark.slow
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str) -> None:
    done = _bench(*argv, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.slow
def test_pump_only_runs_the_protocol_micro_benchmark_alone(tmp_path: Path) -> None:
    out = tmp_path / "pump.json"
    cmd = [sys.executable, "-m", "omni_async.cli", "bench", "--pump-only", "--pump-requests", "200", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["cases"] == [] and report["pump"]["concurrency"] == 1 and report["pump"]["requests"] == 200
    assert 0 < report["pump"]["compute_done_latency_us_p50"] <= report["pump"]["compute_done_latency_us_p99"]
    assert not out.with_suffix(".png").exists()  # no cases, no plot


def test_the_help_names_each_boolean_flag_both_ways_with_what_it_does() -> None:
    """``--copy-bound`` / ``--no-copy-bound`` and ``--client-bytes`` / ``--no-client-bytes``:
    the help says what the flag includes, so "(default: True)" reads as "included"."""
    done = _bench("--help", timeout=60)
    text = " ".join(done.stdout.split())
    assert "--copy-bound, --no-copy-bound include the copy-bound cases" in text, text
    assert "--client-bytes, --no-client-bytes time each output to the client's bytes" in text, text
    assert "--no-copy-bound ... (default: True)" not in text
