"""The segment pool: reuse, bounds, exactly-once release, cross-process leases, crash cleanup."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time

import pytest
import torch

import helpers.shm_children as children
from helpers.shm_fixtures import no_shm_leak, segment_pool
from omni_async.core.errors import UsageError
from omni_async.transport.errors import (
    LeaseAlreadyReleased,
    PoolClosed,
    PoolExhausted,
    SegmentTooLarge,
    TransportError,
    UnknownSegment,
)
from omni_async.transport.shm import (
    Lease,
    SegmentPool,
    attach_view,
    list_segments,
    size_class,
    sweep_dead_executors,
    unlink_all_with_prefix,
)

SPAWN = multiprocessing.get_context("spawn")
pytestmark = pytest.mark.usefixtures("no_shm_leak")
__all__ = ["no_shm_leak", "segment_pool"]  # fixtures, used by name


def test_size_classes() -> None:
    assert size_class(1, 1 << 16) == 1 << 16
    assert size_class((1 << 16) + 1, 1 << 16) == 1 << 17
    assert size_class(1 << 20, 1 << 16) == 1 << 20
    assert size_class((1 << 20) + 1, 1 << 16) == 1 << 21


def test_zero_creations_per_request_in_steady_state(segment_pool: SegmentPool) -> None:
    pool = segment_pool
    for _ in range(3):  # warm-up: the first request creates
        pool.release(pool.lease(300_000))
    warm = pool.stats()
    for i in range(200):
        lease = pool.lease(300_000 - i * 7)  # varying sizes, one class
        pool.view(lease)[:16].fill_(i % 256)
        pool.release(lease)
    st = pool.stats()
    assert warm.created == 1 and st.created == 1, st
    assert st.reused == warm.reused + 200
    assert st.leased == st.released and st.outstanding == 0
    assert st.bytes == 1 << 19 and st.bytes_leased == 0
    assert len(list_segments(pool.prefix)) == 1


def test_a_free_segment_one_class_up_is_reused(segment_pool: SegmentPool) -> None:
    pool = segment_pool
    pool.release(pool.lease(1 << 20))
    lease = pool.lease(600_000)  # class 1 MiB -> 1 MiB exists: reused
    small = pool.lease(400_000)  # class 512 KiB -> none; 1 MiB is leased: created
    st = pool.stats()
    assert (st.created, st.reused) == (2, 1) and lease.size == 1 << 20 and small.size == 1 << 19
    pool.release(lease)
    pool.release(small)


def test_release_exactly_once(segment_pool: SegmentPool) -> None:
    pool = segment_pool
    lease = pool.lease(1000)
    assert pool.is_leased(lease)
    pool.release(lease)
    assert not pool.is_leased(lease)
    with pytest.raises(LeaseAlreadyReleased):
        pool.release(lease)
    again = pool.lease(1000)  # same slot, new generation: the stale lease stays stale
    assert again.slot == lease.slot and again.generation == lease.generation + 1
    with pytest.raises(LeaseAlreadyReleased):
        pool.release(lease)
    with pytest.raises(LeaseAlreadyReleased):
        pool.hand_off(lease)
    pool.release(again)


def test_leaks_are_detectable(segment_pool: SegmentPool) -> None:
    pool = segment_pool
    lease = pool.lease(5000)
    (info,) = pool.outstanding()
    assert info.name == lease.name and info.owner_pid == os.getpid()
    pool.hand_off(lease)
    assert pool.outstanding()[0].owner_pid == -os.getpid()  # shipped by us, not received yet
    assert pool.receive(lease)
    assert pool.outstanding()[0].owner_pid == 0  # the consumer's
    assert not pool.receive(lease)  # once
    pool.release(lease)
    assert pool.outstanding() == []
    assert not pool.receive(lease)  # released: nothing to mark, and no error


def test_foreign_and_forged_leases_are_rejected(segment_pool: SegmentPool) -> None:
    pool = segment_pool
    with pytest.raises(UnknownSegment):
        pool.release(Lease("omni-0-nope-", 0, 1, 1, 1 << 16, 10))
    with pytest.raises(UnknownSegment):
        pool.release(Lease(pool.prefix, 999, 1, 1, 1 << 16, 10))
    with pytest.raises(UnknownSegment):
        SegmentPool.for_prefix("omni-0-nope-")


def test_bounds_wait_then_raise(no_shm_leak: None) -> None:
    with SegmentPool(max_bytes=1 << 20, max_segments=2, lease_timeout=0.1) as pool:
        with pytest.raises(SegmentTooLarge):
            pool.lease((1 << 20) + 1)
        a, b = pool.lease(1000), pool.lease(1000)  # max_segments reached
        t0 = time.monotonic()
        with pytest.raises(PoolExhausted) as info:
            pool.lease(1000)
        assert time.monotonic() - t0 >= 0.09 and info.value.timeout == 0.1
        # A release from another thread ends the wait.
        threading.Timer(0.05, pool.release, args=(a,)).start()
        c = pool.lease(1000, timeout=5.0)
        pool.release(b)
        pool.release(c)
        with pytest.raises(UsageError):
            pool.lease(0)


@pytest.mark.slow
def test_waits_for_room_are_counted_and_a_full_pool_says_so_while_it_lasts(no_shm_leak: None) -> None:
    """Back-pressure is never silent: stats() tells a waiting lease, how long, and the give-ups."""
    with SegmentPool(max_bytes=1 << 20, max_segments=1, lease_timeout=0.1) as pool:
        st = pool.stats()
        assert (st.lease_waits, st.lease_wait_s, st.exhausted, st.full_for_s) == (0, 0.0, 0, 0.0)
        a = pool.lease(1000)
        assert pool.stats().full_for_s == 0.0, "full, but nobody waits"
        got: list[Lease] = []
        waiter = threading.Thread(target=lambda: got.append(pool.lease(1000, timeout=10.0)))
        waiter.start()
        time.sleep(0.3)
        st = pool.stats()
        assert st.full_for_s >= 0.2 and st.lease_waits == 0, st  # waiting now, for that long
        pool.release(a)
        waiter.join(5.0)
        st = pool.stats()
        assert st.lease_waits == 1 and st.lease_wait_s >= 0.25 and st.exhausted == 0, st
        assert st.full_for_s == 0.0, "the wait ended: no longer full"
        with pytest.raises(PoolExhausted):
            pool.lease(1000)
        st = pool.stats()
        assert st.lease_waits == 2 and st.exhausted == 1, st
        time.sleep(1.1)  # nobody waits any more: "full" ends by itself (within 1 s)
        assert pool.stats().full_for_s == 0.0
        pool.release(got[0])


def test_free_segments_of_other_classes_are_evicted_for_room(no_shm_leak: None) -> None:
    with SegmentPool(max_bytes=1 << 20, max_segments=8) as pool:
        smalls = [pool.lease(100_000) for _ in range(4)]  # 4 x 128 KiB
        old_names = [s.name for s in smalls]
        for s in smalls:
            pool.release(s)
        big = pool.lease(900_000)  # 1 MiB: only fits after evicting all four
        st = pool.stats()
        assert st.evicted == 4 and st.bytes == 1 << 20
        assert not set(old_names) & set(list_segments(pool.prefix))
        pool.view(big).fill_(3)
        pool.release(big)


def test_map_segments_maps_what_the_pool_holds_in_another_process(no_shm_leak: None) -> None:
    """The segments made ahead, mapped by a process that did not make them (a worker): the
    mapping it then leases is the one already made (no mmap in the pack)."""
    from omni_async.transport.shm import mapping

    pool = SegmentPool(max_bytes=8 << 20, max_segments=4)
    try:
        pool.prewarm(100_000, 2)
        names = pool.segment_names()
        mapping.drop_mappings(pool.prefix)  # as a process that never mapped them
        assert [mapping.find_mapping(n) for n in names] == [None, None]
        mapped, pinned = pool.map_segments(pin=False)
        assert (mapped, pinned) == (2, 0)
        found = [mapping.find_mapping(n) for n in names]
        assert all(m is not None for m in found)
        lease = pool.lease(100_000)
        assert any(pool.view(lease).data_ptr() == m.base.data_ptr() for m in found if m is not None)
        pool.release(lease)
    finally:
        pool.close()
    with pytest.raises(PoolClosed):
        pool.map_segments()


def test_closed_pool(no_shm_leak: None) -> None:
    pool = SegmentPool(max_bytes=4 << 20)
    lease = pool.lease(10_000)
    keep = pool.view(lease)[:4]
    keep.fill_(9)
    assert len(list_segments(pool.prefix)) == 1
    assert pool.close() >= 1
    assert list_segments(pool.prefix) == []
    assert keep.tolist() == [9, 9, 9, 9]  # a view held across close stays readable
    assert pool.close() == 0  # idempotent
    with pytest.raises(PoolClosed):
        pool.lease(10)
    with pytest.raises(PoolClosed):
        pool.release(lease)


def test_unlink_all_with_prefix_needs_no_pool(no_shm_leak: None) -> None:
    pool = SegmentPool(max_bytes=4 << 20)
    leases = [pool.lease(70_000), pool.lease(300_000)]
    assert unlink_all_with_prefix(pool.prefix) == 2
    assert list_segments(pool.prefix) == []
    assert pool.view(leases[0]).numel() == 1 << 17  # mapped views outlive the names
    pool.close()


def test_unlink_all_with_prefix_refuses_broad_prefixes() -> None:
    for bad in ("", "omni", "/dev/shm/x", "a*b", "../x"):
        with pytest.raises(UsageError):
            unlink_all_with_prefix(bad)
    with pytest.raises(UsageError):
        SegmentPool(prefix="not-ours-")


def _assert_table_true(pool: SegmentPool) -> None:
    """Nothing leased, and the files under /dev/shm are exactly the segments the table names."""
    assert pool.outstanding() == []
    assert set(list_segments(pool.prefix)) == set(pool.segment_names())
    st = pool.stats()
    assert st.bytes_leased == 0 and st.segments == len(pool.segment_names())


@pytest.mark.parametrize("cut", ["granting", "evicting"])
@pytest.mark.slow
def test_a_process_killed_inside_the_lock_is_repaired_after(cut: str, no_shm_leak: None) -> None:
    with SegmentPool(max_bytes=1 << 20, lock_timeout=5) as pool:
        p = SPAWN.Process(target=children.die_inside_the_lock, args=(pool, None, cut))
        p.start()
        p.join(60)
        assert p.exitcode == -signal.SIGKILL
        t0 = time.monotonic()
        st = pool.stats()  # the kernel dropped the dead holder's flock: no wait
        assert time.monotonic() - t0 < 2.5  # not the 5 s lock timeout
        assert st.repairs == 1
        _assert_table_true(pool)
        assert pool.reclaim_owner(p.pid or 0) == 0  # the repair already did it
        # The pool still serves its whole budget.
        lease = pool.lease(pool.max_bytes, timeout=0)
        pool.release(lease)
        _assert_table_true(pool)


@pytest.mark.slow
def test_a_live_holder_times_out_the_others_and_its_death_frees_the_lock(no_shm_leak: None) -> None:
    with SegmentPool(max_bytes=1 << 20, lock_timeout=0.2) as pool:
        recv, send = SPAWN.Pipe(duplex=False)
        p = SPAWN.Process(target=children.die_inside_the_lock, args=(pool, send, "holding"))
        p.start()
        send.close()
        assert recv.poll(60)
        pid = recv.recv()
        with pytest.raises(TransportError, match=f"held by live process {pid}"):
            pool.lease(100)
        os.kill(pid, signal.SIGKILL)
        p.join(10)
        pool.release(pool.lease(100))
        assert pool.stats().repairs == 1
        _assert_table_true(pool)


@pytest.mark.slow
def test_workers_killed_at_random_points_leave_a_true_table(no_shm_leak: None) -> None:
    # Children that lease, write and release as fast as they can (creating and evicting
    # segments in a tight budget) are SIGKILLed wherever they happen to be.
    rng = random.Random(5)
    with SegmentPool(max_bytes=2 << 20, max_segments=6) as pool:
        for seed in range(4):
            p = SPAWN.Process(target=children.lease_and_release_forever, args=(pool, seed))
            busy = pool.stats().leased + 200
            p.start()
            deadline = time.monotonic() + 60
            while pool.stats().leased < busy and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.05))
            assert p.pid is not None
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            pool.reclaim_owner(p.pid)
            _assert_table_true(pool)
            pool.release(pool.lease(pool.max_bytes, timeout=0))  # the whole budget still serves
        assert pool.stats().leased >= 4 * 200


def test_a_child_process_leases_writes_and_hands_off(segment_pool: SegmentPool) -> None:
    pool = segment_pool
    recv, send = SPAWN.Pipe(duplex=False)
    p = SPAWN.Process(target=children.lease_and_fill, args=(pool, send, 123_456, 0xA5))
    p.start()
    send.close()
    assert recv.poll(60)
    lease: Lease = recv.recv()
    p.join(30)
    assert p.exitcode == 0
    view = pool.view(lease)  # this process attaches by name
    assert int(view[:123_456].to(torch.int64).sum()) == 0xA5 * 123_456
    assert p.pid is not None and pool.outstanding()[0].owner_pid == -p.pid  # shipped by the child
    assert pool.receive(lease)  # its "message" arrived
    assert pool.outstanding()[0].owner_pid == 0
    assert pool.stats().created == 1  # the child created it, in our table
    pool.release(lease)
    assert attach_view(lease.name, lease.size).data_ptr() == view.data_ptr()  # mapping cached


@pytest.mark.slow
def test_sigkilled_child_cleanup(segment_pool: SegmentPool) -> None:
    pool = segment_pool
    recv, send = SPAWN.Pipe(duplex=False)
    p = SPAWN.Process(target=children.hold_segments_then_hang, args=(pool, send))
    p.start()
    send.close()
    assert recv.poll(60)
    handed, kept_names, child_prefix, child_names = recv.recv()
    assert len(list_segments(child_prefix)) == 2 == len(child_names)
    assert p.pid is not None
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL
    # The executor reclaims the dead worker's leases it never handed off...
    assert pool.stats().outstanding == 3
    assert pool.reclaim_owner(p.pid) == 2
    assert not set(kept_names) & set(list_segments(pool.prefix))
    assert pool.is_leased(handed)  # ...but not the one already handed to a consumer
    pool.release(handed)
    # The child's own pool (the child was an executor) dies with it: sweep by prefix.
    assert sweep_dead_executors() >= 2
    assert list_segments(child_prefix) == []
    assert pool.stats().reclaimed == 2


@pytest.mark.slow
def test_a_lease_shipped_by_a_dead_process_and_never_received_is_reclaimed(segment_pool: SegmentPool) -> None:
    """The long soak's leaked lease, at the pool: a process hands off two leases and dies
    having sent only one.  ``reclaim_owner`` spares both (a message may still come);
    once the sent one is received, ``reclaim_shipped`` frees only the lost one."""
    pool = segment_pool
    recv, send = SPAWN.Pipe(duplex=False)
    p = SPAWN.Process(target=children.ship_two_send_one_then_hang, args=(pool, send))
    p.start()
    send.close()
    assert recv.poll(60)
    sent, lost = recv.recv()
    assert p.pid is not None
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert pool.reclaim_owner(p.pid) == 0  # both were handed off
    assert pool.receive(sent)
    assert pool.reclaim_shipped(p.pid) == 1
    assert pool.is_leased(sent) and not pool.is_leased(lost)
    assert [i.name for i in pool.outstanding()] == [sent.name]
    assert pool.reclaim_shipped(p.pid) == 0  # idempotent
    pool.release(sent)
    with pytest.raises(LeaseAlreadyReleased):
        pool.release(lost)
    assert pool.stats().reclaimed == 1


def test_receive_never_raises_for_a_lease_that_is_not_shipped(segment_pool: SegmentPool) -> None:
    """It runs on the executor's pump for every message: a forged, foreign, stale or
    never-handed-off lease is left alone (its unpack reports what is wrong)."""
    pool = segment_pool
    lease = pool.lease(5000)
    assert not pool.receive(lease)  # leased, not handed off: still the leaser's
    assert pool.outstanding()[0].owner_pid == os.getpid()
    assert not pool.receive(Lease("omni-0-nope-", 0, 1, 1, 1 << 16, 10))
    assert not pool.receive(Lease(pool.prefix, 999, 1, 1, 1 << 16, 10))
    assert not pool.receive(Lease(pool.prefix, lease.slot, lease.incarnation, lease.generation + 1, lease.size, 10))
    pool.release(lease)
    with pytest.raises(UsageError):
        pool.reclaim_shipped(0)


_ATTACH_CHILD = """
import pickle, sys
pool = pickle.loads(sys.stdin.buffer.read())
lease = pool.lease(100_000, timeout=5)
pool.view(lease)[:100_000].fill_(0x5A)
pool.hand_off(lease)
sys.stdout.buffer.write(pickle.dumps(lease))
"""


@pytest.mark.slow
def test_a_pool_attached_by_name_pickles_anywhere(no_shm_leak: None) -> None:
    """``attach_by_name``: the table lives in the lock file, so a process that is no child
    of ours (a Ray actor) attaches from the pickled pool; a default pool refuses."""
    import pickle
    import subprocess
    import sys

    with SegmentPool(max_bytes=16 << 20, max_segments=4) as plain:
        with pytest.raises(pickle.PicklingError):  # its RawArray travels only by spawning
            pickle.dumps(plain)
    with SegmentPool(max_bytes=16 << 20, max_segments=4, attach_by_name=True) as pool:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run(
            [sys.executable, "-c", _ATTACH_CHILD], input=pickle.dumps(pool), capture_output=True, env=env, timeout=60
        )
        assert done.returncode == 0, done.stderr.decode()
        lease: Lease = pickle.loads(done.stdout)
        assert pool.stats().created == 1  # the stranger created it, in our table
        assert pool.receive(lease)
        assert int(pool.view(lease)[:100_000].to(torch.int64).sum()) == 0x5A * 100_000
        pool.release(lease)
        assert not pool.outstanding()
