"""Issue 8, defect 1: a released output must never change under a view the caller kept.

The rule under test (``omni_async.transport.packing``): the zero-copy views an unpack
returns hold their segment; it goes back to the pool when the last of them is gone,
never before.  ``release_unpacked_output`` takes the output's own views back and
releases at once when no other view is left, and raises ``OutputStillViewed`` (naming
the output, how many views live, what to do) when some are: loud, never stale, and the
segment still goes back by itself when those views go.
"""

from __future__ import annotations

import gc
import multiprocessing
import queue
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers.shm_children as children
from helpers.finalizers import quiet_finalizers
from helpers.hypo import examples
from helpers.shm_fixtures import no_shm_leak, segment_pool
from omni_async.core.messages import DiffusionOutput
from omni_async.transport.errors import LeaseAlreadyReleased, OutputStillViewed
from omni_async.transport.packing import (
    pack_diffusion_output_shm,
    packed_lease,
    release_packed_output,
    release_unpacked_output,
    settle_releases,
    unpack_diffusion_output_shm,
    viewed_segment,
)
from omni_async.transport.shm import SegmentPool

__all__ = ["no_shm_leak", "segment_pool"]
SPAWN = multiprocessing.get_context("spawn")
N = 1 << 16  # float32 elements: 256 KiB per tensor, always shared memory


