"""Segment names under ``/dev/shm``, and the sweeps that need no pool and no lock.

Every name of ours starts with ``omni-<pid of the creating executor>-``, so a crash
cleanup finds a pool's files by prefix alone, and ``sweep_dead_executors`` finds the
pools whose executor no longer runs.  So does the name of a result channel's credit
semaphore (``transport.pipe.CreditSemaphore``), whose file glibc calls
``sem.omni-<pid>-sem-<random>``: normally unlinked as soon as the workers are up, it is
left only by an executor killed (with its resource tracker) while they were starting,
and the same sweeps remove it.

A run may tag its files: with ``OMNI_ASYNC_SHM_TAG`` set (letters and digits, at most
16), every name this run makes carries ``<tag>_`` right after ``omni-<pid>-`` (a
semaphore's after ``sem.omni-<pid>-sem-``), and this run's sweeps of dead executors
remove only the dead files that carry the same tag: another run's files on the same
machine are not its to judge.  Unset (the default), names carry no tag and the sweeps
remove the files of every dead executor, tagged or not.  The test suite tags its
session, so that it judges and sweeps only what it made.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Final, NamedTuple

from omni_async.core.errors import UsageError

log = logging.getLogger(__name__)

__all__ = [
    "LOCK_SUFFIX",
    "SEM_FILE_PREFIX",
    "SHM_DIR",
    "SHM_PREFIX_ROOT",
    "SHM_TAG_ENV",
    "DeadFile",
    "dead_executor_files",
    "entries",
    "is_plain_name",
    "list_segments",
    "name_tag",
    "owner_pid",
    "pid_alive",
    "remove_dead_executor_files",
    "shm_tag",
    "sweep_dead_executors",
    "tag_mark",
    "unlink",
    "unlink_all_with_prefix",
]

SHM_DIR: Final = "/dev/shm"
SHM_PREFIX_ROOT: Final = "omni-"
LOCK_SUFFIX: Final = "lock"  # <prefix>lock; segment names end in <slot>.<incarnation>
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
SEM_FILE_PREFIX: Final = "sem."  # glibc's file of the POSIX semaphore named /<name>
_EXECUTOR_PID = re.compile(r"^(?:sem\.)?omni-(\d+)-")
SHM_TAG_ENV: Final = "OMNI_ASYNC_SHM_TAG"
_TAG = re.compile(r"^[A-Za-z0-9]{1,16}$")
_NAME_TAG = re.compile(r"^(?:sem\.)?omni-\d+-(?:sem-)?([A-Za-z0-9]{1,16})_")


def shm_tag() -> str:
    """This run's tag (``$OMNI_ASYNC_SHM_TAG``, module docstring); ``""`` when unset."""
    tag = os.environ.get(SHM_TAG_ENV, "")
    if tag and not _TAG.match(tag):
        raise UsageError(f"{SHM_TAG_ENV}={tag!r}: a tag is 1 to 16 letters or digits")
    return tag


def tag_mark() -> str:
    """What a new name carries after ``omni-<pid>-``: ``"<tag>_"``, or ``""`` untagged."""
    tag = shm_tag()
    return f"{tag}_" if tag else ""


def name_tag(name: str) -> str | None:
    """The tag a file's name carries (None: untagged, or not one of ours)."""
    m = _NAME_TAG.match(name)
    return m.group(1) if m is not None else None


def is_plain_name(name: str) -> bool:
    """A name that cannot leave ``/dev/shm`` (no slash, no ``..`` tricks, no spaces)."""
    return bool(_PLAIN_NAME.match(name))


def unlink(name: str) -> bool:
    """Unlink ``/dev/shm/<name>``; False when it was already gone."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


def entries(prefix: str) -> list[str]:
    """Every file under ``/dev/shm`` whose name starts with ``prefix`` (lock files too)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def list_segments(prefix: str = SHM_PREFIX_ROOT) -> list[str]:
    """The segments under ``/dev/shm`` whose names start with ``prefix`` (not lock files)."""
    return [n for n in entries(prefix) if not n.endswith(LOCK_SUFFIX)]


def unlink_all_with_prefix(prefix: str) -> int:
    """Unlink every ``/dev/shm`` segment whose name starts with ``prefix``; returns how many.

    Needs no pool and no lock: the executor's crash cleanup.  Lock files go too (not
    counted).  Mappings that processes still hold stay valid until unmapped; the memory
    is freed when the last one goes.
    """
    if len(prefix) < len(SHM_PREFIX_ROOT) or not is_plain_name(prefix):
        raise UsageError(f"refusing to unlink by the prefix {prefix!r} (too short or not a plain name)")
    n = 0
    for name in entries(prefix):
        gone = unlink(name)
        n += gone and not name.endswith(LOCK_SUFFIX)
    return n


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (segment names carry their creator's pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_pid(name: str) -> int | None:
    """The pid of the executor that made the pool ``name`` belongs to (None: not one of ours)."""
    m = _EXECUTOR_PID.match(name)
    return int(m.group(1)) if m is not None else None


class DeadFile(NamedTuple):
    """A file under ``/dev/shm`` left by an executor that no longer runs."""

    name: str
    pid: int  # the dead executor's
    size: int  # bytes

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @property
    def is_lock(self) -> bool:
        return self.name.endswith(LOCK_SUFFIX)

    @property
    def is_semaphore(self) -> bool:
        """A result channel's credit semaphore, not a segment."""
        return self.name.startswith(SEM_FILE_PREFIX)

    @property
    def is_segment(self) -> bool:
        return not self.is_lock and not self.is_semaphore


def dead_executor_files() -> list[DeadFile]:
    """Segments, lock files and credit semaphores of executors (the pid in the name) that no longer run.

    In a tagged run (``OMNI_ASYNC_SHM_TAG``), only those that carry its tag.

    Liveness is ``pid_alive`` on that pid: a process of another pid namespace that
    shares this ``/dev/shm`` (a container with ``--ipc=host``) looks dead from here, so
    do not share ``/dev/shm`` across pid namespaces, or turn the executor's sweep off.
    """
    found = []
    tag = shm_tag()
    for name in [*entries(SHM_PREFIX_ROOT), *entries(SEM_FILE_PREFIX + SHM_PREFIX_ROOT)]:
        pid = owner_pid(name)
        if pid is None or (tag and name_tag(name) != tag) or pid_alive(pid):
            continue
        try:
            size = os.stat(os.path.join(SHM_DIR, name)).st_size
        except FileNotFoundError:
            continue  # swept meanwhile by someone else
        found.append(DeadFile(name, pid, size))
    return found


def remove_dead_executor_files() -> list[DeadFile]:
    """Unlink what ``dead_executor_files`` finds; returns what this call removed.

    A file this user may not unlink (another user's, ``/dev/shm`` is sticky) is skipped
    and logged; one that is already gone (a concurrent sweep) is not counted.
    """
    removed = []
    for f in dead_executor_files():
        try:
            if unlink(f.name):
                removed.append(f)
        except PermissionError as exc:
            log.info("cannot unlink %s left by dead executor %d: %s", f.path, f.pid, exc)
    return removed


def sweep_dead_executors() -> int:
    """Unlink segments left by executors that are no longer running (their pid is in the name).

    Lock files and credit semaphores go too (not counted); returns how many segments.
    """
    return sum(f.is_segment for f in remove_dead_executor_files())
