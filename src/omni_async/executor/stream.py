"""``RequestStream``: the executor's handle on one streaming request.

``DiffusionExecutor.submit(request, stream=True)`` sends a forward that ships
intermediate outputs (chunks, see ``omni_async.worker.stream``); its handle's
``stream`` is a ``RequestStream``:

* ``next_chunk(timeout)`` blocks until the next chunk is announced and returns it as an
  ``OutputChunk`` (its place ``seq`` and a future of its output, claimed for you), or
  None once the stream is finished; ``poll()`` is the same without waiting;
* iterating the stream yields the chunks' outputs themselves, in order, waiting for
  each; a chunk that failed (its packing, its deadline, ...) closes the stream and
  raises its typed error, and a call that failed raises its error at the end;
* ``result`` is the call's future, the handle's ``computed``: the final output's id
  at COMPUTE_DONE, which comes after every chunk;
* ``close()`` (also on leaving a ``with`` block) drops every chunk not taken and every
  chunk still to come (F11): each is released the moment it arrives, and a chunk still
  queued in the worker's packer is skipped (F15).  It does not stop the forward
  (``cancel_requests`` does).

Every chunk taken is the caller's, like an output of ``wait_output_ready``: release it
(``release_output``) or drop its views, and cancel the future of one you will not read.
The chunks announced and not yet taken each hold an output of the budget of held
outputs once packed, so a consumer that falls behind slows the worker's packer and,
through its back-pressure, the forward; nothing is dropped.  An output deadline
(``Deadlines.output_timeout``, measured from the chunk's announcement) still bounds how
long a chunk waits to be taken and delivered.

Thread safe; ``add_listener(fn)`` calls ``fn()`` (on the pump's thread, or on a caller's,
never under a lock; it must not block) whenever the stream changes, for an event loop
that polls.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import attrs

from omni_async.core.messages import DiffusionOutput, RunnerOutput
from omni_async.core.stream import ChunkFeed

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["OutputChunk", "RequestStream"]


@attrs.frozen
class OutputChunk:
    """One intermediate output of a streaming request: ``seq`` (0, 1, ... in the request's
    stream), its output id, and the future of its ``DiffusionOutput`` (cancel it to
    abandon the chunk: released on arrival, F9)."""

    request_id: str
    seq: int
    async_output_id: str
    output: Future[DiffusionOutput] = attrs.field(eq=False, repr=False)


# One look at a feed under the pump's lock: the next chunk, claimed (or None), whether the
# stream is finished, how it ended.
TakeFn = Callable[[ChunkFeed], "tuple[OutputChunk | None, bool, BaseException | None]"]
# The same look without taking anything.
PeekFn = Callable[[ChunkFeed], "tuple[bool, BaseException | None]"]
CloseFn = Callable[[ChunkFeed], "Future[None]"]


class RequestStream:
    """One streaming request's chunks, then its call (see the module docstring).

    Made by the batch submitter (``submit(stream=True)``), which gives it its executor's ways to
    take from, look at and close the feed (under the pump's lock).
    """

    result: Future[RunnerOutput]

    def __init__(self, feed: ChunkFeed, take: TakeFn, peek: PeekFn, close: CloseFn) -> None:
        self.request_id = feed.request_id
        self._take = take
        self._peek_fn = peek
        self._close_fn = close
        self._feed = feed
        self._cond = threading.Condition()
        self._version = 0
        self._listeners: list[Callable[[], None]] = []
        self._error: BaseException | None = None
        self._closed: Future[None] | None = None
        feed.listener = self._changed

    # ------------------------------------------------------------------ consumer

    def poll(self) -> OutputChunk | None:
        """The next chunk if one is announced, else None (see ``finished``); never waits."""
        chunk, _, error = self._take(self._feed)
        self._error = error
        return chunk

    @property
    def finished(self) -> bool:
        """No chunk will come any more: the call ended (or the stream was closed) and every
        chunk announced was taken."""
        finished, error = self._peek_fn(self._feed)
        self._error = error
        return finished

    @property
    def error(self) -> BaseException | None:
        """Why the stream ended early: the call's failure (None: still running, or it ended
        with the call's success, or closed)."""
        self._error = self._peek_fn(self._feed)[1]
        return self._error

    def next_chunk(self, timeout: float | None = None) -> OutputChunk | None:
        """The next chunk, once announced; None once the stream is finished.  ``TimeoutError``
        when neither happens within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                seen = self._version
            chunk, finished, error = self._take(self._feed)
            self._error = error
            if chunk is not None:
                return chunk
            if finished:
                return None
            with self._cond:
                while self._version == seen:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"no chunk of request {self.request_id!r} within {timeout} s")
                    self._cond.wait(left)

    def __iter__(self) -> Iterator[DiffusionOutput]:
        """The chunks' outputs in order, each waited for; a failed chunk closes the stream
        and raises its error; at the end, a failed call raises its error."""
        while (chunk := self.next_chunk()) is not None:
            try:
                output = chunk.output.result()
            except BaseException:
                self.close()
                raise
            yield output
        if self._error is not None and self._closed is None:
            raise self._error

    def close(self) -> Future[None]:
        """Stop streaming: drop every chunk not taken and every chunk still to come.  Returns
        a future resolved once the dropped chunks are gone from the executor.  Idempotent."""
        if self._closed is None:
            self._closed = self._close_fn(self._feed)
        return self._closed

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever a chunk is announced or the stream ends (see the module docstring)."""
        self._listeners.append(listener)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _changed(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()
        for listener in list(self._listeners):
            listener()
