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
  carries on).

Two implementations:

``InProcessChannel``
    Threads of one process (tests, the in-process executor).  It pickles every message
    by default, so it fails exactly where the real channel fails.

``PipeChannel`` / ``PipeSender``
    Worker processes -> executor.  Each worker gets its own ``PipeSender`` (one
    ``multiprocessing`` pipe and one credit semaphore), created in the executor with
    ``PipeChannel.new_sender()`` and handed to the worker as a ``Process`` argument.
    One pipe per worker, rather than one shared pipe, because a worker can be
    SIGKILLed in the middle of a write: a shared pipe would then be corrupt for every
    worker and a shared lock would stay held forever; with one pipe per worker the
    reader sees EOF (or a torn message) on that worker's pipe alone and drops it.

Flow control of ``PipeSender``: a byte budget, counted in 64 KiB credits held in a
``multiprocessing.Semaphore``.  The sender takes ``ceil(n / 64 KiB)`` credits (at least
one) before writing an ``n``-byte message; the reader gives them back after reading it.
A semaphore, not a lock plus counter, because the reader only ever posts to it, so a
sender killed at any instant cannot leave the pump blocked.  The pipe's kernel buffer
is enlarged towards the byte budget where the OS allows, so a write that holds its
credits does not block on the reader.
"""

from __future__ import annotations

import collections
import fcntl
import multiprocessing
import multiprocessing.connection
import pickle
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import attrs

from omni_async.core.errors import ProtocolError, UsageError
from omni_async.core.messages import AsyncDiffusionOutput
from omni_async.transport.errors import ChannelClosed, ChannelFull, MessageTooLarge, UnpicklableMessage

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_PUT_TIMEOUT",
    "CREDIT_BYTES",
    "InProcessChannel",
    "PipeChannel",
    "PipeSender",
    "ResultChannel",
    "ResultReceiver",
    "ResultSender",
    "dumps_message",
    "loads_message",
]

# Packed outputs are small (tensors travel in shared memory): these are generous bounds
# for handles and inline items, far below the reference's fixed 240 MiB ring (F13).
DEFAULT_MAX_MESSAGE_BYTES: Final = 4 << 20
DEFAULT_CAPACITY_BYTES: Final = 8 << 20
DEFAULT_MAX_MESSAGES: Final = 1024
# ``put(msg)`` with no timeout waits this long for room, then raises ChannelFull: a
# stuck pump must surface as an error at the worker, never as a silent hang.
DEFAULT_PUT_TIMEOUT: Final = 60.0
CREDIT_BYTES: Final = 64 << 10


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


def dumps_message(msg: AsyncDiffusionOutput, max_bytes: int | None) -> bytes:
    """Pickle ``msg`` in the caller's thread; typed errors for a wrong type, unpicklable or oversize."""
    if not isinstance(msg, AsyncDiffusionOutput):
        raise UsageError(f"the result channel carries AsyncDiffusionOutput, got {type(msg).__qualname__}")
    try:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError, ...
        raise UnpicklableMessage(f"cannot pickle {msg.kind} message: {type(exc).__name__}: {exc}") from exc
    if max_bytes is not None and len(data) > max_bytes:
        raise MessageTooLarge(len(data), max_bytes)
    return data


def loads_message(data: bytes) -> AsyncDiffusionOutput:
    """Unpickle and validate one message; anything else is the peer's ``ProtocolError``."""
    try:
        msg = pickle.loads(data)
    except Exception as exc:
        raise ProtocolError(f"undecodable message on the result channel: {type(exc).__name__}: {exc}") from exc
    if not isinstance(msg, AsyncDiffusionOutput):
        raise ProtocolError(f"the result channel carried a {type(msg).__qualname__}, not an AsyncDiffusionOutput")
    # Unpickling skips the constructor and with it the validation, so a message a peer
    # built by hand (a kind outside the enum, an OUTPUT_READY carrying no DiffusionOutput)
    # would reach the dispatcher and fail there untyped, or half-way through a delivery.
    # Construct it again: it is refused here, typed, like an undecodable one.
    try:
        return attrs.evolve(msg)
    except Exception as exc:
        raise ProtocolError(f"invalid message on the result channel: {type(exc).__name__}: {exc}") from exc


def _resolve_timeout(timeout: float | None, default: float | None) -> float | None:
    t = default if timeout is None else timeout
    if t is not None and t < 0:
        raise UsageError(f"timeout must be >= 0, got {t}")
    return t


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
        t = _resolve_timeout(timeout, self._put_timeout)
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


