"""``MultiprocDiffusionExecutor``: worker processes, a result pump and a monitor.

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
  and the exit code, reclaims the segments the dead process had leased, and
  marks the executor failed: ``check_health`` raises from then on.  Twice a
  second it also looks at the pool, and logs a warning when the budget of held
  outputs is full (see below).

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

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import attrs

from omni_async.core.config import Deadlines
from omni_async.core.errors import ExecutorShutdown, OmniAsyncError, UsageError, WorkerDied
from omni_async.core.messages import DiffusionOutput, RpcRequest
from omni_async.core.trace import Tracer
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.futures import map_future
from omni_async.transport.channel import PipeChannel, PipeSender
from omni_async.transport.errors import HeldOutputsFull, PoolExhausted
from omni_async.transport.packing import (
    pack_diffusion_output_shm,
    release_packed_output,
    release_unpacked_output,
    unpack_diffusion_output_shm,
)
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.transport.shm import SegmentPool, unlink_all_with_prefix
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.packer import Packer

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The default budget of held outputs; the byte budget defaults to half the free space of
# /dev/shm (at most 8 GiB), see SegmentPool.
DEFAULT_MAX_HELD_OUTPUTS = 64
# How often the monitor looks for a full budget of held outputs.
_BUDGET_CHECK_S = 0.5


@attrs.frozen
class WorkerSpec:
    """How a worker process builds its model: ``"package.module:factory"`` plus keyword arguments.

    The factory is called as ``factory(**kwargs)``; with ``pass_rank`` it also gets
    ``rank=``.  A string, not a callable, so that it pickles into a spawned process.
    """

    factory: str
    kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    pass_rank: bool = False

    def __attrs_post_init__(self) -> None:
        if ":" not in self.factory:
            raise UsageError(f"WorkerSpec.factory must be 'module:callable', got {self.factory!r}")

    def build(self, rank: int) -> object:
        module, _, name = self.factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
        kwargs = dict(self.kwargs)
        if self.pass_rank:
            kwargs["rank"] = rank
        return factory(**kwargs)


@attrs.frozen
class WorkerOptions:
    """Worker-side settings, sent to every worker process."""

    reply_rank: int = 0
    device: str = "cpu"
    max_outputs_in_flight: int = 4
    max_bytes_in_flight: int | None = None
    backpressure_timeout: float | None = None
    inline_threshold: int = 64 << 10
    # How long packing waits for room in the budget of held outputs before the output
    # fails with HeldOutputsFull (None: the pool's own lease timeout).
    lease_timeout: float | None = 30.0


def _device_setup(device: str) -> torch.device:
    """Select the worker's device on the calling thread; returns it."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if str(dev) == "cuda":  # no index given: the process's current device
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def _worker_main(
    rank: int,
    spec: WorkerSpec,
    opts: WorkerOptions,
    pool: SegmentPool,
    sender: PipeSender,
    rpc_conn: multiprocessing.connection.Connection,
) -> None:
    """Entry point of a worker process (module level: spawn pickles it by name)."""
    import torch

    from omni_async.transport.platform import record_device_event

    dev = _device_setup(opts.device)

    def make_stream() -> CopyStream:
        # Runs on the packer thread: the current device is per thread, set it first.
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            return torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
        return None

    def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        try:
            return pack_diffusion_output_shm(
                output,
                stream,
                pool=pool,
                inline_threshold=opts.inline_threshold,
                ready_event=event,
                lease_timeout=opts.lease_timeout,
            )
        except PoolExhausted as exc:
            if isinstance(exc.__cause__, OSError):  # /dev/shm itself is full, not the budget
                raise
            raise _budget_full(output, exc, pool) from exc

    def release(packed: DiffusionOutput) -> None:
        release_packed_output(packed, pool=pool)

    worker = spec.build(rank)
    packer = Packer(
        rank,
        sender,
        pack=pack,
        release=release,
        make_stream=make_stream,
        max_outputs=opts.max_outputs_in_flight,
        max_bytes=opts.max_bytes_in_flight,
    )
    loop = WorkerLoop(
        rank,
        worker,
        sender,
        reply_rank=opts.reply_rank,
        packer=packer,
        pack_sync=pack,
        record_event=lambda: record_device_event(dev),
        backpressure_timeout=opts.backpressure_timeout,
    )
    packer.start()
    try:
        while True:
            try:
                req = rpc_conn.recv()
            except (EOFError, OSError):
                break  # the executor is gone
            if req is None:
                break
            loop.handle_rpc(req)
    finally:
        packer.stop(timeout=10.0)
        sender.close()


