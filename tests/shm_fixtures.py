"""Shared-memory fixtures for the transport tests (wired into conftest.py by its owner).

``no_shm_leak``: fails a test that leaves a ``/dev/shm`` entry with the project's prefix
behind (and unlinks it, so one leak does not fail every later test).
``segment_pool``: a small ``SegmentPool`` that must end its test with no lease
outstanding (a leaked lease fails the test), closed afterwards.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

from omni_async.shm import SHM_DIR, SHM_PREFIX_ROOT, SegmentPool


_PID = re.compile(rf"^{re.escape(SHM_PREFIX_ROOT)}(\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours() -> set[str]:
    """Entries of pools this test process created, or that a dead process left behind.

    Segment names carry the creating executor's pid.  A live *other* process's segments
    are not ours: another test session running at the same time on this machine must
    not fail our tests, nor have its live segments unlinked by our cleanup.
    """
    me = os.getpid()
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX_ROOT)]
    except FileNotFoundError:
        return set()
    out = set()
    for n in names:
        m = _PID.match(n)
        if m is None or int(m.group(1)) == me or not _alive(int(m.group(1))):
            out.add(n)
    return out


@pytest.fixture
def no_shm_leak() -> Iterator[None]:
    before = _ours()
    yield
    leaked = _ours() - before
    if leaked:
        for name in leaked:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        pytest.fail(f"test leaked shared-memory segments: {sorted(leaked)}")


@pytest.fixture
def segment_pool(no_shm_leak: None) -> Iterator[SegmentPool]:
    pool = SegmentPool(max_bytes=64 << 20, max_segments=16, lease_timeout=2.0)
    try:
        yield pool
        leaked = pool.outstanding()
        assert not leaked, f"test leaked leases: {leaked}"
    finally:
        pool.close()
