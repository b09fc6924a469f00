"""``AsyncDiffusionEngine``: an asyncio engine over any ``DiffusionExecutor``.

Theory of operation
-------------------
The engine's lifecycle and each request's stage are machines from
``omni_async.core.engine_states`` (their docstring says what each state means); every
change goes through them, so a step the tables do not allow raises instead of
happening.  ``generate(request)`` validates the request (the model's
``validate_request``, through the executor), puts it into the scheduler's waiting queue
(``omni_async.engine.scheduler``) and awaits its outcome.  The engine's loop task
(``omni-engine-loop``) admits waiting requests as far as the scheduler allows and
starts one *driver* task per admitted request (ADMIT), which walks it through the
executor:

1. **send** (SENT): ``executor.submit_handle`` on the ``omni-engine-send`` thread (it
   writes to every worker's pipe, which can block while a worker is busy).  Cancels,
   drops and stream closes go on ``omni-engine-control``, so an abort never waits
   behind another request's send.
2. **forward** (COMPUTE_DONE): await the handle's ``computed``.  The running slot is
   freed at once and the loop admits the next request, so with ``max_running >= 2``
   one is always queued on the worker behind the running forward.
3. **output** (OUTPUT): await the handle's ``output``, which the pump claimed for it as
   it dispatched the COMPUTE_DONE (a stream's final output: ``wait_output_ready``).
4. **post-process**: on an ``omni-postprocess`` thread: the pipeline's host stage (or,
   without one, an owned copy of the output's tensors), then ``release_output`` --
   the segment goes back to the pool before the result reaches the caller.
5. **outcome** (RESULT): the caller's future gets the ``GenerationResult`` (or the
   typed error), and the scheduler frees the request's place in the budget.  The step
   that decides a request's end counts its outcome, once.

Every wait on the executor is ``asyncio.wrap_future`` of its ``concurrent.futures``
future (the callbacks run on the pump and only schedule work on the loop); nothing
that blocks ever runs on the event loop.

Ends, and who releases what (nothing of a request survives any of them):

* **abort while waiting**: removed from the queue; it never reaches a worker.
* **abort after sending, before COMPUTE_DONE**: ``executor.cancel_requests`` stops the
  forward at the model's next cancellation check (the execute future fails with
  ``RequestAborted``); a model that ignores it finishes, and its output is dropped
  the moment COMPUTE_DONE names it.
* **abort after COMPUTE_DONE**: ``drop_output``: a packing that has not started is
  cancelled (F15), an output already here is released at once (F10); the driver
  awaits the drop's acknowledgement.
* **abort while post-processing**: the host stage cannot be interrupted; its result
  is discarded when it returns, after the release.
* **the caller's task cancelled**: the same as an abort (F11).
* **close()**: every request not finished fails with ``EngineClosed``; the work in
  flight is aborted as above (an engine that owns its executor shuts it down, which
  fails and releases everything at once), and ``close`` returns when nothing is left,
  or at its deadline, which bounds all of it (the executor's shutdown included; host
  stages still running are abandoned with a warning).

An abort decides the outcome at once (``generate`` raises ``RequestAborted``, or
``CancelledError``); the release goes on in the driver.  ``abort(ids, wait=True)``
awaits the drivers, i.e. until nothing of those requests remains on any worker or in
the executor.

Streaming (``generate_stream``): the driver sends the request with
``executor.submit_stream`` and walks it as above; the caller's async iterator takes the
chunks from the executor's ``RequestStream`` one at a time, as the caller asks for them:
it awaits the chunk's output, post-processes it like a final output (step 4: host stage
or owned copy, then the release) and yields a ``GenerationChunk``; after the last chunk
it yields the ``GenerationResult``.  Chunks not yet asked for stay in the executor,
each holding an output of the budget of held outputs once packed: a slow consumer
slows the worker's packer and, through it, the forward (nothing is dropped, and
nothing piles up in the engine).  The request stays in the engine until its consumer
has taken every chunk (or closed the iterator): the driver awaits that before it
forgets the request.  A chunk that fails ends the stream: the iterator raises its
typed error and the request is aborted (everything of it released).  Closing the
iterator early (``aclose``, or ``break`` with ``contextlib.aclosing``) or cancelling
the consuming task aborts the request like a cancelled ``generate`` (F9, F11), and
closes its stream: the chunks not taken are dropped, and every later one is dropped
on arrival.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import traceback
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Self, TypeVar

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
from omni_async.core.errors import OmniAsyncError, OutputDropped, RequestAborted, UsageError
from omni_async.core.states import Machine
from omni_async.core.engine_trace import trace_observers
from omni_async.core.trace import Tracer
from omni_async.core.messages import DiffusionOutput, DiffusionRequest, RunnerOutput
from omni_async.engine.errors import (
    EngineClosed,
    EngineDead,
    EngineNotStarted,
    EngineOverloaded,
    PostProcessFailed,
)
from omni_async.engine.metrics import (
    STAGES,
    EngineMetrics,
    GenerationChunk,
    GenerationResult,
    LatencyHistogram,
    RequestTimings,
)
from omni_async.engine.owned import owned_copy
from omni_async.engine.scheduler import SchedulerPhase, Scheduler
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.metrics import ExecutorMetrics
from omni_async.executor.stream import OutputChunk, RequestStream
from omni_async.transport.errors import OutputStillViewed
from omni_async.worker.postprocess import HostStage, get_postprocess
from omni_async.worker.stamps import FORWARD_ENDED_AT, FORWARD_STARTED_AT, PACK_ENDED_AT, PACK_STARTED_AT

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["AsyncDiffusionEngine"]

log = logging.getLogger(__name__)

T = TypeVar("T")
SS = StageState
SE = StageEvent
EE = EngineEvent
ES = EngineState

DEFAULT_MAX_RUNNING = 2
DEFAULT_MAX_WAITING = 4096
# Without a budget reported by the executor (InProcessExecutor): how many requests may
# be running or holding an output at once.
DEFAULT_MAX_IN_FLIGHT = 64


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


@attrs.define(eq=False)
class _Request:
    request: DiffusionRequest
    deadlines: Deadlines | None
    result: asyncio.Future[GenerationResult]
    enqueued_at: float
    # Where the request is, and how it ended: the only state that decides what the
    # engine does with it (``omni_async.core.engine_states``).
    machine: Machine[StageState, StageEvent]
    # The error an early end gave the caller (an abort, close, a failed chunk): what a
    # stream's consumer raises instead of a result set before that end.
    error: BaseException | None = None
    output_id: str | None = None
    drop: asyncio.Future[Future[None]] | None = None
    driver: asyncio.Task[None] | None = None
    # Set once nothing of the request remains anywhere (what abort(wait=True) awaits).
    gone: asyncio.Event = attrs.field(factory=asyncio.Event)
    submitted_at: float = 0.0
    compute_done_at: float = 0.0
    output_ready_at: float = 0.0
    # Streaming (generate_stream): the executor's stream once sent; ``changed`` wakes the
    # consumer (a chunk, the stream's end, the request's end); ``consumed``: the consumer
    # is done with the stream (took every chunk, or went away); ``taking``: chunks the
    # consumer took and has not yet post-processed (each holds an output); ``close``: the
    # stream's close, on the control thread (its result: the drops' acknowledgement).
    # The driver forgets the request once the consumer is done, or the stream is closed
    # and the consumer holds no chunk (``poke`` wakes it when either may have happened).
    streaming: bool = False
    stream: RequestStream | None = None
    changed: asyncio.Event = attrs.field(factory=asyncio.Event)
    consumed: bool = False
    taking: int = 0
    poke: asyncio.Event = attrs.field(factory=asyncio.Event)
    close: asyncio.Future[Future[None]] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def stage(self) -> StageState:
        return self.machine.state

    def ended(self) -> bool:
        """An end was decided (abort, cancelled caller, close, failure), or the request
        is over.  A call, not a property: it changes across the driver's awaits, and a
        type checker narrows a property once tested."""
        return self.machine.state in OUTCOME_OF or self.machine.terminal


def _held_bytes(metrics: Mapping[str, float]) -> float:
    """The bytes an output holds outside the message: in a pooled segment, or a buffer in
    Ray's object store (``RayDiffusionExecutor``)."""
    return metrics.get("pack_shm_bytes", 0.0) + metrics.get("pack_stored_bytes", 0.0)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    # A caller that went away never reads its future: mark the exception retrieved, so
    # asyncio does not log "Future exception was never retrieved".
    if not fut.cancelled():
        fut.exception()


