"""The budget of held outputs: one object that the executor, the worker and the engine read.

An output packed by a worker holds room in shared memory (or, for a Ray rank on another
node, in Ray's object store) until the engine releases it.  The budget bounds that room
by count (``max_outputs``) and by bytes (``max_bytes``).  Before this object, the bound
went down as loose constructor arguments, came back up as floats in ``metrics()``, and
the engine re-derived the pool's sizing rule with a copy of its own; now the executor
builds its pool from the budget (``make_pool``), reads the one it got back
(``of_pool``: a caller's pool, or the byte default the pool picked), and hands that to
the engine, whose admission control asks the budget how many outputs of a given size
fit (``outputs_that_fit``: the pool's own size classes, never a copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import attrs

from omni_async.core.errors import UsageError

if TYPE_CHECKING:
    import multiprocessing.context

    from omni_async.transport.shm.pool import SegmentPool

__all__ = ["DEFAULT_MAX_HELD_OUTPUTS", "DEFAULT_MIN_SEGMENT_BYTES", "OutputBudget", "check_positive"]

# The default count; the byte budget defaults to half the free space of /dev/shm (at
# most 8 GiB), decided by the pool when it is made (``max_bytes=None``).
DEFAULT_MAX_HELD_OUTPUTS: Final = 64
DEFAULT_MIN_SEGMENT_BYTES: Final = 1 << 16


def check_positive(name: str, value: object, *, optional: bool = False) -> None:
    """``UsageError`` naming ``name`` unless ``value`` is a positive int (or None, when optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")


@attrs.frozen
class OutputBudget:
    """How many outputs, and how many bytes of them, may be held at once.

    ``max_bytes`` None: no byte bound known yet (the pool picks one when it is made:
    read the executor's ``budget`` for the one in force).  ``min_segment_bytes``: the
    pool's smallest size class, part of its sizing rule (``size_class``).
    """

    max_outputs: int = DEFAULT_MAX_HELD_OUTPUTS
    max_bytes: int | None = None
    min_segment_bytes: int = DEFAULT_MIN_SEGMENT_BYTES

    def __attrs_post_init__(self) -> None:
        check_positive("max_held_outputs", self.max_outputs)
        check_positive("max_held_bytes", self.max_bytes, optional=True)
        m = self.min_segment_bytes
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or m & (m - 1):
            raise UsageError(f"OutputBudget.min_segment_bytes must be a power of two, got {m!r}")

    @classmethod
    def of_pool(cls, pool: SegmentPool) -> OutputBudget:
        """The budget a pool enforces (its count, its byte bound, its smallest class)."""
        return cls(pool.max_segments, pool.max_bytes, pool.class_of(1))

    def make_pool(
        self, *, mp_context: multiprocessing.context.BaseContext | None = None, attach_by_name: bool = False
    ) -> SegmentPool:
        """A ``SegmentPool`` sized by this budget (see ``SegmentPool`` for the two options)."""
        from omni_async.transport.shm.pool import SegmentPool

        return SegmentPool(
            max_segments=self.max_outputs,
            max_bytes=self.max_bytes,
            min_segment_bytes=self.min_segment_bytes,
            mp_context=mp_context,
            attach_by_name=attach_by_name,
        )

    def size_class(self, nbytes: int) -> int:
        """The segment size the pool leases for an output of ``nbytes`` (the pool's rule)."""
        # Imported here: the engine reads the budget, and ``import omni_async`` (which
        # imports the engine's scheduler) must not import the pool, numpy or torch.
        from omni_async.transport.shm.pool import size_class

        return size_class(max(0, nbytes), self.min_segment_bytes)

    def outputs_that_fit(self, output_nbytes: int) -> int | None:
        """How many outputs of ``output_nbytes`` the byte bound admits, counted
        pessimistically: the pool may hand out a segment one class larger, so each counts
        as twice its class; at least 1.  None without a byte bound, or before any size is
        known (``output_nbytes`` 0)."""
        if self.max_bytes is None or output_nbytes <= 0:
            return None
        return max(1, self.max_bytes // (2 * self.size_class(output_nbytes)))

    def in_flight_limit(self, output_nbytes: int) -> int:
        """How many outputs may be held at once given the largest output seen so far."""
        fit = self.outputs_that_fit(output_nbytes)
        return self.max_outputs if fit is None else min(self.max_outputs, fit)
