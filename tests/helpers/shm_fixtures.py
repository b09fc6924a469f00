"""Shared-memory fixtures for the transport tests (wired into conftest.py by its owner).

``no_shm_leak``: fails a test that leaves a ``/dev/shm`` entry with the project's prefix
behind (and unlinks it, so one leak does not fail every later test).
``segment_pool``: a small ``SegmentPool`` that must end its test with no lease
outstanding (a leaked lease fails the test), closed afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from helpers.leaks import ours
from omni_async.transport.shm import SHM_DIR, SegmentPool


def _ours() -> set[str]:
    # Same rule as conftest's autouse check (this fixture also serves runs with
    # --noconftest): segments of this process or of dead ones, not of live others.
    return ours(exclude_long_lived=False)


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
