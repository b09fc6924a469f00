"""``omni-async demo``, README's main job, run as a user runs it: a real subprocess."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_async import cli
from omni_async.cli import demo as cli_demo
from omni_async.models.tiny import image_digest

# Small images, one step: seconds.  128 x 256 RGB uint8 (96 KiB) travel through shared memory.
SMALL = ["--height", "128", "--width", "256", "--steps", "1"]


# The fast tier (pytest -m "not slow") runs the in-process demo; worker processes start
# from a script in tests/cli/test_readme.py there.
@pytest.mark.parametrize("executor", [pytest.param("multiproc", marks=pytest.mark.slow), "inproc"])
def test_demo_checks_every_output_and_leaves_nothing_behind(executor: str, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "omni_async.cli", "demo", "--executor", executor, "--requests", "6", *SMALL]
    done = subprocess.run(
        [*cmd, "--max-running", "3", "--out", str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for mode in ("sync", "async"):
        assert f"{mode}: 6 requests in " in done.stdout and "; 0 mismatched" in done.stdout, done.stdout
    assert "speed-up (omni_async over before): " in done.stdout
    assert "What it does not show: the throughput a" in done.stdout  # the CPU note
    # Each run: the 6 requests and a warm-up; nothing left in the engine.
    assert done.stdout.count(": finished=7; ") == 2 and done.stdout.count("; nothing left in it") == 2, done.stdout
    assert "no timeouts, protocol errors or outputs left" in done.stdout, done.stdout
    assert "checks: every output intact, nothing left behind" in done.stdout
    if executor == "multiproc":
        assert "0 still leased" in done.stdout


@pytest.mark.slow
def test_many_requests_submitted_at_once_wait_in_the_engine_not_in_shared_memory(tmp_path: Path) -> None:
    """Issue 9: more requests than the budget of held outputs (64), handed over at once.
    The demo before the engine submitted them all, then claimed: the packer waited for
    room, the forwards behind it too, and the first outputs expired unclaimed after 20 s
    (OutputTimeout, exit status 1).  Through the engine the rest wait in its queue."""
    cmd = [sys.executable, "-m", "omni_async.cli", "demo", "--requests", "100", "--output-timeout", "20"]
    done = subprocess.run([*cmd, *SMALL, "--out", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "async: 100 requests in " in done.stdout and "; 0 mismatched" in done.stdout, done.stdout
    assert done.stdout.count(": finished=101; ") == 2 and "in_flight_limit=64;" in done.stdout, done.stdout
    assert "no timeouts, protocol errors or outputs left" in done.stdout and "0 still leased" in done.stdout, (
        done.stdout
    )
    assert len(list((tmp_path / "images").glob("*.png"))) == 100


@pytest.mark.slow
def test_demo_refuses_cuda_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run(
        [sys.executable, "-m", "omni_async.cli", "demo", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "CUDA requested but not available" in done.stderr


def test_the_demo_digest_sees_one_flipped_bit_and_one_swap() -> None:
    img = torch.rand(64, 64, generator=torch.Generator().manual_seed(3)) * 255
    d = int(image_digest(img))
    assert int(image_digest(img.clone())) == d
    flipped = img.clone()
    flipped.view(torch.int32)[7, 9] ^= 1  # the lowest mantissa bit
    assert int(image_digest(flipped)) != d
    swapped = img.clone()
    swapped[0, 0], swapped[0, 1] = img[0, 1], img[0, 0]
    assert int(image_digest(swapped)) != d


# -- options: help texts with defaults, bad values refused before anything starts ---------

BAD_VALUES = [
    (["--max-running", "0"], "--max-running"),
    (["--max-running", "two"], "--max-running"),
    (["--requests", "-1"], "--requests"),
    (["--requests", "0"], "--requests"),
    (["--world-size", "0"], "--world-size"),
    (["--steps", "0"], "--steps"),
    (["--height", "7"], "--height"),
    (["--height", "-8"], "--height"),
    (["--width", "100"], "--width"),
    (["--compute-timeout", "-1"], "--compute-timeout"),
    (["--output-timeout", "-0.5"], "--output-timeout"),
    (["--output-timeout", "nan"], "--output-timeout"),
    (["--output-timeout", "soon"], "--output-timeout"),
    (["--device", "tpu"], "--device"),
    (["--device", "cpu:3"], "--device"),
    (["--executor", "threads"], "--executor"),
]


def _demo_options() -> list[argparse.Action]:
    demo: argparse.ArgumentParser = cli.build_parser().parse_args(["demo"]).subparser
    return [a for a in demo._actions if a.option_strings and a.dest != "help"]


def _assert_one_error_line(stderr: str, option: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert lines[0].startswith("usage: omni-async demo"), stderr
    errors = [line for line in lines if "error" in line]
    assert errors == [lines[-1]], stderr
    assert lines[-1].startswith(f"omni-async demo: error: argument {option}: "), stderr
    # Everything before the error line is the usage (continuation lines are indented).
    assert all(line.startswith(" ") for line in lines[1:-1]), stderr


@pytest.mark.parametrize(("argv", "option"), BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_a_bad_value_is_one_error_line_before_anything_starts(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_run(args: argparse.Namespace) -> int:
        raise AssertionError(f"the demo started with {args}")

    monkeypatch.setattr(cli_demo, "run", must_not_run)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    _assert_one_error_line(captured.err, option)


@pytest.mark.slow
def test_a_bad_value_from_the_real_command_line_is_no_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omni_async.cli", "demo", "--max-running", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    _assert_one_error_line(done.stderr, "--max-running")
    last = done.stderr.strip().splitlines()[-1]
    assert last == "omni-async demo: error: argument --max-running: must be >= 1, got 0"


def test_a_bad_timeout_in_the_environment_is_one_error_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_demo, "run", lambda args: pytest.fail("the demo started"))
    monkeypatch.setenv("OMNI_ASYNC_RPC_TIMEOUT", "-3")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("omni-async demo: error: OMNI_ASYNC_RPC_TIMEOUT='-3'")


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        (["--max-running", "3"], "max_running", 3),
        (["--height", "64"], "height", 64),
        (["--world-size", "2"], "world_size", 2),
        (["--output-timeout", "2.5"], "output_timeout", 2.5),
        (["--output-timeout", "0"], "output_timeout", None),
        (["--compute-timeout", "none"], "compute_timeout", None),
        (["--device", "cpu"], "device", "cpu"),
        (["--executor", "inproc"], "executor", "inproc"),
    ],
)
def test_good_values_reach_the_demo(argv: list[str], dest: str, value: object, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []

    def record(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(cli_demo, "run", record)
    assert cli.main(["demo", *argv]) == 0
    assert getattr(seen[0], dest) == value


def test_demo_help_lists_every_option_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    options = _demo_options()
    assert {a.dest for a in options} >= {
        "executor",
        "device",
        "world_size",
        "requests",
        "max_running",
        "height",
        "width",
        "steps",
        "compute_timeout",
        "output_timeout",
    }
    for action in options:
        assert action.help, f"{action.option_strings[0]} has no help text"
        option = action.option_strings[0]
        assert option in text
        # The help of each option, then its default, as ArgumentDefaultsHelpFormatter writes it.
        help_text = " ".join(action.help.split())
        assert f"{help_text} (default: {action.default})" in text, option


def test_top_level_help_names_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "usage: omni-async" in text
    assert "-h, --help show this help message and exit" in text
    assert "demo run the reference stack end to end and check every output" in text


def test_no_command_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("omni-async: error:")
