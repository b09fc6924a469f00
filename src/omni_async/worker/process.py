"""The worker process: its entry point, and the threads that watch its executor.

``worker_main`` is what ``MultiprocDiffusionExecutor`` spawns for every rank: it
builds the rank's model, packer and loop (``omni_async.worker.host.build_worker``),
reports the start-up to the executor on a status pipe, serves RPCs on its main thread
and cancels on a thread of its own (``read_control``), and watches the executor
(``ExecutorWatch``): when the executor process is gone, the worker unlinks its pool
and exits with ``EXIT_ORPHANED``.  It lives in the worker layer because it runs in the
worker process; the executor side of the same pipes is ``omni_async.executor.multiproc``.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import sys
import threading
import time
from typing import NoReturn

from omni_async.core.messages import CancelMessage, Failure
from omni_async.transport.channel import PipeSender
from omni_async.transport.children import ignore_stop_signals
from omni_async.transport.shm import SegmentPool, unlink_all_with_prefix
from omni_async.worker.dist import Rendezvous, leave_process_group
from omni_async.worker.host import WorkerOptions, WorkerSpec, build_worker
from omni_async.worker.loop import WorkerLoop

__all__ = ["EXIT_ORPHANED", "ExecutorWatch", "read_control", "report", "worker_main"]

log = logging.getLogger(__name__)

# A worker whose executor died exits with this code after unlinking the pool.
EXIT_ORPHANED = 3


class ExecutorWatch:
    """Worker side: notices that the executor process is gone, unlinks its pool, exits.

    How the death is noticed: the executor keeps the writing end of a "lifeline" pipe
    and never writes to it; the worker holds the reading end, which turns readable
    (EOF) the moment the kernel closes the executor's last descriptor -- however it
    died, ``kill -9`` included -- with no polling delay.  As a fallback the watch also
    checks every second that ``os.getppid()`` is still the executor: the pipe stays
    open if the executor forked a child that inherited its end.

    Not ``prctl(PR_SET_PDEATHSIG)``: it fires when the *thread* that spawned the worker
    exits, and an executor may be built on a short-lived thread; and it would kill the
    worker, which then could not clean up (unless it caught the signal, racing its
    own threads).  Not ``multiprocessing.parent_process().sentinel`` either: the same
    pipe trick, but its write end lives in the ``Process`` object and is closed with
    it; ours is explicit and lives as long as the executor.

    On EOF (or a new parent) it marks the pool closed, unlinks every file with the
    pool's prefix, lock file included, and ``os._exit(EXIT_ORPHANED)`` -- whatever the
    main thread is doing (a forward can take minutes).  Runs once, from whichever of
    the watch thread and the RPC loop (whose pipe hits EOF too) gets there first.
    """

    def __init__(self, rank: int, pool: SegmentPool, lifeline: multiprocessing.connection.Connection) -> None:
        self._rank = rank
        self._pool = pool
        self._lifeline = lifeline
        self._ppid = os.getppid()
        self._once = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"omni-watch-{self._rank}", daemon=True).start()

    def executor_gone(self, timeout: float) -> bool:
        if os.getppid() != self._ppid:
            return True
        try:
            return self._lifeline.poll(timeout)  # readable only at EOF: nobody writes
        except (EOFError, OSError):
            return True

    def _run(self) -> None:
        while not self.executor_gone(1.0):
            pass
        self.orphaned()

    def orphaned(self) -> NoReturn:
        self._once.acquire()  # the second caller waits here for the first one's exit
        try:
            n = self._pool.close_orphaned()
            # A lease that was creating its file as the flag went up: catch it too.
            time.sleep(0.05)
            n += unlink_all_with_prefix(self._pool.prefix)
            log.warning(
                "omni-worker-%d: the executor process %d is gone; unlinked %d segment(s) of pool %s, exiting",
                self._rank,
                self._ppid,
                n,
                self._pool.prefix,
            )
        except BaseException:
            pass  # nothing to report to, and the exit below must happen
        finally:
            os._exit(EXIT_ORPHANED)


def report(status: multiprocessing.connection.Connection, failure: Failure | None) -> bool:
    """Tell the executor the model is built (None) or what stopped the worker; False if it cannot hear."""
    try:
        status.send(failure)
        return True
    except (OSError, ValueError):
        return False


def worker_main(
    rank: int,
    spec: WorkerSpec,
    opts: WorkerOptions,
    pool: SegmentPool,
    sender: PipeSender,
    rpc_conn: multiprocessing.connection.Connection,
    status: multiprocessing.connection.Connection,
    lifeline: multiprocessing.connection.Connection,
    control: multiprocessing.connection.Connection,
    rendezvous: Rendezvous | None = None,
) -> None:
    """Entry point of a worker process (module level: spawn pickles it by name);
    ``rendezvous``: the executor's process group, joined before the model is built."""
    # Ctrl-C (SIGINT) and a service manager's stop (SIGTERM) reach the whole process group;
    # the executor stops its workers in order.  Spawned with both blocked, so a pending one
    # is discarded here.
    ignore_stop_signals()
    watch = ExecutorWatch(rank, pool, lifeline)
    watch.start()
    try:
        packer, loop = build_worker(rank, spec, opts, pool, sender, rendezvous=rendezvous)
    except BaseException as exc:
        # The executor raises it (WorkerStartupFailed, with the traceback); print it
        # here only if the executor cannot hear.
        if not report(status, Failure.from_exception(exc)):
            raise
        sys.exit(1)
    report(status, None)
    packer.start()
    threading.Thread(target=read_control, args=(loop, control), name=f"omni-cancel-{rank}", daemon=True).start()
    code = 0
    # This loop calls idle() whenever the pipe holds no RPC: the packer may wait for the
    # next forward's start (WorkerLoop.idle says why).
    loop.defer_packing = opts.defer_packing
    try:
        while True:
            try:
                if not rpc_conn.poll():
                    loop.idle()
                req = rpc_conn.recv()
            except (EOFError, OSError):
                # No ``None`` came first: the executor is gone (or dropped without shutdown).
                if watch.executor_gone(2.0):
                    watch.orphaned()
                break
            if req is None:
                break
            loop.handle_rpc(req)
    except BaseException as exc:
        if not report(status, Failure.from_exception(exc)):
            raise
        code = 1
    finally:
        # Exiting: a pack still waiting for room must not hold the exit (F16).
        packer.stop(timeout=10.0, abandon=True)
        sender.close()
        # Reached only with the main thread free: a rank stuck in a collective is
        # terminated by the executor instead, and its peers' collectives fail.
        leave_process_group()
    # Leave without the interpreter's finalization: an abandoned packer (or a torch
    # thread pool) may still be inside C++ code, and tearing the runtime down under it
    # aborts the process ("terminate called without an active exception", seen once
    # when Ctrl-C stopped the demo mid-run).  Everything the worker owns is closed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def read_control(loop: WorkerLoop, control: multiprocessing.connection.Connection) -> None:
    """Worker side of the control pipe: cancel messages into the loop's table, until EOF."""
    while True:
        try:
            msg = control.recv()
        except (EOFError, OSError):
            return  # the executor closed it (shutdown) or is gone (the watch handles that)
        if msg is None:
            return
        if isinstance(msg, CancelMessage):
            loop.cancel(msg)
        else:
            log.warning("omni-cancel-%d: ignoring a control message of type %s", loop.rank, type(msg).__name__)
