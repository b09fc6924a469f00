"""Encoded outputs in the engine: the pixels of a request that asked for a format, and
the process pool that encodes them.

A request with a ``format`` (``DiffusionRequest(..., format="png")``) skips its pipeline's
host stage.  On its ``omni-postprocess`` thread ``take_for_encoding`` reads its output:

* pixels the worker's GPU encoded already (JPEG, ``omni_async.worker.encode``): their
  bytes are copied out of shared memory and are the result (``EncodedOutput`` with
  ``encoded_on="cuda"``);
* otherwise the pixels (uint8, channel-last: ``"frames"``, else ``"image"``) become an
  ``EncodeJob``.  Zero copy where they are a contiguous view of the output's
  shared-memory segment (``omni_async.transport.unpacking.segment_span``): the job
  carries the segment's name and where the pixels lie in it (``SharedPixels``), the
  encoder process maps it and reads them in place, and the engine holds the output
  (the segment stays leased) until the job's future is done, whatever ended it, then
  releases it, once.  Without a segment (``InProcessExecutor``'s inline outputs,
  ``copy_outputs``, a strided view) the pixels are copied into one uint8 numpy array,
  pickled to the process, and the output goes back at once.

The job goes to ``EncoderPool``: spawned encoder processes (``os.cpu_count()`` by
default, ``AsyncDiffusionEngine(encode_workers=...)``), all started with the first job, so
an engine whose requests never ask for a format starts none.  Each process has a pipe of
its own and one job at a time: a process that dies (SIGKILL, the OOM killer) fails the
one request it was encoding, with ``EncodeFailed`` naming the process and the signal; the
other processes' jobs go on, and a new process takes its place.  The event loop awaits
the job's future, which fails with ``EncodeFailed`` only (the request, the format, why);
the encoding never holds the engine's GIL.  Only uint8 pixels travel to the pool (a
float tensor is refused before: it would pickle 2-4x the bytes, and its scale is the
pipeline's to know).

A video encoded in parts (``VideoSession``, ``omni_async.engine.video``) takes one
process for its whole length: its first part waits for an idle process like a job, the
process is then bound to the session, takes its later parts in order (no other job)
and is free again after the last part, or when a part failed.  A process that dies
fails the part it had and every part queued behind it.  ``shutdown`` (the engine's close, whatever ended it) fails the jobs
not started, waits for the running ones up to its deadline, then kills what is
left: no encoder process outlives its engine.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing import connection as mp_connection
from multiprocessing.context import SpawnContext
from multiprocessing.reduction import ForkingPickler

import attrs
import numpy as np
import torch

from omni_async.core.encoding import Encoding
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput
from omni_async.engine.encoders import EncodedOutput, EncodeJob, SharedPixels, VideoPart, serve
from omni_async.engine.errors import EncodeFailed
from omni_async.transport.children import stop_signals_blocked
from omni_async.transport.shm import SHM_DIR
from omni_async.transport.unpacking import segment_span
from omni_async.worker.encode import DeviceEncoded, pixel_key

__all__ = [
    "EncodeResult",
    "EncoderPool",
    "HostEncode",
    "PendingEncode",
    "VideoSession",
    "encoded_value",
    "frames_of",
    "take_for_encoding",
]

log = logging.getLogger("omni_async.engine.engine")

EncodeResult = tuple[list[bytes], float]
Encoded = EncodedOutput | tuple[EncodedOutput, ...]
#: Seconds an idle encoder process gets to leave at shutdown before it is terminated.
IDLE_EXIT_S = 2.0


@attrs.frozen
class HostEncode:
    """Pixels for the encoder pool (``job``), and why the GPU did not encode them
    (``note``; empty when the request's format is not one the GPU encodes)."""

    job: EncodeJob
    note: str = ""

    @property
    def shared(self) -> bool:
        """The job reads the output's segment: the output is held until it ends."""
        return isinstance(self.job.pixels, SharedPixels)


class PendingEncode:
    """A request's pixels on their way through the encoder pool: the future of the files,
    and what the result needs besides them."""

    def __init__(self, future: concurrent.futures.Future[EncodeResult], host: HostEncode) -> None:
        self.future = future
        self.encoding = host.job.encoding
        self.sequence = host.job.sequence
        self.shape = host.job.pixels.shape
        self.note = host.note
        self.submitted_at = time.perf_counter()


def _shape(job: EncodeJob | VideoPart) -> tuple[int, ...]:
    pixels = job.pixels if isinstance(job, EncodeJob) else job.frames
    return () if pixels is None else tuple(pixels.shape)


class _Task:
    """A job (or a video's part, of ``session``) and the future of its files."""

    def __init__(self, job: EncodeJob | VideoPart, session: VideoSession | None = None) -> None:
        self.job = job
        self.session = session
        self.future: concurrent.futures.Future[EncodeResult] = concurrent.futures.Future()

    def fail(self, why: str) -> None:
        job = self.job
        self.future.set_exception(
            EncodeFailed(f"request {job.request_id!r}: {why}", request_id=job.request_id, format=job.encoding.format)
        )


class _Encoder:
    """One encoder process, the engine's end of its pipe, and the task it runs (None: idle)."""

    def __init__(self, ctx: SpawnContext) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child,), name="omni-encoder", daemon=True)
        with stop_signals_blocked():  # the child ignores them once started (``transport.children``)
            self.process.start()
        self.pid: int = self.process.pid or 0
        child.close()  # the child's end lives in the child: its death is our end's EOF
        self.task: _Task | None = None
        self.session: VideoSession | None = None  # the video it is bound to, between its first and last part
        self.stopping = False  # told to leave (the pool is shutting down)
        self.lost = False  # its pipe broke: it takes no more jobs
        self.sent = False  # its task's job is wholly in the pipe (a death now fails the task)


