"""Worker processes -> executor: the result channel over one pipe per worker.

Each worker gets its own ``PipeSender`` (one ``multiprocessing`` pipe and one credit
semaphore), created in the executor with ``PipeChannel.new_sender()`` and handed to the
worker as a ``Process`` argument.  One pipe per worker, rather than one shared pipe,
because a worker can be SIGKILLed in the middle of a write: a shared pipe would then be
corrupt for every worker and a shared lock would stay held forever; with one pipe per
worker the reader sees EOF (or a torn message) on that worker's pipe alone and drops it.
The contract both ends keep is ``omni_async.transport.channel``'s.

Flow control of ``PipeSender``: a byte budget, counted in 64 KiB credits held in a
``multiprocessing.Semaphore``.  The sender takes ``ceil(n / 64 KiB)`` credits (at least
one) before writing an ``n``-byte message; the reader gives them back after reading it.
A semaphore, not a lock plus counter, because the reader only ever posts to it, so a
sender killed at any instant cannot leave the pump blocked.  The pipe's kernel buffer
is enlarged towards the byte budget where the OS allows, so a write that holds its
credits does not block on the reader.  The reader trusts no sender: it gives credits
back only up to the budget (a raw write took none), and it reads the pipes
non-blocking, assembling each frame as its bytes come, so a sender stopped half-way
through a frame stalls its own pipe only (``torn_senders`` reports it).

The credit semaphore is a named POSIX semaphore (a 32-byte ``sem.<name>`` file in
``/dev/shm``): a spawned worker opens it by name while it unpickles its arguments.
Its name is ours, ``omni-<executor pid>-sem-<random>`` (``CreditSemaphore``), and it is
unlinked as soon as every process that needs it has opened it
(``PipeChannel.unlink_names``, which the executor calls once its workers are up; the
semaphore lives on in the processes that hold it).  A SIGKILL of the whole process
group -- which takes ``multiprocessing``'s resource tracker with it -- then leaves
nothing behind; one in the window before (workers still starting) leaves a file whose
name carries the dead executor's pid, which the next executor's sweep and
``omni-async cleanup`` remove (``shm.files.dead_executor_files``).
"""

from __future__ import annotations

import collections
import fcntl
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.synchronize
import multiprocessing.util
import os
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final, Protocol

import attrs

from omni_async.core.errors import ProtocolError, UsageError
from omni_async.core.messages import AsyncDiffusionOutput
from omni_async.transport.codec import (
    CREDIT_BYTES,
    DEFAULT_CAPACITY_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_PUT_TIMEOUT,
    dumps_message,
    loads_message,
    resolve_timeout,
)
from omni_async.transport.errors import ChannelClosed, ChannelFull
from omni_async.transport.shm.files import SHM_PREFIX_ROOT, tag_mark

log = logging.getLogger(__name__)

__all__ = ["CreditSemaphore", "PipeChannel", "PipeSender"]


class Credits(Protocol):
    """What both ends use of a sender's credit semaphore (a ``CreditSemaphore``, or any
    ``multiprocessing`` semaphore a test hands in)."""

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool: ...

    def release(self) -> None: ...

    def get_value(self) -> int: ...


