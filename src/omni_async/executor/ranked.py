"""``RankedExecutor``: what every executor whose ranks live elsewhere shares.

An executor with ranks in worker processes (``MultiprocDiffusionExecutor``) and one
with ranks in Ray actors (``RayDiffusionExecutor``) differ only in how a rank is
reached.  Everything else is here, once: the shared-memory pool and its budget of held
outputs (``OutputBudget``), start-up (every rank built and answering, or the executor
shut down and the error raised), the death of a rank (every waiter failed, the
registry closed, the dead rank's segments reclaimed), receiving, unpacking and
releasing outputs, the typed metrics, shutdown (the ranks stopped, then the pool
closed and unlinked).

How ranks are reached is a ``RankTransport`` handed to the executor: worker processes
and pipes (``omni_async.executor.multiproc.ProcessRanks``) or Ray actors and their
outboxes (``omni_async.executor.ray_executor.RayRanks``).  The two executors are
siblings over this class, as vLLM's ``MultiprocExecutor`` and
``RayDistributedExecutor`` are over theirs, and neither overrides the other.  A
transport talks back to its executor through ``RankHost`` (the death of a rank, the
budget check of a monitor, whether the executor is closed).
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, Protocol, TypeVar

import attrs

from omni_async.core.config import Deadlines
from omni_async.core.errors import ExecutorShutdown, OmniAsyncError, OutputUnpackFailed, WorkerDied
from omni_async.core.messages import BatchDiffusionOutput, CancelMessage, DiffusionOutput, DiffusionRequest, RpcRequest
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.batches import BatchKeyer
from omni_async.executor.config import ExecutorConfig, InvalidConfig
from omni_async.executor.futures import map_future
from omni_async.executor.metrics import HeldOutputMetrics
from omni_async.executor.pump import ResultPump
from omni_async.transport.budget import OutputBudget
from omni_async.transport.channel import ResultReceiver
from omni_async.transport.packing import (
    packed_lease,
    release_packed_output,
    release_unpacked_output,
    unpack_diffusion_output_shm,
)
from omni_async.transport.shm import PoolStats, SegmentPool, unlink_all_with_prefix
from omni_async.worker.baselines import discard_fresh_output, is_fresh, receive_fresh_output

__all__ = ["RankHost", "RankTransport", "RankedExecutor", "prewarm_pool"]

log = logging.getLogger(__name__)


class RankHost(Protocol):
    """What a ``RankTransport`` may ask of the executor it serves."""

    @property
    def closed(self) -> bool: ...

    @property
    def token(self) -> str: ...

    @property
    def pump(self) -> ResultPump: ...

    @property
    def deadlines(self) -> Deadlines: ...

    def rank_died(
        self,
        rank: int,
        error: WorkerDied,
        per_output: Callable[[str | None], WorkerDied],
        pid: int | None,
        *,
        reclaim_shipped: bool,
    ) -> None: ...

    def reclaim_shipped(self, rank: int, pid: int) -> None: ...

    def check_budget(self) -> None: ...


class RankTransport(abc.ABC):
    """How an executor reaches its ranks: start them, send them RPCs and cancels, stop them.

    ``receiver`` is the pump's end of the result channel.  The output hooks
    (``unpack``, ``release``, ``run_unpack``, ``held_elsewhere``, ``stored_outputs``)
    let a transport ship some outputs outside the pool (Ray's object store); their
    defaults say "every output is in the pool".
    """

    receiver: ResultReceiver

    @abc.abstractmethod
    def start(self, host: RankHost, deadline: float, start_timeout: float) -> None:
        """Start every rank and wait until each has built its model (before the pump starts);
        raise ``WorkerStartupFailed`` or ``ComputeTimeout`` otherwise."""

    def started(self) -> None:  # noqa: B027 (a hook most transports leave empty)
        """The pump runs: start what needs it (a monitor that fails waiters)."""

    @abc.abstractmethod
    def broadcast(self, req: RpcRequest, wire: list[bytes] | None) -> None:
        """Deliver ``req`` to every rank (``ExecutorShutdown`` once the executor is closed)."""

    def encode(self, req: RpcRequest) -> list[bytes] | None:
        """``req`` as each rank gets it, for a transport that pickles ahead (None: it does not)."""
        return None

    @abc.abstractmethod
    def deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        """Send ``cancels`` to every rank's control path; never blocks."""

    def failure(self) -> OmniAsyncError | None:
        """A transport-level failure beside a dead rank (a torn frame), or None."""
        return None

    @abc.abstractmethod
    def stop(self, deadline: float | None) -> None:
        """Stop every rank by ``deadline`` (idempotent); the executor closes the pool after."""

    def unpack(self, packed: DiffusionOutput, copy: bool) -> DiffusionOutput | None:
        """An output this transport shipped outside the pool, unpacked (``OutputUnpackFailed``
        on failure); None for a pooled one."""
        return None

    def release(self, packed: DiffusionOutput) -> bool:
        """Release an output shipped outside the pool (True), or say it is pooled (False)."""
        return False

    def run_unpack(self, packed: DiffusionOutput, finish: Callable[[], None]) -> None:
        """Where an unpack runs (``map_future``'s ``run``): here, on the pump's thread."""
        finish()

    def held_elsewhere(self) -> int:
        """Outputs held outside the pool (received, not yet released)."""
        return 0

    def stored_outputs(self) -> int | None:
        """Outputs received outside the pool and not read yet (None: no such path)."""
        return None


TransportT = TypeVar("TransportT", bound=RankTransport)


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


class RankedExecutor(DiffusionExecutor, Generic[TransportT]):
    """The executor over a ``RankTransport`` (module docstring); built by its subclasses,
    which choose the transport and the pool."""

    def __init__(
        self,
        ranks: TransportT,
        pool: SegmentPool,
        config: ExecutorConfig,
        validate_request: Callable[[DiffusionRequest], None] | None,
        batch_key: BatchKeyer | None = None,
    ) -> None:
        self.ranks = ranks
        self.pool = pool
        self.config = config
        self._budget = OutputBudget.of_pool(pool)
        opts = config.worker_options
        self._lease_timeout = opts.lease_timeout if opts.lease_timeout is not None else pool.lease_timeout
        self._budget_full_logged = False
        self._copy_outputs = config.copy_outputs
        self._failure: OmniAsyncError | None = None
        self._final_stats: PoolStats | None = None
        super().__init__(
            ranks.receiver,
            world_size=config.world_size,
            reply_rank=config.reply_rank,
            step_mode=config.step_mode,
            deadlines=config.deadlines,
            release_hook=self._release_packed,
            tracer=config.tracer,
            validate_request=validate_request,
            batch_key=batch_key,
            final_step_async=config.final_step_async,
        )

    def _start(self) -> None:
        """Start the ranks, the pump, then check that every rank answers; on any failure
        shut down (nothing of the executor stays behind) and raise it."""
        try:
            deadline = time.monotonic() + self.config.start_timeout
            self.ranks.start(self, deadline, self.config.start_timeout)
            self.pump.start()
            self.ranks.started()
            self.collective_rpc("loop_info", timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.shutdown("the executor failed to start")
            raise

    # --------------------------------------------------------------- RankHost

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def budget(self) -> OutputBudget:
        """The budget of held outputs in force: the pool's (its byte bound as decided)."""
        return self._budget

    def rank_died(
        self,
        rank: int,
        error: WorkerDied,
        per_output: Callable[[str | None], WorkerDied],
        pid: int | None,
        *,
        reclaim_shipped: bool,
    ) -> None:
        """A rank is gone: the executor fails from now on, every waiter fails with
        ``per_output(id)``, and what the rank held in the pool goes back.  Its shipped
        segments go back too when ``reclaim_shipped`` (every message it sent was read);
        otherwise the transport calls ``reclaim_shipped`` once they are."""
        if self._closed:
            return
        log.error("%s", error)
        if self._failure is None:
            self._failure = error
        if pid is not None:
            try:
                n = self.pool.reclaim_owner(pid)
            except Exception:
                log.exception("reclaiming the segments of dead worker %d failed", rank)
            else:
                if n:
                    log.warning("worker rank %d died holding %d segment(s); they went back to the pool", rank, n)
        # Close the registry too (TLC's DeathKeepsOpen): a message the dead rank sent
        # before dying can still be in the channel; without the close it would create a
        # record (EARLY_READY, no deadline) that nobody ever claims.
        self.pump.fail_all(per_output, outcome="worker_died", close=True)
        if pid is not None and reclaim_shipped:
            self.reclaim_shipped(rank, pid)

    def reclaim_shipped(self, rank: int, pid: int) -> None:
        """The dead rank's death is handled and its channel read to the end: free what it
        shipped that no message carried (TLC's ``ReclaimSparesShipped``; ``PumpReachEof``)."""
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

    def check_budget(self) -> None:
        """Warn once per stall when the budget of held outputs is full (a packer waits for room)."""
        try:
            st = self.pool.stats()
        except Exception:  # noqa: BLE001  # closed at shutdown; a wedged lock surfaces in the workers
            return
        if st.full_for_s > 0 and not self._budget_full_logged:
            self._budget_full_logged = True
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
                type(self).__name__,
            )
        elif st.full_for_s == 0 and self._budget_full_logged:
            self._budget_full_logged = False
            log.info("the budget of held outputs has room again (%d outputs held)", st.outstanding)

    # -------------------------------------------------------------- transport

    def _encode(self, req: RpcRequest) -> list[bytes] | None:
        return self.ranks.encode(req)

    def _broadcast(self, req: RpcRequest, wire: list[bytes] | None = None) -> None:
        self.ranks.broadcast(req, wire)

    def _deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        self.ranks.deliver_cancels(cancels)

    def _worker_failure(self) -> OmniAsyncError | None:
        if self._failure is not None:
            return self._failure
        return self.ranks.failure()

    def _stop_workers(self, deadline: float | None) -> None:
        self.ranks.stop(deadline)
        try:  # what metrics() report once the pool is gone: nothing held, the counts so far
            st = self.pool.stats()
            self._final_stats = attrs.evolve(st, outstanding=0, bytes_leased=0, full_for_s=0.0)
        except Exception:  # noqa: BLE001  # a pool that cannot tell (closed already): no counts
            log.debug("the pool's last stats are unavailable", exc_info=True)
        # The executor owns its pool, also one passed in: closing it unlinks every
        # segment; the prefix sweep catches any a dying worker created meanwhile.
        self.pool.close()
        unlink_all_with_prefix(self.pool.prefix)

    # ---------------------------------------------------------------- outputs

    def _deliver(self, packed: Future[DiffusionOutput]) -> Future[DiffusionOutput]:
        """The unpacked output (``wait_output_ready``, a stream's chunks), delivered to
        exactly one waiter (see ``DiffusionExecutor``).

        Zero copy: its tensors and arrays view the output's shared-memory segment, and
        the segment goes back to the pool only when the last of them (and of anything
        derived from them) is gone -- so a tensor the engine keeps never changes under
        it.  ``release_output`` says "done" explicitly; with ``copy_outputs=True`` the
        output holds owned copies and its segment went back before delivery.
        """
        return map_future(packed, self._receive, discard=self._discard, run=self.ranks.run_unpack)

    def _receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        """Unpack for the waiter; a failure reaches it as ``OutputUnpackFailed`` (M2).

        Past its checks, the unpack gives the segment back itself on failure; a lease
        that is still out after a failure (one it refused before taking it over) goes
        back here, so nothing of a corrupt output stays out of the pool.
        """
        elsewhere = self.ranks.unpack(packed, self._copy_outputs)
        if elsewhere is not None:
            return elsewhere
        try:
            if is_fresh(packed):  # a baseline path (WorkerOptions.output_path): read and unlink
                return receive_fresh_output(packed)
            return unpack_diffusion_output_shm(packed, copy=self._copy_outputs, pool=self.pool)
        except Exception as exc:
            self._release_failed_unpack(packed)
            raise OutputUnpackFailed(packed.async_output_id, packed.request_id, exc) from exc

    def _discard_answer(self, result: object) -> None:
        outputs = result.per_request() if isinstance(result, BatchDiffusionOutput) else [result]
        for out in outputs:
            if isinstance(out, DiffusionOutput):
                self._release_failed_unpack(out)

    def _release_failed_unpack(self, packed: DiffusionOutput) -> None:
        if self.ranks.release(packed):
            return
        lease = packed_lease(packed)
        if lease is None:
            return
        try:
            if self.pool.is_leased(lease):
                self.pool.release(lease)
        except Exception:  # a forged lease (slot out of range, foreign prefix)
            log.debug("no segment to give back for %s", packed.async_output_id, exc_info=True)

    def _discard(self, output: DiffusionOutput) -> None:
        # Unpacked for a waiter that was cancelled meanwhile: nobody else holds its views.
        try:
            self.release_output(output)
        except Exception:
            log.exception("releasing the segment of %s failed", output.async_output_id)

    def release_output(self, output: DiffusionOutput) -> int:
        """The engine is done with ``output``: give its segment back, or fail loudly.

        Takes the output's own views back (``output.output`` then raises
        ``LeaseAlreadyReleased`` on any use) and returns 1 with the segment back in the
        pool.  If the engine still holds a tensor or array viewing the segment (or one
        derived from it), raises ``OutputStillViewed`` naming the output and how many
        are alive: the segment stays out of the pool until they are dropped, then goes
        back by itself (nothing leaks, nothing changes under them); copy what you keep
        to release at once.  0 for an output that holds no segment (inline only, or
        ``copy_outputs=True``).  A second release raises ``LeaseAlreadyReleased``.
        Any thread; dropping every view without calling it releases the segment too.
        """
        self._check_output(output, "release_output")
        return release_unpacked_output(output, pool=self.pool)

    def _release_packed(self, packed: DiffusionOutput) -> None:
        try:
            if self.ranks.release(packed):
                return
            if is_fresh(packed):
                discard_fresh_output(packed)
                return
            release_packed_output(packed, pool=self.pool)
        except Exception:
            log.exception("releasing the segment of %s failed", packed.async_output_id)

    # ---------------------------------------------------------------- metrics

    def metrics(self) -> HeldOutputMetrics:
        """The executor's counters with the budget of held outputs (``HeldOutputMetrics``):
        its bounds, what is held now (in the pool, and outside it for Ray), whether and
        how long packing waited for room, and the outputs that found none in time."""
        base = super().metrics()
        st: PoolStats | None
        try:
            st = self.pool.stats()
        except Exception:  # noqa: BLE001  # the pool closed at shutdown: its last numbers
            st = self._final_stats
        held = self.ranks.held_elsewhere()
        return HeldOutputMetrics(
            **attrs.asdict(base, recurse=False),
            max_held_outputs=self.pool.max_segments,
            max_held_bytes=self.pool.max_bytes,
            held_outputs=held if st is None else st.outstanding + held,
            held_bytes=0 if st is None else st.bytes_leased,
            pool_full=st is not None and st.full_for_s > 0,
            pool_full_s=0.0 if st is None else st.full_for_s,
            pool_waits=0 if st is None else st.lease_waits,
            pool_wait_s_total=0.0 if st is None else st.lease_wait_s,
            pool_exhausted=0 if st is None else st.exhausted,
            stored_outputs=self.ranks.stored_outputs(),
        )


def shut_down_error() -> ExecutorShutdown:
    """What a send to the ranks of a closed executor raises."""
    return ExecutorShutdown("the executor is shut down")
