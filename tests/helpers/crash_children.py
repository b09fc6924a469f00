"""Scripts the crash tests run as real processes, and the checks they make on them.

``python crash_children.py owner WORLD_SIZE``: builds a ``MultiprocDiffusionExecutor``
over the reference model, holds one delivered output (its segment leased), leaves
more outputs in flight, prints one JSON line ``{"prefix", "pid", "workers"}`` and
sleeps until it is killed.

``python crash_children.py channel``: a result channel with a sender never handed to a
worker (its credit semaphore still named); prints the JSON line (empty prefix) and sleeps.

``python crash_children.py pool``: a bare ``SegmentPool`` with one leased, filled
segment; prints the same JSON line (no workers) and sleeps.  A cheap leftover for the
``omni-async cleanup`` test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypedDict

SCRIPT = os.path.abspath(__file__)


class Owner(TypedDict):
    prefix: str
    pid: int
    workers: list[int]


def _announce(prefix: str, workers: list[int]) -> None:
    print(json.dumps({"prefix": prefix, "pid": os.getpid(), "workers": workers}), flush=True)


def _owner(world_size: int) -> None:
    from omni_async.core.config import Deadlines
    from omni_async.core.messages import DiffusionRequest
    from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

    spec = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": 64, "steps": 2})
    ex = MultiprocDiffusionExecutor(
        spec, world_size=world_size, deadlines=Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)
    )
    # 512 x 64 fp32 = 128 KiB: above the inline threshold, so each output is a segment.
    held = []
    for i in range(2):
        ro = ex.execute_request(DiffusionRequest(f"held-{i}", {"height": 512, "seed": i}))
        assert ro.async_output_id is not None
        held.append(ex.wait_output_ready(ro.async_output_id).result(timeout=60))
    # Three calls in flight at once, each returning at its COMPUTE_DONE: announced, packed
    # or packing, never claimed (a handle would claim them).
    with ThreadPoolExecutor(3) as callers:
        list(
            callers.map(
                ex.execute_request, [DiffusionRequest(f"fly-{i}", {"height": 512, "seed": i}) for i in range(3)]
            )
        )
    workers = [p.pid for p in ex.procs if p.pid is not None]
    _announce(ex.pool.prefix, workers)
    time.sleep(600)


def _channel() -> None:
    """A result channel with one sender made and never handed over: its credit semaphore's
    name stays, as in an executor killed while its workers start."""
    import multiprocessing

    from omni_async.transport.channel import PipeChannel

    channel = PipeChannel(mp_context=multiprocessing.get_context("spawn"))
    sender = channel.new_sender("never-handed-over")
    _announce("", [])
    time.sleep(600)
    sender.close()


def _pool() -> None:
    from omni_async.transport.shm import SegmentPool

    pool = SegmentPool(max_bytes=8 << 20)
    lease = pool.lease(200_000)
    pool.view(lease).fill_(7)
    _announce(pool.prefix, [])
    time.sleep(600)


# --------------------------------------------------------------------------- test side


def start(*args: str) -> tuple[subprocess.Popen[str], Owner]:
    """Run this script with ``args`` in a new session; returns it once it announced itself."""
    # stderr goes to a file: the workers inherit it, so a pipe would stay open (and
    # block a reader) for as long as any of them lives.
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    if not line:
        proc.kill()
        proc.wait(timeout=30)
        err.seek(0)
        raise AssertionError(f"{args} exited before announcing itself:\n{err.read()}")
    err.close()
    info: Any = json.loads(line)
    return proc, Owner(prefix=str(info["prefix"]), pid=int(info["pid"]), workers=[int(w) for w in info["workers"]])


def gone(pid: int) -> bool:
    """The process no longer runs: no such pid, or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def kill_all(proc: subprocess.Popen[str], owner: Owner) -> None:
    """Leave a real leftover: stop the workers (so they cannot clean up), SIGKILL the
    owner and reap it, then SIGKILL the workers."""
    for w in owner["workers"]:
        os.kill(w, signal.SIGSTOP)
    proc.kill()
    proc.wait(timeout=30)
    for w in owner["workers"]:
        os.kill(w, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not all(gone(w) for w in owner["workers"]) and time.monotonic() < deadline:
        time.sleep(0.02)


def mapped_semaphores(pids: list[int]) -> set[int]:
    """The inodes of the ``/dev/shm/sem.*`` files these processes have mapped: a named POSIX
    semaphore is a mapped file, so these are exactly the semaphores they made or opened,
    whatever the neighbours do.  Inodes, not names: glibc creates the file under a
    temporary name and links it to the real one, and the mapping keeps the first."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/sem."):
                        found.add(int(fields[4]))
        except OSError:
            continue
    return found


def sem_files_of(inodes: set[int]) -> set[str]:
    """The ``/dev/shm/sem.*`` names that are one of these files (see ``mapped_semaphores``)."""
    names = set()
    for name in os.listdir("/dev/shm"):
        if name.startswith("sem."):
            try:
                if os.stat(os.path.join("/dev/shm", name)).st_ino in inodes:
                    names.add(name)
            except FileNotFoundError:
                continue
    return names


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child's whole process group (it leads its own session): the driver, its
    workers and multiprocessing's resource tracker at once, as a crash or OOM kill does."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (zombies excluded)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


if __name__ == "__main__":
    if sys.argv[1] == "owner":
        _owner(int(sys.argv[2]))
    elif sys.argv[1] == "pool":
        _pool()
    elif sys.argv[1] == "channel":
        _channel()
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
