"""``omni-async cleanup`` and Ctrl-C during ``omni-async demo``, as a user runs them (issue 8, defect 4)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.crash_children import group_members, kill_all, start
from omni_async.transport.shm.files import SHM_DIR, entries, unlink_all_with_prefix

CLI = [sys.executable, "-m", "omni_async.cli"]


@pytest.mark.slow
def test_cleanup_lists_with_dry_run_then_removes_dead_owners_files() -> None:
    # Other test runs on this machine sweep dead owners' files too: when one takes our
    # leftover first, make a new one.
    for _ in range(3):
        proc, owner = start("pool")
        kill_all(proc, owner)
        prefix = owner["prefix"]
        try:
            left = entries(prefix)
            assert len(left) == 2 and any(n.endswith("lock") for n in left), left  # one segment, the lock file
            paths = [os.path.join(SHM_DIR, n) for n in left]

            dry = subprocess.run([*CLI, "cleanup", "--dry-run"], capture_output=True, text=True, timeout=120)
            assert dry.returncode == 0, dry.stdout + dry.stderr
            if entries(prefix) != left:
                continue  # swept by someone else
            assert all(f"would remove {p} " in dry.stdout for p in paths), dry.stdout

            done = subprocess.run([*CLI, "cleanup"], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr
            assert not entries(prefix)
            if not all(f"removed {p} " in done.stdout for p in paths):
                continue  # swept by someone else meanwhile
            assert f"executor pid {owner['pid']} not running" in done.stdout
            return
        finally:
            unlink_all_with_prefix(prefix)
    pytest.fail("concurrent sweeps took the leftovers three times in a row")


@pytest.mark.slow
def test_cleanup_spares_live_owners() -> None:
    proc, owner = start("pool")
    try:
        done = subprocess.run([*CLI, "cleanup"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert len(entries(owner["prefix"])) == 2
    finally:
        proc.kill()
        proc.wait(timeout=30)
        unlink_all_with_prefix(owner["prefix"])


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_during_demo_shuts_down_cleanly_with_one_line() -> None:
    proc = subprocess.Popen(
        # 256 x 256 images, in shared memory; enough requests that the demo is still running
        # when the signal comes (60 could all finish within the 0.5 s below on a quiet machine).
        [*CLI, "demo", "--requests", "240"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # and, like one, with SIGINT's default action even when this run inherited it ignored
        # (a shell's background job: Python then installs no KeyboardInterrupt handler).
        preexec_fn=_default_sigint,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        # A header line, then "<run>: executor ... up in ..." for both runs (the demo starts
        # and warms both executors before it times either), then each run's warm-up line:
        # after those the first round is serving.
        lines_seen = [proc.stdout.readline() for _ in range(5)]
        assert [("up in" in line) for line in lines_seen[1:3]] == [True, True], lines_seen
        assert all("warm-up" in line for line in lines_seen[3:]), lines_seen
        time.sleep(0.5)  # requests computed, outputs in segments, most not claimed yet
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    prefix = f"omni-{proc.pid}-"
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["interrupted; shut down cleanly, 0 shared-memory files left"], err
    assert not entries(prefix), entries(prefix)
    deadline = time.monotonic() + 5
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_members(proc.pid), group_members(proc.pid)


def test_ctrl_c_while_a_command_imports_is_one_line_not_a_traceback() -> None:
    """Ctrl-C (SIGINT to the process group) while ``omni-async serve`` imports torch: one
    line and exit status 130.  The defect: a ``KeyboardInterrupt``
    traceback through torch's import machinery."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_async.cli", "serve", "--model", "tiny", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        # A terminal's foreground job: SIGINT's default action even when this run inherited
        # it ignored (a background job of a script: the ignored signal would be lost).
        preexec_fn=_default_sigint,
    )
    # Once torch's library is mapped, the command is importing torch (for a second or more).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        with open(f"/proc/{proc.pid}/maps") as fh:
            if "libtorch" in fh.read():
                break
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and out.strip() == "omni-async: interrupted", out