class EncoderPool:
    """The engine's encoder processes (see the module docstring); thread-safe.

    Each process has a pipe of its own and runs one job at a time, handed out by the
    pool's ``omni-encoders`` thread, which alone reads the pipes and reaps the processes.
    So a process that dies fails the one job it had (``EncodeFailed`` naming its request,
    its format and how the process ended), a new process takes its place, and the jobs of
    the other processes go on; a ``ProcessPoolExecutor`` breaks as a whole instead,
    failing every job in flight.  ``_on_queued`` (tests only) runs in ``submit`` once the
    job is queued, before ``submit`` returns."""

    def __init__(self, workers: int | None = None) -> None:
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise UsageError(f"encode_workers must be a positive int or None (os.cpu_count()), got {workers!r}")
        self.workers = workers if workers is not None else max(1, os.cpu_count() or 1)
        self._ctx = multiprocessing.get_context("spawn")
        # Guards what follows; no future is completed, and no callback run, under it.
        self._lock = threading.Lock()
        self._closed = False
        self._waiting: collections.deque[_Task] = collections.deque()
        self._encoders: list[_Encoder] = []
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._on_queued: Callable[[concurrent.futures.Future[EncodeResult]], None] | None = None
        # Jobs and video parts queued whose pixels the process reads in shared memory, and
        # those that carry a copy (no segment): how often the zero-copy path is taken.
        self.jobs_shared = 0
        self.jobs_copied = 0

    def _count_locked(self, pixels: object) -> None:
        if isinstance(pixels, SharedPixels):
            self.jobs_shared += 1
        elif pixels is not None:
            self.jobs_copied += 1

    def submit(self, job: EncodeJob) -> concurrent.futures.Future[EncodeResult]:
        """Queue ``job``; the first call starts the processes (spawned: safe beside the
        engine's threads and a CUDA context), all at once: one started only when a job
        found none idle made the first burst of 1024x1024 PNG requests on the H200 wait
        about 3 s for processes still importing (p99 4.4 s against p50 1.2 s).  The
        future fails with ``EncodeFailed`` only: the job's request and format, and why."""
        task = _Task(job)
        with self._lock:
            if self._closed:
                raise EncodeFailed(
                    f"request {job.request_id!r}: the engine's encoder pool is shut down (the engine is closing)",
                    request_id=job.request_id,
                    format=job.encoding.format,
                )
            self._start_locked()
            self._waiting.append(task)
            self._count_locked(job.pixels)
        self._wake()
        if self._on_queued is not None:
            self._on_queued(task.future)
        return task.future

    def open_video(self, request_id: str) -> VideoSession:
        """A video of request ``request_id`` to encode in parts, in one process (module docstring)."""
        return VideoSession(self, request_id)

    def _submit_part(self, session: VideoSession, part: VideoPart) -> concurrent.futures.Future[EncodeResult]:
        task = _Task(part, session)
        failed = None
        with self._lock:
            if self._closed:
                failed = "the engine's encoder pool is shut down (the engine is closing)"
            elif session.failed is not None:
                failed = session.failed
            elif session.ended:
                failed = "its video was already finished (a part after the last)"
            else:
                session.ended = part.last
                self._count_locked(part.frames)
                if not session.started:
                    session.started = True
                    self._start_locked()
                    self._waiting.append(task)  # the first part binds the process that takes it
                else:
                    session.queue.append(task)
        if failed is not None:
            task.future.set_running_or_notify_cancel()
            task.fail(failed)
            return task.future
        self._wake()
        return task.future

    def _start_locked(self) -> None:
        if self._thread is None:
            self._encoders = [_Encoder(self._ctx) for _ in range(self.workers)]
            self._thread = threading.Thread(target=self._serve, name="omni-encoders", daemon=True)
            self._thread.start()

    def pids(self) -> list[int]:
        """The encoder processes' ids (none before the first encode, nor after ``shutdown``)."""
        with self._lock:
            return sorted(e.pid for e in self._encoders)

    def running(self) -> dict[int, str]:
        """The processes that hold a job now (sent to them whole): pid -> its request's id."""
        with self._lock:
            return {e.pid: e.task.job.request_id for e in self._encoders if e.task is not None and e.sent}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the encoder processes: jobs not started fail (``EncodeFailed``), running ones
        get until ``timeout`` seconds, then their processes are killed.  With no job
        running the processes get ``IDLE_EXIT_S`` to leave, whatever ``timeout`` says: an
        idle process that does not leave has nothing to lose (in 4 of 34 closes of
        ``bench/encoded_images.py``'s engines on a 2-core machine, one process of an idle
        pool was still there after the engine's whole close deadline, 60 s).  Idempotent;
        a later ``submit`` raises ``EncodeFailed``."""
        with self._lock:
            self._closed = True
            waiting = [*self._waiting, *self._queued_parts_locked(None)]
            self._waiting.clear()
            running = sum(e.task is not None for e in self._encoders)
            thread = self._thread
        _fail_not_run(waiting)
        if thread is None:
            return
        self._wake()
        thread.join(timeout if running else min(timeout, IDLE_EXIT_S))
        if thread.is_alive():
            with self._lock:
                left = [e.process for e in self._encoders]
                busy = sum(e.task is not None for e in self._encoders)
            if busy:
                log.warning(
                    "engine close: %d encoder process(es) still encoding after %.1f s; killing them", busy, timeout
                )
            else:
                log.warning(
                    "engine close: %d idle encoder process(es) did not leave within %.1f s; killing them",
                    len(left),
                    IDLE_EXIT_S,
                )
            for p in left:
                _stop(p)
            thread.join(5.0)
            if thread.is_alive():
                log.warning("engine close: the encoder pool's thread did not end")
                return
        self._wake_r.close()
        self._wake_w.close()

    def _queued_parts_locked(self, session: VideoSession | None) -> list[_Task]:
        """The parts queued behind a bound session's (``session``; None: every session's), taken."""
        sessions = [session] if session is not None else [e.session for e in self._encoders if e.session is not None]
        parts: list[_Task] = []
        for s in sessions:
            if s is not None:
                parts.extend(s.queue)
                s.queue.clear()
        return parts

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"")
        except OSError:  # the pool's thread is gone: nothing is waiting to be woken
            pass

    # ------------------------------------------------------------------ omni-encoders

    def _serve(self) -> None:
        """The pool's thread: hands jobs to idle processes, takes their replies, replaces
        the dead; ends once the pool is closed and every process has left."""
        try:
            self._serve_until_closed()
        except BaseException as exc:
            # A defect here would leave every encode waiting: fail them all, stop the processes.
            log.exception("engine: the encoder pool's thread failed; failing its encodes")
            with self._lock:
                self._closed = True
                tasks = [
                    *self._waiting,
                    *(e.task for e in self._encoders if e.task is not None),
                    *self._queued_parts_locked(None),
                ]
                self._waiting.clear()
                procs = [e.process for e in self._encoders]
            for p in procs:
                _stop(p)
            for task in tasks:
                if task.future.running() or task.future.set_running_or_notify_cancel():
                    task.fail(f"the engine's encoder pool failed ({type(exc).__name__}: {exc}): send it again")

    def _serve_until_closed(self) -> None:
        while True:
            with self._lock:
                encoders = list(self._encoders)
                if self._closed and not encoders:
                    # A job given back by a process that died after the close has none left to run it.
                    left = list(self._waiting)
                    self._waiting.clear()
                    break
            self._hand_out(encoders)
            ready = set(
                mp_connection.wait([self._wake_r, *(e.conn for e in encoders), *(e.process.sentinel for e in encoders)])
            )
            while self._wake_r.poll():
                self._wake_r.recv_bytes()
            for e in encoders:
                if e.conn in ready or e.process.sentinel in ready:
                    self._take_reply(e)
        _fail_not_run(left)

    def _hand_out(self, encoders: list[_Encoder]) -> None:
        for e in encoders:
            while e.task is None and not e.stopping and not e.lost:
                with self._lock:
                    if e.session is not None:  # bound to a video: its next part, nothing else
                        queue = e.session.queue
                    else:
                        queue = self._waiting
                    task = queue.popleft() if queue else None
                    closed = self._closed
                    if task is not None and task.session is not None:
                        e.session = None if isinstance(task.job, VideoPart) and task.job.last else task.session
                if task is None:
                    if closed:  # nothing more will come: leave
                        e.stopping = True
                        self._send(e, None)
                    break
                if not task.future.running() and not task.future.set_running_or_notify_cancel():
                    if task.session is not None:
                        # A cancelled part of a video: the video is abandoned with it.
                        # A cancelled part of a video: the video is abandoned with it, and its
                        # process drops what it has of it (a close nobody awaits).
                        self._end_session(e, task.session, "one of its parts was cancelled (its request ended)")
                        if isinstance(task.job, VideoPart):
                            self._send_close(e, task.job)
                    continue  # cancelled while it waited (its request ended)
                try:
                    data = ForkingPickler.dumps(task.job)  # pickled here: a job that cannot be fails alone
                except Exception as exc:  # noqa: BLE001  # the job's own failure
                    task.fail(f"its {task.job.encoding.format} job could not be pickled: {type(exc).__name__}: {exc}")
                    if task.session is not None:
                        self._end_session(e, task.session, "one of its parts could not be pickled")
                    continue
                with self._lock:
                    e.task = task
                self._send(e, data)

    def _send(self, e: _Encoder, data: memoryview | None) -> None:
        try:
            if data is None:
                e.conn.send(None)
            else:
                e.conn.send_bytes(data)
                with self._lock:
                    e.sent = True
        except OSError:
            # The process died before it read the job: the job goes back to the front of
            # the queue for another process, and the sentinel tells the death (``_gone``).
            e.lost = True
            with self._lock:
                task, e.task = e.task, None
                if task is not None:
                    self._waiting.appendleft(task)

    def _send_close(self, e: _Encoder, part: VideoPart) -> None:
        """Close an abandoned video in ``e``'s process: a last part nobody awaits."""
        task = _Task(attrs.evolve(part, frames=None, last=True))
        task.future.set_running_or_notify_cancel()
        with self._lock:
            e.task = task
        self._send(e, ForkingPickler.dumps(task.job))

    def _end_session(self, e: _Encoder | None, session: VideoSession, why: str) -> None:
        """``session`` failed (``why``): its queued parts fail, its process is free."""
        with self._lock:
            if session.failed is None:
                session.failed = why
            parts = self._queued_parts_locked(session)
            if e is not None and e.session is session:
                e.session = None
        for part in parts:
            if part.future.running() or part.future.set_running_or_notify_cancel():
                part.fail(f"its video failed before this part was encoded: {why}")

    def _take_reply(self, e: _Encoder) -> None:
        try:
            while e.conn.poll():
                kind, payload = e.conn.recv()
                with self._lock:
                    task, e.task, e.sent = e.task, None, False
                if task is None:
                    continue
                if kind == "files":
                    task.future.set_result(payload)
                else:
                    fmt = task.job.encoding.format
                    why = f"encoding its pixels {_shape(task.job)} as {fmt} failed: {payload}"
                    task.fail(why)
                    if task.session is not None:
                        self._end_session(e, task.session, why)
        except (EOFError, OSError):
            pass
        if e.process.sentinel in mp_connection.wait([e.process.sentinel], 0):
            self._gone(e)

    def _gone(self, e: _Encoder) -> None:
        """``e``'s process ended: its job fails, another process takes its place."""
        e.process.join(1.0)
        code = e.process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"killed by {_signal_name(-code)}"
        if code is not None:
            e.process.close()  # its sentinel's descriptor: a pool that replaces many must not leak them
        e.conn.close()
        with self._lock:
            self._encoders.remove(e)
            task, e.task = e.task, None
            session, e.session = e.session, None
            closed = self._closed
            if not closed and not e.stopping:
                self._encoders.append(_Encoder(self._ctx))
        if not e.stopping and not closed:
            log.warning("engine: encoder process %d died (%s); a new one takes its place", e.pid, how)
        if task is not None and task.session is not None:
            session = task.session
        if session is not None:
            self._end_session(None, session, f"encoder process {e.pid} encoding it died ({how})")
        if task is None:
            return
        fmt = task.job.encoding.format
        if closed:
            task.fail(f"the engine closed while its {fmt} encode ran: encoder process {e.pid} was stopped ({how})")
        else:
            task.fail(
                f"the encoder process (pid {e.pid}) encoding it as {fmt} died ({how}); the other encodes go "
                "on and a new process takes its place: send the request again"
            )