class AsyncDiffusionEngine:
    """An asyncio engine over a ``DiffusionExecutor`` (see the module docstring).

    ``pipeline``: the name of a registered ``PostProcess`` whose ``host`` stage turns each
    output into the caller's result (``UnknownPostProcess`` at once if none is
    registered); without one the result is an owned copy of the model's output.
    ``max_running``: requests sent to the executor whose forward has not finished
    (2 keeps the worker fed); ``max_waiting``: the engine's queue (full:
    ``EngineOverloaded`` at the call); ``max_in_flight``: cap on running requests plus
    outputs not yet released, in addition to the executor's budget of held outputs
    (default: that budget, or 64 for an executor without one); ``postprocess_workers``:
    threads running host stages; ``async_output`` (True): False sends every request down
    the executor's synchronous output path instead (``execute_request(sync_output=True)``:
    the worker copies each output on its main thread before it answers, and the calls
    run one at a time) -- the baseline the asynchronous path is measured against
    (``omni-async demo``), not a way to serve: a request whose call is in flight cannot
    be cancelled (an abort waits for its forward, then releases its output).

    Use on one event loop: ``async with engine:``, or ``await engine.start()`` ...
    ``await engine.close()``.  ``from_factory`` builds an engine that creates its
    executor at ``start`` and shuts it down at ``close`` (both off the event loop).
    """

    def __init__(
        self,
        executor: DiffusionExecutor,
        *,
        pipeline: str | None = None,
        max_running: int = DEFAULT_MAX_RUNNING,
        max_waiting: int = DEFAULT_MAX_WAITING,
        max_in_flight: int | None = None,
        postprocess_workers: int = 2,
        close_timeout: float = 60.0,
        async_output: bool = True,
        tracer: Tracer | None = None,
    ) -> None:
        if not isinstance(executor, DiffusionExecutor):
            raise UsageError(f"executor must be a DiffusionExecutor, got {type(executor).__name__} {executor!r:.80}")
        self._init(
            executor,
            None,
            pipeline=pipeline,
            max_running=max_running,
            max_waiting=max_waiting,
            max_in_flight=max_in_flight,
            postprocess_workers=postprocess_workers,
            close_timeout=close_timeout,
            async_output=async_output,
            tracer=tracer,
        )

    @classmethod
    def from_factory(
        cls,
        factory: Callable[[], DiffusionExecutor],
        *,
        pipeline: str | None = None,
        max_running: int = DEFAULT_MAX_RUNNING,
        max_waiting: int = DEFAULT_MAX_WAITING,
        max_in_flight: int | None = None,
        postprocess_workers: int = 2,
        close_timeout: float = 60.0,
        async_output: bool = True,
        tracer: Tracer | None = None,
    ) -> AsyncDiffusionEngine:
        """An engine that owns its executor: ``start`` calls ``factory()`` and ``close``
        shuts the executor down, both on a worker thread (the executor's constructor and
        shutdown block: processes start and stop)."""
        if not callable(factory):
            raise UsageError(f"factory must be a callable returning a DiffusionExecutor, got {factory!r:.80}")
        engine = cls.__new__(cls)
        engine._init(
            None,
            factory,
            pipeline=pipeline,
            max_running=max_running,
            max_waiting=max_waiting,
            max_in_flight=max_in_flight,
            postprocess_workers=postprocess_workers,
            close_timeout=close_timeout,
            async_output=async_output,
            tracer=tracer,
        )
        return engine

    def _init(
        self,
        executor: DiffusionExecutor | None,
        factory: Callable[[], DiffusionExecutor] | None,
        *,
        pipeline: str | None,
        max_running: int,
        max_waiting: int,
        max_in_flight: int | None,
        postprocess_workers: int,
        close_timeout: float,
        async_output: bool,
        tracer: Tracer | None,
    ) -> None:
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
        self._host: HostStage | None = None
        if pipeline is not None:
            self._host = get_postprocess(pipeline).host
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
        self._records: dict[str, _Request] = {}
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

    # ---------------------------------------------------------------- lifecycle

    @property
    def close_timeout(self) -> float:
        """The default bound of ``close`` (and of a stream's ``aclose``), in seconds."""
        return self._close_timeout

    @property
    def executor(self) -> DiffusionExecutor:
        """The executor (for an engine from a factory: once ``start`` has built it)."""
        if self._executor is None:
            raise EngineNotStarted("the engine builds its executor at start(); start it first")
        return self._executor

    @property
    def started(self) -> bool:
        return self._life.state is ES.RUNNING

    @property
    def closed(self) -> bool:
        """Closing, closed, or failed to start: nothing new is served."""
        return self._life.state in (ES.CLOSING, ES.CLOSED, ES.FAILED)

    @property
    def state(self) -> EngineState:
        """Where the engine's lifecycle is (``omni_async.core.engine_states``)."""
        return self._life.state

    async def start(self) -> None:
        """Build the executor (factory), read its budget, start the loop task.

        Idempotent while it runs; a second caller during the start waits for the first.
        A start that fails shuts down what it built before it raises, and the engine is
        then FAILED (``close`` returns at once; build a new engine).  Cancelling the
        caller gives the start up: an executor the factory is still building is shut
        down the moment it is built.  ``close`` during the start wins: the start raises
        ``EngineClosed`` and nothing it built survives."""
        state = self._life.state
        if state is ES.RUNNING:
            return
        if state is ES.STARTING and self._starting is not None:
            await asyncio.shield(self._starting)
            return
        if state is ES.FAILED:
            raise EngineClosed("the engine failed to start; build a new one")
        if state is not ES.NEW:
            raise EngineClosed("the engine is closed; build a new one")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._life.fire(EE.START)
        self._starting = self._loop.create_task(self._start_up(), name="omni-engine-start")
        self._starting.add_done_callback(_retrieve)
        try:
            await asyncio.shield(self._starting)
        except asyncio.CancelledError:
            if not self._starting.done():
                self._start_given_up = True  # the start-up sees it when its awaits return
            raise

    def _check_start_wanted(self) -> None:
        """Inside the start-up, after each await: has the caller or a close given it up?"""
        if self._life.state is not ES.STARTING:  # CLOSING, or CLOSED by a close that timed out
            raise EngineClosed("the engine was closed while it started")
        if self._start_given_up:
            raise EngineClosed("the engine's start was cancelled")

    async def _start_up(self) -> None:
        assert self._loop is not None
        try:
            if self._executor is None:
                assert self._factory is not None
                # The factory runs to its end on its thread, whatever happens here.
                built = await asyncio.to_thread(self._factory)
                if not isinstance(built, DiffusionExecutor):
                    raise UsageError(f"the executor factory returned {type(built).__name__}, not a DiffusionExecutor")
                self._executor = built
            self._check_start_wanted()
            ex = self._executor
            if ex.step_mode:
                raise UsageError(
                    "AsyncDiffusionEngine needs an executor in request mode (step_mode=False): it overlaps each "
                    "output's copy with the next forward"
                )
            budget = ex.budget
            self._check_start_wanted()
        except BaseException:
            # What the start built goes before the lifecycle says FAILED: a failed start
            # never leaves a live executor behind.
            if self._owns_executor and self._executor is not None:
                await asyncio.to_thread(self._executor.shutdown, "the engine failed to start")
            if not self._life.terminal:  # CLOSED already: a close gave up waiting for the factory
                self._life.fire(EE.START_FAILED)
            raise
        cap = self._max_in_flight
        if cap is None and budget is None:
            cap = DEFAULT_MAX_IN_FLIGHT
        self._scheduler = Scheduler(
            max_waiting=self._max_waiting, max_running=self._max_running, max_in_flight=cap, budget=budget
        )
        self._io = ThreadPoolExecutor(1, thread_name_prefix="omni-engine-send")
        self._control = ThreadPoolExecutor(1, thread_name_prefix="omni-engine-control")
        self._post = ThreadPoolExecutor(self._postprocess_workers, thread_name_prefix="omni-postprocess")
        if not self._async_output:
            self._sync = ThreadPoolExecutor(self._max_running, thread_name_prefix="omni-engine-sync")
        self._loop_task = self._loop.create_task(self._run(), name="omni-engine-loop")
        self._loop_task.add_done_callback(self._on_loop_end)
        self._life.fire(EE.STARTED)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, *, timeout: float | None = None) -> None:
        """Fail every request not finished with ``EngineClosed``, abort the work in flight,
        and return once nothing of it remains (registry empty, segments back); an engine
        that owns its executor shuts it down.  Idempotent; a second caller waits for the
        first.  In every state: before ``start`` it only marks the engine closed; after a
        failed start it returns at once; during a start it stops the start (which shuts
        down what it built) and waits for it.

        ``timeout`` (default: the constructor's ``close_timeout``) bounds all of it: the
        requests' release, the executor's shutdown (cancel, then terminate, each rank in
        parallel) and the host stages, which are abandoned with a warning when they do
        not return in time (their outputs are released when they do).
        """
        limit = self._close_timeout if timeout is None else timeout
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
            raise UsageError(f"close: timeout must be a number of seconds > 0, got {timeout!r}")
        state = self._life.state
        if self._life.terminal:
            return  # closed already, or a failed start (which shut down what it built)
        if state is ES.CLOSING and self._closing is not None:
            self._life.fire(EE.CLOSE)  # CLOSING stays CLOSING: wait for the first close
            await asyncio.shield(self._closing)
            return
        self._life.fire(EE.CLOSE)
        if self._life.state is not ES.CLOSING:
            return  # NEW -> CLOSED: nothing to release
        assert self._loop is not None
        self._closing = self._loop.create_task(self._shut_down(time.monotonic() + limit), name="omni-engine-close")
        self._closing.add_done_callback(_retrieve)
        await asyncio.shield(self._closing)

    async def _shut_down(self, deadline: float) -> None:
        try:
            if self._starting is not None and not self._starting.done():
                # The start sees CLOSING after its await and shuts down what it built.
                await asyncio.wait([self._starting], timeout=max(0.0, deadline - time.monotonic()))
                if not self._starting.done():
                    log.warning(
                        "engine close: the executor factory did not return within the close timeout; the "
                        "executor it builds is shut down when it returns"
                    )
                return
            for rec in list(self._records.values()):
                self._end_early(rec, SE.CLOSE)
            if self._owns_executor:
                # Shutting the executor down fails every pending future at once and
                # unlinks every segment: the drivers only have to notice.
                await asyncio.to_thread(
                    functools.partial(
                        self.executor.shutdown, "the engine closed", timeout=max(0.1, deadline - time.monotonic())
                    )
                )
            await self._await_gone(list(self._records.values()), deadline)
            if self._loop_task is not None:
                self._loop_task.cancel()
                await asyncio.gather(self._loop_task, return_exceptions=True)
            self._stop_threads()
        finally:
            self._life.fire(EE.CLOSED)

    def _stop_threads(self) -> None:
        """The engine's threads, without waiting: a host stage still running is abandoned
        (its output is released when it returns), with a warning."""
        with self._host_lock:
            running = sorted(self._host_running)
        if running:
            log.warning(
                "engine close: the host stage of %d request(s) still running (%s); abandoned: their outputs are "
                "released when they return",
                len(running),
                running[:10],
            )
        # Queued sends and synchronous calls are dropped (the executor is closing or
        # gone); queued releases, drops and cancels still run: they give memory back.
        for pool, drop_queued in ((self._io, True), (self._sync, True), (self._control, False), (self._post, False)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=drop_queued)

    async def _await_gone(self, recs: list[_Request], deadline: float) -> None:
        if not recs:
            return
        waits = [asyncio.ensure_future(r.gone.wait()) for r in recs]
        limit = max(0.0, deadline - time.monotonic())
        _, pending = await asyncio.wait(waits, timeout=limit)
        for w in pending:
            w.cancel()
        left = [r for r in recs if not r.gone.is_set()]
        if left:
            log.warning(
                "engine close: %d request(s) still on a worker after %.1f s (%s); abandoning them to the "
                "executor, which releases their outputs as they arrive",
                len(left),
                limit,
                [r.request_id for r in left][:10],
            )
            for r in left:
                if r.driver is not None:
                    r.driver.cancel()  # cancels the executor futures it awaits: abandoned (F9)
            # A driver stuck in a host stage returns from its cancel at once (the
            # stage's thread is abandoned): this gather does not wait for the stage.
            await asyncio.gather(*(r.driver for r in left if r.driver is not None), return_exceptions=True)

    # ---------------------------------------------------------------- requests

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

    async def generate(self, request: DiffusionRequest, *, deadlines: Deadlines | None = None) -> GenerationResult:
        """Run ``request`` to its finished, post-processed result.

        Raises what ended it: ``RequestAborted`` (``abort``), ``EngineClosed``,
        ``EngineOverloaded`` (refused at the call), ``InvalidRequest`` (the model's
        ``validate_request`` refused its parameters, at the call, before it queues),
        ``PostProcessFailed``, or the executor's typed error (``RpcFailed``,
        ``ComputeTimeout``, ``OutputTimeout``, ``RemoteError``, ``WorkerDied``, ...).
        ``deadlines``: this request's compute and output deadlines instead of the
        executor's.  Cancelling the calling task aborts the request and releases
        everything of it.  Request ids are unique among the requests in the engine
        (``UsageError`` otherwise); an aborted request's id is free again once
        ``abort(..., wait=True)`` returned.
        """
        rec = self._admit(request, deadlines, "generate", streaming=False)
        try:
            # Shielded: cancelling the caller must not cancel the outcome future, only abort.
            return await asyncio.shield(rec.result)
        except asyncio.CancelledError:
            if not rec.result.done():
                self._end_early(rec, SE.CANCEL)
            raise

    def _admit(
        self, request: DiffusionRequest, deadlines: Deadlines | None, what: str, *, streaming: bool
    ) -> _Request:
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
        try:
            self.executor.validate_request(request)
            self._scheduler.add(rid)
        except (EngineOverloaded, UsageError):
            self._counts["rejected"] += 1
            raise
        machine = stage_machine(rid, self._trace_stage)
        rec = _Request(request, deadlines, self._loop.create_future(), time.monotonic(), machine, streaming=streaming)
        rec.result.add_done_callback(_retrieve)
        rec.result.add_done_callback(lambda _: rec.changed.set())
        self._records[rid] = rec
        self._wake.set()
        return rec

    async def generate_stream(
        self, request: DiffusionRequest, *, deadlines: Deadlines | None = None
    ) -> AsyncGenerator[GenerationChunk | GenerationResult, None]:
        """Run ``request`` as a stream: yield a ``GenerationChunk`` per intermediate output
        its model emits (``omni_async.worker.emit_chunk``; ``TinyDiffusionWorker``:
        ``preview_every``), in order, then its ``GenerationResult``.

        Each chunk is post-processed like the final result (the pipeline's host stage, or
        owned copies) when the caller asks for it; until then it waits in the executor's
        shared memory, within the budget of held outputs (a slow consumer slows the
        worker, nothing is dropped).  Raises what ended the request, as ``generate``
        does, or the typed error of a chunk that failed (which aborts the request).
        Closing the iterator early (``await it.aclose()``; ``async with
        contextlib.aclosing(...)`` around an ``async for`` that may ``break``) or
        cancelling the consuming task aborts the request and releases everything of it;
        ``aclose`` returns once nothing of it remains (bounded by ``close_timeout``).
        """
        if not self._async_output:
            raise UsageError("generate_stream: streaming takes the asynchronous output path (async_output=True)")
        rec = self._admit(request, deadlines, "generate_stream", streaming=True)
        done = False
        try:
            while rec.stream is None and not rec.result.done() and not rec.ended():
                rec.changed.clear()
                if rec.stream is None and not rec.result.done() and not rec.ended():
                    await rec.changed.wait()
            while (chunk := await self._next_chunk(rec)) is not None:
                yield await self._chunk_item(rec, chunk)
            result = await asyncio.shield(rec.result)
            if rec.error is not None:
                raise rec.error  # ended (aborted, closed) after its result was set: that end counts
            done = True
            # The consumer has its result: the driver may forget the request (FINISHED).
            self._consumed(rec)
            yield result
        except GeneratorExit:
            # aclose(): abort what is left, and return once nothing of it remains.
            self._stop_stream(rec)
            try:
                await asyncio.wait_for(asyncio.shield(rec.gone.wait()), self._close_timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                log.warning("engine: request %r still releasing after its stream closed", rec.request_id)
            raise
        except asyncio.CancelledError:
            self._stop_stream(rec)
            raise
        except BaseException as exc:
            if not done:
                # A chunk failed: the stream ends with its error, and the request with it.
                self._end_early(rec, SE.FAIL, error=exc)
                self._stop_stream(rec)
            raise
        finally:
            self._consumed(rec)

    def _consumed(self, rec: _Request) -> None:
        rec.consumed = True
        rec.poke.set()

    def _stop_stream(self, rec: _Request) -> None:
        """The consumer of ``rec``'s stream went away (or failed): abort what is left."""
        self._end_early(rec, SE.CANCEL)
        self._close_stream(rec)
        self._consumed(rec)

    async def _next_chunk(self, rec: _Request) -> OutputChunk | None:
        """The next chunk of ``rec``'s stream, claimed; None at its end (or the request's)."""
        stream = rec.stream
        while stream is not None and not rec.ended() and rec.close is None:
            rec.changed.clear()
            # A short look under the executor's lock (as wait_output_ready), not a wait.
            chunk = stream.poll()
            if chunk is not None:
                rec.taking += 1
                return chunk
            if stream.finished:
                return None
            await rec.changed.wait()
        return None

    async def _chunk_item(self, rec: _Request, chunk: OutputChunk) -> GenerationChunk:
        """``chunk``'s output, awaited and post-processed (then released), as a ``GenerationChunk``."""
        try:
            try:
                output = await asyncio.wrap_future(chunk.output)
            except asyncio.CancelledError:
                self._discard_chunk(chunk)
                raise
            arrived = time.monotonic()
            assert self._post is not None and self._loop is not None
            self._postprocessing += 1
            try:
                metrics = dict(output.metrics)
                value, _, post_s = await self._loop.run_in_executor(
                    self._post, functools.partial(self._postprocess, rec.request_id, output, self._host, True)
                )
            finally:
                self._postprocessing -= 1
                del output
        finally:
            rec.taking -= 1
            rec.poke.set()
        self._chunks += 1
        return GenerationChunk(rec.request_id, chunk.seq, value, metrics, self.pipeline, arrived, post_s)

    def _discard_chunk(self, chunk: OutputChunk) -> None:
        """A chunk taken but not consumed (its consumer was cancelled): give it back."""
        fut = chunk.output
        if not fut.cancel() and fut.done() and not fut.cancelled() and fut.exception() is None:
            assert self._post is not None
            self._post.submit(self._release_quietly, fut.result())

    def _close_stream(self, rec: _Request) -> None:
        """Close ``rec``'s stream on the control thread (once): the chunks not taken are dropped."""
        if rec.stream is None or rec.close is not None:
            rec.changed.set()
            return
        assert self._loop is not None and self._control is not None
        rec.close = self._loop.run_in_executor(self._control, rec.stream.close)
        rec.changed.set()
        rec.poke.set()

    async def _finish_stream(self, rec: _Request) -> None:
        """Before the driver forgets a streaming request: its consumer is done with the
        stream (or the stream is closed and the consumer holds no chunk of it), and what
        a close dropped is gone."""
        if rec.stream is None:
            return
        while not rec.consumed and not (rec.close is not None and rec.taking == 0):
            rec.poke.clear()
            await rec.poke.wait()
        if rec.close is not None:
            try:
                ack = await rec.close
                await asyncio.wrap_future(ack)
            except Exception as exc:  # the executor shut down meanwhile: that released it
                log.debug("engine: closing the stream of %r: %s", rec.request_id, exc)

    async def abort(self, request_ids: str | Iterable[str], *, wait: bool = False) -> None:
        """Abort requests by id, at whatever stage they are (unknown or finished ids are
        ignored).  Their ``generate`` raises ``RequestAborted`` at once.  ``wait=True``
        returns only when nothing of them remains on any worker or in the executor (what
        a caller needs before swapping model weights).  ``request_ids``: one id, or an
        iterable of ids (``UsageError`` for anything else, before anything is aborted).
        The abort never waits behind another request's send: cancels and drops travel
        on the engine's control thread."""
        if isinstance(request_ids, str):
            ids = [request_ids]
        elif isinstance(request_ids, (bytes, bytearray, Mapping)) or not isinstance(request_ids, Iterable):
            raise UsageError(
                f"abort: request_ids must be a request id (str) or an iterable of them, got "
                f"{type(request_ids).__name__} {request_ids!r:.60}"
            )
        else:
            ids = list(request_ids)
        for rid in ids:
            if not isinstance(rid, str):
                raise UsageError(f"abort: request ids must be str, got {type(rid).__name__} {rid!r:.60}")
        self._check_open("abort")
        recs = [self._records[rid] for rid in ids if rid in self._records]
        for rec in recs:
            self._end_early(rec, SE.ABORT)
        if wait:
            await asyncio.gather(*(r.gone.wait() for r in recs))

    def _end_early(self, rec: _Request, event: StageEvent, *, error: BaseException | None = None) -> None:
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

    def _fire(self, rec: _Request, event: StageEvent) -> None:
        """Move ``rec``'s machine; the step that decides its end counts its outcome, so
        every request is counted exactly once (``metrics().requests``)."""
        was_ended = rec.ended()
        rec.machine.fire(event)
        if not was_ended and rec.ended():
            self._counts[OUTCOME_OF.get(rec.stage, rec.stage).value] += 1

    def _fail(self, rec: _Request, error: BaseException) -> None:
        self._end_early(rec, SE.FAIL, error=error)

    def _forget(self, rec: _Request) -> None:
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

    # ------------------------------------------------------------ executor calls

    async def _on_io(self, fn: Callable[[], T]) -> T:
        assert self._loop is not None and self._io is not None
        return await self._loop.run_in_executor(self._io, fn)

    def _cancel_forward(self, rec: _Request) -> None:
        """Ask the workers to stop ``rec``'s forward (fire and forget: the driver awaits
        the execute future, which fails with ``RequestAborted`` or resolves anyway).  On
        the control thread: never behind a send that a full pipe holds up."""
        assert self._loop is not None and self._control is not None
        ex = self.executor
        fut = self._loop.run_in_executor(self._control, functools.partial(ex.cancel_requests, [rec.request_id]))
        fut.add_done_callback(functools.partial(self._log_io_error, "cancel_requests", rec.request_id))

    def _drop_output(self, rec: _Request) -> None:
        assert self._loop is not None and self._control is not None and rec.output_id is not None
        if rec.drop is None:
            rec.drop = self._loop.run_in_executor(
                self._control, functools.partial(self.executor.drop_output, rec.output_id)
            )

    @staticmethod
    def _log_io_error(what: str, rid: str, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and (exc := fut.exception()) is not None:
            log.debug("engine: %s for request %r failed: %s", what, rid, exc)

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        assert self._scheduler is not None and self._loop is not None
        while True:
            self._wake.clear()
            for rid in self._scheduler.schedule(time.monotonic()):
                rec = self._records[rid]
                self._fire(rec, SE.ADMIT)
                rec.driver = self._loop.create_task(self._drive(rec), name=f"omni-engine-request-{rid}")
            await self._wake.wait()

    def _on_loop_end(self, task: asyncio.Task[None]) -> None:
        """The loop task ended: at close, by design; otherwise it died (a bug of ours).
        Nobody would admit the waiting requests any more: fail them with ``EngineDead``
        (the ones already sent go on with their drivers)."""
        if task.cancelled() or self._life.state is not ES.RUNNING:
            return
        err = self._dead()
        log.error("engine: %s", err)
        for rec in list(self._records.values()):
            if rec.stage is SS.WAITING:
                self._fail(rec, err)  # WAITING -> FAILED: forgotten at once

    async def _drive(self, rec: _Request) -> None:
        try:
            await self._walk(rec)
            await self._finish_stream(rec)
        except asyncio.CancelledError:
            self._end_early(rec, SE.CLOSE)
            raise
        except BaseException as exc:  # a bug of ours: fail the caller, never hang it
            log.exception("engine: the driver of request %r failed", rec.request_id)
            self._fail(rec, exc)
        finally:
            if not rec.ended() and rec.stage is not SS.RESOLVED:
                self._fail(rec, AssertionError(f"request {rec.request_id!r}: its driver ended in stage {rec.stage}"))
            self._forget(rec)

    async def _walk(self, rec: _Request) -> None:
        ex = self.executor
        rid = rec.request_id
        if rec.ended():
            return  # aborted before it was sent: it never reaches a worker
        if not self._async_output:
            await self._walk_sync(rec)
            return
        rec.submitted_at = time.monotonic()
        try:
            if rec.streaming:
                stream = await self._on_io(functools.partial(ex.submit_stream, rec.request, deadlines=rec.deadlines))
                rec.stream = stream
                loop = self._loop
                assert loop is not None

                def wake() -> None:  # on the pump's thread: only schedule
                    try:
                        loop.call_soon_threadsafe(rec.changed.set)
                    except RuntimeError:  # the loop closed: nobody consumes the stream any more
                        pass

                stream.add_listener(wake)
                rec.changed.set()
                execute = stream.result
                output_future: Future[DiffusionOutput] | None = None
            else:
                # One handle: its COMPUTE_DONE, and its output, claimed by the pump as it
                # dispatches that COMPUTE_DONE (no id travels back down to claim it).
                handle = await self._on_io(functools.partial(ex.submit_handle, rec.request, deadlines=rec.deadlines))
                execute, output_future = handle.computed, handle.output
        except Exception as exc:
            self._fail(rec, exc)
            return
        self._fire(rec, SE.SENT)
        if rec.ended():
            self._cancel_forward(rec)
            self._close_stream(rec)
        try:
            announced: RunnerOutput = await asyncio.wrap_future(execute)
        except Exception as exc:
            self._fail(rec, exc)
            return
        rec.compute_done_at = time.monotonic()
        assert self._scheduler is not None
        self._scheduler.compute_done(rid)
        self._wake.set()  # the running slot is free: admit the next request now
        rec.output_id = announced.async_output_id
        if rec.output_id is None:
            self._fail(rec, UsageError(f"request {rid!r}: the executor answered without an output id"))
            return
        self._fire(rec, SE.COMPUTE_DONE)
        if rec.ended():
            self._drop_output(rec)
            await self._await_drop(rec)
            return
        ready = ex.wait_output_ready(rec.output_id) if output_future is None else output_future
        try:
            output = await asyncio.wrap_future(ready)
        except Exception as exc:
            if rec.drop is not None:
                await self._await_drop(rec)
            elif not isinstance(exc, OutputDropped) or not rec.ended():
                self._fail(rec, exc)
            return
        rec.output_ready_at = time.monotonic()
        await self._finish(rec, output)

    async def _walk_sync(self, rec: _Request) -> None:
        """``async_output=False``: the request's call on the synchronous output path, on
        an ``omni-engine-sync`` thread; COMPUTE_DONE and the output arrive together."""
        ex = self.executor
        rid = rec.request_id
        assert self._loop is not None and self._sync is not None and self._scheduler is not None
        self._fire(rec, SE.SENT)  # the call is in flight on its thread
        rec.submitted_at = time.monotonic()
        call = self._loop.run_in_executor(
            self._sync, functools.partial(ex.execute_request, rec.request, sync_output=True)
        )
        try:
            # Shielded: a cancelled driver cannot stop the call; its output is released
            # when it arrives (below, or by _release_late).
            announced: RunnerOutput = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._release_late)
            raise
        except Exception as exc:
            self._fail(rec, exc)
            return
        rec.compute_done_at = rec.output_ready_at = time.monotonic()
        self._scheduler.compute_done(rid)
        self._wake.set()
        self._fire(rec, SE.COMPUTE_DONE)
        output = announced.result
        if output is None:
            self._fail(rec, UsageError(f"request {rid!r}: the executor's synchronous answer carries no output"))
            return
        await self._finish(rec, output)

    def _release_late(self, call: asyncio.Future[RunnerOutput]) -> None:
        """The synchronous call of a driver that was cancelled ended: release its output."""
        if call.cancelled() or call.exception() is not None:
            return
        output = call.result().result
        if output is not None and self._post is not None:
            try:
                self._post.submit(self._release_quietly, output)
            except RuntimeError:  # the engine's threads are gone: release here
                self._release_quietly(output)

    async def _finish(self, rec: _Request, output: DiffusionOutput) -> None:
        """Post-process ``output`` (the request's, here now) and hand the caller its result."""
        rid = rec.request_id
        assert self._scheduler is not None
        nbytes = _held_bytes(output.metrics)
        if nbytes:
            self._scheduler.observe_output(int(nbytes))
        self._fire(rec, SE.OUTPUT)
        host = None if rec.ended() else self._host  # aborted: only release
        self._postprocessing += 1
        try:
            assert self._post is not None and self._loop is not None
            try:
                value, post_at, post_s = await self._loop.run_in_executor(
                    self._post, functools.partial(self._postprocess, rid, output, host, not rec.ended())
                )
            finally:
                metrics = dict(output.metrics)
                del output  # the release took its views back; nothing of it is kept here
        except PostProcessFailed as exc:
            self._fail(rec, exc)
            return
        finally:
            self._postprocessing -= 1
        if rec.drop is not None:  # an abort raced the output's arrival: its drop found nothing left
            await self._await_drop(rec)
        if rec.ended() or rec.result.done():
            return
        finished = time.monotonic()
        pack_s = metrics.get("pack_s")
        timings = RequestTimings(
            queued=rec.submitted_at - rec.enqueued_at,
            forward=rec.compute_done_at - rec.submitted_at,
            pack=pack_s,
            transfer_wait=rec.output_ready_at - rec.compute_done_at,
            postprocess=post_s,
            total=finished - rec.enqueued_at,
            enqueued_at=rec.enqueued_at,
            submitted_at=rec.submitted_at,
            compute_done_at=rec.compute_done_at,
            output_ready_at=rec.output_ready_at,
            finished_at=finished,
            postprocess_started_at=post_at,
            forward_started_at=metrics.get(FORWARD_STARTED_AT),
            forward_ended_at=metrics.get(FORWARD_ENDED_AT),
            pack_started_at=metrics.get(PACK_STARTED_AT),
            pack_ended_at=metrics.get(PACK_ENDED_AT),
        )
        for stage in STAGES:
            seconds = getattr(timings, stage)
            if seconds is not None:
                self._latency[stage].observe(seconds)
        if pack_s is not None:
            self._pack_s_total += pack_s
            self._pack_bytes_total += _held_bytes(metrics) + metrics.get("pack_inline_bytes", 0.0)
        # A plain request is FINISHED here; a stream's consumer still decides (RESOLVED).
        self._fire(rec, SE.STREAM_RESULT if rec.streaming else SE.RESULT)
        rec.result.set_result(GenerationResult(rid, value, timings, metrics, self.pipeline))

    async def _await_drop(self, rec: _Request) -> None:
        """Until the executor acknowledged the drop of ``rec``'s output (nothing of it left)."""
        assert rec.drop is not None
        try:
            done = await rec.drop
            await asyncio.wrap_future(done)
        except Exception as exc:  # the executor shut down meanwhile: that released it
            log.debug("engine: dropping the output of %r: %s", rec.request_id, exc)

    def _postprocess(
        self, rid: str, output: DiffusionOutput, host: HostStage | None, wanted: bool
    ) -> tuple[Any, float, float]:
        """On an ``omni-postprocess`` thread: the host stage (or an owned copy), then the
        release; the value, when it started (``time.monotonic()``) and its seconds."""
        with self._host_lock:
            self._host_running[rid] = self._host_running.get(rid, 0) + 1
        try:
            return self._run_host_stage(rid, output, host, wanted)
        finally:
            with self._host_lock:
                left = self._host_running.pop(rid) - 1
                if left:
                    self._host_running[rid] = left

    def _run_host_stage(
        self, rid: str, output: DiffusionOutput, host: HostStage | None, wanted: bool
    ) -> tuple[Any, float, float]:
        started = time.monotonic()
        t0 = time.perf_counter()
        value: Any = None
        try:
            if wanted:
                value = host(output) if host is not None else owned_copy(output.output)
        except Exception as exc:
            self._release_quietly(output)
            # The traceback's frames may hold views of the segment: keep the text, free them.
            text = "".join(traceback.format_exception(exc))
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__)
            raise PostProcessFailed(
                f"request {rid!r}: the host stage of pipeline {self.pipeline!r} raised "
                f"{type(exc).__name__}: {exc}\n--- traceback ---\n{text}",
                request_id=rid,
                pipeline=self.pipeline,
            ) from exc
        try:
            self.executor.release_output(output)
        except OutputStillViewed as exc:
            del value  # dropping the views gives the segment back
            raise PostProcessFailed(
                f"request {rid!r}: the result of pipeline {self.pipeline!r}'s host stage still views the output's "
                f"shared memory ({exc.views} view(s) alive); a result must own its memory: copy what it keeps "
                "(tensor.clone(), numpy.array(a, copy=True), bytes(...))",
                request_id=rid,
                pipeline=self.pipeline,
            ) from exc
        except Exception as exc:  # the pool closed under us (executor shut down): nothing to give back
            log.debug("engine: releasing the output of %r: %s", rid, exc)
        return value, started, time.perf_counter() - t0

    def _release_quietly(self, output: DiffusionOutput) -> None:
        try:
            self.executor.release_output(output)
        except Exception as exc:  # views of a failed stage: they go back when its frames go
            log.debug("engine: releasing %s after a failed host stage: %s", output.async_output_id, exc)

    # ---------------------------------------------------------- health, metrics

    def _dead(self) -> EngineDead:
        task = self._loop_task
        cause = None if task is None or task.cancelled() else task.exception()
        err = EngineDead(f"the engine's loop task ended ({cause!r}); close the engine and build a new one")
        err.__cause__ = cause
        return err

    def check_health(self) -> None:
        """Raise if the engine cannot make progress: closed (``EngineClosed``), its loop
        task ended (``EngineDead``), or the executor's pump or a worker is dead (the
        executor's ``check_health``: ``WorkerDied``, ``ExecutorShutdown``, ...)."""
        state = self._life.state
        if state in (ES.CLOSING, ES.CLOSED, ES.FAILED):
            raise EngineClosed("the engine is closed" if state is not ES.FAILED else "the engine failed to start")
        if state is not ES.RUNNING:
            raise EngineNotStarted("the engine is not started")
        task = self._loop_task
        if task is not None and task.done():
            raise self._dead()
        self.executor.check_health()

    def metrics(self) -> EngineMetrics:
        """A snapshot of the engine's counters and the executor's ``metrics()``.

        Any thread: from another thread than the engine's event loop (a Prometheus
        scrape, the synchronous facade) the snapshot is taken on the loop."""
        loop = self._loop
        if loop is not None and self._loop_thread != threading.get_ident() and loop.is_running():
            done: Future[EngineMetrics] = Future()

            def take() -> None:
                try:
                    done.set_result(self._snapshot())
                except BaseException as exc:
                    done.set_exception(exc)

            loop.call_soon_threadsafe(take)
            return done.result(timeout=10.0)
        return self._snapshot()

    def _snapshot(self) -> EngineMetrics:
        s = self._scheduler
        now = time.monotonic()
        executor: ExecutorMetrics | None = None
        if self._executor is not None:
            try:
                executor = self._executor.metrics()
            except OmniAsyncError as exc:  # shut down: the engine's numbers still count
                log.debug("engine metrics: the executor's are unavailable: %s", exc)
        task = self._loop_task
        pump_alive = executor_healthy = False
        if self._executor is not None:
            pump_alive = self._executor.pump.healthy()
            try:
                self._executor.check_health()
                executor_healthy = True
            except OmniAsyncError:
                pass
        return EngineMetrics(
            requests=dict(self._counts),
            waiting=0 if s is None else s.waiting,
            running=0 if s is None else s.running,
            holding=0 if s is None else s.holding,
            postprocessing=self._postprocessing,
            in_flight_limit=None if s is None else s.in_flight_limit,
            budget_waits=0 if s is None else s.stats.budget_waits,
            budget_wait_s=0.0 if s is None else s.budget_wait_s(now),
            largest_output_bytes=0 if s is None else s.largest_output,
            pack_s_total=self._pack_s_total,
            pack_bytes_total=self._pack_bytes_total,
            latency={stage: h.snapshot() for stage, h in self._latency.items()},
            loop_alive=task is not None and not task.done(),
            pump_alive=pump_alive,
            executor_healthy=executor_healthy,
            executor=executor,
            chunks=self._chunks,
        )

    def prometheus_registry(self) -> CollectorRegistry:
        """A ``prometheus_client.CollectorRegistry`` of this engine alone (not the global
        one), read at each scrape; needs the ``metrics`` extra (``prometheus-client``)."""
        if self._prometheus is None:
            from omni_async.engine.prometheus import engine_registry

            self._prometheus = engine_registry(self.metrics)
        return self._prometheus

    def stage_of(self, request_id: str) -> StageState | None:
        """The stage of ``request_id`` in the engine (None: unknown, or over and gone)."""
        rec = self._records.get(request_id)
        return None if rec is None else rec.stage

    def phase_of(self, request_id: str) -> SchedulerPhase | None:
        """Where the scheduler has ``request_id`` (None: unknown or finished)."""
        return None if self._scheduler is None else self._scheduler.phase(request_id)

    def __len__(self) -> int:
        """Requests in the engine: waiting, running, or holding an output."""
        return len(self._records)