def packed(pool: SegmentPool, fill: float, rid: str = "r") -> DiffusionOutput:
    value = {
        "image": torch.full((N,), fill),
        "latent": torch.full((N // 2,), -fill, dtype=torch.float64),
        "audio": np.full(N, fill, dtype=np.float32),
        "note": rid,
    }
    return pack_diffusion_output_shm(
        DiffusionOutput(rid, value, async_output_id=f"o-{rid}"), pool=pool, inline_threshold=0
    )


def churn(pool: SegmentPool, fills: list[float]) -> None:
    """More requests of the same size: each one takes a free segment (the released one)."""
    for i, fill in enumerate(fills):
        out = unpack_diffusion_output_shm(packed(pool, fill, f"churn{i}"))
        assert float(out.output["image"][0]) == fill
        assert release_unpacked_output(out) == 1


def outstanding(pool: SegmentPool) -> int:
    settle_releases()
    return pool.stats().outstanding


def test_a_kept_view_never_changes_after_its_output_is_released(segment_pool: SegmentPool) -> None:
    out = unpack_diffusion_output_shm(packed(segment_pool, 1.0, "a"))
    kept = out.output["image"]
    before = kept.clone()
    loud = False
    try:
        release_unpacked_output(out)
    except OutputStillViewed as err:
        loud = True
        assert err.output_id == "o-a" and err.views == 1, err
    churn(segment_pool, [2.0, 3.0, 4.0, 5.0])
    assert torch.equal(kept, before), f"the kept view changed: sum {float(before.sum())} -> {float(kept.sum())}"
    assert loud, "releasing an output whose tensor is still held must fail loudly"
    del kept
    assert outstanding(segment_pool) == 0


def test_a_segment_is_reused_only_after_its_last_view_is_gone(segment_pool: SegmentPool) -> None:
    out = unpack_diffusion_output_shm(packed(segment_pool, 1.0, "a"))
    t = out.output["image"][::2]  # a view of a view
    a = out.output["audio"][10:]
    del out
    assert outstanding(segment_pool) == 1
    other = packed(segment_pool, 2.0, "b")  # the first segment is still viewed: a second one
    st = segment_pool.stats()
    assert st.created == 2 and st.reused == 0, st
    assert release_packed_output(other) == 1
    del t
    assert outstanding(segment_pool) == 1, "the array view still holds the segment"
    assert float(a[0]) == 1.0
    del a
    assert outstanding(segment_pool) == 0
    churn(segment_pool, [3.0])
    assert segment_pool.stats().reused == 1 and segment_pool.stats().created == 2


def _derive(kind: str, out: DiffusionOutput) -> object:
    t: torch.Tensor = out.output["image"]
    a: np.ndarray[Any, Any] = out.output["audio"]
    if kind == "tensor_slice":
        return t[5:]
    if kind == "tensor_numpy":
        return t.numpy()
    if kind == "np_asarray":
        return np.asarray(t)
    if kind == "memoryview":
        return memoryview(a.data)
    if kind == "from_numpy":
        return torch.from_numpy(a)
    if kind == "storage":
        return t.untyped_storage()
    if kind == "dlpack":
        return torch.utils.dlpack.from_dlpack(t.__dlpack__())
    if kind == "array_reshape":
        return a.reshape(16, -1).T
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["tensor_slice", "tensor_numpy", "np_asarray", "memoryview", "from_numpy", "storage", "dlpack", "array_reshape"],
)
def test_every_kind_of_derived_view_holds_the_segment(segment_pool: SegmentPool, kind: str) -> None:
    out = unpack_diffusion_output_shm(packed(segment_pool, 1.0))
    view = _derive(kind, out)
    with pytest.raises(OutputStillViewed):
        release_unpacked_output(out)
    churn(segment_pool, [7.0, 8.0])
    assert outstanding(segment_pool) == 1
    del view
    assert outstanding(segment_pool) == 0


def test_release_with_no_view_left_gives_the_segment_back_at_once(segment_pool: SegmentPool) -> None:
    p = packed(segment_pool, 1.0)
    out = unpack_diffusion_output_shm(p)
    assert float(out.output["latent"][0]) == -1.0
    assert release_unpacked_output(out) == 1
    assert segment_pool.stats().outstanding == 0  # at once, no settling needed
    with pytest.raises(LeaseAlreadyReleased, match="o-r"):
        out.output["image"]  # reading a released output is loud, not stale
    with pytest.raises(LeaseAlreadyReleased):
        release_unpacked_output(out)
    with pytest.raises(LeaseAlreadyReleased):
        release_packed_output(p)
    assert "released" in repr(out)


def test_release_with_a_live_view_is_loud_and_leaks_nothing(segment_pool: SegmentPool) -> None:
    p = packed(segment_pool, 1.0)
    lease = packed_lease(p)
    assert lease is not None
    out = unpack_diffusion_output_shm(p)
    image, audio = out.output["image"], out.output["audio"]
    with pytest.raises(OutputStillViewed) as info:
        release_unpacked_output(out)
    err = info.value
    assert err.output_id == "o-r" and err.views == 2 and err.segment == lease.name
    assert "copy" in str(err) and "drop" in str(err).lower() and "2 tensor" in str(err)
    with pytest.raises(OutputStillViewed):
        release_packed_output(p)  # the packed handle cannot pull it from under the views
    assert outstanding(segment_pool) == 1
    assert float(image[0]) == 1.0 and float(audio[0]) == 1.0
    del image
    assert outstanding(segment_pool) == 1
    del audio
    assert outstanding(segment_pool) == 0
    with pytest.raises(LeaseAlreadyReleased):
        release_packed_output(p)


def test_copies_release_at_once_and_bytes_leaves_are_copies(segment_pool: SegmentPool) -> None:
    p = pack_diffusion_output_shm(
        DiffusionOutput("r", {"t": torch.ones(N), "blob": b"\x07" * 100_000}), pool=segment_pool, inline_threshold=0
    )
    got = unpack_diffusion_output_shm(p, copy=True).output
    assert segment_pool.stats().outstanding == 0
    churn(segment_pool, [9.0])
    assert torch.equal(got["t"], torch.ones(N)) and got["blob"] == b"\x07" * 100_000
    # Only bytes in shared memory: nothing views the segment, it goes back during the unpack.
    p = pack_diffusion_output_shm(
        DiffusionOutput("r", {"blob": b"\x05" * 100_000}), pool=segment_pool, inline_threshold=0
    )
    blob = unpack_diffusion_output_shm(p).output["blob"]
    assert segment_pool.stats().outstanding == 0 and blob == b"\x05" * 100_000


def test_views_dropped_on_another_thread_give_the_segment_back(segment_pool: SegmentPool) -> None:
    out = unpack_diffusion_output_shm(packed(segment_pool, 1.0))
    box: queue.Queue[list[object]] = queue.Queue()
    box.put([out.output["image"], out.output["audio"], out.output["latent"][1:]])
    del out

    def consumer() -> None:
        views = box.get()
        assert float(views[0][0]) == 1.0  # type: ignore[index]
        views.clear()  # the last views die on this thread: so does the release

    with quiet_finalizers() as caught:
        th = threading.Thread(target=consumer)
        th.start()
        th.join(10)
        assert outstanding(segment_pool) == 0
    assert caught == []


def test_views_outliving_their_pool_stay_readable_and_release_quietly(no_shm_leak: None) -> None:
    pool = SegmentPool(max_bytes=8 << 20)
    out = unpack_diffusion_output_shm(packed(pool, 3.0))
    kept, arr = out.output["image"], out.output["audio"]
    del out
    assert pool.stats().outstanding == 1
    pool.close()  # shutdown with live views: the files go, the mapping stays
    assert float(kept.sum()) == 3.0 * N and float(arr[-1]) == 3.0
    with quiet_finalizers() as caught:
        del kept, arr
        gc.collect()
        settle_releases()
    assert caught == []


def test_a_view_collected_inside_the_pools_lock_neither_deadlocks_nor_leaks(segment_pool: SegmentPool) -> None:
    """The garbage collector can run anywhere, also on a thread inside the pool's lock;
    the release it triggers must not wait for that lock on the same thread."""
    out = unpack_diffusion_output_shm(packed(segment_pool, 1.0))
    cycle: list[object] = [out.output["image"]]
    cycle.append(cycle)
    del out, cycle
    assert segment_pool.stats().outstanding == 1
    with quiet_finalizers() as caught:
        t0 = time.monotonic()
        with segment_pool._locked():
            gc.collect()
        assert time.monotonic() - t0 < 2.0
        assert outstanding(segment_pool) == 0
    assert caught == []


def test_a_consumer_process_that_exits_holding_views_gives_them_back(segment_pool: SegmentPool) -> None:
    p = packed(segment_pool, 4.0)
    recv, send = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=children.unpack_keep_and_exit, args=(segment_pool, send, p))
    proc.start()
    send.close()
    assert recv.poll(60)
    assert recv.recv() == 4.0 * N
    proc.join(30)
    assert proc.exitcode == 0
    assert segment_pool.outstanding() == []


