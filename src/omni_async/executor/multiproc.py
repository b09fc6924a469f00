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
nobody would unlink the pool: every worker watches the executor (``_ExecutorWatch``)
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

import contextlib
import importlib
import queue
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NoReturn, cast

import attrs

from omni_async.core.config import Deadlines
from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    OmniAsyncError,
    OutputUnpackFailed,
    ProtocolError,
    UsageError,
    WorkerDied,
    WorkerStartupFailed,
)
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    BatchDiffusionOutput,
    CancelMessage,
    DiffusionOutput,
    DiffusionRequest,
    Failure,
    RpcRequest,
)
from omni_async.core.trace import Tracer
from omni_async.executor.api import DiffusionExecutor, check_final_step_async, stop_budget
from omni_async.executor.futures import map_future
from omni_async.executor.validation import model_validator
from omni_async.transport.channel import PipeChannel, PipeSender, ResultSender
from omni_async.transport.errors import HeldOutputsFull, PoolExhausted
from omni_async.transport.packing import (
    carried_leases,
    pack_diffusion_output_shm,
    packed_lease,
    release_packed_output,
    release_unpacked_output,
    unpack_diffusion_output_shm,
)
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.transport.rpc import encode_rpc, pickle_problem
from omni_async.transport.shm import SegmentPool, unlink_all_with_prefix
from omni_async.transport.shm.files import remove_dead_executor_files
from omni_async.worker.baselines import (
    OutputPath,
    check_output_path,
    discard_fresh_output,
    is_fresh,
    pack_reference_fresh,
    pack_sync_fresh,
    receive_fresh_output,
)
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.packer import Packer, PackFn
from omni_async.worker.postprocess import DeviceStage, get_postprocess

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The default budget of held outputs; the byte budget defaults to half the free space of
# /dev/shm (at most 8 GiB), see SegmentPool.
DEFAULT_MAX_HELD_OUTPUTS = 64
# How often the monitor looks for a full budget of held outputs.
_BUDGET_CHECK_S = 0.5


_SPEC_HINT = "pass the import path, e.g. 'mypkg.models:MyWorker'"