class CreditSemaphore(multiprocessing.synchronize.Semaphore):
    """A sender's credits: a ``multiprocessing`` semaphore whose name is ours (module docstring).

    ``/dev/shm/sem.omni-<pid of the creating process>-sem-<random>`` (``<tag>_<random>``
    in a tagged run, ``transport.shm.files``), so the sweeps of
    dead executors find it by the pid, as they find segments; ``unlink_name`` removes
    the name early, once every process that opens it by name has done so.
    """

    @staticmethod
    def _make_name() -> str:
        # Called by SemLock.__init__ (retried on a clash); the leading slash is POSIX's.
        return f"/{SHM_PREFIX_ROOT}{os.getpid()}-sem-{tag_mark()}{secrets.token_hex(6)}"

    def unlink_name(self) -> None:
        """Remove the name now (idempotent; the semaphore stays usable where it is open).

        Runs the finalizer ``multiprocessing`` registered for it -- unlink the name and
        tell the resource tracker -- early, so it does not run again at exit.
        """
        for ref in weakref.getweakrefs(self):
            finalize = getattr(ref, "__callback__", None)
            if isinstance(finalize, multiprocessing.util.Finalize):
                try:
                    finalize()
                except OSError:  # already unlinked (a sweep that took us for dead)
                    log.debug("credit semaphore already unlinked", exc_info=True)


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
        credits: Credits,
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
        t = resolve_timeout(timeout, self._put_timeout)
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

    def unlink_credit_name(self) -> None:
        """Remove the name of this sender's credit semaphore (see ``PipeChannel.unlink_names``)."""
        if isinstance(self._credits, CreditSemaphore):
            self._credits.unlink_name()

    def close(self) -> None:
        """Idempotent; closes this process's copy of the writing end."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()


class _FrameReader:
    """The executor's reading end of one sender's pipe: frames read without ever blocking.

    The bytes of a ``Connection.send_bytes`` frame (a 4-byte big-endian length, or -1
    and an 8-byte length, then the body) are read from a non-blocking descriptor as they
    come, so a sender that stops half-way through a frame (a live worker stuck mid-write,
    M5) holds only its own pipe: the reader serves the other pipes meanwhile, and
    ``partial_since`` says since when this one is torn.  A frame whose header announces
    more than ``max_frame`` bytes is refused (``ProtocolError``) and its body is read and
    discarded, never held (M4).  Credits go back only up to the sender's budget, so a
    writer that took none (it wrote raw bytes) cannot inflate it.
    """

    _CHUNK: Final = 1 << 20

    def __init__(
        self, conn: multiprocessing.connection.Connection, label: str, credits: Credits, budget: int, max_frame: int
    ) -> None:
        self.conn = conn
        self.label = label
        self.credits = credits
        self._budget = budget
        self._max_frame = max_frame
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._buf = bytearray()
        self._size: int | None = None  # the body length of the frame being read
        self._skip = 0  # bytes of a refused frame still to discard
        self.partial_since: float | None = None
        self.refused = 0

    def _give_back(self, nbytes: int) -> None:
        n = _credits_for(nbytes)
        try:
            # Only the reader posts, senders only take: the room seen here cannot shrink
            # before the posts, so the budget never grows beyond its capacity.
            n = min(n, self._budget - int(self.credits.get_value()))
        except NotImplementedError:  # macOS has no sem_getvalue
            pass
        for _ in range(max(0, n)):
            self.credits.release()

    def read(self) -> tuple[list[bytes | ProtocolError], str | None]:
        """What one read of the pipe completes: frames and refusals, and why the pipe is done (or None).

        Raises nothing: EOF, a torn last frame and an unreadable length end the pipe.
        """
        out: list[bytes | ProtocolError] = []
        try:
            want = self._skip or (self._size - len(self._buf) if self._size is not None else 0)
            chunk = os.read(self._fd, min(max(want, CREDIT_BYTES), self._CHUNK))
        except BlockingIOError:
            return out, None
        except OSError as exc:
            return out, f"unreadable ({exc})"
        if not chunk:
            torn = self._size is not None or self._buf or self._skip
            return out, "closed mid-frame (a torn message)" if torn else "closed"
        self._buf += chunk
        while True:
            if self._skip:
                n = min(self._skip, len(self._buf))
                del self._buf[:n]
                self._skip -= n
                if self._skip:
                    break
            if self._size is None:
                if len(self._buf) < 4:
                    break
                (size,) = struct.unpack("!i", self._buf[:4])
                head = 4
                if size == -1:
                    if len(self._buf) < 12:
                        break
                    (size,) = struct.unpack("!Q", self._buf[4:12])
                    head = 12
                del self._buf[:head]
                if size < 0:
                    out.append(ProtocolError(f"result channel {self.label}: a frame of negative length {size}"))
                    return out, "its frames cannot be parsed any more"
                if size > self._max_frame:
                    self.refused += 1
                    self._skip = size
                    out.append(
                        ProtocolError(
                            f"result channel {self.label}: a frame of {size} bytes exceeds the limit of "
                            f"{self._max_frame} bytes; refused (its bytes are discarded)"
                        )
                    )
                    continue
                self._size = size
            if len(self._buf) < self._size:
                break
            frame = bytes(self._buf[: self._size])
            del self._buf[: self._size]
            self._size = None
            self._give_back(len(frame))
            out.append(frame)
        if not self._buf and self._size is None and not self._skip:
            self.partial_since = None  # at a frame boundary
        elif out or self.partial_since is None:
            self.partial_since = time.monotonic()  # a frame begun since the last boundary
        return out, None


@attrs.frozen
class _SenderGone:
    """Queued behind a sender's last frames: its pipe reached its end."""

    label: str


