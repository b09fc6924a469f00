"""The output stores, each on its own: ``InlineStore``, ``PoolStore`` over a real
``SegmentPool`` (packed as a worker packs), ``PathStore`` over the bench's sync path."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch

from omni_async.bench.paths import SYNC, is_fresh, pack_sync_fresh
from omni_async.core.errors import OutputUnpackFailed
from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput
from omni_async.executor.metrics import ExecutorMetrics
from omni_async.executor.path_store import PathStore
from omni_async.executor.pool_store import PoolStore
from omni_async.executor.store import InlineStore
from omni_async.transport.packing import pack_diffusion_output_shm, settle_releases
from omni_async.transport.shm import SegmentPool
from omni_async.transport.shm.files import entries

BIG = 1 << 18  # float32 elements: 1 MiB, well above the inline threshold


@pytest.fixture
def pool() -> Iterator[SegmentPool]:
    p = SegmentPool(max_bytes=8 << 20, max_segments=4, lease_timeout=0.5)
    try:
        yield p
    finally:
        p.close()


def _packed(pool: SegmentPool, oid: str, value: float = 1.0) -> DiffusionOutput:
    out = DiffusionOutput(oid, {"image": torch.full((BIG,), value)}, async_output_id=oid)
    return pack_diffusion_output_shm(out, pool=pool)


def _fresh_files(pool: SegmentPool) -> list[str]:
    return [name for name in entries(pool.prefix) if "fresh" in name]


def _base() -> ExecutorMetrics:
    fields: dict[str, float] = {a.name: 0 for a in ExecutorMetrics.__attrs_attrs__}
    fields.update(output_wait_s_total=0.0, output_wait_s_max=0.0)
    return ExecutorMetrics(**fields)  # type: ignore[arg-type]  # every field by name, ints and floats


def test_inline_store_delivers_as_it_came_and_hands_outputs_for_nobody_to_its_hook() -> None:
    seen: list[DiffusionOutput] = []
    store = InlineStore(seen.append)
    out = DiffusionOutput("r", {"x": 1}, async_output_id="o")
    assert store.receive(out) is out and store.release(out) == 0 and store.budget is None
    assert not store.lends_segments
    store.release_packed(out)
    assert seen == [out]


def test_pool_store_unpacks_views_and_gives_the_segment_back_on_release(pool: SegmentPool) -> None:
    store = PoolStore(pool, copy_outputs=False, lease_timeout=None, owner="Test")
    assert store.budget.max_outputs == 4
    got = store.receive(_packed(pool, "a", 3.0))
    assert torch.equal(got.output["image"], torch.full((BIG,), 3.0))
    assert pool.stats().outstanding == 1
    assert store.release(got) == 1 and pool.stats().outstanding == 0
    assert store.lends_segments  # its outputs view their segments until released: the engine may lend them


def test_pool_store_copies_when_asked_and_the_segment_goes_back_at_once(pool: SegmentPool) -> None:
    store = PoolStore(pool, copy_outputs=True, lease_timeout=None, owner="Test")
    assert not store.lends_segments  # copied out: no segment left to lend
    got = store.receive(_packed(pool, "c", 2.0))
    settle_releases()
    assert pool.stats().outstanding == 0 and float(got.output["image"][0]) == 2.0


def test_pool_store_releases_outputs_for_nobody_and_answers_nobody_takes(pool: SegmentPool) -> None:
    store = PoolStore(pool, copy_outputs=False, lease_timeout=None, owner="Test")
    store.release_packed(_packed(pool, "n"))
    store.discard_answer(BatchDiffusionOutput((_packed(pool, "b1"), _packed(pool, "b2"))))
    store.discard_answer("not an output")
    settle_releases()
    assert pool.stats().outstanding == 0


def test_a_failed_unpack_gives_its_segment_back(pool: SegmentPool) -> None:
    store = PoolStore(pool, copy_outputs=False, lease_timeout=None, owner="Test")
    packed = _packed(pool, "bad")
    pool.close()  # the unpack cannot map the segment any more
    with pytest.raises(OutputUnpackFailed) as err:
        store.receive(packed)
    assert err.value.output_id == "bad"


def test_pool_store_reclaims_what_a_dead_owner_held(pool: SegmentPool, caplog: pytest.LogCaptureFixture) -> None:
    store = PoolStore(pool, copy_outputs=False, lease_timeout=None, owner="Test")
    pool.lease(1 << 20)  # leased by this process, not handed off: as a worker that then died
    caplog.set_level(logging.WARNING, logger="omni_async")
    store.reclaim_owner(0, os.getpid())
    assert pool.stats().outstanding == 0
    assert "died holding 1 segment(s)" in caplog.text


def test_pool_store_metrics_and_close(pool: SegmentPool) -> None:
    store = PoolStore(pool, copy_outputs=False, lease_timeout=None, owner="Test")
    got = store.receive(_packed(pool, "m"))
    m = store.metrics(_base(), held_elsewhere=2, stored=1)
    assert (m.held_outputs, m.max_held_outputs, m.stored_outputs, m.pool_full) == (3, 4, 1, False)
    del got
    prefix = pool.prefix
    store.close()
    assert not entries(prefix)
    after = store.metrics(_base())
    assert after.held_outputs == 0 and after.held_bytes == 0  # the last numbers, nothing held


def test_fresh_store_reads_and_unlinks_a_baseline_output_and_leaves_pooled_ones_to_the_pool(
    pool: SegmentPool,
) -> None:
    store = PathStore(pool, SYNC, copy_outputs=False, lease_timeout=None, owner="Test")
    assert not store.lends_segments  # its outputs' segments are made for each: none to lend
    image = torch.arange(BIG, dtype=torch.float32)
    fresh = pack_sync_fresh(
        DiffusionOutput("f", {"image": image}, async_output_id="f"), None, None, prefix=pool.prefix, inline_threshold=64
    )
    assert is_fresh(fresh) and _fresh_files(pool)
    got = store.receive(fresh)
    assert torch.equal(got.output["image"], image) and not _fresh_files(pool), "read, then unlinked"
    unread = pack_sync_fresh(
        DiffusionOutput("u", {"image": image}, async_output_id="u"), None, None, prefix=pool.prefix, inline_threshold=64
    )
    store.release_packed(unread)
    assert _fresh_files(pool) == [], "an output for nobody is unlinked unread"
    pooled = store.receive(_packed(pool, "p", 5.0))
    assert float(pooled.output["image"][0]) == 5.0
    assert store.release(pooled) == 1