@attrs.frozen
class WorkerSpec:
    """How a worker process builds its model: ``"package.module:factory"`` plus keyword arguments.

    The factory is called as ``factory(**kwargs)``; with ``pass_rank`` it also gets
    ``rank=``.  A string, not a callable, so that it pickles into a spawned process.

    The constructor checks the fields (``UsageError`` naming the problem) and, with
    ``check_import`` (the default), imports the factory here, in the engine's process:
    a typo fails now rather than as a worker that dies at start-up.  Turn it off for a
    module that must not be imported outside a worker (one that initialises a device
    at import time, say); the worker then reports the import error at start-up.

    A factory with a static (or class) method ``validate_request(request)`` -- or, for
    a factory function, such an attribute -- gets it called by the executor on every
    request before sending it (``request_validator``): a bad request fails in the
    caller's thread, and no worker sees it.  A factory class whose ``validate_request``
    is an instance method is refused here (``UsageError``): the executor could not run
    it, and a bad request would reach the model unchecked.  The kwargs must pickle (they
    travel to every worker): one that does not is refused here, named.

    ``postprocess``: the pipeline name of a registered ``PostProcess`` whose ``device``
    stage the worker's packer runs on every output before the copy (see
    ``omni_async.worker.postprocess``).  The worker looks it up after building the
    model (the factory's module, imported there, registers it); with ``check_import``
    the constructor looks it up here too, so an unknown name fails now
    (``UnknownPostProcess``), not as a worker that cannot start.
    """

    factory: str
    kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    pass_rank: bool = False
    check_import: bool = attrs.field(default=True, kw_only=True)
    postprocess: str | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.factory, str):
            raise UsageError(
                f"WorkerSpec.factory must be a 'module:callable' string (it travels to the worker "
                f"processes by name), got {type(self.factory).__name__} {self.factory!r}: {_SPEC_HINT}"
            )
        module, _, name = self.factory.partition(":")
        if not module or not name or not all(p.isidentifier() for p in (*module.split("."), *name.split("."))):
            raise UsageError(f"WorkerSpec.factory must be 'module:callable', got {self.factory!r}: {_SPEC_HINT}")
        if not isinstance(self.kwargs, Mapping):
            raise UsageError(
                f"WorkerSpec.kwargs must be a mapping of keyword arguments, got {type(self.kwargs).__name__} "
                f"{self.kwargs!r}"
            )
        bad_keys = [k for k in self.kwargs if not isinstance(k, str)]
        if bad_keys:
            raise UsageError(f"WorkerSpec.kwargs keys must be str (keyword arguments), got {bad_keys!r}")
        for key, value in self.kwargs.items():
            problem = pickle_problem(value, spawning=True)
            if problem is not None:
                raise UsageError(
                    f"WorkerSpec.kwargs[{key!r}] does not pickle ({type(problem).__name__}: {problem}): the "
                    "kwargs travel to every worker process by pickle; pass data (or an import path) and "
                    "build the object in the factory"
                )
        for field in ("pass_rank", "check_import"):
            if not isinstance(getattr(self, field), bool):
                raise UsageError(f"WorkerSpec.{field} must be a bool, got {getattr(self, field)!r}")
        if self.postprocess is not None and (not isinstance(self.postprocess, str) or not self.postprocess):
            raise UsageError(
                f"WorkerSpec.postprocess must be a registered pipeline name (str) or None, got {self.postprocess!r}"
            )
        if self.check_import:
            model_validator(self.resolve(), f"WorkerSpec({self.factory!r})")  # the one rule, checked now
            self.device_stage()

    def device_stage(self) -> DeviceStage | None:
        """The device stage of ``postprocess`` in this process (None without one);
        ``UnknownPostProcess`` when no post-process is registered under the name."""
        if self.postprocess is None:
            return None
        return get_postprocess(self.postprocess).device

    def resolve(self) -> Callable[..., object]:
        """Import the factory in this process; ``UsageError`` when it cannot be found."""
        module_name, _, qualname = self.factory.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception as exc:
            raise UsageError(
                f"WorkerSpec.factory {self.factory!r}: cannot import {module_name!r} "
                f"({type(exc).__name__}: {exc}); {_SPEC_HINT}"
            ) from exc
        for part in qualname.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError as exc:
                raise UsageError(f"WorkerSpec.factory {self.factory!r}: {module_name!r} has no {qualname!r}") from exc
        if not callable(obj):
            raise UsageError(f"WorkerSpec.factory {self.factory!r} is a {type(obj).__name__}, not a callable")
        return cast("Callable[..., object]", obj)

    def request_validator(self) -> Callable[[DiffusionRequest], None] | None:
        """The factory's ``validate_request`` (a static or class method, or a factory
        function's attribute), run by the executor in the caller's thread; None without
        one, and without ``check_import`` (the factory is not imported here).  An instance
        method is refused (``UsageError``): see ``omni_async.executor.validation``."""
        if not self.check_import:
            return None
        return model_validator(self.resolve(), f"WorkerSpec({self.factory!r})")

    def build(self, rank: int) -> object:
        factory = self.resolve()
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
    # How outputs are shipped: ours ("omni"), or a baseline that ``omni-async bench``
    # measures ours against ("sync": the seed's, step mode; "reference": the reference
    # implementation's, request mode); see ``omni_async.worker.baselines``.
    output_path: OutputPath = "omni"

    def __attrs_post_init__(self) -> None:
        check_output_path(self.output_path)