class PipeChannel:
    """The executor's end: one pipe per sender, one reader (the pump).

    ``put`` on the channel itself writes through a local sender, so executor-side code
    (an in-process worker, a test) can use the same object as a full ``ResultChannel``.

    ``on_sender_gone(label)``: called once a sender's pipe reached its end (every copy
    of its writing end closed: the process exited or was killed, or its last frame is
    torn).  It runs in ``get``, on the reader's thread, and only after every message
    that sender wrote has been returned by an earlier ``get``: a reader that handles
    each message before it calls ``get`` again has handled them all.
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
        self._receivers: dict[multiprocessing.connection.Connection, _FrameReader] = {}
        self._ready: collections.deque[multiprocessing.connection.Connection] = collections.deque()
        self._frames: collections.deque[bytes | ProtocolError | _SenderGone] = collections.deque()
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
            budget = self._capacity // CREDIT_BYTES
            credits = CreditSemaphore(budget, ctx=self._ctx)
            self._receivers[recv] = _FrameReader(recv, label, credits, budget, self._max_message_bytes)
        return PipeSender(
            send, credits, name=label, max_message_bytes=self._max_message_bytes, put_timeout=self._put_timeout
        )

    def unlink_names(self) -> None:
        """Every process that opens a sender's credit semaphore by name has done so (the
        workers are up): remove the names from ``/dev/shm`` (module docstring).  Senders
        made later get theirs removed by the next call, or at ``close``."""
        with self._lock:
            readers = list(self._receivers.values())
        for r in readers:
            if isinstance(r.credits, CreditSemaphore):
                r.credits.unlink_name()

    def put(self, msg: AsyncDiffusionOutput, timeout: float | None = None) -> None:
        with self._lock:
            if self._closed:
                raise ChannelClosed("put on a closed channel")
            local = self._local
        if local is None:
            local = self.new_sender("executor-local")
            local.unlink_credit_name()  # used in this process only: nobody opens it by name
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
        if entry is not None:
            # Behind the frames already read: ``on_sender_gone`` runs once they are out.
            self._frames.append(_SenderGone(entry.label))

    def get(self, timeout: float) -> AsyncDiffusionOutput | None:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if self._frames:
                item = self._frames.popleft()
                if isinstance(item, _SenderGone):
                    if self._on_sender_gone is not None:
                        self._on_sender_gone(item.label)
                    continue
                if isinstance(item, ProtocolError):
                    raise item
                self.received += 1
                self.bytes_received += len(item)
                return loads_message(item)
            while self._ready and not self._frames:
                conn = self._ready.popleft()
                with self._lock:
                    reader = self._receivers.get(conn)
                if reader is None:
                    continue
                frames, gone = reader.read()
                self._frames.extend(frames)
                if gone is not None:
                    # Every copy of the writing end is closed (the worker exited or was
                    # killed), or the worker died mid-write and the message is torn.
                    if gone != "closed":
                        log.warning("result channel %s: %s; dropped", reader.label, gone)
                    self._drop(conn)
            if self._frames:
                continue
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

    def torn_senders(self, older_than: float) -> dict[str, float]:
        """Senders whose frame has been incomplete for more than ``older_than`` seconds, and for how long.

        A live sender stuck half-way through a frame does not block the reader (the
        other senders are served), but its own messages stall behind it: this is how
        the executor's health check sees it.
        """
        now = time.monotonic()
        with self._lock:
            readers = list(self._receivers.values())
        return {
            r.label: now - r.partial_since
            for r in readers
            if r.partial_since is not None and now - r.partial_since > older_than
        }

    @property
    def senders(self) -> list[str]:
        with self._lock:
            return [r.label for r in self._receivers.values()]

    def close(self) -> None:
        """Idempotent.  Closes every reading end: senders then get ``ChannelClosed``."""
        self.unlink_names()  # nobody may open them any more
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._receivers)
            self._receivers.clear()
            local, self._local = self._local, None
        self._ready.clear()
        self._frames.clear()
        if local is not None:
            local.close()
        for c in conns:
            c.close()

    @property
    def closed(self) -> bool:
        return self._closed
