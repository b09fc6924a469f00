"""Process targets for the shared-memory tests (spawned children import this module by name)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import torch

from omni_async.messages import DiffusionOutput
from omni_async.packing import release_packed_output, unpack_diffusion_output_shm
from omni_async.shm import SegmentPool


def lease_and_fill(pool: SegmentPool, conn: Connection, nbytes: int, value: int) -> None:
    """Lease a segment in this process, fill it, hand it off and send the lease back."""
    lease = pool.lease(nbytes)
    view = pool.view(lease)
    view[:nbytes].fill_(value)
    pool.hand_off(lease)
    conn.send(lease)
    conn.close()


def unpack_and_check(pool: SegmentPool, conn: Connection, packed: DiffusionOutput) -> None:
    """Unpack without copying, report each tensor's raw bytes checksum, release here."""
    out = unpack_diffusion_output_shm(packed)
    report: dict[str, object] = {}
    for key, t in out.output.items():
        if isinstance(t, torch.Tensor):
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            report[key] = (str(t.dtype), tuple(t.shape), int(raw.to(torch.int64).sum()), raw[:64].tolist())
    report["_released"] = release_packed_output(packed, pool=pool)
    conn.send(report)
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