def device_for_rank(device: str, rank: int, device_count: int) -> str:
    """The device rank ``rank`` computes on: ``"cuda"`` without an index puts rank r on
    ``cuda:r`` when the machine has that many GPUs, round-robin when it has fewer
    (``cuda:{r % count}``); an explicit index, or another device, is used as given."""
    if device == "cuda" and device_count > 0:
        return f"cuda:{rank % device_count}"
    return device


def _device_setup(device: str, rank: int = 0) -> torch.device:
    """Select rank ``rank``'s device (``device_for_rank``) on the calling thread; returns it."""
    import torch

    count = torch.cuda.device_count() if device == "cuda" else 0
    dev = torch.device(device_for_rank(device, rank, count))
    if dev.type == "cuda":
        if str(dev) == "cuda":  # no GPU counted: the process's current device
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


# A worker whose executor died exits with this code after unlinking the pool.
EXIT_ORPHANED = 3


class _ExecutorWatch:
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


def _report(status: multiprocessing.connection.Connection, failure: Failure | None) -> bool:
    """Tell the executor the model is built (None) or what stopped the worker; False if it cannot hear."""
    try:
        status.send(failure)
        return True
    except (OSError, ValueError):
        return False


def _worker_main(
    rank: int,
    spec: WorkerSpec,
    opts: WorkerOptions,
    pool: SegmentPool,
    sender: PipeSender,
    rpc_conn: multiprocessing.connection.Connection,
    status: multiprocessing.connection.Connection,
    lifeline: multiprocessing.connection.Connection,
    control: multiprocessing.connection.Connection,
) -> None:
    """Entry point of a worker process (module level: spawn pickles it by name)."""
    # Ctrl-C reaches the whole process group; the executor stops its workers in order.
    # Spawned with SIGINT blocked (``_sigint_blocked``), so a pending one is discarded here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    watch = _ExecutorWatch(rank, pool, lifeline)
    watch.start()
    try:
        packer, loop = _build_worker(rank, spec, opts, pool, sender)
    except BaseException as exc:
        # The executor raises it (WorkerStartupFailed, with the traceback); print it
        # here only if the executor cannot hear.
        if not _report(status, Failure.from_exception(exc)):
            raise
        sys.exit(1)
    _report(status, None)
    packer.start()
    threading.Thread(target=_read_control, args=(loop, control), name=f"omni-cancel-{rank}", daemon=True).start()
    code = 0
    try:
        while True:
            try:
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
        if not _report(status, Failure.from_exception(exc)):
            raise
        code = 1
    finally:
        # Exiting: a pack still waiting for room must not hold the exit (F16).
        packer.stop(timeout=10.0, abandon=True)
        sender.close()
    # Leave without the interpreter's finalization: an abandoned packer (or a torch
    # thread pool) may still be inside C++ code, and tearing the runtime down under it
    # aborts the process ("terminate called without an active exception", seen once
    # when Ctrl-C stopped the demo mid-run).  Everything the worker owns is closed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _read_control(loop: WorkerLoop, control: multiprocessing.connection.Connection) -> None:
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


