"""``PoolStore``: outputs in the executor's shared-memory ``SegmentPool``.

The executor process owns the pool: it makes every segment (or ``prewarm_pool`` makes
them ahead), a packing rank leases one per output, and the output travels as a lease
that the executor unpacks into zero-copy views.  The store owns what follows from that:

* the budget of held outputs (``OutputBudget.of_pool``) and the warning, once per stall,
  when it is full (``check_budget``, from the rank link's monitor);
* receiving (``receive``: zero-copy views, or owned copies with ``copy_outputs``),
  releasing a delivered output (``release``) and one for nobody (``release_packed``);
* what a dead rank held (``reclaim_owner``) or shipped without a message that arrived
  (``reclaim_shipped``), once the rank link says so;
* closing: the pool's last numbers kept for ``metrics()``, every segment unlinked.
"""

from __future__ import annotations

import logging

import attrs

from omni_async.core.errors import OutputUnpackFailed
from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput
from omni_async.executor.config import ExecutorConfig, InvalidConfig
from omni_async.executor.metrics import ExecutorMetrics, HeldOutputMetrics
from omni_async.executor.store import OutputStore
from omni_async.transport.budget import OutputBudget
from omni_async.transport.packing import (
    packed_lease,
    release_packed_output,
    release_unpacked_output,
    unpack_diffusion_output_shm,
)
from omni_async.transport.shm import PoolStats, SegmentPool, unlink_all_with_prefix

__all__ = ["PoolStore", "prewarm_pool"]

log = logging.getLogger(__name__)


def prewarm_pool(pool: SegmentPool, config: ExecutorConfig, *, owned: bool) -> None:
    """Make the segments ``config.prewarm`` asks for in ``pool``, in the executor's process,
    before any rank starts (the packing rank then maps them, and on CUDA pins them, while
    starting: ``SegmentPool.map_segments``).  Checked against the pool's budget first;
    ``InvalidConfig`` naming what failed -- and the pool closed when the executor made it
    (``owned``), so a constructor that raises leaves nothing in /dev/shm."""
    try:
        plan = config.prewarm_plan(OutputBudget.of_pool(pool))
        if plan is None:
            return
        nbytes, count = plan
        try:
            pool.prewarm(nbytes, count)
        except Exception as exc:
            raise InvalidConfig(
                "prewarm",
                f"could not make {count} segment(s) of {nbytes} bytes in /dev/shm ({type(exc).__name__}: {exc}); "
                "free /dev/shm, lower the count, or drop prewarm=",
            ) from exc
    except BaseException:
        if owned:
            pool.close()
        raise
    log.debug("prewarmed %d segment(s) of %d bytes", count, nbytes)


