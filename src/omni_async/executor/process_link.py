"""``ProcessRanks``: the rank link of ``MultiprocDiffusionExecutor`` -- worker processes
(spawn), a pipe per worker for RPCs, one for cancels and one for its start-up status,
the result ``PipeChannel`` the pump reads, a lifeline the workers watch, and a monitor
thread on their sentinels.  ``omni_async.executor.multiproc``'s docstring says who owns
what and how a death is handled; the worker process itself is ``omni_async.worker.process``.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time

from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OmniAsyncError,
    ProtocolError,
    WorkerDied,
    WorkerStartupFailed,
)
from omni_async.core.messages import AsyncDiffusionOutput, CancelMessage, Failure, RpcRequest
from omni_async.executor.checks import stop_budget
from omni_async.executor.dist import GroupRendezvous
from omni_async.executor.link import RankEvents, RankLink, shut_down_error
from omni_async.transport.channel import PipeChannel
from omni_async.transport.children import stop_signals_blocked
from omni_async.transport.packing import carried_leases
from omni_async.transport.rpc import encode_rpc
from omni_async.transport.shm import SegmentPool
from omni_async.worker.host import WorkerOptions, WorkerSpec
from omni_async.worker.process import worker_main

__all__ = ["ProcessRanks"]

log = logging.getLogger(__name__)

# How often the monitor looks for a full budget of held outputs.
_BUDGET_CHECK_S = 0.5
# How long the ranks still alive get to exit when asked, once a rank has died: every
# call in flight failed with the death (WorkerDied), so what they still compute is for
# nobody; a forward that ignores cancellation would otherwise hold the shutdown for
# half its deadline (a close after a SIGKILL took 20 s with nothing left to wait for).
_ASK_AFTER_DEATH_S = 1.0


class _CancelSender:
    """Executor side of the control pipes: one thread writes every cancel to every rank.

    ``put`` never blocks (a queue), so the pump thread can cancel the forward of a call
    whose deadline expired; a write to a dead worker's pipe is skipped (its death is
    the monitor's business).
    """

    def __init__(self, conns: list[multiprocessing.connection.Connection]) -> None:
        self._conns = conns
        self._queue: queue.SimpleQueue[list[CancelMessage] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="omni-cancel", daemon=True)
        self.sent = 0

    def start(self) -> None:
        self._thread.start()

    def put(self, cancels: list[CancelMessage]) -> None:
        self._queue.put(cancels)

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        for conn in self._conns:
            conn.close()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            for rank, conn in enumerate(self._conns):
                for msg in batch:
                    try:
                        conn.send(msg)
                    except (OSError, ValueError) as exc:
                        log.debug("cannot send %s to worker rank %d: %s", msg, rank, exc)
                        break
            self.sent += len(batch)


_NO_REPORT = object()  # a worker that died without reporting how its start-up went


def _join_all(
    procs: list[multiprocessing.process.BaseProcess], until: float
) -> list[multiprocessing.process.BaseProcess]:
    """Wait for all of ``procs`` at once, until ``until`` (monotonic); returns those still alive."""
    alive = [p for p in procs if p.is_alive()]
    while alive and (left := until - time.monotonic()) > 0:
        multiprocessing.connection.wait([p.sentinel for p in alive], left)
        alive = [p for p in alive if p.is_alive()]
    return alive


class _ReceivingEnd:
    """The pump's end of the result channel: each lease a message carries is marked
    received (``SegmentPool.receive``) as the message is read, before the dispatcher
    sees it, so ``reclaim_shipped`` never takes a segment that a message delivered."""

    def __init__(self, channel: PipeChannel, pool: SegmentPool) -> None:
        self._channel = channel
        self._pool = pool

    def get(self, timeout: float) -> AsyncDiffusionOutput | None:
        msg = self._channel.get(timeout)
        if msg is not None:
            for lease in carried_leases(msg):
                try:
                    self._pool.receive(lease)
                except Exception:  # noqa: BLE001  # the pool closed at shutdown: nothing left to reclaim
                    log.debug("marking %s received failed", lease.name, exc_info=True)
        return msg

    def close(self) -> None:
        self._channel.close()


class ProcessRanks(RankLink):
    """Ranks in worker processes (spawn): pipes for RPCs, cancels, start-up status and
    results, a lifeline the workers watch, and a monitor thread on their sentinels."""

    def __init__(
        self,
        spec: WorkerSpec,
        opts: WorkerOptions,
        world_size: int,
        pool: SegmentPool,
        group: GroupRendezvous | None = None,
    ) -> None:
        self._spec = spec
        self._group = group  # the ranks' process group's rendezvous, closed by ``stop``
        self._opts = opts
        self._world_size = world_size
        self._pool = pool
        self._ctx = multiprocessing.get_context("spawn")
        # A dead worker's shipped segments are reclaimed once both its death was handled
        # (monitor) and its pipe was read to the end (pump): see ``_on_pipe_end``.
        self._reap_lock = threading.Lock()
        self._sender_ranks: dict[str, int] = {}
        self._pipe_ended: set[int] = set()
        self._dead_pids: dict[int, int] = {}
        self._channel = PipeChannel(mp_context=self._ctx, on_sender_gone=self._on_pipe_end)
        self.receiver = _ReceivingEnd(self._channel, pool)
        self._rpc_lock = threading.Lock()
        self._rpc_conns: list[multiprocessing.connection.Connection] = []
        self._control_conns: list[multiprocessing.connection.Connection] = []
        self._cancel_sender = _CancelSender(self._control_conns)
        self._status_conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._monitor_stop_r, self._monitor_stop_w = self._ctx.Pipe(duplex=False)
        # The workers' lifeline (``ExecutorWatch``): we hold the writing end, never
        # write, and close it only once every worker is gone.
        self._lifeline_r, self._lifeline_w = self._ctx.Pipe(duplex=False)
        self._monitor: threading.Thread | None = None
        self._events: RankEvents | None = None

    @property
    def events(self) -> RankEvents:
        assert self._events is not None, "ProcessRanks.start sets the events"
        return self._events

    def start(self, events: RankEvents | None, deadline: float, start_timeout: float) -> None:
        assert events is not None, "worker processes can die: their link reports to RankEvents"
        self._events = events
        lifeline_r = self._lifeline_r
        try:
            for rank in range(self._world_size):
                sender = self._channel.new_sender(f"rank{rank}")
                self._sender_ranks[sender.name] = rank
                rpc_r, rpc_w = self._ctx.Pipe(duplex=False)
                status_r, status_w = self._ctx.Pipe(duplex=False)
                control_r, control_w = self._ctx.Pipe(duplex=False)
                proc = self._ctx.Process(
                    target=worker_main,
                    args=(
                        rank,
                        self._spec,
                        self._opts,
                        self._pool,
                        sender,
                        rpc_r,
                        status_w,
                        lifeline_r,
                        control_r,
                        None if self._group is None else self._group.rendezvous,
                    ),
                    name=f"omni-worker-{rank}",
                    daemon=True,
                )
                with stop_signals_blocked():
                    proc.start()
                # The child holds its own copies; closing ours lets EOF mean "worker gone".
                sender.close()
                rpc_r.close()
                status_w.close()
                control_r.close()
                self._control_conns.append(control_w)
                self._rpc_conns.append(rpc_w)
                self._status_conns.append(status_r)
                self.procs.append(proc)
        finally:
            lifeline_r.close()
        self._await_models(deadline, start_timeout)
        # Every worker opened its credit semaphore by name while unpickling its
        # arguments: the names can go (a SIGKILL of the whole group leaves none).
        self._channel.unlink_names()
        self._cancel_sender.start()

    def started(self) -> None:
        self._monitor = threading.Thread(target=self._watch, name="omni-monitor", daemon=True)
        self._monitor.start()

    def _await_models(self, deadline: float, start_timeout: float) -> None:
        """Wait until every rank reports its model built; raise ``WorkerStartupFailed`` for the first that fails."""
        waiting = set(range(len(self.procs)))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ComputeTimeout(f"worker rank(s) {sorted(waiting)} did not build their model in {start_timeout} s")
            objects: dict[object, int] = {}
            for rank in waiting:
                objects[self._status_conns[rank]] = rank
                objects[self.procs[rank].sentinel] = rank
            for ready in multiprocessing.connection.wait(list(objects), left):  # type: ignore[arg-type]
                rank = objects[ready]
                if rank not in waiting:
                    continue
                conn = self._status_conns[rank]
                failure: object
                if conn.poll(0):
                    try:
                        failure = conn.recv()
                    except (EOFError, OSError):
                        failure = _NO_REPORT
                    if failure is None:
                        waiting.discard(rank)
                        continue
                else:
                    failure = _NO_REPORT  # the sentinel fired: dead without a word
                proc = self.procs[rank]
                proc.join(5.0)
                raise WorkerStartupFailed(
                    rank, proc.exitcode, failure=failure if isinstance(failure, Failure) else None
                )

    def _last_words(self, rank: int) -> Failure | None:
        """The failure a dead worker reported before exiting, if any (monitor thread)."""
        conn = self._status_conns[rank]
        try:
            while conn.poll(0):
                msg = conn.recv()
                if isinstance(msg, Failure):
                    return msg
        except (EOFError, OSError):
            pass
        return None

    # ------------------------------------------------------------------- sending

    def encode(self, req: RpcRequest) -> list[bytes] | None:
        return encode_rpc(req, len(self._rpc_conns))

    def broadcast(self, req: RpcRequest, wire: list[bytes] | None) -> None:
        # Pickled for every rank before the first write, outside the lock: an argument
        # that does not pickle fails here, with no rank holding half a call.
        data = wire if wire is not None else encode_rpc(req, len(self._rpc_conns))
        with self._rpc_lock:
            if self.events.closed:
                raise shut_down_error()
            for rank, conn in enumerate(self._rpc_conns):
                try:
                    conn.send_bytes(data[rank])
                except (BrokenPipeError, OSError) as exc:
                    raise ExecutorShutdown(f"cannot reach worker rank {rank}: {exc}") from exc

    def deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        self._cancel_sender.put(cancels)

    # A worker's frame incomplete this long (a live sender stopped mid-write, M5) fails
    # ``check_health``: the reader serves the other ranks meanwhile, but this rank's
    # results stall behind the torn frame.
    torn_frame_bound: float = 5.0

    def failure(self) -> OmniAsyncError | None:
        if self._events is not None and self._events.failure is not None:
            return self._events.failure
        torn = self._channel.torn_senders(self.torn_frame_bound)
        if torn:
            label, age = max(torn.items(), key=lambda kv: kv[1])
            return ProtocolError(
                f"worker {label}: a message on its result channel has been incomplete for {age:.1f} s "
                f"(the worker stopped mid-write); its results stall behind it"
            )
        return None

    # ------------------------------------------------------------------- monitor

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while sentinels:
            ready = multiprocessing.connection.wait([*sentinels, self._monitor_stop_r], _BUDGET_CHECK_S)
            if self._monitor_stop_r in ready:
                return
            self.events.check_budget()
            for s in ready:
                if not isinstance(s, int):
                    continue
                rank = sentinels.pop(s)
                proc = self.procs[rank]
                proc.join(1.0)  # the sentinel fires just before the exit code is readable
                if self.events.closed:
                    continue
                self._on_worker_death(rank, proc.exitcode, proc.pid)

    def _on_worker_death(self, rank: int, exitcode: int | None, pid: int | None) -> None:
        failure = self._last_words(rank)
        self.events.rank_died(
            rank,
            WorkerDied(rank, exitcode, failure=failure),
            lambda oid: WorkerDied(rank, exitcode, output_id=oid, failure=failure),
            pid,
            reclaim_shipped=False,  # its pipe may still hold messages: see _on_pipe_end
        )
        if pid is not None:
            with self._reap_lock:
                self._dead_pids[rank] = pid
                ended = rank in self._pipe_ended
            if ended:
                self.events.reclaim_shipped(rank, pid)

    def _on_pipe_end(self, label: str) -> None:
        """Pump thread: a worker's result pipe reached its end, every message it wrote handled."""
        rank = self._sender_ranks.get(label)
        if rank is None:
            return  # the executor's own sender, or one a test made
        with self._reap_lock:
            self._pipe_ended.add(rank)
            pid = self._dead_pids.get(rank)
        if pid is not None:
            self.events.reclaim_shipped(rank, pid)

    # ------------------------------------------------------------------ shutdown

    def stop(self, deadline: float | None) -> None:
        # Phases, every rank at once: ask (a None on its RPC pipe), then SIGKILL.  Without
        # a deadline they last 5 s and 2 s; with one, half of what is left of it each.
        t0 = time.monotonic()
        span = None if deadline is None else max(0.0, deadline - t0)

        def phase_end(default: float, fraction: float, after: float) -> float:
            return after + (default if span is None else span * fraction)

        try:
            self._monitor_stop_w.send(None)
        except OSError:
            pass
        # Nobody reads the result pipes any more: close them so a worker's put fails
        # at once instead of waiting for room.
        self._channel.close()  # unlinks the credit semaphores' names too (a failed start)
        asked = phase_end(5.0, 0.5, t0)
        if any(p.exitcode is not None for p in self.procs):
            asked = min(asked, t0 + _ASK_AFTER_DEATH_S)
        self._cancel_sender.stop(timeout=max(0.0, min(1.0, asked - time.monotonic())))
        # A caller's send may be blocked on a full RPC pipe (a large request) and hold the
        # lock: then that rank is not asked, it is terminated below, and the broken pipe
        # frees the sender (why the lock is taken with a timeout, and the pipes closed last).
        polite = self._rpc_lock.acquire(timeout=max(0.0, min(1.0, asked - time.monotonic())))
        if polite:
            try:
                for conn in self._rpc_conns:
                    try:
                        conn.send(None)
                    except OSError:
                        pass
            finally:
                self._rpc_lock.release()
        alive = _join_all(self.procs, asked)
        # A worker ignores a SIGTERM not sent by this process (``transport.children``: a service
        # manager's stop reaches the whole group, and the requests in flight must end
        # first); the one that did not leave when asked is killed.
        for p in alive:
            p.kill()
        alive = _join_all(alive, phase_end(2.0, 0.5, asked) if deadline is None else deadline)
        if alive:
            log.warning(
                "shutdown: worker process(es) %s still running after SIGKILL; not waited for",
                [p.pid for p in alive],
            )
        if self._rpc_lock.acquire(timeout=stop_budget(deadline, 2.0)):
            try:
                for conn in self._rpc_conns:
                    conn.close()
            finally:
                self._rpc_lock.release()
        if self._monitor is not None:
            self._monitor.join(stop_budget(deadline, 5.0))
        self._monitor_stop_r.close()
        self._monitor_stop_w.close()
        # Every worker is gone: the lifeline has nobody left to warn.
        self._lifeline_w.close()
        for conn in self._status_conns:
            conn.close()
        if self._group is not None:
            self._group.close()
