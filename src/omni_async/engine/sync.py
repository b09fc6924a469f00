"""``DiffusionEngine``: the synchronous facade, for scripts and warm-up.

The same ``AsyncDiffusionEngine``, on an event loop of its own that runs on a
background thread (``omni-engine-thread``); each call hands a coroutine to that loop
and waits for it.  Any number of threads may call it at once (their requests run
concurrently, as concurrent ``generate`` calls do).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Self, TypeVar, Unpack

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.config import EngineConfig, EngineOptions, engine_config
from omni_async.engine.encoders import VideoBytes
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EngineClosed
from omni_async.engine.metrics import EngineMetrics, GenerationChunk, GenerationResult
from omni_async.engine.sinks import OutputFiles
from omni_async.executor.api import DiffusionExecutor

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["DiffusionEngine"]

T = TypeVar("T")


class DiffusionEngine:
    """A blocking engine: ``generate(request)`` returns the ``GenerationResult``.

    Takes an ``EngineConfig`` (``config=``) or its fields as keyword arguments, as
    ``AsyncDiffusionEngine`` does; ``from_factory`` builds one
    that owns its executor.  Started by the constructor; ``close()`` (or leaving the
    ``with`` block) stops it.
    """

    def __init__(
        self, executor: DiffusionExecutor, *, config: EngineConfig | None = None, **options: Unpack[EngineOptions]
    ) -> None:
        made = engine_config(config, options, "DiffusionEngine")  # refused here, before a thread starts
        self._start(lambda: AsyncDiffusionEngine(executor, config=made))

    @classmethod
    def from_factory(
        cls,
        factory: Callable[[], DiffusionExecutor],
        *,
        config: EngineConfig | None = None,
        **options: Unpack[EngineOptions],
    ) -> DiffusionEngine:
        """An engine that builds its executor with ``factory()`` and shuts it down at ``close``."""
        made = engine_config(config, options, "DiffusionEngine.from_factory")
        engine = cls.__new__(cls)
        engine._start(lambda: AsyncDiffusionEngine.from_factory(factory, config=made))
        return engine

    def _start(self, make: Callable[[], AsyncDiffusionEngine]) -> None:
        self._closed = False
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-engine-thread", daemon=True)
        self._thread.start()

        async def build() -> AsyncDiffusionEngine:
            engine = make()
            await engine.start()
            return engine

        try:
            self._engine = self._run(build())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def engine(self) -> AsyncDiffusionEngine:
        """The ``AsyncDiffusionEngine`` underneath (its coroutines run on this facade's loop)."""
        return self._engine

    @property
    def executor(self) -> DiffusionExecutor:
        return self._engine.executor

    @property
    def files(self) -> OutputFiles:
        """The files written for requests with ``sink="file"`` (thread-safe: any thread)."""
        return self._engine.files

    def _run(self, coro: Coroutine[object, None, T], timeout: float | None = None) -> T:
        if self._closed:
            coro.close()
            raise EngineClosed("the engine is closed")
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            # Our wait ended (timeout, Ctrl-C): cancelling the task aborts the request.
            fut.cancel()
            raise

    def generate(
        self, request: DiffusionRequest, *, deadlines: Deadlines | None = None, timeout: float | None = None
    ) -> GenerationResult:
        """Run ``request`` to its result (see ``AsyncDiffusionEngine.generate``).

        ``timeout``: how long this call waits; when it runs out the request is aborted,
        and ``TimeoutError`` (naming the request) is raised once nothing of it is left, so
        its id is free for a retry -- at once for a model that checks for cancellation
        between its steps, after its forward for one that does not (bounded by
        ``close_timeout``).
        """
        try:
            return self._run(self._engine.generate(request, deadlines=deadlines), timeout)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(request, timeout) from None

    def _timed_out(self, request: DiffusionRequest, timeout: float | None) -> TimeoutError:
        """Our wait for ``request`` ran out: the cancel of its task is on its way; return
        once nothing of it is left, so its id is free for a retry."""
        rid = request.request_id
        grace = self._engine.close_timeout
        try:
            self._run(self._engine.abort(rid, wait=True), grace)
        except concurrent.futures.TimeoutError:
            # A model that ignores cancellation runs its forward to its end.
            return TimeoutError(
                f"request {rid!r}: no result within {timeout} s; it was aborted, and is still being released "
                f"{grace} s later (does its model check cancel_requested()?): its id is free once it is gone"
            )
        except Exception as exc:  # the engine closed meanwhile
            return TimeoutError(f"request {rid!r}: no result within {timeout} s; aborting it failed: {exc}")
        return TimeoutError(f"request {rid!r}: no result within {timeout} s; it was aborted and released")

    def add_req_and_wait_for_response(
        self, request: DiffusionRequest, *, deadlines: Deadlines | None = None, timeout: float | None = None
    ) -> GenerationResult:
        """The seed's name for ``generate``."""
        return self.generate(request, deadlines=deadlines, timeout=timeout)

    def generate_stream(
        self, request: DiffusionRequest, *, deadlines: Deadlines | None = None, timeout: float | None = None
    ) -> Generator[GenerationChunk | GenerationResult, None, None]:
        """Run ``request`` as a stream (see ``AsyncDiffusionEngine.generate_stream``): an
        iterator of its ``GenerationChunk`` items, then its ``GenerationResult``.

        Closing the iterator before its end (``close()``, a ``with
        contextlib.closing(...)`` block left by ``break``, or the iterator being garbage
        collected) aborts the request and returns once nothing of it remains.
        ``timeout``: how long each item is waited for; when it runs out the request is
        aborted and ``TimeoutError`` is raised.
        """
        return self._iterate(request, self._engine.generate_stream(request, deadlines=deadlines), timeout)

    def generate_video(
        self,
        request: DiffusionRequest,
        *,
        fragmented: bool = False,
        deadlines: Deadlines | None = None,
        timeout: float | None = None,
    ) -> Generator[VideoBytes | GenerationResult, None, None]:
        """Run ``request`` (``format="mp4"``) with its video encoded while it decodes (see
        ``AsyncDiffusionEngine.generate_video``): with ``fragmented=True`` an iterator of
        its ``VideoBytes`` as they are made, then its ``GenerationResult`` (the whole MP4).
        Closing the iterator early and ``timeout`` behave as in ``generate_stream``."""
        agen = self._engine.generate_video(request, fragmented=fragmented, deadlines=deadlines)
        return self._iterate(request, agen, timeout)

    def _iterate(
        self, request: DiffusionRequest, agen: AsyncGenerator[T, None], timeout: float | None
    ) -> Generator[T, None, None]:
        async def step() -> T:
            return await agen.__anext__()

        ended = False
        try:
            while True:
                try:
                    item = self._run(step(), timeout)
                except StopAsyncIteration:
                    ended = True
                    return
                except concurrent.futures.TimeoutError:
                    ended = True
                    raise self._timed_out(request, timeout) from None
                except BaseException:
                    ended = True  # the stream raised (or our wait ended and cancelled it): it is over
                    raise
                yield item
        finally:
            if not ended and not self._closed:
                # Closed early: the async stream's aclose aborts the request and returns
                # once nothing of it remains.
                self._run(agen.aclose())

    def abort(self, request_ids: str | Iterable[str], *, wait: bool = False) -> None:
        self._run(self._engine.abort(request_ids, wait=wait))

    def metrics(self) -> EngineMetrics:
        return self._engine.metrics()

    def check_health(self) -> None:
        async def check() -> None:
            self._engine.check_health()

        self._run(check())

    def prometheus_registry(self) -> CollectorRegistry:
        return self._engine.prometheus_registry()

    def close(self, *, timeout: float | None = None) -> None:
        """Close the engine (see ``AsyncDiffusionEngine.close``) and stop its thread.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self._run(self._engine.close(timeout=timeout))
            finally:
                self._closed = True
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
