"""The pool's sizing rule: size classes and the default budget.

Size classes are powers of two (at least ``min_segment_bytes``), so outputs of similar
size share segments; a lease may take a free segment one class larger rather than
create one.  Anything that must predict what the pool will lease for an output (a
budget of held bytes) reads this rule, never a copy of it.
"""

from __future__ import annotations

import os

from omni_async.transport.shm import files

__all__ = ["default_max_bytes", "size_class"]


def size_class(nbytes: int, min_segment_bytes: int) -> int:
    """The segment size that serves ``nbytes``: the next power of two, at least the minimum."""
    if nbytes <= min_segment_bytes:
        return min_segment_bytes
    return 1 << (nbytes - 1).bit_length()


def default_max_bytes() -> int:
    """Half the free space of /dev/shm now, at most 8 GiB: a budget that fits (never above it)."""
    try:
        st = os.statvfs(files.SHM_DIR)
        room = st.f_bavail * st.f_frsize // 2
    except OSError:
        room = 1 << 30
    return int(max(1 << 20, min(8 << 30, room)))