def _budget_full(output: DiffusionOutput, exc: PoolExhausted, pool: SegmentPool) -> HeldOutputsFull:
    """The error of an output that found no room in the budget of held outputs."""
    try:
        st = pool.stats()
        held = f"{st.outstanding} of max_held_outputs={pool.max_segments} outputs and {st.bytes_leased} of "
    except Exception:  # noqa: BLE001  # closing at shutdown: the numbers are not essential
        held = f"up to max_held_outputs={pool.max_segments} outputs and "
    return HeldOutputsFull(
        f"output {output.async_output_id} of request {output.request_id!r} found no room in the budget of held "
        f"outputs within lease_timeout={exc.timeout} s: {held}max_held_bytes={pool.max_bytes} bytes are held in "
        f"shared memory (packed, not yet released); it needs {exc.nbytes} bytes.  Release outputs sooner "
        "(release_output after wait_output_ready, or drop_output), or raise "
        "MultiprocDiffusionExecutor(max_held_outputs=..., max_held_bytes=...)",
        nbytes=exc.nbytes,
        timeout=exc.timeout,
    )


class MultiprocDiffusionExecutor(DiffusionExecutor):
    """``world_size`` worker processes built from ``spec``; ``reply_rank`` ships the outputs.

    ``options`` are the worker-side settings (device, packer budget); ``max_held_outputs``
    and ``max_held_bytes`` the budget of outputs held in shared memory (see the module
    docstring; defaults: 64 outputs, half the free space of /dev/shm up to 8 GiB);
    ``pool`` a shared-memory pool made by the caller instead, whose ``max_segments``
    and ``max_bytes`` are then the budget (either way the executor closes it at
    shutdown); ``copy_outputs`` makes ``wait_output_ready`` return owned copies and
    give the segment back at once instead of zero-copy views.  The constructor
    returns once every rank has built its model and answered.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        world_size: int = 1,
        reply_rank: int = 0,
        step_mode: bool = False,
        deadlines: Deadlines | None = None,
        options: WorkerOptions | None = None,
        pool: SegmentPool | None = None,
        max_held_outputs: int | None = None,
        max_held_bytes: int | None = None,
        copy_outputs: bool = False,
        start_timeout: float = 120.0,
        tracer: Tracer | None = None,
    ) -> None:
        opts = options if options is not None else WorkerOptions(reply_rank=reply_rank)
        if opts.reply_rank != reply_rank:
            opts = attrs.evolve(opts, reply_rank=reply_rank)
        self._ctx = multiprocessing.get_context("spawn")
        if pool is not None and (max_held_outputs is not None or max_held_bytes is not None):
            raise UsageError("pass either pool= or max_held_outputs=/max_held_bytes=: the pool is the budget")
        for name, value in (("max_held_outputs", max_held_outputs), ("max_held_bytes", max_held_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{name} must be a positive int, got {value!r}")
        self.pool = (
            pool
            if pool is not None
            else SegmentPool(
                max_bytes=max_held_bytes,
                max_segments=max_held_outputs if max_held_outputs is not None else DEFAULT_MAX_HELD_OUTPUTS,
                mp_context=self._ctx,
            )
        )
        self._lease_timeout = opts.lease_timeout if opts.lease_timeout is not None else self.pool.lease_timeout
        self._budget_full_logged = False
        self._channel = PipeChannel(mp_context=self._ctx)
        self._copy_outputs = copy_outputs
        super().__init__(
            self._channel,
            world_size=world_size,
            reply_rank=reply_rank,
            step_mode=step_mode,
            deadlines=deadlines,
            release_hook=self._release_packed,
            tracer=tracer,
        )
        self._rpc_lock = threading.Lock()
        self._rpc_conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._failure: WorkerDied | None = None
        self._monitor_stop_r, self._monitor_stop_w = self._ctx.Pipe(duplex=False)
        try:
            for rank in range(world_size):
                sender = self._channel.new_sender(f"rank{rank}")
                rpc_r, rpc_w = self._ctx.Pipe(duplex=False)
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(rank, spec, opts, self.pool, sender, rpc_r),
                    name=f"omni-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                # The child holds its own copies; closing ours lets EOF mean "worker gone".
                sender.close()
                rpc_r.close()
                self._rpc_conns.append(rpc_w)
                self.procs.append(proc)
            self.pump.start()
            self._monitor = threading.Thread(target=self._watch, name="omni-monitor", daemon=True)
            self._monitor.start()
            # Every rank has built its model and answers RPCs.
            self.collective_rpc("loop_info", timeout=start_timeout)
        except BaseException:
            self.shutdown("the executor failed to start")
            raise

    # ----------------------------------------------------------------- transport

    def _broadcast(self, req: RpcRequest) -> None:
        with self._rpc_lock:
            if self._closed:
                raise ExecutorShutdown("the executor is shut down")
            for rank, conn in enumerate(self._rpc_conns):
                try:
                    conn.send(req)
                except (BrokenPipeError, OSError) as exc:
                    raise ExecutorShutdown(f"cannot reach worker rank {rank}: {exc}") from exc

    def _worker_failure(self) -> OmniAsyncError | None:
        return self._failure

    def wait_output_ready(self, async_output_id: str) -> Future[DiffusionOutput]:
        """The unpacked output, delivered to exactly one waiter (see ``DiffusionExecutor``).

        Zero copy: its tensors and arrays view the output's shared-memory segment, and
        the segment goes back to the pool only when the last of them (and of anything
        derived from them) is gone -- so a tensor the engine keeps never changes under
        it.  ``release_output`` says "done" explicitly; with ``copy_outputs=True`` the
        output holds owned copies and its segment went back before delivery.
        """
        packed = super().wait_output_ready(async_output_id)
        return map_future(packed, self._receive, discard=self._discard)

    def _receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        # On failure the unpack gives the segment back itself.
        return unpack_diffusion_output_shm(packed, copy=self._copy_outputs, pool=self.pool)

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
        return release_unpacked_output(output, pool=self.pool)

    def _release_packed(self, packed: DiffusionOutput) -> None:
        try:
            release_packed_output(packed, pool=self.pool)
        except Exception:
            log.exception("releasing the segment of %s failed", packed.async_output_id)

    # ------------------------------------------------------------------- monitor

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while sentinels:
            ready = multiprocessing.connection.wait([*sentinels, self._monitor_stop_r], _BUDGET_CHECK_S)
            if self._monitor_stop_r in ready:
                return
            self._check_budget()
            for s in ready:
                if not isinstance(s, int):
                    continue
                rank = sentinels.pop(s)
                proc = self.procs[rank]
                proc.join(1.0)  # the sentinel fires just before the exit code is readable
                if self._closed:
                    continue
                self._on_worker_death(rank, proc.exitcode, proc.pid)

    def _check_budget(self) -> None:
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
                "MultiprocDiffusionExecutor(max_held_outputs=..., max_held_bytes=...)",
                st.outstanding,
                self.pool.max_segments,
                st.bytes_leased,
                self.pool.max_bytes,
                st.full_for_s,
                self._lease_timeout,
            )
        elif st.full_for_s == 0 and self._budget_full_logged:
            self._budget_full_logged = False
            log.info("the budget of held outputs has room again (%d outputs held)", st.outstanding)

    def metrics(self) -> dict[str, float]:
        """The executor's counters (see ``DiffusionExecutor.metrics``) and the budget of held outputs:
        ``max_held_outputs``/``max_held_bytes``, what is held now (``held_outputs``/``held_bytes``),
        ``pool_full`` (1 while a worker's packing waits for room) and for how long (``pool_full_s``),
        ``pool_waits``/``pool_wait_s_total`` (packs that had to wait, and how long in all) and
        ``pool_exhausted`` (outputs that found no room in time: ``HeldOutputsFull``)."""
        m = super().metrics()
        m["max_held_outputs"] = float(self.pool.max_segments)
        m["max_held_bytes"] = float(self.pool.max_bytes)
        try:
            st = self.pool.stats()
        except Exception:  # noqa: BLE001  # the pool closed at shutdown
            return m
        m.update(
            held_outputs=float(st.outstanding),
            held_bytes=float(st.bytes_leased),
            pool_full=float(st.full_for_s > 0),
            pool_full_s=st.full_for_s,
            pool_waits=float(st.lease_waits),
            pool_wait_s_total=st.lease_wait_s,
            pool_exhausted=float(st.exhausted),
        )
        return m

    def _on_worker_death(self, rank: int, exitcode: int | None, pid: int | None) -> None:
        err = WorkerDied(rank, exitcode)
        log.error("%s", err)
        if self._failure is None:
            self._failure = err
        if pid is not None:
            try:
                self.pool.reclaim_owner(pid)
            except Exception:
                log.exception("reclaiming the segments of dead worker %d failed", rank)
        # Close the registry too (TLC's DeathKeepsOpen): a message the dead worker sent
        # before dying can still be in the pipe; without the close it would create a
        # record (EARLY_READY, no deadline) that nobody ever claims.
        self.pump.fail_all(lambda oid: WorkerDied(rank, exitcode, output_id=oid), outcome="worker_died", close=True)

    # ------------------------------------------------------------------ shutdown

    def _stop_workers(self) -> None:
        try:
            self._monitor_stop_w.send(None)
        except OSError:
            pass
        # Nobody reads the result pipes any more: close them so a worker's put fails
        # at once instead of waiting for room.
        self._channel.close()
        with self._rpc_lock:
            for conn in self._rpc_conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
                conn.close()
        for p in self.procs:
            p.join(5.0)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        if hasattr(self, "_monitor"):
            self._monitor.join(5.0)
        self._monitor_stop_r.close()
        self._monitor_stop_w.close()
        # The executor owns its pool, also one passed in: closing it unlinks every
        # segment; the prefix sweep catches any a dying worker created meanwhile.
        self.pool.close()
        unlink_all_with_prefix(self.pool.prefix)
