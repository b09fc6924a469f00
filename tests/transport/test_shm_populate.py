"""Prewarmed segments are populated in the processes that map them (issue 19): the first
copy into a segment that was only created (pages reserved, none mapped) paid a page
fault per page -- 28 ms for 64 MiB on the 2-core CPU machine, against 11.5 ms into a
segment already written.  ``SegmentPool.prewarm`` populates its own mappings, and
``map_segments`` (a worker, while starting) those it does not pin."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from helpers.shm_fixtures import no_shm_leak
from omni_async.transport.shm import SegmentPool, mapping

__all__ = ["no_shm_leak"]

MIB = 1 << 20


def _rss_of(name: str) -> int:
    """Resident bytes of this process's mapping of ``/dev/shm/<name>`` (/proc/self/smaps)."""
    rss = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
                inside = line.rstrip().endswith(f"/{name}")
            elif inside and line.startswith("Rss:"):
                rss += int(head[1]) * 1024
    return rss


@pytest.fixture
def pool(no_shm_leak: None) -> Iterator[SegmentPool]:
    p = SegmentPool(max_bytes=64 * MIB, max_segments=4, pin_cuda=False)
    try:
        yield p
    finally:
        p.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_prewarm_leaves_its_segments_resident_in_this_process(pool: SegmentPool) -> None:
    pool.prewarm(4 * MIB, 2)
    names = pool.segment_names()
    assert len(names) == 2
    for name in names:
        assert _rss_of(name) >= 4 * MIB, f"{name}: {_rss_of(name)} bytes resident"


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_populate_without_madvise_reads_a_byte_per_page_and_changes_nothing(
    pool: SegmentPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = pool.lease(4 * MIB)
    try:
        view = pool.view(lease)
        view.fill_(7)
        del view
        m = mapping.find_mapping(lease.name)
        assert m is not None
        monkeypatch.setattr(mapping, "_MADV_POPULATE_WRITE", -1)  # refused, as by a kernel before 5.14
        m.populate()
        assert int(pool.view(lease).sum()) == 7 * 4 * MIB
    finally:
        pool.release(lease)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_map_segments_populates_what_it_maps_and_does_not_pin(pool: SegmentPool) -> None:
    """What a worker process does while starting, here in one process: its own mappings
    of the segments made ahead, fresh (the executor's are dropped first)."""
    pool.prewarm(4 * MIB, 2)
    mapping.drop_mappings(pool.prefix)
    names = pool.segment_names()
    assert all(_rss_of(name) == 0 for name in names)  # not mapped here any more
    assert pool.map_segments() == (2, 0)
    for name in names:
        assert _rss_of(name) >= 4 * MIB, f"{name}: {_rss_of(name)} bytes resident"
