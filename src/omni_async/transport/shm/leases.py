"""What the pool hands out and reports: a ``Lease``, a ``LeaseInfo``, ``PoolStats``.

Small, frozen and picklable: a ``Lease`` travels inside a packed output to the
consumer, which releases it exactly once (the table's per-slot generation tells a stale
lease from the current one, across processes).
"""

from __future__ import annotations

import attrs

__all__ = ["Lease", "LeaseInfo", "PoolStats"]


@attrs.frozen
class Lease:
    """One leased segment.  Small and picklable: it travels inside a packed output."""

    prefix: str
    slot: int
    incarnation: int
    generation: int
    size: int  # the segment's size (its class)
    nbytes: int  # the bytes asked for

    @property
    def name(self) -> str:
        return f"{self.prefix}{self.slot}.{self.incarnation}"


@attrs.frozen
class LeaseInfo:
    name: str
    size: int
    generation: int
    # > 0: leased by that process, not handed off; < 0: handed off by process -owner_pid,
    # its message not received yet; 0: received by the consumer.
    owner_pid: int


@attrs.frozen
class PoolStats:
    created: int
    reused: int
    leased: int
    released: int
    evicted: int
    reclaimed: int
    repairs: int  # times a process died inside the lock and the table was repaired
    segments: int
    bytes: int
    bytes_leased: int
    outstanding: int
    # Back-pressure: leases that waited for room, the seconds they waited, those that
    # gave up (PoolExhausted); ``full_for_s`` > 0 while a lease is waiting now: how long
    # the pool has stayed full for it (every ``max_segments`` or ``max_bytes`` leased).
    lease_waits: int = 0
    lease_wait_s: float = 0.0
    exhausted: int = 0
    full_for_s: float = 0.0