class VideoSession:
    """A video encoded in parts in one of the pool's processes (module docstring).
    ``put`` queues a part and returns the future of the bytes it made (``[bytes]``, and
    the seconds): a fragmented MP4's bytes so far, and after the last part the file's
    last bytes (fragmented) or the whole file.  A failed part fails every later one
    (``EncodeFailed``, the request, the format, why)."""

    def __init__(self, pool: EncoderPool, request_id: str) -> None:
        self._pool = pool
        self.request_id = request_id
        # Under the pool's lock: the parts waiting for the bound process, whether the first
        # was queued, the last was, and why the video failed.
        self.queue: collections.deque[_Task] = collections.deque()
        self.started = False
        self.ended = False
        self.failed: str | None = None

    def put(self, part: VideoPart) -> concurrent.futures.Future[EncodeResult]:
        return self._pool._submit_part(self, part)


def _fail_not_run(tasks: list[_Task]) -> None:
    for task in tasks:
        if task.future.running() or task.future.set_running_or_notify_cancel():
            task.fail(f"the engine's encoder pool shut down before its {task.job.encoding.format} encode ran")


def _stop(process: multiprocessing.process.BaseProcess) -> None:
    """Kill ``process`` unless it has ended and the pool's thread closed it."""
    try:
        if process.exitcode is None:
            process.kill()
    except ValueError:  # closed by the pool's thread once it ended: nothing to stop
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _pixels(
    value: object, rid: str, encoding: Encoding, key: str, output: DiffusionOutput | None
) -> np.ndarray | SharedPixels:
    """The pixels where ``output``'s segment holds them (``SharedPixels``), else as an owned,
    contiguous uint8 numpy array (a ``"frames"`` of grey ``[T, H, W]`` as ``[T, H, W, 1]``),
    or ``EncodeFailed`` saying why not."""
    span = None if output is None else segment_span(output, value)
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8:
            raise _not_uint8(rid, encoding, key, str(value.dtype))
        array = value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise _not_uint8(rid, encoding, key, str(value.dtype))
        array = value
    else:
        raise EncodeFailed(
            f"request {rid!r} asked for format {encoding.format!r}, but its output's {key!r} is a "
            f"{type(value).__name__}, not uint8 pixels (a tensor or numpy array)",
            request_id=rid,
            format=encoding.format,
        )
    if key == "frames" and array.ndim == 3:
        array = array[..., None]
    if array.ndim not in (2, 3, 4) or (array.ndim >= 3 and array.shape[-1] not in (1, 3, 4)):
        raise EncodeFailed(
            f"request {rid!r} asked for format {encoding.format!r}, but its output's {key!r} has shape "
            f"{tuple(array.shape)}; an encoder takes channel-last pixels [H, W], [H, W, C] or [N, H, W, C] with "
            "C 1, 3 or 4",
            request_id=rid,
            format=encoding.format,
        )
    if span is not None:
        name, size, offset = span
        return SharedPixels(os.path.join(SHM_DIR, name), size, offset, tuple(int(d) for d in array.shape))
    # A copy: the view's segment goes back to the pool before the job is pickled.
    return np.array(array, dtype=np.uint8, copy=True, order="C")