def _build_worker(
    rank: int,
    spec: WorkerSpec,
    opts: WorkerOptions,
    pool: SegmentPool | None,
    sender: ResultSender,
    *,
    packing: tuple[PackFn, Callable[[DiffusionOutput], None]] | None = None,
) -> tuple[Packer, WorkerLoop]:
    """The worker's model, packer and loop (the packer not started yet).

    ``packing``: (pack, release) replacing the pool's (the Ray executor's object-store
    path, where ``pool`` is None: a remote node cannot attach to it).
    """
    import torch

    from omni_async.transport.platform import record_device_event

    dev = _device_setup(opts.device, rank)

    def make_stream() -> CopyStream:
        # Runs on the packer thread: the current device is per thread, set it first.
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            return torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
        return None

    def pack_omni(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        assert pool is not None
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

    def release_pooled(packed: DiffusionOutput) -> None:
        assert pool is not None
        if is_fresh(packed):
            discard_fresh_output(packed)
        else:
            release_packed_output(packed, pool=pool)

    baseline = pack_sync_fresh if opts.output_path == "sync" else pack_reference_fresh

    def pack_baseline(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        assert pool is not None
        return baseline(output, stream, event, prefix=pool.prefix, inline_threshold=opts.inline_threshold)

    # A baseline path replaces ours for both the packer and step mode's answers.
    pack: PackFn = pack_omni if opts.output_path == "omni" else pack_baseline
    release: Callable[[DiffusionOutput], None] = release_pooled
    if packing is not None:
        pack, release = packing

    worker = spec.build(rank)
    # After the build: importing the factory's module registers its post-processes here.
    stage = spec.device_stage()
    packer = Packer(
        rank,
        sender,
        pack=pack,
        release=release,
        make_stream=make_stream,
        max_outputs=opts.max_outputs_in_flight,
        max_bytes=opts.max_bytes_in_flight,
        interrupt=pool.cancel_waits if pool is not None else None,
        device_stage=stage,
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
        device_stage=stage,
    )
    if pool is not None and packing is None and opts.output_path == "omni" and rank == opts.reply_rank:
        # The rank that packs maps (and on CUDA pins) the segments made ahead of it, now
        # rather than in its first packs (SegmentPool.map_segments).
        mapped, pinned = pool.map_segments()
        loop.info.update(mapped_segments=mapped, pinned_segments=pinned)
    return packer, loop


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread while a worker is spawned.

    The child inherits the mask through fork and exec, so a Ctrl-C during its start-up
    (imports, unpickling) stays pending until it ignores SIGINT and then is discarded,
    instead of printing a ``KeyboardInterrupt`` traceback.  Only this thread's mask
    changes (any thread may call it); a SIGINT for this process meanwhile goes to
    another thread or waits until the block ends.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


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
    returns once every rank has built its model and answered; a rank whose model
    fails to build makes it raise ``WorkerStartupFailed`` carrying the remote error.

    ``sweep_dead_pools`` (default on): first unlink the shared-memory files of
    executors that died without cleaning up (their pid, in the file names, no longer
    runs; see ``files.dead_executor_files`` for the one caveat), and log how many.
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
        sweep_dead_pools: bool = True,
        final_step_async: bool = False,
    ) -> None:
        if not isinstance(spec, WorkerSpec):
            raise UsageError(
                f"spec must be a WorkerSpec, got {type(spec).__name__} {spec!r}: "
                f"WorkerSpec('mypkg.models:MyWorker', kwargs={{...}})"
            )
        opts = options if options is not None else WorkerOptions(reply_rank=reply_rank)
        check_output_path(opts.output_path, step_mode=step_mode)
        if opts.reply_rank != reply_rank:
            opts = attrs.evolve(opts, reply_rank=reply_rank)
        self._ctx = multiprocessing.get_context("spawn")
        if pool is not None and (max_held_outputs is not None or max_held_bytes is not None):
            raise UsageError("pass either pool= or max_held_outputs=/max_held_bytes=: the pool is the budget")
        for name, value in (("max_held_outputs", max_held_outputs), ("max_held_bytes", max_held_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{name} must be a positive int, got {value!r}")
        check_final_step_async(final_step_async, step_mode)
        if sweep_dead_pools:  # after the argument checks: a call that fails touches nothing
            _sweep_dead_pools()
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
        # A dead worker's shipped segments are reclaimed once both its death was handled
        # (monitor) and its pipe was read to the end (pump): see ``_on_pipe_end``.
        self._reap_lock = threading.Lock()
        self._sender_ranks: dict[str, int] = {}
        self._pipe_ended: set[int] = set()
        self._dead_pids: dict[int, int] = {}
        self._channel = PipeChannel(mp_context=self._ctx, on_sender_gone=self._on_pipe_end)
        self._copy_outputs = copy_outputs
        super().__init__(
            _ReceivingEnd(self._channel, self.pool),
            world_size=world_size,
            reply_rank=reply_rank,
            step_mode=step_mode,
            deadlines=deadlines,
            release_hook=self._release_packed,
            tracer=tracer,
            validate_request=spec.request_validator(),
            final_step_async=final_step_async,
        )
        self._rpc_lock = threading.Lock()
        self._rpc_conns: list[multiprocessing.connection.Connection] = []
        self._control_conns: list[multiprocessing.connection.Connection] = []
        self._cancel_sender = _CancelSender(self._control_conns)
        self._status_conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._failure: WorkerDied | None = None
        self._monitor_stop_r, self._monitor_stop_w = self._ctx.Pipe(duplex=False)
        # The workers' lifeline (``_ExecutorWatch``): we hold the writing end, never
        # write, and close it only once every worker is gone.
        lifeline_r, self._lifeline_w = self._ctx.Pipe(duplex=False)
        try:
            deadline = time.monotonic() + start_timeout
            for rank in range(world_size):
                sender = self._channel.new_sender(f"rank{rank}")
                self._sender_ranks[sender.name] = rank
                rpc_r, rpc_w = self._ctx.Pipe(duplex=False)
                status_r, status_w = self._ctx.Pipe(duplex=False)
                control_r, control_w = self._ctx.Pipe(duplex=False)
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(rank, spec, opts, self.pool, sender, rpc_r, status_w, lifeline_r, control_r),
                    name=f"omni-worker-{rank}",
                    daemon=True,
                )
                with _sigint_blocked():
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
            lifeline_r.close()
            self._await_models(deadline, start_timeout)
            # Every worker opened its credit semaphore by name while unpickling its
            # arguments: the names can go (a SIGKILL of the whole group leaves none).
            self._channel.unlink_names()
            self._cancel_sender.start()
            self.pump.start()
            self._monitor = threading.Thread(target=self._watch, name="omni-monitor", daemon=True)
            self._monitor.start()
            # Every rank answers RPCs.
            self.collective_rpc("loop_info", timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            lifeline_r.close()
            self.shutdown("the executor failed to start")
            raise

    def _await_models(self, deadline: float, start_timeout: float) -> None:
        """Wait until every rank reports its model built; raise ``WorkerStartupFailed`` for the first that fails."""
        waiting = set(range(len(self.procs)))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ComputeTimeout(f"worker rank(s) {sorted(waiting)} did not build their model in {start_timeout} s")
            objects: dict[Any, int] = {}
            for rank in waiting:
                objects[self._status_conns[rank]] = rank
                objects[self.procs[rank].sentinel] = rank
            for ready in multiprocessing.connection.wait(list(objects), left):
                rank = objects[ready]
                if rank not in waiting:
                    continue
                conn = self._status_conns[rank]
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

    # ----------------------------------------------------------------- transport

    def _encode(self, req: RpcRequest) -> list[bytes] | None:
        return encode_rpc(req, len(self._rpc_conns))

    def _broadcast(self, req: RpcRequest, wire: list[bytes] | None = None) -> None:
        # Pickled for every rank before the first write, outside the lock: an argument
        # that does not pickle fails here, with no rank holding half a call.
        data = wire if wire is not None else encode_rpc(req, len(self._rpc_conns))
        with self._rpc_lock:
            if self._closed:
                raise ExecutorShutdown("the executor is shut down")
            for rank, conn in enumerate(self._rpc_conns):
                try:
                    conn.send_bytes(data[rank])
                except (BrokenPipeError, OSError) as exc:
                    raise ExecutorShutdown(f"cannot reach worker rank {rank}: {exc}") from exc

    def _deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        self._cancel_sender.put(cancels)

    # A worker's frame incomplete this long (a live sender stopped mid-write, M5) fails
    # ``check_health``: the reader serves the other ranks meanwhile, but this rank's
    # results stall behind the torn frame.
    torn_frame_bound: float = 5.0

    def _worker_failure(self) -> OmniAsyncError | None:
        if self._failure is not None:
            return self._failure
        torn = self._channel.torn_senders(self.torn_frame_bound)
        if torn:
            label, age = max(torn.items(), key=lambda kv: kv[1])
            return ProtocolError(
                f"worker {label}: a message on its result channel has been incomplete for {age:.1f} s "
                f"(the worker stopped mid-write); its results stall behind it"
            )
        return None

    def _deliver(self, packed: Future[DiffusionOutput]) -> Future[DiffusionOutput]:
        """The unpacked output (``wait_output_ready``, a stream's chunks), delivered to
        exactly one waiter (see ``DiffusionExecutor``).

        Zero copy: its tensors and arrays view the output's shared-memory segment, and
        the segment goes back to the pool only when the last of them (and of anything
        derived from them) is gone -- so a tensor the engine keeps never changes under
        it.  ``release_output`` says "done" explicitly; with ``copy_outputs=True`` the
        output holds owned copies and its segment went back before delivery.
        """
        return map_future(packed, self._receive, discard=self._discard)

    def _receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        """Unpack for the waiter; a failure reaches it as ``OutputUnpackFailed`` (M2).

        Past its checks, the unpack gives the segment back itself on failure; a lease
        that is still out after a failure (one it refused before taking it over) goes
        back here, so nothing of a corrupt output stays out of the pool.
        """
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
            if is_fresh(packed):
                discard_fresh_output(packed)
                return
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
        failure = self._last_words(rank)
        err = WorkerDied(rank, exitcode, failure=failure)
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
        self.pump.fail_all(
            lambda oid: WorkerDied(rank, exitcode, output_id=oid, failure=failure), outcome="worker_died", close=True
        )
        if pid is not None:
            with self._reap_lock:
                self._dead_pids[rank] = pid
                ended = rank in self._pipe_ended
            if ended:
                self._reclaim_shipped(rank, pid)

    def _on_pipe_end(self, label: str) -> None:
        """Pump thread: a worker's result pipe reached its end, every message it wrote handled."""
        rank = self._sender_ranks.get(label)
        if rank is None:
            return  # the executor's own sender, or one a test made
        with self._reap_lock:
            self._pipe_ended.add(rank)
            pid = self._dead_pids.get(rank)
        if pid is not None:
            self._reclaim_shipped(rank, pid)

    def _reclaim_shipped(self, rank: int, pid: int) -> None:
        """The dead worker's death is handled and its pipe read to the end: free what it shipped
        that no message carried (TLC's ``ReclaimSparesShipped``; ``PumpReachEof`` in the spec)."""
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

    # ------------------------------------------------------------------ shutdown

    def _stop_workers(self, deadline: float | None) -> None:
        # Phases, every rank at once: ask (a None on its RPC pipe), then SIGTERM, then
        # SIGKILL.  Without a deadline each phase has its old length (5 s, 2 s, 2 s);
        # with one, half, three tenths and a fifth of what is left of it.
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
        for p in alive:
            p.terminate()
        terminated = phase_end(2.0, 0.3, asked if span is None else max(time.monotonic(), asked))
        alive = _join_all(alive, terminated)
        for p in alive:
            p.kill()
        alive = _join_all(alive, phase_end(2.0, 0.2, terminated) if deadline is None else deadline)
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
        if hasattr(self, "_monitor"):
            self._monitor.join(stop_budget(deadline, 5.0))
        self._monitor_stop_r.close()
        self._monitor_stop_w.close()
        # Every worker is gone: the lifeline has nobody left to warn.
        self._lifeline_w.close()
        for conn in self._status_conns:
            conn.close()
        # The executor owns its pool, also one passed in: closing it unlinks every
        # segment; the prefix sweep catches any a dying worker created meanwhile.
        self.pool.close()
        unlink_all_with_prefix(self.pool.prefix)
