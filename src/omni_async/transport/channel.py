"""The result channel: workers (and their packer threads) -> the executor's pump.

Contract (the ``ResultChannel`` protocol, every implementation here keeps it):

* ``put(msg, timeout)`` is safe from any thread of the sending process (F7: a lock
  serializes writers, so two threads never interleave the bytes of two messages).
* The message is pickled **in the caller's thread**, before anything is sent: an
  unpicklable message raises ``UnpicklableMessage`` and an oversize one raises
  ``MessageTooLarge`` to the caller of ``put`` (F5).  ``multiprocessing.Queue`` is not
  used on purpose: its feeder thread pickles later, swallows the error, and can lose
  queued messages when the process exits.
* The channel is bounded (bytes and messages) and never drops a message: a full
  channel blocks ``put`` until the reader makes room, and raises ``ChannelFull`` when
  ``timeout`` passes; the message was then not sent, and the caller decides.
* One reader (the pump) calls ``get(timeout)``: the next message, or ``None`` when
  ``timeout`` passed with nothing to read.  After ``close()``, ``put`` raises
  ``ChannelClosed`` and ``get`` raises ``ChannelClosed`` (close is shutdown: messages
  still unread are discarded; their shared-memory segments are unlinked by the pool).
  A payload that does not unpickle to a valid ``AsyncDiffusionOutput`` (one its
  constructor accepts) raises ``ProtocolError`` from ``get`` (the pump counts it and
  carries on); so does, on ``PipeChannel``, a frame longer than the message limit,
  whatever its sender checked (its bytes are discarded unread; the pipe reads on).

Two implementations:

``InProcessChannel``
    Threads of one process (tests, the in-process executor).  It pickles every message
    by default, so it fails exactly where the real channel fails.

``PipeChannel`` / ``PipeSender``
    Worker processes -> executor, one pipe per worker (``omni_async.transport.pipe``).

What a message is on the wire (its frame and bounds) is ``omni_async.transport.codec``.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from omni_async.core.errors import UsageError
from omni_async.core.messages import AsyncDiffusionOutput
from omni_async.transport.codec import (
    CREDIT_BYTES,
    DEFAULT_CAPACITY_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_PUT_TIMEOUT,
    dumps_message,
    loads_message,
    resolve_timeout,
)
from omni_async.transport.errors import ChannelClosed, ChannelFull
from omni_async.transport.pipe import CreditSemaphore, PipeChannel, PipeSender

__all__ = [
    "CREDIT_BYTES",
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_MAX_MESSAGES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_PUT_TIMEOUT",
    "CreditSemaphore",
    "InProcessChannel",
    "PipeChannel",
    "PipeSender",
    "ResultChannel",
    "ResultReceiver",
    "ResultSender",
    "dumps_message",
    "loads_message",
]


class ResultSender(Protocol):
    """The writing end: any thread of the owning process may call ``put``."""

    def put(self, msg: AsyncDiffusionOutput, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


class ResultReceiver(Protocol):
    """The reading end: one reader thread (the pump)."""

    def get(self, timeout: float) -> AsyncDiffusionOutput | None: ...

    def close(self) -> None: ...


@runtime_checkable
class ResultChannel(Protocol):
    """Both ends of one channel (see the module docstring for the full contract)."""

    def put(self, msg: AsyncDiffusionOutput, timeout: float | None = None) -> None: ...

    def get(self, timeout: float) -> AsyncDiffusionOutput | None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------
# In-process
# ---------------------------------------------------------------------------------------


class InProcessChannel:
    """A bounded channel between threads of one process, with the real channel's contract.

    ``serialize=True`` (the default) pickles each message in ``put`` and unpickles it in
    ``get``, so a test sees the same ``UnpicklableMessage``/``MessageTooLarge`` and the
    same copy semantics as across processes.  ``serialize=False`` passes the object
    itself (faster; sizes are then not checked and each message counts as one byte).
    """

    def __init__(
        self,
        maxsize: int = DEFAULT_MAX_MESSAGES,
        *,
        max_bytes: int = DEFAULT_CAPACITY_BYTES,
        max_message_bytes: int | None = None,
        put_timeout: float | None = DEFAULT_PUT_TIMEOUT,
        serialize: bool = True,
    ) -> None:
        if max_message_bytes is None:
            max_message_bytes = min(DEFAULT_MAX_MESSAGE_BYTES, max_bytes)
        if maxsize < 1:
            raise UsageError(f"maxsize must be >= 1, got {maxsize}")
        if max_message_bytes > max_bytes:
            raise UsageError(f"max_message_bytes ({max_message_bytes}) exceeds max_bytes ({max_bytes})")
        self._maxsize = maxsize
        self._max_bytes = max_bytes
        self._max_message_bytes = max_message_bytes
        self._put_timeout = put_timeout
        self._serialize = serialize
        self._items: collections.deque[tuple[object, int]] = collections.deque()
        self._bytes = 0
        self._closed = False
        self._cond = threading.Condition(threading.Lock())
        self.sent = 0
        self.received = 0

    def put(self, msg: AsyncDiffusionOutput, timeout: float | None = None) -> None:
        t = resolve_timeout(timeout, self._put_timeout)
        item: object
        if self._serialize:
            data = dumps_message(msg, self._max_message_bytes)
            item, n = data, len(data)
        else:
            if not isinstance(msg, AsyncDiffusionOutput):
                raise UsageError(f"the result channel carries AsyncDiffusionOutput, got {type(msg).__qualname__}")
            item, n = msg, 1
        deadline = None if t is None else time.monotonic() + t
        with self._cond:
            while True:
                if self._closed:
                    raise ChannelClosed("put on a closed channel")
                if len(self._items) < self._maxsize and (not self._items or self._bytes + n <= self._max_bytes):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ChannelFull(
                        f"channel full ({len(self._items)} messages, {self._bytes} bytes) for {t} s",
                        nbytes=n,
                        timeout=t,
                    )
                self._cond.wait(remaining)
            self._items.append((item, n))
            self._bytes += n
            self.sent += 1
            self._cond.notify_all()

    def get(self, timeout: float) -> AsyncDiffusionOutput | None:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                if self._closed:
                    raise ChannelClosed("get on a closed channel")
                if self._items:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            item, n = self._items.popleft()
            self._bytes -= n
            self.received += 1
            self._cond.notify_all()
        if self._serialize:
            assert isinstance(item, bytes)
            return loads_message(item)
        assert isinstance(item, AsyncDiffusionOutput)
        return item

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)

    def close(self) -> None:
        """Idempotent; wakes every blocked ``put`` (they raise ``ChannelClosed``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


if TYPE_CHECKING:  # static conformance to the protocols, checked by mypy only

    def _conforms(
        a: InProcessChannel, b: PipeChannel, c: PipeSender
    ) -> tuple[ResultChannel, ResultChannel, ResultSender, ResultReceiver]:
        return a, b, c, b