class PoolStore(OutputStore):
    """Outputs in ``pool`` (module docstring).  ``lease_timeout``: how long a packing waits
    for room (for the budget warning); ``owner``: the executor's name, for the warning."""

    def __init__(self, pool: SegmentPool, *, copy_outputs: bool, lease_timeout: float | None, owner: str) -> None:
        self.pool = pool
        self._budget = OutputBudget.of_pool(pool)
        self._copy = copy_outputs
        self._lease_timeout = lease_timeout if lease_timeout is not None else pool.lease_timeout
        self._owner = owner
        self._full_logged = False
        self._final_stats: PoolStats | None = None

    @property
    def budget(self) -> OutputBudget:
        """The pool's budget of held outputs (its byte bound as decided)."""
        return self._budget

    @property
    def lends_segments(self) -> bool:
        """Zero copy: a delivered output views its segment until ``release`` (not with
        ``copy_outputs``, which gave the segment back before delivery)."""
        return not self._copy

    # ------------------------------------------------------------------ outputs

    def receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        """Unpack for the waiter; a failure reaches it as ``OutputUnpackFailed`` (M2).

        Zero copy: the tensors and arrays view the output's segment, which goes back to
        the pool only when the last of them (and of anything derived from them) is gone;
        with ``copy_outputs`` the output holds owned copies and the segment went back
        before delivery.  Past its checks the unpack gives the segment back itself on
        failure; a lease still out after a failure goes back here.
        """
        try:
            return unpack_diffusion_output_shm(packed, copy=self._copy, pool=self.pool)
        except Exception as exc:
            self.give_back(packed)
            raise OutputUnpackFailed(packed.async_output_id, packed.request_id, exc) from exc

    def give_back(self, packed: DiffusionOutput) -> None:
        """The lease of a packed output that will never be unpacked, back to the pool."""
        lease = packed_lease(packed)
        if lease is None:
            return
        try:
            if self.pool.is_leased(lease):
                self.pool.release(lease)
        except Exception:  # a forged lease (slot out of range, foreign prefix)
            log.debug("no segment to give back for %s", packed.async_output_id, exc_info=True)

    def release_packed(self, packed: DiffusionOutput) -> None:
        try:
            release_packed_output(packed, pool=self.pool)
        except Exception:
            log.exception("releasing the segment of %s failed", packed.async_output_id)

    def release(self, output: DiffusionOutput) -> int:
        """Takes the output's own views back (``output.output`` then raises
        ``LeaseAlreadyReleased`` on any use); 1 with the segment back in the pool,
        ``OutputStillViewed`` while another view is alive (the segment goes back by itself
        once they are gone), 0 for an output without a segment."""
        return release_unpacked_output(output, pool=self.pool)

    def discard_answer(self, result: object) -> None:
        outputs = result.per_request() if isinstance(result, BatchDiffusionOutput) else [result]
        for out in outputs:
            if isinstance(out, DiffusionOutput):
                self.give_back(out)

    # ------------------------------------------------------------- dead ranks

    def reclaim_owner(self, rank: int, pid: int) -> None:
        """What dead rank ``rank`` (process ``pid``) had leased and not handed off, back."""
        try:
            n = self.pool.reclaim_owner(pid)
        except Exception:
            log.exception("reclaiming the segments of dead worker %d failed", rank)
            return
        if n:
            log.warning("worker rank %d died holding %d segment(s); they went back to the pool", rank, n)

    def reclaim_shipped(self, rank: int, pid: int) -> None:
        """What the dead rank shipped that no message carried (TLC's ``ReclaimSparesShipped``),
        once every message it sent was read."""
        try:
            n = self.pool.reclaim_shipped(pid)
        except Exception:
            if self.pool.closed:
                return  # shut down meanwhile: closing the pool unlinked every segment
            log.exception("reclaiming the shipped segments of dead worker %d failed", rank)
            return
        if n:
            log.warning(
                "worker rank %d (pid %d) died after packing %d output(s) it never sent; "
                "their shared-memory segment(s) went back to the pool",
                rank,
                pid,
                n,
            )

    # ------------------------------------------------------------------ budget

    def check_budget(self) -> None:
        """Warn once per stall when the budget of held outputs is full (a packer waits for room)."""
        try:
            st = self.pool.stats()
        except Exception:  # noqa: BLE001  # closed at shutdown; a wedged lock surfaces in the workers
            return
        if st.full_for_s > 0 and not self._full_logged:
            self._full_logged = True
            log.warning(
                "the budget of held outputs is full: %d of max_held_outputs=%d outputs and %d of "
                "max_held_bytes=%d bytes are held in shared memory (packed, not yet released), and a "
                "worker's packing has waited %.1f s for room; its next forwards wait too, and an output "
                "still without room after lease_timeout=%s s fails with HeldOutputsFull.  Release outputs "
                "sooner (release_output after wait_output_ready, or drop_output), or raise "
                "%s(max_held_outputs=..., max_held_bytes=...)",
                st.outstanding,
                self.pool.max_segments,
                st.bytes_leased,
                self.pool.max_bytes,
                st.full_for_s,
                self._lease_timeout,
                self._owner,
            )
        elif st.full_for_s == 0 and self._full_logged:
            self._full_logged = False
            log.info("the budget of held outputs has room again (%d outputs held)", st.outstanding)

    def metrics(
        self, base: ExecutorMetrics, *, held_elsewhere: int = 0, stored: int | None = None
    ) -> HeldOutputMetrics:
        """``base`` with the budget of held outputs; ``held_elsewhere``/``stored``: outputs
        held outside the pool (Ray's object store)."""
        st: PoolStats | None
        try:
            st = self.pool.stats()
        except Exception:  # noqa: BLE001  # the pool closed at shutdown: its last numbers
            st = self._final_stats
        return HeldOutputMetrics(
            **attrs.asdict(base, recurse=False),
            max_held_outputs=self.pool.max_segments,
            max_held_bytes=self.pool.max_bytes,
            held_outputs=held_elsewhere if st is None else st.outstanding + held_elsewhere,
            held_bytes=0 if st is None else st.bytes_leased,
            pool_full=st is not None and st.full_for_s > 0,
            pool_full_s=0.0 if st is None else st.full_for_s,
            pool_waits=0 if st is None else st.lease_waits,
            pool_wait_s_total=0.0 if st is None else st.lease_wait_s,
            pool_exhausted=0 if st is None else st.exhausted,
            stored_outputs=stored,
        )

    def close(self) -> None:
        """Unlink every segment (the executor owns its pool, also one passed in); the prefix
        sweep catches any a dying worker created meanwhile.  What ``metrics`` reports from
        then on: nothing held, the counts so far."""
        if self._final_stats is None:
            try:
                st = self.pool.stats()
                self._final_stats = attrs.evolve(st, outstanding=0, bytes_leased=0, full_for_s=0.0)
            except Exception:  # noqa: BLE001  # a pool that cannot tell (closed already): no counts
                log.debug("the pool's last stats are unavailable", exc_info=True)
        self.pool.close()
        unlink_all_with_prefix(self.pool.prefix)
