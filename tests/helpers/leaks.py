"""Which ``/dev/shm`` files this test session made, and prefixes that outlive one test.

The session is tagged (``tag_session``, called by conftest before any test): every
process it starts inherits ``OMNI_ASYNC_SHM_TAG``, so every segment, lock file and
credit semaphore that the session's executors make -- in the pytest process, in a
child a test crashes, in an ``omni-async`` subprocess -- carries the tag in its name,
and their sweeps of dead executors remove only the session's own dead files
(``transport.shm.files``).  The leak checks judge only those files (``ours``): another
checkout's suite, a running engine or a crashed run on the same machine is never
blamed on a test, whether its files appear or vanish during it.

Module-scoped executors: conftest's per-test leak check skips their prefixes
(``LONG_LIVED``); the fixture that owns such a prefix checks, after its executor shut
down, that no segment with it remains.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING

from omni_async.transport.shm import SHM_DIR, pid_alive
from omni_async.transport.shm import SHM_PREFIX_ROOT as SHM_PREFIX
from omni_async.transport.shm.files import SHM_TAG_ENV, name_tag, owner_pid, shm_tag

if TYPE_CHECKING:
    from omni_async.executor.multiproc import MultiprocDiffusionExecutor

LONG_LIVED: set[str] = set()


def kept_for_the_module(ex: MultiprocDiffusionExecutor) -> Iterator[MultiprocDiffusionExecutor]:
    """The body of a module-scoped executor fixture (``yield from``): the per-test leak
    check skips ``ex``'s pool while it lives; after its shutdown none of its segments
    may remain."""
    prefix = ex.pool.prefix
    LONG_LIVED.add(prefix)
    try:
        yield ex
    finally:
        ex.shutdown()
        LONG_LIVED.discard(prefix)
    assert not with_prefix(prefix), with_prefix(prefix)


def tag_session() -> str:
    """Give this session a fresh tag (in ``os.environ``, so its children inherit it)."""
    tag = f"t{secrets.token_hex(4)}"
    os.environ[SHM_TAG_ENV] = tag
    return tag


def _mine(name: str) -> bool:
    """Made by this session: the name carries its tag, or the pid of this process.

    Without a tag (``--noconftest``), the old rule: this process's, or a dead
    process's (a child of a test), never a live other's.
    """
    pid = owner_pid(name)
    if pid == os.getpid():
        return True
    tag = shm_tag()
    if tag:
        return name_tag(name) == tag
    return pid is not None and not pid_alive(pid)


def ours(exclude_long_lived: bool = True) -> set[str]:
    """This session's segments and lock files under ``/dev/shm``.

    Not its credit semaphores (``sem.omni-...``): a bare ``PipeChannel``'s keeps its
    name until the semaphore is collected (an executor unlinks it once its workers are
    up), so judging them per test would blame the garbage collector's timing.
    """
    try:
        names = {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX) and _mine(n)}
    except FileNotFoundError:
        return set()
    if exclude_long_lived:
        names = {n for n in names if not any(n.startswith(p) for p in LONG_LIVED)}
    return names


def with_prefix(prefix: str) -> set[str]:
    return {n for n in ours(exclude_long_lived=False) if n.startswith(prefix)}
