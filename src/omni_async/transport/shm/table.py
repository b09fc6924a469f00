"""The pool's shared slot table: its layout, and what each pool operation writes in it.

One small table in shared memory (a ``multiprocessing.RawArray``, or the pool's lock
file mapped with ``attach_by_name``): one row of ``NF`` int64 fields per slot (state,
size, incarnation, lease generation, owner), then ``NC`` counters.  Every method of
``SlotTable`` but the read-only ``is_leased`` runs with the pool's lock held (the
caller's: ``SegmentPool``), and is ordered so that a process killed anywhere inside
leaves something the lock's repair recognises: a slot turns LEASED only after its
owner, size and generation are written, and an evicted slot turns EMPTY before its
file is unlinked.  Byte totals are computed from the slots, never kept as counters.

The owner field of a leased slot says who must give it back: ``pid > 0``, the process
that leased it, still writing; ``-pid``, shipped by that process, its message not
received yet; ``0``, the consumer's.
"""

from __future__ import annotations

import time
from typing import Final

import numpy as np
import numpy.typing as npt

from omni_async.transport.errors import LeaseAlreadyReleased, PoolClosed, UnknownSegment
from omni_async.transport.shm import files
from omni_async.transport.shm.leases import Lease, LeaseInfo, PoolStats

__all__ = ["C_CLOSED", "C_HOLDER", "NC", "NF", "SlotTable", "table_nbytes"]

# Slot table layout (int64): one row of NF fields per slot, then the counters.
_STATE, _SIZE, _INC, _GEN, _OWNER = range(5)
NF: Final = 5
_EMPTY, _FREE, _LEASED = 0, 1, 2
(
    _C_CREATED,
    _C_REUSED,
    _C_LEASED,
    _C_RELEASED,
    _C_EVICTED,
    _C_RECLAIMED,
    _C_REPAIRS,
    C_CLOSED,
    C_HOLDER,  # pid inside the lock, 0 when free
    _C_WAITS,  # leases that had to wait for room
    _C_WAIT_NS,  # the time they waited, in all
    _C_EXHAUSTED,  # leases that waited in vain (PoolExhausted)
    _C_FULL_SINCE_NS,  # monotonic ns: when the pool became full for a waiting lease; 0: never
    _C_FULL_SEEN_NS,  # monotonic ns: a waiting lease last found no room; 0: none waits
) = range(14)
NC: Final = 14
# A lease that waits finds no room at least every 20 ms (its backoff cap), a loaded
# machine permitting; a pool whose last failed attempt is older than this has no live
# waiter (a waiter killed while waiting stops updating it), so "full" ends by itself.
_FULL_GAP_NS: Final = 1_000_000_000


def table_nbytes(max_segments: int) -> int:
    return (max_segments * NF + NC) * 8


