"""The engine's state, and the steps every part of it takes.

``EngineBase`` holds what ``AsyncDiffusionEngine`` is made of (``_init``: its machines,
queues, threads and counters) and the steps its parts share: admitting a request, a
request's early end (abort, cancelled caller, close, failure) and its clean-up, the
executor calls on the send and control threads (an abort never waits behind a send),
and the post-processing on the ``omni-postprocess`` threads.  The parts built on it:
``streaming`` (a stream's consumer), ``driver`` (the loop and each request's walk
through the executor), ``lifecycle`` (the start-up and close tasks), and ``engine``
(the public face).  The module docstring of ``engine`` is the theory of operation.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, TypeVar

import attrs

from omni_async.core.config import Deadlines
from omni_async.core.engine_states import (
    OUTCOME_OF,
    STAGE_TERMINAL,
    EngineEvent,
    EngineState,
    StageEvent,
    StageState,
    engine_machine,
    stage_machine,
)
from omni_async.core.engine_trace import trace_observers
from omni_async.core.errors import RequestAborted, UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.core.trace import Tracer
from omni_async.engine.encode_pool import (
    EncoderPool,
    HostEncode,
    PendingEncode,
    encoded_value,
    take_for_encoding,
)
from omni_async.engine.errors import (
    EncodeFailed,
    EngineClosed,
    EngineDead,
    EngineNotStarted,
    EngineOverloaded,
    PostProcessFailed,
)
from omni_async.engine.metrics import STAGES, LatencyHistogram
from omni_async.engine.owned import Guarded, guard_input, owned_copy, written
from omni_async.engine.record import RequestRecord, retrieve
from omni_async.engine.scheduler import Scheduler
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.batches import BatchKeyer
from omni_async.transport.errors import OutputStillViewed
from omni_async.worker.postprocess import PostProcess, get_postprocess

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["DEFAULT_BATCH_WAIT_S", "DEFAULT_MAX_RUNNING", "EngineBase", "log"]

# Requests sent to the executor whose forward has not finished.  3: one computing and
# two queued behind it on the worker, so the engine has a whole forward of slack to send
# the next one -- a loop held up by host work or a busy consumer for longer than one
# forward no longer leaves the worker idle (with 2 it did: bench/engine_ceiling.py,
# ``starved``).  A batch's members count one by one: ``DEFAULT_MAX_RUNNING_BATCHES``
# batches (one computing, one queued: a batch's forward is longer, and requests sent
# ahead could not join a later batch).
DEFAULT_MAX_RUNNING = 3
DEFAULT_MAX_RUNNING_BATCHES = 2
# How long a batch that could take more members waits for them (seconds).
DEFAULT_BATCH_WAIT_S = 0.002

# The engine's one logger, whichever of its modules logs: a user's logging set-up for
# ``omni_async.engine.engine`` sees all of it.
log = logging.getLogger("omni_async.engine.engine")

T = TypeVar("T")
SS = StageState
SE = StageEvent
EE = EngineEvent
ES = EngineState

_OUTCOMES = (*(st.value for st in STAGE_TERMINAL), "rejected")

# What an abort's error says of where the request was.
_WHERE: dict[StageState, str] = {
    SS.WAITING: "while waiting in the engine's queue; it never reached a worker",
    SS.SUBMITTED: "while it was being sent",
    SS.COMPUTING: "during its forward",
    SS.COMPUTED: "after its forward, before its output arrived",
    SS.POSTPROCESSING: "while its output was post-processed",
    SS.RESOLVED: "while its stream was read",
}


class EngineBase:
    """The engine's state and shared steps (see the module docstring)."""

    def _init(
        self,
        executor: DiffusionExecutor | None,
        factory: Callable[[], DiffusionExecutor] | None,
        *,
        pipeline: str | None,
        max_running: int | None,
        max_waiting: int,
        max_in_flight: int | None,
        postprocess_workers: int,
        close_timeout: float,
        async_output: bool,
        tracer: Tracer | None,
        max_batch_size: int = 1,
        batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
        batch_key: BatchKeyer | None = None,
        encode_workers: int | None = None,
    ) -> None:
        # Requests that ask for a format are encoded in these processes (started on first use).
        self._encoders = EncoderPool(encode_workers)
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise UsageError(f"max_batch_size must be a positive int (1: no batching), got {max_batch_size!r}")
        if max_running is None:
            # Members count as running requests: one batch computing, one queued behind it.
            max_running = DEFAULT_MAX_RUNNING if max_batch_size == 1 else DEFAULT_MAX_RUNNING_BATCHES * max_batch_size
        elif isinstance(max_running, int) and not isinstance(max_running, bool) and 1 <= max_running < max_batch_size:
            raise UsageError(
                f"max_running ({max_running}) is below max_batch_size ({max_batch_size}): the members of a batch "
                f"count as running requests, so no batch could fill; raise max_running to at least "
                f"{max_batch_size} (2 x max_batch_size keeps a batch queued behind the running one), or leave it "
                "out for that default"
            )
        if (
            isinstance(batch_wait_s, bool)
            or not isinstance(batch_wait_s, (int, float))
            or not 0 <= batch_wait_s < float("inf")
        ):
            raise UsageError(
                f"batch_wait_s must be a number of seconds >= 0 (0: take what waits), got {batch_wait_s!r}"
            )
        if batch_key is not None and not callable(batch_key):
            raise UsageError(f"batch_key must be a callable (request -> key or None) or None, got {batch_key!r:.80}")
        self._max_batch_size = max_batch_size
        self._batch_wait_s = float(batch_wait_s)
        self._batch_key = batch_key
        for name, value in (
            ("max_running", max_running),
            ("max_waiting", max_waiting),
            ("postprocess_workers", postprocess_workers),
            ("max_in_flight", max_in_flight),
        ):
            if value is None and name == "max_in_flight":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a positive int, got {value!r}")
        if isinstance(close_timeout, bool) or not isinstance(close_timeout, (int, float)) or close_timeout <= 0:
            raise UsageError(f"close_timeout must be a number of seconds > 0, got {close_timeout!r}")
        if not isinstance(async_output, bool):
            raise UsageError(f"async_output must be a bool, got {async_output!r:.80}")
        self._async_output = async_output
        self._executor = executor
        self._factory = factory
        self._owns_executor = factory is not None
        self.pipeline = pipeline
        # The engine's post-process: a request's own (DiffusionRequest.postprocess) wins.
        self._default_post: PostProcess | None = None
        if pipeline is not None:
            self._default_post = get_postprocess(pipeline)
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._max_in_flight = max_in_flight
        self._postprocess_workers = postprocess_workers
        self._close_timeout = float(close_timeout)
        # With a tracer, every step of the machines is recorded (EngineFire, StageFire).
        self._trace_life, self._trace_stage = trace_observers(tracer)
        self._life = engine_machine(f"engine-{id(self):x}", self._trace_life)
        # The start-up and the close, each a task of its own: a caller that cancels its
        # ``start`` or ``close`` stops waiting, never the work (what was built is shut
        # down when the factory returns, whoever waits).
        self._starting: asyncio.Task[None] | None = None
        self._start_given_up = False
        self._closing: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._scheduler: Scheduler | None = None
        self._records: dict[str, RequestRecord] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        # Sends (a request's data: it can block on a full pipe) and control (cancels,
        # drops, stream closes) on threads of their own, so an abort never waits behind
        # a send.
        self._io: ThreadPoolExecutor | None = None
        self._control: ThreadPoolExecutor | None = None
        self._post: ThreadPoolExecutor | None = None
        self._sync: ThreadPoolExecutor | None = None  # async_output=False: the blocking calls
        self._counts = dict.fromkeys(_OUTCOMES, 0)
        self._latency = {stage: LatencyHistogram() for stage in STAGES}
        self._pack_s_total = 0.0
        self._pack_bytes_total = 0.0
        self._postprocessing = 0
        # Host stages running on their threads, by request (what close abandons).
        self._host_lock = threading.Lock()
        self._host_running: dict[str, int] = {}
        self._chunks = 0
        self._prometheus: CollectorRegistry | None = None

    @property
    def executor(self) -> DiffusionExecutor:
        """The executor (for an engine from a factory: once ``start`` has built it)."""
        if self._executor is None:
            raise EngineNotStarted("the engine builds its executor at start(); start it first")
        return self._executor

    def _check_open(self, what: str) -> None:
        state = self._life.state
        if state in (ES.CLOSING, ES.CLOSED):
            raise EngineClosed(f"{what}: the engine is closed")
        if state is ES.FAILED:
            raise EngineClosed(f"{what}: the engine failed to start; build a new one")
        if state is not ES.RUNNING:
            raise EngineNotStarted(f"{what}: the engine is not started (await engine.start() or use async with)")
        task = self._loop_task
        if task is not None and task.done():
            raise self._dead()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise UsageError(
                f"{what}: called from another event loop than the engine's (the one that ran start()); the engine "
                "serves one loop: call it there (asyncio.run_coroutine_threadsafe from another thread), or use "
                "the blocking DiffusionEngine"
            )

    def _dead(self) -> EngineDead:
        task = self._loop_task
        cause = None if task is None or task.cancelled() else task.exception()
        err = EngineDead(f"the engine's loop task ended ({cause!r}); close the engine and build a new one")
        err.__cause__ = cause
        return err

    def _admit(
        self, request: DiffusionRequest, deadlines: Deadlines | None, what: str, *, streaming: bool
    ) -> RequestRecord:
        """Check the call and queue the request (``generate``, ``generate_stream``).
        Everything that can refuse it does so here, before anything of it exists."""
        if not isinstance(request, DiffusionRequest):
            raise UsageError(f"{what}: request must be a DiffusionRequest, got {type(request).__name__}")
        if deadlines is not None and not isinstance(deadlines, Deadlines):
            raise UsageError(f"{what}: deadlines must be a Deadlines or None, got {type(deadlines).__name__}")
        self._check_open(what)
        assert self._scheduler is not None and self._loop is not None
        rid = request.request_id
        if rid in self._records:
            raise UsageError(f"{what}: request id {rid!r} is already in the engine; request ids must be unique")
        now = time.monotonic()
        try:
            self.executor.validate_request(request)
            post = self._post_of(request)
            key = self._compat_key(request, deadlines, streaming)
            self._scheduler.add(rid, key=key, now=now)
        except (EngineOverloaded, UsageError):
            self._counts["rejected"] += 1
            raise
        machine = stage_machine(rid, self._trace_stage)
        rec = RequestRecord(request, deadlines, self._loop.create_future(), now, machine, streaming=streaming)
        rec.postprocess = post
        rec.pipeline = request.postprocess if request.postprocess is not None else self.pipeline
        rec.result.add_done_callback(retrieve)
        rec.result.add_done_callback(lambda _: rec.changed.set())
        self._records[rid] = rec
        self._wake.set()
        return rec

    def _post_of(self, request: DiffusionRequest) -> PostProcess | None:
        """The post-process ``request`` asks for (``UnknownPostProcess`` naming it and the
        registered names), or the engine's."""
        if request.postprocess is None:
            return self._default_post
        return get_postprocess(request.postprocess, request_id=request.request_id)

    def _compat_key(self, request: DiffusionRequest, deadlines: Deadlines | None, streaming: bool) -> object:
        """What the requests of one batch share (None: ``request`` goes alone): the
        model's batch key, the deadlines (one call, one compute deadline: a member keeps
        the deadline it has alone) and whether it streams."""
        if self._max_batch_size == 1:
            return None
        keyer = self._batch_key if self._batch_key is not None else self.executor.batch_key
        try:
            key = keyer(request)
            hash(key)
        except (UsageError, EngineOverloaded):
            raise
        except Exception as exc:
            raise UsageError(
                f"request {request.request_id!r}: its batch key could not be taken ({type(exc).__name__}: {exc}); "
                "a batch_key must return a hashable value (or None: never batched) for every valid request"
            ) from exc
        return None if key is None else (key, deadlines, streaming)

    def _end_early(self, rec: RequestRecord, event: StageEvent, *, error: BaseException | None = None) -> None:
        """Decide ``rec``'s end now (``ABORT``, ``CANCEL``: its caller went away,
        ``CLOSE``, ``FAIL`` with ``error``) unless one is decided already, fail its caller,
        and start its clean-up."""
        if event is SE.CLOSE:
            self._close_stream(rec)  # also after its result: the chunks nobody took go
        if rec.ended():
            return  # the first end decided counts
        rid = rec.request_id
        where = rec.stage
        self._fire(rec, event)
        if error is None:
            if event is SE.CLOSE:
                error = EngineClosed(f"the engine closed before request {rid!r} finished", request_id=rid)
            elif event is SE.ABORT:
                error = RequestAborted(rid, by="abort", detail=f"aborted in the engine {_WHERE[where]}")
        rec.error = error
        if not rec.result.done():
            if error is not None:
                rec.result.set_exception(error)
            else:
                rec.result.cancel()
        self._close_stream(rec)
        match where:
            case SS.WAITING:
                self._forget(rec)  # nothing of it reached a worker
            case SS.SUBMITTED | SS.POSTPROCESSING | SS.RESOLVED:
                pass  # the driver sees the end at its next step
            case SS.COMPUTING:
                self._cancel_forward(rec)
            case SS.COMPUTED:
                self._drop_output(rec)
            case _:
                raise AssertionError(f"request {rid!r}: an end decided in stage {where}")

    def _fire(self, rec: RequestRecord, event: StageEvent) -> None:
        """Move ``rec``'s machine; the step that decides its end counts its outcome, so
        every request is counted exactly once (``metrics().requests``)."""
        was_ended = rec.ended()
        rec.machine.fire(event)
        if not was_ended and rec.ended():
            self._counts[OUTCOME_OF.get(rec.stage, rec.stage).value] += 1

    def _fail(self, rec: RequestRecord, error: BaseException) -> None:
        self._end_early(rec, SE.FAIL, error=error)

    def _forget(self, rec: RequestRecord) -> None:
        """Nothing of ``rec`` remains: it reaches its terminal state, frees its place and
        wakes the loop."""
        assert self._scheduler is not None
        if not rec.machine.terminal:
            self._fire(rec, SE.GONE)
        self._scheduler.remove(rec.request_id)
        if self._records.get(rec.request_id) is rec:
            del self._records[rec.request_id]
        rec.gone.set()
        self._wake.set()

    async def _on_io(self, fn: Callable[[], T]) -> T:
        assert self._loop is not None and self._io is not None
        return await self._loop.run_in_executor(self._io, fn)

    def _cancel_forward(self, rec: RequestRecord) -> None:
        """Ask the workers to stop ``rec``'s forward (fire and forget: the driver awaits
        the execute future, which fails with ``RequestAborted`` or resolves anyway).  On
        the control thread: never behind a send that a full pipe holds up."""
        assert self._loop is not None and self._control is not None
        ex = self.executor
        fut = self._loop.run_in_executor(self._control, functools.partial(ex.cancel_requests, [rec.request_id]))
        fut.add_done_callback(functools.partial(self._log_io_error, "cancel_requests", rec.request_id))

    def _drop_output(self, rec: RequestRecord) -> None:
        assert self._loop is not None and self._control is not None and rec.output_id is not None
        if rec.drop is None:
            rec.drop = self._loop.run_in_executor(
                self._control, functools.partial(self.executor.drop_output, rec.output_id)
            )

    @staticmethod
    def _log_io_error(what: str, rid: str, fut: asyncio.Future[object]) -> None:
        if not fut.cancelled() and (exc := fut.exception()) is not None:
            log.debug("engine: %s for request %r failed: %s", what, rid, exc)

    def _close_stream(self, rec: RequestRecord) -> None:
        """Close ``rec``'s stream on the control thread (once): the chunks not taken are dropped."""
        if rec.stream is None or rec.close is not None:
            rec.changed.set()
            return
        assert self._loop is not None and self._control is not None
        rec.close = self._loop.run_in_executor(self._control, rec.stream.close)
        rec.changed.set()
        rec.poke.set()

    def _postprocess(self, rec: RequestRecord, output: DiffusionOutput, wanted: bool) -> tuple[object, float, float]:
        """On an ``omni-postprocess`` thread: the request's host stage (or an owned copy),
        and the release; the value, when it started (``time.monotonic()``) and its seconds.
        ``wanted`` False (the request ended): only the release."""
        rid = rec.request_id
        with self._host_lock:
            self._host_running[rid] = self._host_running.get(rid, 0) + 1
        try:
            value, started, seconds = self._run_host_stage(rec, output, wanted)
            if isinstance(value, HostEncode):
                # After the release: the job owns its pixels.  The event loop awaits it.
                value = PendingEncode(self._encoders.submit(value.job), value)
            return value, started, seconds
        finally:
            with self._host_lock:
                left = self._host_running.pop(rid) - 1
                if left:
                    self._host_running[rid] = left

    def _run_host_stage(self, rec: RequestRecord, output: DiffusionOutput, wanted: bool) -> tuple[object, float, float]:
        """The host stage never writes into shared memory: it gets an owned copy (the
        segment goes back first), or, declared ``host_reads_only``, the views, checked
        for in-place writes afterwards (``omni_async.worker.postprocess``)."""
        rid, pipeline = rec.request_id, rec.pipeline
        post = rec.postprocess if wanted else None
        started = time.monotonic()
        t0 = time.perf_counter()
        value: object = None
        guarded: Guarded | None = None
        encoding = rec.request.encoding if wanted else None
        try:
            if encoding is not None:
                # A format asked for: the pixels are encoded instead of the host stage.
                value = take_for_encoding(output.output, rid, encoding)
            elif wanted and (post is None or post.host is None):
                value = owned_copy(output.output)
            elif post is not None and post.host_reads_only:
                guarded = guard_input(output.output)
                value = post.run_host(output, rec.request)
            elif post is not None:
                owned = attrs.evolve(output, output=owned_copy(output.output))
                self._release_quietly(output)  # the stage holds no view of it: back to the pool now
                value = post.run_host(owned, rec.request)
                return value, started, time.perf_counter() - t0
        except EncodeFailed:
            self._release_quietly(output)
            raise
        except Exception as exc:
            guarded = None
            self._release_quietly(output)
            # The traceback's frames may hold views of the segment: keep the text, free them.
            text = "".join(traceback.format_exception(exc))
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__)
            raise PostProcessFailed(
                f"request {rid!r}: the host stage of pipeline {pipeline!r} raised "
                f"{type(exc).__name__}: {exc}\n--- traceback ---\n{text}",
                request_id=rid,
                pipeline=pipeline,
            ) from exc
        wrote = [] if guarded is None else written(guarded)
        guarded = None  # it holds the input's tensors: views of the segment, which the release takes back
        if wrote:
            del value
            self._release_quietly(output)
            raise PostProcessFailed(
                f"request {rid!r}: the host stage of pipeline {pipeline!r} is declared host_reads_only=True but "
                f"wrote into its input in place ({', '.join(wrote[:5])}), which is the output's shared memory; "
                "copy before writing (t.clone(), t.to(torch.float32, copy=True)), or register the post-process "
                "without host_reads_only so that its stage gets an owned copy",
                request_id=rid,
                pipeline=pipeline,
            )
        try:
            self.executor.release_output(output)
        except OutputStillViewed as exc:
            del value  # dropping the views gives the segment back
            raise PostProcessFailed(
                f"request {rid!r}: the result of pipeline {pipeline!r}'s host stage still views the output's "
                f"shared memory ({exc.views} view(s) alive); a result must own its memory: copy what it keeps "
                "(tensor.clone(), numpy.array(a, copy=True), bytes(...))",
                request_id=rid,
                pipeline=pipeline,
            ) from exc
        except Exception as exc:  # the pool closed under us (executor shut down): nothing to give back
            log.debug("engine: releasing the output of %r: %s", rid, exc)
        return value, started, time.perf_counter() - t0

    async def _encoded(
        self, rec: RequestRecord, value: object, metrics: Mapping[str, float]
    ) -> tuple[object, float | None]:
        """The result of a request that asked for a format, and the encode's seconds: the
        encoder pool's job awaited (from its submission to its files here), or the
        worker's GPU's time (``device_encode_s``).  Other results pass as they are."""
        if not isinstance(value, PendingEncode):
            if rec.request.format is not None and "device_encode_s" in metrics:
                return value, metrics["device_encode_s"]
            return value, None
        rid, fmt = rec.request_id, value.encoding.format
        try:
            files, _ = await asyncio.wrap_future(value.future)
        except EncodeFailed:
            raise
        except BrokenProcessPool as exc:
            raise EncodeFailed(
                f"request {rid!r}: the encoder process encoding it as {fmt} died ({exc}); the pool is replaced at "
                "the next encode: send the request again",
                request_id=rid,
                format=fmt,
            ) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the driver is cancelled (its future's cancel follows through wrap_future)
            # The pool cancelled the job: it shut down (the engine is closing).
            raise EncodeFailed(
                f"request {rid!r}: the engine's encoder pool shut down before its {fmt} encode ran",
                request_id=rid,
                format=fmt,
            ) from None
        except Exception as exc:
            raise EncodeFailed(
                f"request {rid!r}: encoding its pixels {tuple(value.shape)} as {fmt} failed: "
                f"{type(exc).__name__}: {exc}",
                request_id=rid,
                format=fmt,
            ) from exc
        return encoded_value(value, files), time.perf_counter() - value.submitted_at

    def _release_quietly(self, output: DiffusionOutput) -> None:
        try:
            self.executor.release_output(output)
        except Exception as exc:  # views of a failed stage: they go back when its frames go
            log.debug("engine: releasing %s after a failed host stage: %s", output.async_output_id, exc)
