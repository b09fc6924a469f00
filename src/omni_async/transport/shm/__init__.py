"""Pooled POSIX shared-memory segments for finished outputs.

``pool``: the bounded pool and its shared slot table; ``lock``: its crash-safe lock;
``mapping``: this process's cached mappings; ``cuda_host``: registering them as pinned
memory; ``files``: names under ``/dev/shm`` and the sweeps that need no pool.
"""

from omni_async.transport.shm.files import (
    SHM_DIR,
    SHM_PREFIX_ROOT,
    list_segments,
    pid_alive,
    sweep_dead_executors,
    unlink_all_with_prefix,
)
from omni_async.transport.shm.mapping import attach_view
from omni_async.transport.shm.pool import Lease, LeaseInfo, PoolStats, SegmentPool, size_class

__all__ = [
    "SHM_DIR",
    "SHM_PREFIX_ROOT",
    "Lease",
    "LeaseInfo",
    "PoolStats",
    "SegmentPool",
    "attach_view",
    "list_segments",
    "pid_alive",
    "size_class",
    "sweep_dead_executors",
    "unlink_all_with_prefix",
]
