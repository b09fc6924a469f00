"""``MultiprocDiffusionExecutor``: worker processes, a result pump and a monitor.

The executor is a ``DiffusionExecutor`` (``omni_async.executor.api``) built with two
collaborators: ``ProcessRanks``, its rank link (``omni_async.executor.process_link``:
the processes, their pipes, the monitor), and a ``PoolStore``, its output store
(``omni_async.executor.pool_store``: the pool, its budget, what a dead rank held; a
``PathStore`` when ``WorkerOptions.output_path`` names an output path of its own, such as
the bench's comparison paths: ``omni_async.executor.path_store``).  A death is reported to
``RankEvents`` (``omni_async.executor.link``).  The worker process itself (its entry
point, the watch of its executor) is ``omni_async.worker.process``, and what it builds
is ``omni_async.worker.host``.

Processes and threads, and who owns what:

* The executor process owns the ``SegmentPool`` (it creates and finally unlinks
  every segment), the result ``PipeChannel`` (one pipe per worker, read by the
  pump), one RPC pipe per worker (written under ``_rpc_lock``), the pump thread
  (``omni-pump``) and the monitor thread (``omni-monitor``).
* Each worker process (spawn context, ``omni-worker-<rank>``) builds its model
  from a ``WorkerSpec``, runs ``WorkerLoop.handle_rpc`` on its main thread and a
  ``Packer`` (``omni-packer-<rank>``) on a side stream; both write to the
  worker's result pipe through one sender (thread safe, F7).
* The monitor waits on every worker's process sentinel.  A worker that dies
  fails every pending waiter and RPC at once with ``WorkerDied`` naming the rank
  and the exit code, reclaims the segments the dead process had leased and not
  handed off, and marks the executor failed: ``check_health`` raises from then on.
  Twice a second it also looks at the pool, and logs a warning when the budget of
  held outputs is full (see below).
* A segment the dead worker handed off (``SegmentPool.hand_off``, right before its
  OUTPUT_READY is sent) is spared then: its message may still be in the pipe, and
  is released like any message of a dead worker when the pump reads it.  The pump
  marks every lease it reads in a message as received (``SegmentPool.receive``).
  Once the dead worker's pipe has been read to its end (``PipeChannel``'s
  ``on_sender_gone``: every message it wrote was handled) *and* the monitor has
  handled the death, whichever comes second reclaims what the worker shipped that
  no message carried (``SegmentPool.reclaim_shipped``): it was killed after the
  hand-off and before (or while) writing the message.
* Each worker has a control pipe from the executor, read by a thread of its own
  (``omni-cancel-<rank>``), because its main thread may be busy in a forward for
  minutes: ``CancelMessage``s travel there, written by the executor's
  ``omni-cancel`` thread (so neither ``cancel_requests`` nor the pump, which cancels
  the forward of a call whose compute deadline expired, ever blocks on a pipe), and
  land in the worker loop's cancel table, which the model reads between steps
  (``omni_async.worker.cancel_requested``).
* Each worker has a status pipe to the executor: it reports that its model is
  built, or the exception that stopped it (type, message, traceback) before it
  exits.  A start-up failure makes the constructor raise ``WorkerStartupFailed``
  with that ``Failure``; a later one rides on the monitor's ``WorkerDied``.

The executor process may die without shutting down (``kill -9``, a crash).  Then
nobody would unlink the pool: every worker watches the executor (``ExecutorWatch``)
and, once it is gone, unlinks the whole pool by its prefix and exits.  What escapes
that too (the workers were killed as well) is swept by the next executor at
construction (``sweep_dead_pools``) or by ``omni-async cleanup``.

Ctrl-C: a terminal sends SIGINT to the whole foreground process group, the workers
included.  Workers ignore it (they are spawned with SIGINT blocked and ignore it
before unblocking); the executor process gets ``KeyboardInterrupt`` and shuts them
down in order.

The budget of held outputs: ``max_held_outputs`` and ``max_held_bytes`` bound the
outputs held in shared memory -- packed by a worker and not yet released, whether
unclaimed or claimed and still viewed by the engine (inline outputs, below
``WorkerOptions.inline_threshold``, travel in the message and are not counted).
They size the ``SegmentPool``.  When the budget is full, a worker's packing waits for
room, its next forwards wait for the packer (back-pressure), ``metrics()`` shows
``pool_full`` and for how long (``pool_full_s``), the monitor logs a warning naming
the budget, and an output that finds no room within ``WorkerOptions.lease_timeout``
fails with ``HeldOutputsFull`` (to its waiter: a ``RemoteError`` of that type).

Shutdown (idempotent, F16): stop the pump (every pending waiter fails with
``ExecutorShutdown``), close the result pipes so a worker's write fails at once
instead of waiting for room, ask each worker to exit, then join -> terminate ->
kill, and finally close the pool, which unlinks every segment.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.process
from typing import Unpack

from omni_async.core.config import Deadlines
from omni_async.core.errors import UsageError
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.config import ExecutorConfig, ExecutorOptions, InvalidConfig, check_multiproc_arguments
from omni_async.executor.dist import GroupRendezvous, check_process_group
from omni_async.executor.link import RankEvents
from omni_async.executor.metrics import HeldOutputMetrics
from omni_async.executor.path_store import PathStore
from omni_async.executor.pool_store import PoolStore, prewarm_pool
from omni_async.executor.process_link import ProcessRanks
from omni_async.transport.budget import OutputBudget
from omni_async.transport.shm import SegmentPool
from omni_async.transport.shm.files import remove_dead_executor_files
from omni_async.worker.host import WorkerOptions, WorkerSpec, device_for_rank
from omni_async.worker.output_path import resolve_output_path

# WorkerSpec, WorkerOptions and device_for_rank live in the worker layer now; they are
# named here too, where engine authors have always imported them from.
__all__ = ["MultiprocDiffusionExecutor", "ProcessRanks", "WorkerOptions", "WorkerSpec", "device_for_rank"]

log = logging.getLogger(__name__)


def _sweep_dead_pools() -> None:
    try:
        removed = remove_dead_executor_files()
    except Exception:  # best effort: a sweep that fails must not stop an executor from starting
        log.warning("sweeping the shared memory of dead executors failed", exc_info=True)
        return
    if removed:
        pids = sorted({f.pid for f in removed})
        segments = sum(f.is_segment for f in removed)
        log.warning(
            "swept %d shared-memory file(s) (%d segment(s), %d bytes) left in /dev/shm by %d executor(s) "
            "that died without cleaning up: pid(s) %s",
            len(removed),
            segments,
            sum(f.size for f in removed),
            len(pids),
            pids,
        )
    else:
        log.debug("no shared-memory files of dead executors to sweep")


class MultiprocDiffusionExecutor(DiffusionExecutor):
    """``world_size`` worker processes built from ``spec``; ``reply_rank`` ships the outputs.

    The settings are an ``ExecutorConfig`` (``config=``) or its fields as keyword
    arguments (``world_size=2, max_held_outputs=8``; they override ``config``'s):
    ``options`` are the worker-side settings (device, packer budget);
    ``max_held_outputs`` and ``max_held_bytes`` the budget of outputs held in shared
    memory (see the module docstring; defaults: 64 outputs, half the free space of
    /dev/shm up to 8 GiB); ``copy_outputs`` makes ``wait_output_ready`` return owned
    copies and give the segment back at once instead of zero-copy views.  ``pool``: a
    shared-memory pool made by the caller instead, whose ``max_segments`` and
    ``max_bytes`` are then the budget (either way the executor closes it at shutdown).
    ``prewarm`` (``Prewarm``): segments made in the pool before the workers start, with
    either budget.
    The constructor returns once every rank has built its model and answered; a rank
    whose model fails to build makes it raise ``WorkerStartupFailed`` carrying the
    remote error.

    ``sweep_dead_pools`` (default on): first unlink the shared-memory files of
    executors that died without cleaning up (their pid, in the file names, no longer
    runs; see ``files.dead_executor_files`` for the one caveat), and log how many.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        config: ExecutorConfig | None = None,
        *,
        pool: SegmentPool | None = None,
        sweep_dead_pools: bool = True,
        **options: Unpack[ExecutorOptions],
    ) -> None:
        check_multiproc_arguments(spec, config, pool=pool, sweep_dead_pools=sweep_dead_pools)
        if not isinstance(spec, WorkerSpec):
            raise UsageError(
                f"spec must be a WorkerSpec, got {type(spec).__name__} {spec!r}: "
                f"WorkerSpec('mypkg.models:MyWorker', kwargs={{...}})"
            )
        cfg = (config if config is not None else ExecutorConfig()).with_options(options)
        if pool is not None and (cfg.max_held_outputs is not None or cfg.max_held_bytes is not None):
            raise InvalidConfig(
                "pool", "or max_held_outputs=/max_held_bytes=: pass either, not both (the pool is the budget)"
            )
        validator = spec.request_validator()
        pg = check_process_group(spec, cfg)
        keyer = spec.batch_keyer()
        if sweep_dead_pools:  # after the argument checks: a call that fails touches nothing
            _sweep_dead_pools()
        owned = pool is None
        if pool is None:
            pool = cfg.budget.make_pool(mp_context=multiprocessing.get_context("spawn"))
        prewarm_pool(pool, cfg, owned=owned)  # before the workers start: they map what it made
        try:
            group = None if pg is None else GroupRendezvous(pg, cfg, cfg.deadlines or Deadlines.from_env())
        except BaseException:
            if owned:  # a constructor that raises leaves nothing in /dev/shm
                pool.close()
            raise
        self.config = cfg
        self.pool = pool
        opts = cfg.worker_options
        # An output path of its own (the bench's comparison paths among them) ships
        # outputs the path reads and frees: its store hands them to it.
        path = resolve_output_path(opts.output_path)
        owner = type(self).__name__
        self._pool_store = (
            PoolStore(pool, copy_outputs=cfg.copy_outputs, lease_timeout=opts.lease_timeout, owner=owner)
            if path is None
            else PathStore(pool, path, copy_outputs=cfg.copy_outputs, lease_timeout=opts.lease_timeout, owner=owner)
        )
        self.ranks = ProcessRanks(spec, opts, cfg.world_size, pool, group)
        super().__init__(
            self.ranks,
            self._pool_store,
            world_size=cfg.world_size,
            reply_rank=cfg.reply_rank,
            step_mode=cfg.step_mode,
            deadlines=cfg.deadlines,
            tracer=cfg.tracer,
            validate_request=validator,
            final_step_async=cfg.final_step_async,
            batch_key=keyer,
        )
        events = RankEvents(self.pump, self._pool_store, closed=lambda: self._closed, token=self.token)
        self._start(events, cfg.start_timeout, probe=True)

    @property
    def procs(self) -> list[multiprocessing.process.BaseProcess]:
        """The worker processes, by rank."""
        return self.ranks.procs

    @property
    def budget(self) -> OutputBudget:
        """The budget of held outputs in force: the pool's (its byte bound as decided)."""
        return self._pool_store.budget

    def metrics(self) -> HeldOutputMetrics:
        """The executor's counters with the budget of held outputs (``HeldOutputMetrics``):
        its bounds, what is held now, whether and how long packing waited for room, and
        the outputs that found none in time."""
        return self._pool_store.metrics(super().metrics())