class SlotTable:
    """The slot rows and counters of one pool, over its shared buffer."""

    def __init__(self, prefix: str, max_segments: int, max_bytes: int, flat: npt.NDArray[np.int64]) -> None:
        self.prefix = prefix
        self.max_segments = max_segments
        self.max_bytes = max_bytes
        self.slots = flat[: max_segments * NF].reshape(max_segments, NF)
        self.ctr = flat[max_segments * NF :]

    def name(self, i: int) -> str:
        return f"{self.prefix}{i}.{int(self.slots[i, _INC])}"

    @property
    def closed(self) -> bool:
        return bool(self.ctr[C_CLOSED])

    def mark_closed(self) -> None:
        # No lock needed: the flag only ever goes up.
        self.ctr[C_CLOSED] = 1

    def note_repair(self) -> None:
        self.ctr[_C_REPAIRS] += 1

    def bytes(self, state: int | None = None) -> int:
        """Bytes in segments that exist (or, given ``state``, in that state); from the slots."""
        st = self.slots[:, _STATE]
        mask = st != _EMPTY if state is None else st == state
        return int(self.slots[mask, _SIZE].sum())

    def try_lease(self, pid: int, size: int, nbytes: int) -> tuple[Lease, bool] | None:
        """A slot for a ``size``-class segment, and whether its file must be created; None
        when the pool is full (the caller waits)."""
        s, c = self.slots, self.ctr
        if c[C_CLOSED]:
            raise PoolClosed(f"segment pool {self.prefix} is closed")
        state, sizes = s[:, _STATE], s[:, _SIZE]
        # Reuse: the exact class first, then one class up (waste <= 4x, no creation).
        for want in (size, size * 2):
            hits = np.flatnonzero((state == _FREE) & (sizes == want))
            if hits.size:
                i = int(hits[0])
                return self.grant(i, pid, nbytes), False
        empties = np.flatnonzero(state == _EMPTY)
        live = self.bytes()
        if empties.size == 0 or live + size > self.max_bytes:
            # Evict free segments of other classes, largest first, until it fits.
            free = np.flatnonzero(state == _FREE)
            need_bytes = live + size - self.max_bytes
            need_slot = empties.size == 0
            if int(sizes[free].sum()) < need_bytes or (need_slot and free.size == 0):
                # Full: the caller waits.  Time the stall (see _FULL_GAP_NS).
                now = time.monotonic_ns()
                if not c[_C_FULL_SEEN_NS] or now - int(c[_C_FULL_SEEN_NS]) > _FULL_GAP_NS:
                    c[_C_FULL_SINCE_NS] = now
                c[_C_FULL_SEEN_NS] = now
                return None
            for i in sorted(free.tolist(), key=lambda j: -int(sizes[j])):
                if need_bytes <= 0 and not need_slot:
                    break
                need_bytes -= int(sizes[i])
                need_slot = False
                self.evict(int(i))
            empties = np.flatnonzero(state == _EMPTY)
        return self.grant(int(empties[0]), pid, nbytes, new_size=size), True

    def count_wait(self, since_ns: int, *, exhausted: bool) -> None:
        c = self.ctr
        c[_C_WAITS] += 1
        c[_C_WAIT_NS] += time.monotonic_ns() - since_ns
        if exhausted:
            c[_C_EXHAUSTED] += 1
        else:
            c[_C_FULL_SEEN_NS] = 0  # room was found: this stall is over

    def grant(self, i: int, pid: int, nbytes: int, *, new_size: int = 0) -> Lease:
        # The state is written last: a slot is LEASED only once its owner is known, so a
        # cut anywhere before leaves nothing to reclaim.
        row, c = self.slots[i], self.ctr
        row[_OWNER] = pid
        if new_size:  # a new incarnation: a new name, created by the caller
            row[_SIZE] = new_size
            row[_INC] += 1
        row[_GEN] += 1
        row[_STATE] = _LEASED
        c[_C_LEASED] += 1
        c[_C_CREATED if new_size else _C_REUSED] += 1
        return Lease(self.prefix, i, int(row[_INC]), int(row[_GEN]), int(row[_SIZE]), nbytes)

    def evict(self, i: int) -> None:
        # EMPTY before the unlink: a cut in between leaves an orphan file that the
        # pool's repair finds, never a slot naming a file that is gone.  The name dies
        # with the incarnation: a process that still maps it keeps valid memory until it
        # prunes its cache; a new incarnation gets a new name.
        row = self.slots[i]
        row[_STATE] = _EMPTY
        row[_OWNER] = 0
        self.ctr[_C_EVICTED] += 1
        files.unlink(f"{self.prefix}{i}.{int(row[_INC])}")

    def abandon(self, lease: Lease) -> None:
        """A lease whose segment could not be created: as if it never happened."""
        s, c = self.slots, self.ctr
        if s[lease.slot, _GEN] == lease.generation and s[lease.slot, _STATE] == _LEASED:
            c[_C_LEASED] -= 1
            c[_C_CREATED] -= 1
            self.evict(lease.slot)
            c[_C_EVICTED] -= 1

    def check_lease(self, lease: Lease) -> None:
        if lease.prefix != self.prefix:
            raise UnknownSegment(f"lease {lease.name} belongs to another pool than {self.prefix}")
        if not 0 <= lease.slot < self.max_segments:
            raise UnknownSegment(f"lease {lease.name} names no slot of pool {self.prefix}")
        row = self.slots[lease.slot]
        if row[_STATE] != _LEASED or row[_INC] != lease.incarnation or row[_GEN] != lease.generation:
            if self.ctr[C_CLOSED]:
                raise PoolClosed(f"segment pool {self.prefix} is closed (lease {lease.name})")
            raise LeaseAlreadyReleased(lease.name)

    def release(self, lease: Lease) -> None:
        self.check_lease(lease)
        row = self.slots[lease.slot]
        row[_STATE] = _FREE
        row[_OWNER] = 0
        self.ctr[_C_RELEASED] += 1

    def hand_off(self, lease: Lease, pid: int) -> None:
        self.check_lease(lease)
        self.slots[lease.slot, _OWNER] = -pid

    def receive(self, lease: Lease) -> bool:
        row = self.slots[lease.slot]
        if (
            row[_STATE] != _LEASED
            or row[_INC] != lease.incarnation
            or row[_GEN] != lease.generation
            or row[_OWNER] >= 0
        ):
            return False
        row[_OWNER] = 0
        return True

    def is_leased(self, lease: Lease) -> bool:
        row = self.slots[lease.slot]
        return bool(
            lease.prefix == self.prefix
            and row[_STATE] == _LEASED
            and row[_INC] == lease.incarnation
            and row[_GEN] == lease.generation
        )

    def reclaim(self, owner: int) -> int:
        # Its bytes may be half written and its file half created: start over.
        s, c = self.slots, self.ctr
        victims = np.flatnonzero((s[:, _STATE] == _LEASED) & (s[:, _OWNER] == owner)).tolist()
        for i in victims:
            c[_C_RECLAIMED] += 1
            self.evict(int(i))
            c[_C_EVICTED] -= 1
        return len(victims)

    def live(self) -> list[tuple[str, int]]:
        """(name, size) of every segment that exists."""
        s = self.slots
        return [(self.name(i), int(s[i, _SIZE])) for i in np.flatnonzero(s[:, _STATE] != _EMPTY).tolist()]

    def segment_names(self) -> list[str]:
        s = self.slots
        return [self.name(i) for i in np.flatnonzero(s[:, _STATE] != _EMPTY).tolist()]

    def stats(self) -> PoolStats:
        s, c = self.slots, self.ctr
        seen, now = int(c[_C_FULL_SEEN_NS]), time.monotonic_ns()
        full = seen > 0 and now - seen <= _FULL_GAP_NS
        return PoolStats(
            created=int(c[_C_CREATED]),
            reused=int(c[_C_REUSED]),
            leased=int(c[_C_LEASED]),
            released=int(c[_C_RELEASED]),
            evicted=int(c[_C_EVICTED]),
            reclaimed=int(c[_C_RECLAIMED]),
            repairs=int(c[_C_REPAIRS]),
            segments=int((s[:, _STATE] != _EMPTY).sum()),
            bytes=self.bytes(),
            bytes_leased=self.bytes(_LEASED),
            outstanding=int((s[:, _STATE] == _LEASED).sum()),
            lease_waits=int(c[_C_WAITS]),
            lease_wait_s=int(c[_C_WAIT_NS]) / 1e9,
            exhausted=int(c[_C_EXHAUSTED]),
            full_for_s=max(now - int(c[_C_FULL_SINCE_NS]), 1) / 1e9 if full else 0.0,
        )

    def outstanding(self) -> list[LeaseInfo]:
        s = self.slots
        return [
            LeaseInfo(self.name(i), int(s[i, _SIZE]), int(s[i, _GEN]), int(s[i, _OWNER]))
            for i in np.flatnonzero(s[:, _STATE] == _LEASED).tolist()
        ]

    def close_all(self) -> int:
        """Mark the table closed and every slot EMPTY, unlinking their files; returns how many."""
        n = 0
        if not self.ctr[C_CLOSED]:
            self.ctr[C_CLOSED] = 1
            s = self.slots
            for i in np.flatnonzero(s[:, _STATE] != _EMPTY).tolist():
                s[i, _STATE] = _EMPTY
                n += files.unlink(f"{self.prefix}{i}.{int(s[i, _INC])}")
        return n
