"""Process targets for the shared-memory tests (spawned children import this module by name)."""

from __future__ import annotations

import os
import random
import signal
import time
from multiprocessing.connection import Connection
from typing import NoReturn

import torch

from omni_async.core.messages import DiffusionOutput
from omni_async.transport.errors import PoolExhausted
from omni_async.transport.packing import release_unpacked_output, unpack_diffusion_output_shm
from omni_async.transport.shm import Lease, SegmentPool, files
from omni_async.transport.shm import table as shm  # where the pool grants a Lease


def lease_and_fill(pool: SegmentPool, conn: Connection, nbytes: int, value: int) -> None:
    """Lease a segment in this process, fill it, hand it off and send the lease back."""
    lease = pool.lease(nbytes)
    view = pool.view(lease)
    view[:nbytes].fill_(value)
    pool.hand_off(lease)
    conn.send(lease)
    conn.close()


def _checksums(out: DiffusionOutput) -> dict[str, object]:
    report: dict[str, object] = {}
    for key, t in out.output.items():
        if isinstance(t, torch.Tensor):
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            report[key] = (str(t.dtype), tuple(t.shape), int(raw.to(torch.int64).sum()), raw[:64].tolist())
    return report


def unpack_and_check(pool: SegmentPool, conn: Connection, packed: DiffusionOutput) -> None:
    """Unpack without copying, report each tensor's raw bytes checksum, release here."""
    out = unpack_diffusion_output_shm(packed)
    report = _checksums(out)  # its views die with the helper's frame
    report["_released"] = release_unpacked_output(out, pool=pool)
    conn.send(report)
    conn.close()


_KEPT: list[object] = []


def unpack_keep_and_exit(pool: SegmentPool, conn: Connection, packed: DiffusionOutput) -> None:
    """Unpack without copying, keep a view in a global and exit normally while holding it."""
    out = unpack_diffusion_output_shm(packed)
    _KEPT.append(out.output["image"])
    conn.send(float(out.output["image"].sum()))
    conn.close()


def hold_segments_then_hang(pool: SegmentPool, conn: Connection) -> None:
    """Take leases from the executor's pool and make segments of a pool of our own, then hang.

    The parent SIGKILLs us: reclaim_owner must free the two leases never handed off
    (and spare the handed-off one), and unlink_all_with_prefix must clean our own pool.
    """
    kept = [pool.lease(100_000), pool.lease(200_000)]
    handed = pool.lease(300_000)
    pool.hand_off(handed)
    own = SegmentPool(max_bytes=8 << 20)
    own_leases = [own.lease(70_000), own.lease(1 << 20)]
    for lease in own_leases:
        own.view(lease).fill_(1)
    conn.send((handed, [lease.name for lease in kept], own.prefix, own.segment_names()))
    time.sleep(120)


def ship_two_send_one_then_hang(pool: SegmentPool, conn: Connection) -> None:
    """Hand off two leases, "send" only the first (its message, over ``conn``), then hang.

    The parent SIGKILLs us: the second is the soak's leaked lease, shipped and never
    sent; ``reclaim_shipped`` frees it once the first, which arrived, was received.
    """
    sent, lost = pool.lease(100_000), pool.lease(200_000)
    pool.hand_off(sent)
    pool.hand_off(lost)
    conn.send((sent, lost))
    time.sleep(120)


def _kill_self(*args: object, **kwargs: object) -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("still alive after SIGKILL")


def die_inside_the_lock(pool: SegmentPool, conn: Connection, cut: str) -> None:
    """Die (SIGKILL) inside the pool's lock at a real cut point of the pool's own code.

    ``granting``: a lease is written LEASED and owned by us, and we die before returning
    it.  ``evicting``: a free segment of another class is being evicted to make room,
    the slot is EMPTY and we die before its file is unlinked.  ``holding``: we take the
    lock, report in and stay alive inside it until the parent kills us.
    """
    if cut == "granting":
        shm.Lease = _kill_self  # type: ignore[assignment,attr-defined]
        pool.lease(100_000)
    elif cut == "evicting":
        pool.release(pool.lease(100_000))  # a free 128 KiB segment
        files.unlink = _kill_self
        pool.lease(pool.max_bytes)  # needs the whole budget: evicts the free one
    elif cut == "holding":
        with pool._locked():
            conn.send(os.getpid())
            time.sleep(120)
    raise AssertionError(f"cut {cut!r} did not kill this process")


def lease_and_release_forever(pool: SegmentPool, seed: int) -> None:
    """Lease, write and release segments of random sizes (creating and evicting) until killed."""
    rng = random.Random(seed)
    held: list[Lease] = []
    while True:
        if len(held) < 3 and rng.random() < 0.6:
            try:
                lease = pool.lease(rng.choice([50_000, 100_000, 300_000, 700_000]), timeout=0.01)
            except PoolExhausted:
                continue
            pool.view(lease)[:16].fill_(7)
            held.append(lease)
        elif held:
            pool.release(held.pop(rng.randrange(len(held))))