def test_a_second_zero_copy_unpack_shares_the_views(segment_pool: SegmentPool) -> None:
    p = packed(segment_pool, 1.0)
    first = unpack_diffusion_output_shm(p)
    second = unpack_diffusion_output_shm(p)
    assert first.output["image"].data_ptr() == second.output["image"].data_ptr()
    with pytest.raises(OutputStillViewed):
        release_unpacked_output(first)  # the second output still views it
    assert release_unpacked_output(second) == 1
    assert segment_pool.stats().outstanding == 0
    with pytest.raises(LeaseAlreadyReleased):
        unpack_diffusion_output_shm(p)  # a stale handle: loud, never a view of reused bytes


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("keep"), st.sampled_from(["image", "latent", "audio"])),
        st.tuples(st.just("derive"), st.integers(0, 7)),
        st.tuples(st.just("drop"), st.integers(0, 7)),
        st.tuples(st.just("release"), st.just(0)),
        st.tuples(st.just("drop_output"), st.just(0)),
        st.tuples(st.just("churn"), st.just(0)),
    ),
    max_size=14,
)


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(ops=OPS)
def test_any_order_of_keep_drop_release_never_shows_other_bytes(no_shm_leak: None, ops: list[tuple[str, Any]]) -> None:
    with SegmentPool(max_bytes=16 << 20, max_segments=4, lease_timeout=2.0) as pool:
        _keep_drop_release(pool, ops)


def _keep_drop_release(segment_pool: SegmentPool, ops: list[tuple[str, Any]]) -> None:
    out: DiffusionOutput | None = unpack_diffusion_output_shm(packed(segment_pool, 1.0))
    released = False
    kept: list[tuple[Any, Any]] = []  # (view, a copy of its values when taken)
    fill = 10.0

    def snapshot(v: Any) -> Any:
        return v.clone() if isinstance(v, torch.Tensor) else np.array(v, copy=True)

    def same(v: Any, s: Any) -> bool:
        return bool(torch.equal(v, s)) if isinstance(v, torch.Tensor) else bool(np.array_equal(v, s))

    def take(v: Any) -> None:  # no local of the loop below may keep a view alive
        kept.append((v, snapshot(v)))

    for op, arg in ops:
        if op == "keep" and out is not None and not released:
            take(out.output[arg])
        elif op == "derive" and kept:
            take(kept[arg % len(kept)][0][1::3])
        elif op == "drop" and kept:
            kept.pop(arg % len(kept))
        elif op == "release" and out is not None and not released:
            released = True
            if kept:
                with pytest.raises(OutputStillViewed):
                    release_unpacked_output(out)
            else:
                assert release_unpacked_output(out) == 1
        elif op == "drop_output":
            out = None
        elif op == "churn":
            fill += 1.0
            churn(segment_pool, [fill])
        assert all(same(v, s) for v, s in kept), "a kept view shows other bytes"
        viewed = bool(kept) or (out is not None and not released)
        assert outstanding(segment_pool) == (1 if viewed else 0), (op, len(kept), out is not None, released)
    kept.clear()
    out = None
    assert outstanding(segment_pool) == 0


def test_viewed_segment_names_the_segment_the_views_slice(segment_pool: SegmentPool) -> None:
    """What the engine's ``sink="segment"`` lends: the segment's name and where each leaf lies."""
    packed_out = packed(segment_pool, 2.5, "named")
    lease = packed_lease(packed_out)
    out = unpack_diffusion_output_shm(packed_out)
    found = viewed_segment(out)
    assert found is not None and lease is not None
    name, size, address = found
    assert (name, size) == (lease.name, lease.size)
    image = out.output["image"]
    offset = image.data_ptr() - address
    assert 0 <= offset and offset + image.numel() * 4 <= size
    with open(f"/dev/shm/{name}", "rb") as f:  # another reader, by name alone
        f.seek(offset)
        assert np.array_equal(np.frombuffer(f.read(image.numel() * 4), np.float32), image.numpy())
    del image
    assert release_unpacked_output(out) == 1
    assert viewed_segment(out) is None  # released: nothing to name
    copied = unpack_diffusion_output_shm(packed(segment_pool, 1.0, "copied"), copy=True)
    assert viewed_segment(copied) is None
