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

1. **send** (SENT): ``executor.submit`` on the ``omni-engine-send`` thread (it
   writes to every worker's pipe, which can block while a worker is busy).  Cancels,
   drops and stream closes go on ``omni-engine-control``, so an abort never waits
   behind another request's send.
2. **forward** (COMPUTE_DONE): await the handle's ``computed``.  The running slot is
   freed at once and the loop admits the next request, so with ``max_running >= 2``
   one is always queued on the worker behind the running forward (the default, 3,
   keeps two: the engine has a whole forward's time to send the next one).
3. **output** (OUTPUT): await the handle's ``output``, which the pump claimed for it as
   it dispatched the COMPUTE_DONE (a stream's too): no output id travels back down.
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
* **abort after COMPUTE_DONE**: the handle's ``drop()``: a packing that has not started is
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
``executor.submit(..., stream=True)`` and walks it as above; the caller's async iterator takes the
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

Collaborators, each a class that owns its state (the engine owns them all and hands
each what it needs; none calls back up into the engine):

* ``EngineConfig`` (``config``): every setting, validated when made;
* ``Lifecycle`` (``lifecycle``): the start/close machine and its tasks;
* ``Admission`` (``admission``): the scheduler (queue, running slots, budget of held
  outputs, batches), the requests' records and outcome counts, the admitting loop;
* ``RequestDriver`` (``driver``): one request's walk through its stage machine, with
  ``Sender`` (``sending``: alone or in batches, through handles), ``RequestEnds``
  (``ends``: aborts, cancels, closes and their clean-up) and ``StreamReader``
  (``streaming``: a stream's consumer);
* ``PostProcessor`` (``postprocessor``): host stages and the encoder pool;
* ``OutputFiles`` and ``SegmentLeases`` (``sinks``): the files written for requests with
  ``sink="file"`` (``files``) and the outputs lent with ``sink="segment"``, both handed
  to the post-processor; their sweepers delete and release what expires, and ``close``
  removes every file and releases every lease;
* ``EngineThreads`` (``threads``): the send, control and sync threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Self, TypeVar, Unpack

from omni_async.core.config import Deadlines
from omni_async.core.engine_states import EngineState, StageEvent, StageState
from omni_async.core.engine_trace import trace_observers
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.admission import Admission
from omni_async.engine.config import EngineConfig, EngineOptions, engine_config
from omni_async.engine.driver import RequestDriver
from omni_async.engine.encoders import VideoBytes
from omni_async.engine.ends import RequestEnds
from omni_async.engine.errors import EngineClosed, EngineDead, EngineNotStarted
from omni_async.engine.lifecycle import Lifecycle
from omni_async.engine.metrics import EngineMetrics, GenerationChunk, GenerationResult
from omni_async.engine.postprocessor import PostProcessor
from omni_async.engine.record import RequestRecord
from omni_async.engine.scheduler import SchedulerPhase
from omni_async.engine.sending import Sender
from omni_async.engine.sinks import OutputFiles, SegmentLeases, check_sink_served
from omni_async.engine.snapshot import engine_snapshot
from omni_async.engine.streaming import StreamReader
from omni_async.engine.threads import EngineThreads
from omni_async.engine.video import VideoEncode
from omni_async.executor.api import DiffusionExecutor

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["AsyncDiffusionEngine"]

# The engine's one logger, whichever of its modules logs: a user's logging set-up for
# ``omni_async.engine.engine`` sees all of it.
log = logging.getLogger("omni_async.engine.engine")

#: An item of a request's iterator before its result: a stream's chunk, a video's bytes.
_Item = TypeVar("_Item", GenerationChunk, VideoBytes)

SS = StageState
SE = StageEvent
ES = EngineState


class AsyncDiffusionEngine:
    """An asyncio engine over a ``DiffusionExecutor`` (see the module docstring); its
    settings are an ``EngineConfig`` (``config=``) or that class's fields as keyword
    arguments (``EngineConfig``'s docstring says what each does).

    Use on one event loop: ``async with engine:``, or ``await engine.start()`` ...
    ``await engine.close()``.  ``from_factory`` builds an engine that creates its
    executor at ``start`` and shuts it down at ``close`` (both off the event loop).
    """

    def __init__(
        self, executor: DiffusionExecutor, *, config: EngineConfig | None = None, **options: Unpack[EngineOptions]
    ) -> None:
        """``config``, or its fields as keyword arguments (``EngineConfig``)."""
        if not isinstance(executor, DiffusionExecutor):
            raise UsageError(f"executor must be a DiffusionExecutor, got {type(executor).__name__} {executor!r:.80}")
        self._setup(executor, None, engine_config(config, options, "AsyncDiffusionEngine"))

    @classmethod
    def from_factory(
        cls,
        factory: Callable[[], DiffusionExecutor],
        *,
        config: EngineConfig | None = None,
        **options: Unpack[EngineOptions],
    ) -> AsyncDiffusionEngine:
        """An engine that owns its executor: ``start`` calls ``factory()`` and ``close``
        shuts the executor down, both on a worker thread (the executor's constructor and
        shutdown block: processes start and stop)."""
        if not callable(factory):
            raise UsageError(f"factory must be a callable returning a DiffusionExecutor, got {factory!r:.80}")
        engine = cls.__new__(cls)
        engine._setup(None, factory, engine_config(config, options, "from_factory"))
        return engine

    def _setup(
        self, executor: DiffusionExecutor | None, factory: Callable[[], DiffusionExecutor] | None, config: EngineConfig
    ) -> None:
        self.config = config
        self._executor = executor
        self._factory = factory
        # With a tracer, every step of the machines is recorded (EngineFire, StageFire).
        trace_life, trace_stage = trace_observers(config.tracer)
        self._life = Lifecycle(f"engine-{id(self):x}", trace_life)
        self._files = OutputFiles(config.output_dir, config.output_ttl_s)
        self._leases = SegmentLeases(config.output_ttl_s)
        self._post = PostProcessor(config, self._files, self._leases)  # checks the pipeline's name now
        self._admission = Admission(config, trace_stage)
        # Built at start, once the executor is known.
        self._threads: EngineThreads | None = None
        self._ends: RequestEnds | None = None
        self._streams: StreamReader | None = None
        self._driver: RequestDriver | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._prometheus: CollectorRegistry | None = None

    @property
    def executor(self) -> DiffusionExecutor:
        """The executor (for an engine from a factory: once ``start`` has built it)."""
        if self._executor is None:
            raise EngineNotStarted("the engine builds its executor at start(); start it first")
        return self._executor

    @property
    def pipeline(self) -> str | None:
        return self.config.pipeline

    @property
    def files(self) -> OutputFiles:
        """The files written for requests with ``sink="file"`` (``get``, ``delete``)."""
        return self._files

    # ---------------------------------------------------------------- lifecycle

    @property
    def close_timeout(self) -> float:
        """The default bound of ``close`` (and of a stream's ``aclose``), in seconds."""
        return self.config.close_timeout

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
        await self._life.start(self._start_up)

    async def _start_up(self) -> None:
        cfg = self.config
        try:
            if self._executor is None:
                assert self._factory is not None
                # The factory runs to its end on its thread, whatever happens here.
                built = await asyncio.to_thread(self._factory)
                if not isinstance(built, DiffusionExecutor):
                    raise UsageError(f"the executor factory returned {type(built).__name__}, not a DiffusionExecutor")
                self._executor = built
            self._life.check_start_wanted()
            await asyncio.to_thread(self._files.open)  # makes its directory: file I/O, off the loop
            ex = self._executor
            if ex.step_mode and cfg.async_output:
                raise UsageError(
                    "AsyncDiffusionEngine needs an executor in request mode (step_mode=False): it overlaps each "
                    "output's copy with the next forward (a step-mode executor serves only the synchronous "
                    "baseline, async_output=False)"
                )
            budget = ex.budget
            self._life.check_start_wanted()
        except BaseException:
            # What the start built goes before the lifecycle says FAILED: a failed start
            # never leaves a live executor behind, nor its output directory.
            await asyncio.to_thread(self._files.close)
            if self._factory is not None and self._executor is not None:
                await asyncio.to_thread(self._executor.shutdown, "the engine failed to start")
            raise
        loop = asyncio.get_running_loop()
        admission = self._admission
        admission.open(budget, validate=check_sink_served(ex), post_of=self._post.post_of, batch_key=ex.batch_key)
        self._post.start(loop, ex.release_output)
        leases = self._leases

        def lent_changed() -> None:  # any thread: the scheduler counts the leases on the loop
            loop.call_soon_threadsafe(lambda: admission.set_lent(leases.held))

        leases.open(ex.release_output, lent_changed)
        self._threads = threads = EngineThreads(loop, sync_threads=0 if cfg.async_output else cfg.running_slots)
        self._ends = ends = RequestEnds(self._admission, threads, ex)
        self._streams = streams = StreamReader(loop, ends, self._post)
        sender = Sender(ex, threads, ends, streams, self._post, async_output=cfg.async_output)
        self._driver = RequestDriver(
            ex, self._admission, threads, ends, sender, streams, self._post, async_output=cfg.async_output
        )
        self._loop_task = loop.create_task(self._admission.run(self._driver.start), name="omni-engine-loop")
        self._loop_task.add_done_callback(self._on_loop_end)

    def _on_loop_end(self, task: asyncio.Task[None]) -> None:
        """The loop task ended: at close, by design; otherwise it died (a bug of ours).
        Nobody would admit the waiting requests any more: fail them with ``EngineDead``
        (the ones already sent go on with their drivers)."""
        if task.cancelled() or self._life.state is not ES.RUNNING:
            return
        err = self._dead()
        log.error("engine: %s", err)
        assert self._ends is not None
        for rec in list(self._admission.records.values()):
            if rec.stage is SS.WAITING:
                self._ends.fail(rec, err)  # WAITING -> FAILED: forgotten at once

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

        ``timeout`` (default: the config's ``close_timeout``) bounds all of it: the
        requests' release, the executor's shutdown (cancel, then terminate, each rank in
        parallel) and the host stages, which are abandoned with a warning when they do
        not return in time (their outputs are released when they do).
        """
        await self._life.close(self.config.close_timeout if timeout is None else timeout, self._shut_down)

    async def _shut_down(self, deadline: float, started: bool) -> None:
        try:
            # The lent outputs go back first: the executor's shutdown must find them released.
            await asyncio.to_thread(self._leases.close)
            if started and self._ends is not None:  # (a start a close stopped built nothing to release)
                await self._release_everything(deadline)
        finally:
            # Whatever ended the engine: no encoder process outlives it, no file it wrote.
            await self._post.close_encoders(max(0.1, deadline - time.monotonic()))
            await asyncio.to_thread(self._files.close)

    async def _release_everything(self, deadline: float) -> None:
        assert self._ends is not None and self._threads is not None
        for rec in list(self._admission.records.values()):
            self._ends.end_early(rec, SE.CLOSE)
        if self._factory is not None:
            # Shutting the executor down fails every pending future at once and
            # unlinks every segment: the drivers only have to notice.
            shutdown = functools.partial(
                self.executor.shutdown, "the engine closed", timeout=max(0.1, deadline - time.monotonic())
            )
            await asyncio.to_thread(shutdown)
        await self._admission.await_gone(deadline)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._threads.stop()
        self._post.stop()

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
        if running is not self._life.loop:
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
        self, request: DiffusionRequest, deadlines: Deadlines | None, what: str, streaming: bool
    ) -> RequestRecord:
        if not isinstance(request, DiffusionRequest):
            raise UsageError(f"{what}: request must be a DiffusionRequest, got {type(request).__name__}")
        if deadlines is not None and not isinstance(deadlines, Deadlines):
            raise UsageError(f"{what}: deadlines must be a Deadlines or None, got {type(deadlines).__name__}")
        self._check_open(what)
        assert self._life.loop is not None
        return self._admission.admit(request, deadlines, what, streaming=streaming, loop=self._life.loop)

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
        rec = self._admit(request, deadlines, "generate", False)
        try:
            # Shielded: cancelling the caller must not cancel the outcome future, only abort.
            return await asyncio.shield(rec.result)
        except asyncio.CancelledError:
            if not rec.result.done():
                assert self._ends is not None
                self._ends.end_early(rec, SE.CANCEL)
            raise

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
        if not self.config.async_output:
            raise UsageError("generate_stream: streaming takes the asynchronous output path (async_output=True)")
        rec = self._admit(request, deadlines, "generate_stream", True)
        async with contextlib.aclosing(self._deliver(rec, self._chunks(rec), "stream")) as items:
            async for item in items:
                yield item

    async def _chunks(self, rec: RequestRecord) -> AsyncGenerator[GenerationChunk, None]:
        """A stream's chunks, post-processed as the caller takes each (``generate_stream``)."""
        assert self._streams is not None
        streams = self._streams
        while rec.stream is None and not rec.result.done() and not rec.ended():
            rec.changed.clear()
            if rec.stream is None and not rec.result.done() and not rec.ended():
                await rec.changed.wait()
        while (chunk := await streams.next_chunk(rec)) is not None:
            yield await streams.item(rec, chunk)

    async def generate_video(
        self, request: DiffusionRequest, *, fragmented: bool = False, deadlines: Deadlines | None = None
    ) -> AsyncGenerator[VideoBytes | GenerationResult, None]:
        """Run ``request`` (``format="mp4"``) with its video encoded while it decodes: the
        frame parts its model emits (``omni_async.worker.emit_frames``) are encoded as they
        arrive, in one encoder process, the final output's frames last
        (``omni_async.engine.video``).  ``fragmented=True``: yields the fragmented MP4's
        bytes as they are made (``VideoBytes``, in order: the pieces are the file), for
        a client that takes them as they come; False: a plain MP4 (its index at the end,
        for a file).  Then yields the ``GenerationResult``, whose output is the whole MP4
        (``EncodedOutput``).  A model that emits no parts is encoded from its final output.
        Raises as ``generate_stream`` does (``EncodeFailed`` when the video could not be
        encoded, its encoder process killed included); closing the iterator early or
        cancelling the consuming task aborts the request and releases everything of it."""
        if not self.config.async_output:
            raise UsageError("generate_video: a video encoded while it decodes takes the asynchronous output path")
        if not isinstance(request, DiffusionRequest) or request.encoding is None or not request.encoding.is_video:
            got = getattr(request, "format", request)
            raise UsageError(f"generate_video: the request must ask for format='mp4', got {got!r:.80}")
        if not isinstance(fragmented, bool):
            raise UsageError(f"generate_video: fragmented must be a bool, got {fragmented!r:.80}")
        rec = self._admit(request, deadlines, "generate_video", True)
        assert self._streams is not None
        streams, post = self._streams, self._post
        video = rec.video = VideoEncode(
            rec.request_id,
            request.encoding,
            post.encoders,
            release=post.release_later,
            release_now=post.release_quietly,
            ended=lambda: rec.result.done() or rec.ended(),
            fragmented=fragmented,
            bound=self.config.video_bytes_in_flight,
        )
        rec.result.add_done_callback(lambda _: video.wake())
        pump = asyncio.get_running_loop().create_task(
            streams.feed_video(rec, video), name=f"omni-video-{rec.request_id}"
        )

        async def pieces() -> AsyncGenerator[VideoBytes, None]:
            while (piece := await video.next_piece()) is not None:
                yield piece
            if video.failure is not None and not rec.result.done():
                raise video.failure

        try:
            async with contextlib.aclosing(self._deliver(rec, pieces(), "video's iterator")) as items:
                async for item in items:
                    yield item
        finally:
            if not pump.done():
                pump.cancel()
            video.abandon()

    async def _deliver(
        self, rec: RequestRecord, items: AsyncGenerator[_Item, None], what: str
    ) -> AsyncGenerator[_Item | GenerationResult, None]:
        """What ``generate_stream`` and ``generate_video`` share: yield ``items`` (the
        request's chunks, or its video's bytes), then its ``GenerationResult``, with one
        ending for every way out.  Closed early (``aclose``): abort what is left of the
        request and return once nothing of it remains (bounded by ``close_timeout``);
        cancelled: abort it; an item failed: the request ends with that error."""
        assert self._streams is not None and self._ends is not None
        streams, ends = self._streams, self._ends
        done = False
        try:
            async with contextlib.aclosing(items) as each:
                async for item in each:
                    yield item
            result = await asyncio.shield(rec.result)
            if rec.error is not None:
                raise rec.error  # ended (aborted, closed) after its result was set: that end counts
            done = True
            # The consumer has its result: the driver may forget the request (FINISHED).
            streams.consumed(rec)
            yield result
        except GeneratorExit:
            streams.stop(rec)
            try:
                await asyncio.wait_for(asyncio.shield(rec.gone.wait()), self.config.close_timeout)
            except (TimeoutError, asyncio.CancelledError):
                log.warning("engine: request %r still releasing after its %s closed", rec.request_id, what)
            raise
        except asyncio.CancelledError:
            streams.stop(rec)
            raise
        except BaseException as exc:
            if not done:
                ends.end_early(rec, SE.FAIL, error=exc)
                streams.stop(rec)
            raise
        finally:
            streams.consumed(rec)

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
        records = self._admission.records
        recs = [records[rid] for rid in ids if rid in records]
        assert self._ends is not None
        for rec in recs:
            self._ends.end_early(rec, SE.ABORT)
        if wait:
            await asyncio.gather(*(r.gone.wait() for r in recs))

    # ---------------------------------------------------------- health, metrics

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
        loop = self._life.loop
        if loop is not None and self._life.loop_thread != threading.get_ident() and loop.is_running():
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
        return engine_snapshot(
            self._admission, self._post, self._driver, self._streams, self._executor, self._loop_task,
            self._files, self._leases,
        )  # fmt: skip

    def prometheus_registry(self) -> CollectorRegistry:
        """A ``prometheus_client.CollectorRegistry`` of this engine alone (not the global
        one), read at each scrape; needs the ``metrics`` extra (``prometheus-client``)."""
        if self._prometheus is None:
            from omni_async.engine.prometheus import engine_registry

            self._prometheus = engine_registry(self.metrics)
        return self._prometheus

    def stage_of(self, request_id: str) -> StageState | None:
        """The stage of ``request_id`` in the engine (None: unknown, or over and gone)."""
        rec = self._admission.records.get(request_id)
        return None if rec is None else rec.stage

    def phase_of(self, request_id: str) -> SchedulerPhase | None:
        """Where the scheduler has ``request_id`` (None: unknown or finished)."""
        return self._admission.phase_of(request_id)

    def __len__(self) -> int:
        """Requests in the engine: waiting, running, or holding an output."""
        return len(self._admission.records)
