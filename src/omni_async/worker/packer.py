"""The packer: a worker-side daemon thread that ships finished outputs.

The worker's main thread hands each finished output to the packer together
with a device event recorded right after the forward, sends COMPUTE_DONE, and
takes the next request.  The packer then, for each output in order:

1. runs the pipeline's device stage on it, if it has one (``worker.postprocess``),
2. packs the output (device -> shared memory, on the side stream), the pack
   function ordering its reads after the event (the copy must not read the
   output before the forward's last kernel wrote it -- F1; a platform that
   cannot record an event gives a marker that makes it synchronize instead),
3. sends OUTPUT_READY, or OUTPUT_READY with a typed failure (F2).

The device stage runs one output ahead of the copy: a second thread, the *stager*,
queues the next output's stage on a stream of its own while the packer's stream copies
this one (on a GPU the stage runs on the SMs, the copy on a copy engine: they overlap,
so a copy-bound worker ships at the copy's rate instead of stage plus copy in series).
The packer's stream waits for the stage's end (a device event) before it copies.  The
stage is a job's first step whichever thread claims it: the packer runs it itself when
the stager has not (the first output after an idle spell, the last ones of a drain).
A staged output that is dropped before its copy is cancelled like any other (F15).

Two copies in flight (``copies_in_flight``, with ``start_pack``: the omni path): the
packer thread *starts* each pack -- its segment leased, its copies queued on the side
stream -- and a third thread, the *finisher*, ends them in order: it waits for the
copies, hands the lease off and sends OUTPUT_READY.  The packer thread starts the next
output's pack while the finisher still waits for this one, so the copy engine goes
straight from one output's copy to the next instead of idling through the packer's host
work between them (on an H200, a copy-bound worker shipping uint8 video went from 1.78x
to 2.01x the bf16 ideal: ``bench/results/h200_issue19_20/``).  A cancelled output waits
until nothing is in flight, so every message keeps the queue's order; a worker that dies
with two leases out has both reclaimed (``SegmentPool.reclaim_owner``; the spec's
``PackDepth``).

Back-pressure: at most ``max_outputs`` outputs and ``max_bytes`` bytes are in the
packer at once.  The main thread calls ``wait_for_room`` *before* it starts the
next forward, so a slow consumer slows the producer instead of growing an
unbounded queue; the time spent waiting is reported in ``metrics``.

A drop that arrives before an output's packing starts cancels it (F15): the
packer sends a ``Cancelled`` failure instead, so the executor's record ends.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeAlias

import attrs

from omni_async.core.encoding import Encoding
from omni_async.core.messages import DiffusionOutput, Failure, OutputReady
from omni_async.core.registry import no_release
from omni_async.core.states import (
    LifecycleEvent,
    LifecycleState,
    Machine,
    RequestEvent,
    RequestState,
    lifecycle_machine,
)
from omni_async.core.trace import Tracer, emit
from omni_async.transport.channel import ResultSender
from omni_async.transport.clock import ClockMark, DeviceClock
from omni_async.transport.errors import ChannelClosed
from omni_async.transport.packing import packed_nbytes
from omni_async.transport.platform import CopyStream, DeviceEvent, record_stream_event, wait_device_event
from omni_async.worker.encode import encodes_on_device, run_device_encode
from omni_async.worker.postprocess import DeviceStage, launch_device_stage, with_stage_time
from omni_async.worker.stamps import ForwardMarks, timed

log = logging.getLogger(__name__)

# pack(output, side_stream, ready_event) -> the packed output (what travels on the
# channel).  It must order its reads after ready_event (see omni_async.transport.platform).
# The side stream is what ``make_stream`` made on the packer thread (None on the worker's
# main thread, which packs step-mode answers).
PackFn: TypeAlias = "Callable[[DiffusionOutput, CopyStream, DeviceEvent | None], DiffusionOutput]"
# Called with a packed output that could not be sent, to give its segments back.
ReleaseFn = Callable[[DiffusionOutput], None]
# start_pack(output, side_stream, ready_event): ``pack``'s first half, which queues the
# copies and returns at once (``transport.packing.start_pack_shm``); with it the packer
# keeps up to ``copies_in_flight`` copies queued on its stream (module docstring).
StartPackFn: TypeAlias = "Callable[[DiffusionOutput, CopyStream, DeviceEvent | None], StartedPack]"


class StartedPack(Protocol):
    """A pack whose copies are queued (``transport.packing.PackInFlight``): ``finish``
    waits for them and returns the packed output, or raises with nothing leased."""

    def finish(self) -> DiffusionOutput: ...


def budget_nbytes(output: DiffusionOutput) -> int:
    """What ``output`` counts against the packer's byte budget: the bytes packing copies.

    0 for an output the packer will refuse: its pack fails the same way at once, copies
    nothing, and the packer reports the failure (F2); sizing must not fail the call.
    """
    try:
        return packed_nbytes(output)
    except Exception:  # noqa: BLE001  # the packer's walk raises it again, and reports it
        return 0


def _identity_pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
    return output


def _no_stream() -> CopyStream:
    return None


@attrs.define(eq=False)
class StageRun:
    """One output's device stage, claimed by the stager (ahead of the copy) or the packer.

    ``running`` until its kernels are queued; then ``output`` (what the stage returned)
    or ``error``, ``done`` (the point on the stage's stream after its kernels: the copy
    waits for it) and its marks (``started``/``ended``: its device time)."""

    running: bool = True
    output: DiffusionOutput | None = None
    error: Exception | None = None
    done: DeviceEvent | None = None
    started: ClockMark | None = None
    ended: ClockMark | None = None


@attrs.define(eq=False)
class PackJob:
    output_id: str
    output: DiffusionOutput
    event: DeviceEvent | None
    nbytes: int
    machine: Machine[RequestState, RequestEvent]
    submitted_at: float
    # The forward's marks (None: a streamed chunk); the packer stamps the output with
    # them once its copy has synchronized (``worker.stamps.timed``).
    forward: ForwardMarks | None = None
    # The format its request asked for: JPEG is encoded on the device before the copy
    # (``worker.encode``); the others are the engine's.
    encoding: Encoding | None = None
    # Submitted under a hold (``Packer.hold``): not started until the hold ends.  Per job,
    # so a later hold never takes back a job already released.
    held: bool = False
    # Its device stage, once a thread claimed it (None: not started, or no device stage).
    stage: StageRun | None = None


@attrs.define(eq=False)
class Flight:
    """A job whose pack started: its copies queued (``pending``), or it failed to start
    (``error``).  The finisher ends it in its turn (``Packer._finish``)."""

    job: PackJob
    copy: ClockMark | None = None
    pending: StartedPack | None = None
    error: Exception | None = None


@attrs.frozen
class _Packed:
    """A ``pack`` that ran whole (no ``start_pack``): nothing left to wait for."""

    packed: DiffusionOutput

    def finish(self) -> DiffusionOutput:
        return self.packed


@attrs.define
class PackerMetrics:
    packed: int = 0
    failed: int = 0
    cancelled: int = 0
    bytes_packed: int = 0
    # The sum of the packed outputs' ``pack_s`` (the copy and the packing alone, from
    # the copy's start on the device: ``worker.stamps``).
    pack_seconds: float = 0.0
    backpressure_waits: int = 0
    backpressure_seconds: float = 0.0
    in_flight_outputs: int = 0
    in_flight_bytes: int = 0


class Packer:
    def __init__(
        self,
        rank: int,
        sender: ResultSender,
        *,
        pack: PackFn = _identity_pack,
        release: ReleaseFn = no_release,
        make_stream: Callable[[], CopyStream] = _no_stream,
        max_outputs: int = 4,
        max_bytes: int | None = None,
        tracer: Tracer | None = None,
        interrupt: Callable[[], None] | None = None,
        device_stage: DeviceStage | None = None,
        clock: DeviceClock | None = None,
        start_pack: StartPackFn | None = None,
        copies_in_flight: int = 2,
        thread_mode: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        """``device_stage``: a post-process's device stage (``PostProcess.device``), run on
        each output on the side stream before ``pack``; the byte budget then counts what
        it returned (see ``omni_async.worker.postprocess``).  ``clock``: the worker's
        ``DeviceClock`` (the one its loop marks forwards with; None: the host's clock),
        which times each pack from the copy's start on the device (``worker.stamps``).
        ``start_pack``: ``pack`` split in two (``StartPackFn``); with it, up to
        ``copies_in_flight`` outputs have their copies queued at once (1: one at a time).
        ``thread_mode``: a context each of the packer's threads runs in (the worker's
        ``torch.inference_mode``: its outputs are inference tensors, and a compiled device
        stage's guards check the mode)."""
        if max_outputs < 1:
            raise ValueError(f"max_outputs must be >= 1, got {max_outputs}")
        if isinstance(copies_in_flight, bool) or not isinstance(copies_in_flight, int) or copies_in_flight < 1:
            raise ValueError(f"copies_in_flight must be an int >= 1, got {copies_in_flight!r}")
        self.rank = rank
        self._sender = sender
        self._pack = pack
        self._start_pack = start_pack
        self._depth = copies_in_flight if start_pack is not None else 1
        self._release = release
        self._make_stream = make_stream
        self._max_outputs = max_outputs
        self._max_bytes = max_bytes
        self._trace = tracer
        self._interrupt = interrupt
        self._device_stage = device_stage
        self._clock = clock if clock is not None else DeviceClock("cpu")
        self._cond = threading.Condition()
        self._jobs: collections.deque[PackJob] = collections.deque()
        self._cancelled: set[str] = set()
        self._active: PackJob | None = None
        # Packs started and not finished yet, oldest first (the finisher's queue).
        self._flights: collections.deque[Flight] = collections.deque()
        self._launcher_done = False
        self._held = 0  # > 0: the main thread is handing off a forward's outputs (see held())
        self._machine = lifecycle_machine(f"omni-packer-{rank}")
        self.metrics = PackerMetrics()
        self._thread_mode = thread_mode
        self._thread = threading.Thread(
            target=self._in_mode, args=(self._run,), name=f"omni-packer-{rank}", daemon=True
        )
        # Runs the device stage one output ahead of the copy (module docstring).
        self._stager = (
            threading.Thread(target=self._in_mode, args=(self._run_stager,), name=f"omni-stager-{rank}", daemon=True)
            if device_stage is not None
            else None
        )
        # Finishes the packs the packer thread started, in order (module docstring).
        self._finisher = (
            threading.Thread(
                target=self._in_mode, args=(self._run_finisher,), name=f"omni-finisher-{rank}", daemon=True
            )
            if self._depth > 1
            else None
        )

    # ------------------------------------------------------------ main thread

    def start(self) -> None:
        self._thread.start()
        if self._stager is not None:
            self._stager.start()
        if self._finisher is not None:
            self._finisher.start()

    @property
    def state(self) -> LifecycleState:
        with self._cond:
            return self._machine.state

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_for_room(self, count: int = 1, nbytes: int = 0, timeout: float | None = None) -> bool:
        """Block until ``count`` more outputs (``nbytes`` in all) fit in the budget (back-pressure).

        An empty packer always has room, so a batch larger than the budget still runs.
        """
        t0 = time.monotonic()
        waited = False
        with self._cond:
            while not self._has_room(count, nbytes):
                if self._machine.terminal:
                    return False
                waited = True
                remaining = None if timeout is None else timeout - (time.monotonic() - t0)
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            if waited:
                self.metrics.backpressure_waits += 1
                self.metrics.backpressure_seconds += time.monotonic() - t0
            return True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Around the hand-off of a forward's outputs and the COMPUTE_DONE that follows it:
        the outputs are queued at once (the hand-off happens before the announcement, as
        the spec has it), but the packer thread starts on them only after the block.

        In one process the two threads share the interpreter: a packer woken by the
        hand-off took it while the main thread was sending COMPUTE_DONE and delayed the
        announcement by its packing (on the 2-core CPU machine, 350 us median from the
        forward's end to the executor's receipt).  The packer loses nothing by waiting:
        on a GPU it waits for the forward's event anyway.
        """
        self.hold()
        try:
            yield
        finally:
            self.unhold()

    def hold(self) -> None:
        """Keep the packer thread from starting on queued outputs until ``unhold`` (counted).

        The worker's loop holds it from a forward's hand-off until the next forward has
        started or the loop has nothing to do (``WorkerLoop.defer_packing``): in one
        interpreter the packer's Python competes with the main thread for the GIL, and
        the main thread's way to the next forward's launch is the device's idle time."""
        with self._cond:
            self._held += 1

    def unhold(self) -> None:
        """End one ``hold``; the packer starts on what is queued once none is left."""
        with self._cond:
            if self._held <= 0:
                raise RuntimeError(f"packer {self.rank}: unhold() without a hold")
            self._held -= 1
            if not self._held:
                for job in self._jobs:
                    job.held = False
                self._cond.notify_all()

    def has_room(self, count: int = 1, nbytes: int = 0) -> bool:
        """Whether ``count`` more outputs (``nbytes`` in all) fit now (``wait_for_room`` would not wait)."""
        with self._cond:
            return self._has_room(count, nbytes)

    def submit(
        self,
        output_id: str,
        output: DiffusionOutput,
        machine: Machine[RequestState, RequestEvent],
        *,
        event: DeviceEvent | None = None,
        nbytes: int = 0,
        cancelled: bool = False,
        forward: ForwardMarks | None = None,
        encoding: Encoding | None = None,
    ) -> None:
        """Queue one finished output (its machine in COMPUTE_DONE). Never blocks: see ``wait_for_room``.

        ``cancelled``: its request was cancelled meanwhile: it is not packed, but reported
        cancelled in its turn, exactly as if it had been dropped before packing (F15).
        ``forward``: its forward's marks, read into its stamps once it is packed.
        ``encoding``: the format its request asked for (JPEG: encoded on the device after
        the device stage, ``omni_async.worker.encode``).
        """
        with self._cond:
            if self._machine.terminal:
                raise RuntimeError(f"packer {self.rank} is {self._machine.state}")
            self._jobs.append(
                PackJob(
                    output_id, output, event, nbytes, machine, time.monotonic(), forward, encoding, held=self._held > 0
                )
            )
            if cancelled:
                self._cancelled.add(output_id)
            self.metrics.in_flight_outputs += 1
            self.metrics.in_flight_bytes += nbytes
            if not self._held:
                self._cond.notify_all()

    def drop(self, output_ids: Iterable[str]) -> int:
        """Cancel packing of outputs that have not started (F15); returns how many were cancelled."""
        ids = set(output_ids)
        with self._cond:
            queued = {j.output_id for j in self._jobs}
            hit = ids & queued
            self._cancelled |= hit
            return len(hit)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted output has been sent (F8). True if drained in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._active is not None or self._flights:
                if not self._thread.is_alive():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def stop(self, timeout: float | None = 5.0, *, abandon: bool = False) -> bool:
        """Finish what is queued, then stop. True if the thread ended in time.

        ``abandon=True`` (the worker exits: nobody waits for its outputs any more) first
        calls the ``interrupt`` given at construction, which makes a pack waiting for
        room in the budget of held outputs fail at once (and the queued ones after it),
        instead of holding the thread, and with it the worker's exit, for up to the
        lease timeout (F16).  Each such output is reported failed, as far as the
        channel still takes it.
        """
        if abandon and self._interrupt is not None:
            try:
                self._interrupt()
            except Exception:
                log.exception("packer %d: interrupting its packs failed", self.rank)
        with self._cond:
            if self._machine.can(LifecycleEvent.DRAIN):
                self._machine.fire(LifecycleEvent.DRAIN)
            elif self._machine.state is LifecycleState.STARTING:
                self._machine.fire(LifecycleEvent.STOPPED)
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._stager is not None and self._stager.is_alive():
            # It leaves once nothing is left to stage (the packer stages what it left).
            self._stager.join(timeout)
        with self._cond:
            if not self._thread.is_alive() and self._machine.can(LifecycleEvent.STOPPED):
                self._machine.fire(LifecycleEvent.STOPPED)
        return not self._thread.is_alive()

    # ---------------------------------------------------------------- thread

    def _has_room(self, count: int, nbytes: int) -> bool:
        m = self.metrics
        if m.in_flight_outputs == 0:
            return True
        if m.in_flight_outputs + count > self._max_outputs:
            return False
        return self._max_bytes is None or m.in_flight_bytes + nbytes <= self._max_bytes

    def _in_mode(self, body: Callable[[], None]) -> None:
        """A packer thread's body, in ``thread_mode``."""
        with self._thread_mode():
            body()

    def _run(self) -> None:
        # The side stream is created on this thread: a CUDA stream belongs to the
        # device current when it is made, and make_stream sets that device first.
        try:
            stream = self._make_stream()
        except BaseException:
            log.exception("packer %d: cannot create its stream", self.rank)
            with self._cond:
                self._machine.fire(LifecycleEvent.CRASH)
                self._cond.notify_all()
            raise
        with self._cond:
            if self._machine.can(LifecycleEvent.STARTED):
                self._machine.fire(LifecycleEvent.STARTED)
        while True:
            with self._cond:
                while (not self._jobs or self._jobs[0].held) and self._machine.state is LifecycleState.RUNNING:
                    self._cond.wait()
                if not self._jobs:
                    break
                while len(self._flights) >= self._depth:
                    self._cond.wait()  # the finisher always gets through its queue
                job = self._jobs.popleft()
                cancelled = job.output_id in self._cancelled
                self._cancelled.discard(job.output_id)
                self._active = job
                # Its device stage: run here when the stager has not claimed it, else
                # wait for the stager to have queued it.
                stage_here = not cancelled and self._device_stage is not None and job.stage is None
                if stage_here:
                    job.stage = StageRun()
                else:
                    while job.stage is not None and job.stage.running:
                        self._cond.wait()
                self._cond.notify_all()  # the stager may take the next one
            handed = False
            try:
                if cancelled:
                    # After what is in flight: the failures keep the queue's order.
                    self._wait_for_flights()
                    self._cancel(job)
                else:
                    if stage_here:
                        self._stage(job, stream)
                    flight = self._launch(job, stream)
                    if self._finisher is None:
                        self._finish(flight)
                    else:
                        with self._cond:
                            self._flights.append(flight)
                            handed = True
            except BaseException:
                log.exception("packer %d: unexpected error on %s", self.rank, job.output_id)
            finally:
                with self._cond:
                    self._active = None
                    if not handed:
                        self._done(job)
                    self._cond.notify_all()
        with self._cond:
            self._launcher_done = True
            self._cond.notify_all()
        if self._finisher is not None:
            self._finisher.join()
        with self._cond:
            if self._machine.can(LifecycleEvent.STOPPED):
                self._machine.fire(LifecycleEvent.STOPPED)
            self._cond.notify_all()

    def _run_finisher(self) -> None:
        """The finisher thread: end each started pack in order (wait for its copies, send
        its OUTPUT_READY or failure) while the packer thread starts the next ones."""
        while True:
            with self._cond:
                while not self._flights and not self._launcher_done:
                    self._cond.wait()
                if not self._flights:
                    return
                flight = self._flights[0]
            try:
                self._finish(flight)
            except BaseException:
                log.exception("packer %d: unexpected error on %s", self.rank, flight.job.output_id)
            finally:
                with self._cond:
                    self._flights.popleft()
                    self._done(flight.job)
                    self._cond.notify_all()

    def _wait_for_flights(self) -> None:
        with self._cond:
            while self._flights:
                self._cond.wait()

    def _done(self, job: PackJob) -> None:
        """``job`` left the packer (called under the lock): its room in the budget is free."""
        self.metrics.in_flight_outputs -= 1
        self.metrics.in_flight_bytes -= job.nbytes

    def _run_stager(self) -> None:
        """The stager thread: queue the device stage of the output next in line while the
        packer copies the one before it (module docstring)."""
        try:
            stream = self._make_stream()  # a stream of its own: the stage overlaps the copy
        except Exception:
            log.exception("packer %d: the stager cannot create its stream; the packer runs each stage", self.rank)
            return
        while True:
            with self._cond:
                job = self._next_to_stage()
                while job is None and self._machine.state in (LifecycleState.STARTING, LifecycleState.RUNNING):
                    self._cond.wait()
                    job = self._next_to_stage()
                if job is None:
                    return  # stopping: the packer stages what is left itself
                job.stage = StageRun()
            self._stage(job, stream)

    def _next_to_stage(self) -> PackJob | None:
        """The job the stager may start on: the next in line, unless it is cancelled, held
        (``hold``) or already claimed."""
        if not self._jobs:
            return None
        job = self._jobs[0]
        held = job.held and self._machine.state is LifecycleState.RUNNING
        if job.stage is not None or held or job.output_id in self._cancelled:
            return None
        return job

    def _stage(self, job: PackJob, stream: CopyStream) -> None:
        """Queue ``job``'s device stage on ``stream``, after its forward (the calling thread
        claimed it: ``job.stage`` is running); never waits for the stage's kernels."""
        run = job.stage
        assert run is not None and self._device_stage is not None
        output = attrs.evolve(job.output, async_output_id=job.output_id)
        nbytes = job.nbytes
        try:
            wait_device_event(job.event, stream)
            run.started = self._clock.mark(stream)
            run.output = launch_device_stage(self._device_stage, output, stream)
            run.ended = self._clock.mark(stream)
            run.done = record_stream_event(stream)
            nbytes = budget_nbytes(run.output)
        except Exception as exc:
            run.error = exc
        finally:
            with self._cond:
                run.running = False
                self.metrics.in_flight_bytes += nbytes - job.nbytes
                job.nbytes = nbytes
                self._cond.notify_all()

    def _launch(self, job: PackJob, stream: CopyStream) -> Flight:
        """Start ``job``'s pack: its copies queued on ``stream`` after its forward and
        device stage (with ``start_pack``), or the whole pack (``pack``)."""
        self._fire(job, RequestEvent.PACK)
        output = attrs.evolve(job.output, async_output_id=job.output_id)
        run = job.stage
        try:
            # The copy's stream waits for the forward and the device stage first (device-side
            # on CUDA; the pack waits again, at no cost), so the mark after it is where the
            # copy can start -- never the forward's tail nor the stage, which have times of
            # their own.
            wait_device_event(job.event, stream)
            if run is not None:
                if run.error is not None:
                    raise run.error
                assert run.output is not None
                output = run.output
                wait_device_event(run.done, stream)
            copy = self._clock.mark(stream)
            if job.encoding is not None and encodes_on_device(job.encoding):
                output = run_device_encode(output, job.encoding, stream, job.event)
                self._resize(job, budget_nbytes(output))
            if self._start_pack is not None:
                return Flight(job, copy, pending=self._start_pack(output, stream, job.event))
            return Flight(job, copy, pending=_Packed(self._pack(output, stream, job.event)))
        except Exception as exc:
            return Flight(job, error=exc)

    def _finish(self, flight: Flight) -> None:
        """End a started pack: wait for its copies, stamp it, send OUTPUT_READY (or a
        typed failure, F2)."""
        job = flight.job
        run = job.stage
        try:
            if flight.error is not None:
                raise flight.error
            assert flight.pending is not None and flight.copy is not None
            packed = flight.pending.finish()
            if run is not None and run.started is not None and run.ended is not None:
                # Read now: the copy's stream waited for the stage and has finished.
                packed = with_stage_time(packed, self._clock.time_of(run.ended) - self._clock.time_of(run.started))
            packed = timed(packed, self._clock, job.forward, flight.copy, time.monotonic())
        except Exception as exc:
            self._fail(job, exc)
            return
        self.metrics.pack_seconds += packed.metrics.pack_s or 0.0
        try:
            self._sender.put(OutputReady(job.output_id, packed, rank=self.rank))
        except Exception as exc:
            # Unpicklable, oversize, or a full channel: the packed segments go back,
            # and the executor gets a typed failure instead of waiting forever (F5).
            self._release(packed)
            self._fail(job, exc)
            return
        self.metrics.packed += 1
        self.metrics.bytes_packed += job.nbytes
        self._fire(job, RequestEvent.OUTPUT_READY)

    def _resize(self, job: PackJob, nbytes: int) -> None:
        """The device stage changed what ``job`` copies: the byte budget counts the new size."""
        with self._cond:
            self.metrics.in_flight_bytes += nbytes - job.nbytes
            job.nbytes = nbytes
            self._cond.notify_all()

    def _cancel(self, job: PackJob) -> None:
        self.metrics.cancelled += 1
        self._fire(job, RequestEvent.DROP)
        self._send_failure(job, Failure("Cancelled", f"output {job.output_id} was dropped before packing"))

    def _fail(self, job: PackJob, exc: Exception) -> None:
        """Packing or sending ``job`` raised ``exc``: count it and report it as a typed failure (F2)."""
        self.metrics.failed += 1
        self._send_failure(job, Failure.from_exception(exc))

    def _send_failure(self, job: PackJob, failure: Failure) -> None:
        try:
            self._sender.put(OutputReady.failed(job.output_id, failure, rank=self.rank))
        except ChannelClosed as exc:
            # Shutdown (or the executor is gone): nobody is waiting for this output any more.
            log.debug("packer %d: %s not reported, the result channel is closed: %s", self.rank, job.output_id, exc)
        except Exception:
            log.exception("packer %d: cannot report the failure of %s", self.rank, job.output_id)
        if job.machine.can(RequestEvent.OUTPUT_FAILED):
            self._fire(job, RequestEvent.OUTPUT_FAILED)

    def _fire(self, job: PackJob, event: RequestEvent) -> None:
        fire_traced(job.machine, event, self._trace, self.rank)


def fire_traced(
    machine: Machine[RequestState, RequestEvent], event: RequestEvent, tracer: Tracer | None, rank: int
) -> None:
    """Fire a worker-side request machine, recording ``WorkerFire`` when tracing."""
    src = machine.state
    dst = machine.fire(event)
    emit(tracer, "WorkerFire", output_id=machine.key, event=event.name, src=src.name, dst=dst.name, rank=rank)
