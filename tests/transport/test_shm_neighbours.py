"""The suite judges and sweeps only the ``/dev/shm`` files it made (issue 18).

A dead neighbour -- another checkout's suite, a crashed engine, an old run -- leaves
``omni-<pid>-...`` segments, lock files and ``sem.omni-<pid>-sem-...`` semaphores of a
pid that is not alive and is not this session's.  Planted during a test, they must not
fail it (the autouse leak check), and no sweep of this session's (an executor's, the
library's, ``omni-async cleanup``'s) may take them.  Untagged -- a user's run -- the
names and the sweeps are what they always were.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import subprocess
from collections.abc import Iterator

import pytest

from helpers.leaks import ours
from omni_async.cli import cleanup
from omni_async.core.config import Deadlines
from omni_async.core.errors import UsageError
from omni_async.executor import multiproc
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.transport.shm import SHM_DIR, SegmentPool, sweep_dead_executors
from omni_async.transport.shm.files import (
    SHM_TAG_ENV,
    DeadFile,
    dead_executor_files,
    name_tag,
    pid_alive,
    remove_dead_executor_files,
    shm_tag,
    unlink,
)

SPEC = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 8, "steps": 1})


def dead_pid() -> int:
    """A pid that no process has (a child of ours that ran and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not pid_alive(proc.pid)
    return proc.pid


def neighbour_names(pid: int, tag: str = "") -> set[str]:
    """What a dead executor of ``pid`` leaves: a segment, its pool's lock file, a credit
    semaphore (tagged ``tag``, as another tagged suite's, or untagged, as a user's)."""
    mark = f"{tag}_" if tag else ""
    pool = f"omni-{pid}-{mark}{secrets.token_hex(4)}-"
    return {f"{pool}0.1", f"{pool}lock", f"sem.omni-{pid}-sem-{mark}{secrets.token_hex(6)}"}


@pytest.fixture
def planted() -> Iterator[set[str]]:
    """A dead neighbour's files, planted in /dev/shm during the test, removed after it."""
    pid = dead_pid()
    names = neighbour_names(pid) | neighbour_names(pid, tag="tdeadbeef")
    for name in names:
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"\0" * 4096)
    try:
        yield names
    finally:
        for name in names:
            unlink(name)


def test_the_session_is_tagged() -> None:
    tag = shm_tag()
    assert re.fullmatch(r"t[0-9a-f]{8}", tag), tag
    pool = SegmentPool(max_bytes=1 << 20)
    try:
        assert pool.prefix.startswith(f"omni-{os.getpid()}-{tag}_"), pool.prefix
        assert name_tag(pool.prefix + "lock") == tag
    finally:
        pool.close()


def test_a_dead_neighbours_files_are_not_blamed_nor_swept(
    planted: set[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Fails without the tag: the autouse leak check blamed this test for the planted
    files (a dead pid's), and every sweep below listed or removed them."""
    assert not planted & ours()
    assert not planted & ours(exclude_long_lived=False)
    assert not planted & {f.name for f in dead_executor_files()}
    assert not planted & {f.name for f in remove_dead_executor_files()}
    sweep_dead_executors()
    assert cleanup.run(argparse.Namespace(dry_run=True)) == 0
    assert not any(name in capsys.readouterr().out for name in planted)
    # (Whether they are still there says nothing of ours: a run of the library without
    # the tag -- a user's, an older checkout's suite -- sweeps every dead executor's.)


def test_an_executor_of_the_suite_sweeps_none_of_a_neighbours_files(
    planted: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor's sweep at construction (on, the library's default) removes only this
    session's dead files; the planted ones stay (unless another run's sweep took them)."""
    swept: list[DeadFile] = []

    def spy() -> list[DeadFile]:
        removed = remove_dead_executor_files()
        swept.extend(removed)
        return removed

    monkeypatch.setattr(multiproc, "remove_dead_executor_files", spy)
    relaxed = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)
    with MultiprocDiffusionExecutor(SPEC, deadlines=relaxed):
        pass
    assert not planted & {f.name for f in swept}, swept


def test_this_sessions_dead_files_are_blamed_and_swept() -> None:
    """Files of a dead child of this session (they carry the session's tag) are ours:
    the leak check sees its segment and lock file, the sweeps take all three."""
    mine = neighbour_names(dead_pid(), tag=shm_tag())
    for name in mine:
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"\0" * 4096)
    try:
        assert {n for n in mine if not n.startswith("sem.")} <= ours()
        assert mine <= {f.name for f in dead_executor_files()}
        assert sweep_dead_executors() >= 1
        assert not mine & set(os.listdir(SHM_DIR))
    finally:
        for name in mine:
            unlink(name)


def test_untagged_names_and_sweeps_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's run (no tag): names as before, and the sweep finds every dead
    executor's files, tagged or not (listed here, not removed)."""
    monkeypatch.delenv(SHM_TAG_ENV)
    assert shm_tag() == ""
    pool = SegmentPool(max_bytes=1 << 20)
    try:
        assert re.fullmatch(rf"omni-{os.getpid()}-[0-9a-f]{{8}}-", pool.prefix), pool.prefix
        assert name_tag(pool.prefix + "lock") is None
    finally:
        pool.close()
    pid = dead_pid()
    names = neighbour_names(pid) | neighbour_names(pid, tag="tdeadbeef")
    for name in names:
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"\0")
    try:
        found = {f.name for f in dead_executor_files()}
        left = names & set(os.listdir(SHM_DIR))
        assert left <= found, left - found
    finally:
        for name in names:
            unlink(name)


@pytest.mark.parametrize("bad", ["has-dash", "x" * 17, "under_score"])
def test_a_malformed_tag_is_a_usage_error(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHM_TAG_ENV, bad)
    with pytest.raises(UsageError, match=SHM_TAG_ENV):
        SegmentPool(max_bytes=1 << 20)
