"""Segment prefixes that outlive one test (module-scoped executors).

conftest's per-test leak check skips them; the fixture that owns such a prefix
checks, after its executor shut down, that no segment with it remains.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from omni_async.transport.shm import SHM_DIR, pid_alive
from omni_async.transport.shm import SHM_PREFIX_ROOT as SHM_PREFIX

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



def _mine(name: str) -> bool:
    """Made by this process, or by a process that is gone (a child of a test).

    Segments of other live processes (a concurrent test run, a demo) are not ours to
    judge: the pool's names are ``omni-<creating pid>-...``.
    """
    pid_text = name[len(SHM_PREFIX) :].split("-", 1)[0]
    if not pid_text.isdigit():
        return True
    pid = int(pid_text)
    return pid == os.getpid() or not pid_alive(pid)


def ours(exclude_long_lived: bool = True) -> set[str]:
    try:
        names = {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX) and _mine(n)}
    except FileNotFoundError:
        return set()
    if exclude_long_lived:
        names = {n for n in names if not any(n.startswith(p) for p in LONG_LIVED)}
    return names


def with_prefix(prefix: str) -> set[str]:
    return {n for n in ours(exclude_long_lived=False) if n.startswith(prefix)}