def _not_uint8(rid: str, encoding: Encoding, key: str, dtype: str) -> EncodeFailed:
    return EncodeFailed(
        f"request {rid!r} asked for format {encoding.format!r}, but its output's {key!r} is {dtype}, not uint8 "
        "pixels; name the pipeline's post-process in WorkerSpec(postprocess=...) so that its device stage "
        "converts them on the worker (its scale, 0..1, -1..1 or 0..255, is the pipeline's to know)",
        request_id=rid,
        format=encoding.format,
    )


def take_for_encoding(whole: DiffusionOutput, rid: str, encoding: Encoding) -> Encoded | HostEncode:
    """The result of a request that asked for ``encoding``, from its unpacked output: the
    files its worker's GPU encoded, or the job for the encoder pool (the pixels in the
    output's segment, ``HostEncode.shared``, or copied) and why the GPU did not encode
    them (empty: it was not asked to)."""
    output = whole.output
    key = pixel_key(output)
    if key is None or not isinstance(output, Mapping):
        keys = f" with keys {sorted(map(str, output))[:8]}" if isinstance(output, Mapping) else ""
        raise EncodeFailed(
            f"request {rid!r} asked for format {encoding.format!r}, but its output ({type(output).__name__}{keys}) "
            "has no 'image' or 'frames' to encode",
            request_id=rid,
            format=encoding.format,
        )
    value = output[key]
    note = ""
    if isinstance(value, DeviceEncoded):
        if value.parts:
            files = tuple(
                EncodedOutput(part.numpy().tobytes(), value.media_type, value.width, value.height, encoded_on="cuda")
                for part in value.parts
            )
            return files if value.batched or key == "frames" else files[0]
        note = value.reason
        value = value.pixels
    pixels = _pixels(value, rid, encoding, key, whole)
    del value
    fps = output.get("fps", 24.0)
    rate = float(fps) if isinstance(fps, (int, float)) else 24.0
    return HostEncode(EncodeJob(pixels, encoding, sequence=len(pixels.shape) == 4, fps=rate, request_id=rid), note)


def frames_of(whole: DiffusionOutput, rid: str, encoding: Encoding) -> np.ndarray | SharedPixels | None:
    """The ``"frames"`` of an output that is a part of a video (``emit_frames``, or the
    final output of ``generate_video``'s request), in its segment or copied; None when it
    has none (the model emitted every frame as parts)."""
    output = whole.output
    if not isinstance(output, Mapping) or "frames" not in output:
        return None
    return _pixels(output["frames"], rid, encoding, "frames", whole)


def encoded_value(pending: PendingEncode, files: list[bytes]) -> Encoded:
    """The ``EncodedOutput``(s) of a finished job."""
    shape = pending.shape
    if pending.sequence:
        frames, height, width = int(shape[0]), int(shape[1]), int(shape[2])
    else:
        frames, height, width = 1, int(shape[0]), int(shape[1])
    media = pending.encoding.media_type
    if pending.encoding.is_video:
        return EncodedOutput(files[0], media, width, height, frames=frames, note=pending.note)
    out = tuple(EncodedOutput(f, media, width, height, note=pending.note) for f in files)
    return out if pending.sequence else out[0]