# ---------------------------------------------------------------------------------------
# Across processes
# ---------------------------------------------------------------------------------------


def _credits_for(nbytes: int) -> int:
    return max(1, -(-nbytes // CREDIT_BYTES))


def _enlarge_pipe(conn: multiprocessing.connection.Connection, want: int) -> int:
    """Best effort: grow the pipe's kernel buffer towards ``want`` bytes; returns the size."""
    fd = conn.fileno()
    set_sz: int | None = getattr(fcntl, "F_SETPIPE_SZ", None)
    get_sz: int | None = getattr(fcntl, "F_GETPIPE_SZ", None)
    if set_sz is None or get_sz is None:
        return 0
    try:
        fcntl.fcntl(fd, set_sz, want)
    except OSError:
        # Unprivileged processes are capped by /proc/sys/fs/pipe-max-size.
        try:
            with open("/proc/sys/fs/pipe-max-size") as f:
                fcntl.fcntl(fd, set_sz, min(want, int(f.read())))
        except (OSError, ValueError):
            pass
    try:
        return int(fcntl.fcntl(fd, get_sz))
    except OSError:
        return 0


class PipeSender:
    """One worker's writing end of a ``PipeChannel``; pass it to the worker as a ``Process`` arg.

    Safe from any thread of the process that holds it (a ``threading.Lock`` serializes
    writers, F7).  After ``Process.start()``, call ``close()`` on the executor's copy:
    the child holds its own duplicate, and the reader sees EOF only when every copy of
    the writing end is closed, which is how a dead worker is noticed.
    """

    def __init__(
        self,
        conn: multiprocessing.connection.Connection,
        credits: Any,  # multiprocessing.synchronize.Semaphore (its type is not exported usefully)
        *,
        name: str,
        max_message_bytes: int,
        put_timeout: float | None,
    ) -> None:
        self._conn = conn
        self._credits = credits
        self._name = name
        self._max_message_bytes = max_message_bytes
        self._put_timeout = put_timeout
        self._lock = threading.Lock()
        self._closed = False
        self.sent = 0
        self.bytes_sent = 0

    @property
    def name(self) -> str:
        return self._name

    def __getstate__(self) -> dict[str, object]:
        # Connection and Semaphore pickle only while a Process is being spawned, which
        # is the one supported way to hand a sender to a worker.
        return {
            "conn": self._conn,
            "credits": self._credits,
            "name": self._name,
            "max_message_bytes": self._max_message_bytes,
            "put_timeout": self._put_timeout,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]  # re-run __init__ to rebuild the lock and counters
            state["conn"],
            state["credits"],
            name=state["name"],
            max_message_bytes=state["max_message_bytes"],
            put_timeout=state["put_timeout"],
        )

    def put(self, msg: AsyncDiffusionOutput, timeout: float | None = None) -> None:
        t = _resolve_timeout(timeout, self._put_timeout)
        data = dumps_message(msg, self._max_message_bytes)  # in the caller's thread (F5)
        need = _credits_for(len(data))
        deadline = None if t is None else time.monotonic() + t

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        def full() -> ChannelFull:
            return ChannelFull(f"result channel {self._name} full for {t} s", nbytes=len(data), timeout=t)

        if not self._lock.acquire(timeout=-1 if deadline is None else remaining() or 0.0):
            raise full()
        try:
            if self._closed:
                raise ChannelClosed(f"sender {self._name} is closed")
            taken = 0
            try:
                # Only the thread holding self._lock takes credits, so a partial take
                # cannot deadlock against another writer of this process.
                while taken < need:
                    if not self._credits.acquire(True, remaining()):
                        raise full()
                    taken += 1
                self._conn.send_bytes(data)
            except BaseException:
                for _ in range(taken):
                    self._credits.release()
                raise
            self.sent += 1
            self.bytes_sent += len(data)
        except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
            raise ChannelClosed(f"result channel {self._name}: the reader is gone ({exc})") from exc
        finally:
            self._lock.release()

    def close(self) -> None:
        """Idempotent; closes this process's copy of the writing end."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()


class PipeChannel:
    """The executor's end: one pipe per sender, one reader (the pump).

    ``put`` on the channel itself writes through a local sender, so executor-side code
    (an in-process worker, a test) can use the same object as a full ``ResultChannel``.
    """

    def __init__(
        self,
        *,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        max_message_bytes: int | None = None,
        put_timeout: float | None = DEFAULT_PUT_TIMEOUT,
        mp_context: multiprocessing.context.BaseContext | None = None,
        on_sender_gone: Callable[[str], None] | None = None,
    ) -> None:
        if max_message_bytes is None:
            max_message_bytes = min(DEFAULT_MAX_MESSAGE_BYTES, capacity_bytes)
        if max_message_bytes > capacity_bytes:
            raise UsageError(f"max_message_bytes ({max_message_bytes}) exceeds capacity_bytes ({capacity_bytes})")
        if capacity_bytes < CREDIT_BYTES:
            raise UsageError(f"capacity_bytes must be >= {CREDIT_BYTES}")
        self._ctx = mp_context or multiprocessing.get_context("spawn")
        self._capacity = capacity_bytes
        self._max_message_bytes = max_message_bytes
        self._put_timeout = put_timeout
        self._on_sender_gone = on_sender_gone
        self._lock = threading.Lock()  # guards the receiver table (new_sender vs. get)
        self._receivers: dict[multiprocessing.connection.Connection, tuple[str, Any]] = {}
        self._ready: collections.deque[multiprocessing.connection.Connection] = collections.deque()
        self._local: PipeSender | None = None
        self._closed = False
        self._n = 0
        self.received = 0
        self.bytes_received = 0
        self.pipe_buffer_bytes = 0

    def new_sender(self, name: str | None = None) -> PipeSender:
        """A new writing end with its own pipe and byte budget (one per worker process)."""
        with self._lock:
            if self._closed:
                raise ChannelClosed("new_sender on a closed channel")
            self._n += 1
            label = name or f"sender-{self._n}"
            recv, send = self._ctx.Pipe(duplex=False)
            self.pipe_buffer_bytes = _enlarge_pipe(send, self._capacity)
            credits = self._ctx.Semaphore(self._capacity // CREDIT_BYTES)
            self._receivers[recv] = (label, credits)
        return PipeSender(
            send, credits, name=label, max_message_bytes=self._max_message_bytes, put_timeout=self._put_timeout
        )

    def put(self, msg: AsyncDiffusionOutput, timeout: float | None = None) -> None:
        with self._lock:
            if self._closed:
                raise ChannelClosed("put on a closed channel")
            local = self._local
        if local is None:
            local = self.new_sender("executor-local")
            with self._lock:
                if self._local is None:
                    self._local = local
                else:
                    local.close()
                    local = self._local
        local.put(msg, timeout)

    def _drop(self, conn: multiprocessing.connection.Connection) -> None:
        with self._lock:
            entry = self._receivers.pop(conn, None)
        conn.close()
        if entry is not None and self._on_sender_gone is not None:
            self._on_sender_gone(entry[0])

    def get(self, timeout: float) -> AsyncDiffusionOutput | None:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            while self._ready:
                conn = self._ready.popleft()
                with self._lock:
                    entry = self._receivers.get(conn)
                if entry is None:
                    continue
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    # Every copy of the writing end is closed (the worker exited or was
                    # killed), or the worker died mid-write and the message is torn.
                    self._drop(conn)
                    continue
                for _ in range(_credits_for(len(data))):
                    entry[1].release()
                self.received += 1
                self.bytes_received += len(data)
                return loads_message(data)
            with self._lock:
                if self._closed:
                    raise ChannelClosed("get on a closed channel")
                conns = list(self._receivers)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if not conns:
                time.sleep(min(remaining, 0.05))
                continue
            ready = multiprocessing.connection.wait(conns, remaining)
            if not ready:
                return None
            self._ready.extend(c for c in ready if isinstance(c, multiprocessing.connection.Connection))

    @property
    def senders(self) -> list[str]:
        with self._lock:
            return [label for label, _ in self._receivers.values()]

    def close(self) -> None:
        """Idempotent.  Closes every reading end: senders then get ``ChannelClosed``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._receivers)
            self._receivers.clear()
            local, self._local = self._local, None
        self._ready.clear()
        if local is not None:
            local.close()
        for c in conns:
            c.close()

    @property
    def closed(self) -> bool:
        return self._closed


if TYPE_CHECKING:  # static conformance to the protocols, checked by mypy only

    def _conforms(
        a: InProcessChannel, b: PipeChannel, c: PipeSender
    ) -> tuple[ResultChannel, ResultChannel, ResultSender, ResultReceiver]:
        return a, b, c, b
