"""Typed errors of the data plane: the result channel, the shared-memory pool, packing.

They live apart from ``errors.py`` so the transport can grow without touching the
protocol's error module; every one of them still derives from ``OmniAsyncError``, so one
``except OmniAsyncError`` catches them.  As in ``errors.py``, a ``UsageError`` subclass
means the local caller can fix it (a message too large, an unsupported type, a second
release); the others report a resource condition (full channel, exhausted pool, closed).
"""

from __future__ import annotations

from omni_async.core.errors import OmniAsyncError, UsageError


class TransportError(OmniAsyncError):
    """Base class of the data plane's resource errors."""


# -- result channel ---------------------------------------------------------------------


class ChannelClosed(TransportError):
    """The channel was closed: ``put`` after ``close``, or ``get`` on a closed, drained channel."""


class ChannelFull(TransportError, TimeoutError):
    """``put`` waited ``timeout`` seconds for room and got none; the message was NOT sent.

    The channel never drops a message: the caller decides (retry, fail the request).
    """

    def __init__(self, message: str, *, nbytes: int, timeout: float | None) -> None:
        super().__init__(message)
        self.nbytes = nbytes
        self.timeout = timeout


class MessageTooLarge(UsageError, ValueError):
    """A message pickles to more bytes than the channel accepts (F5): an error, never a loss."""

    def __init__(self, nbytes: int, limit: int) -> None:
        super().__init__(
            f"message pickles to {nbytes} bytes, over the channel's limit of {limit} bytes; "
            "large tensors belong in shared memory (pack_diffusion_output_shm)"
        )
        self.nbytes = nbytes
        self.limit = limit


class UnpicklableMessage(UsageError, TypeError):
    """A message could not be pickled; raised in the sender's thread, never hidden (F5)."""


# -- shared-memory pool -----------------------------------------------------------------


class PoolClosed(TransportError):
    """The segment pool was closed (executor shutdown); no lease can be taken or resolved."""


class PoolExhausted(TransportError, TimeoutError):
    """No segment of the needed size class became free within the lease timeout."""

    def __init__(self, message: str, *, nbytes: int, timeout: float) -> None:
        super().__init__(message)
        self.nbytes = nbytes
        self.timeout = timeout


class HeldOutputsFull(PoolExhausted):
    """An output found no room in the executor's budget of held outputs within the lease timeout.

    ``MultiprocDiffusionExecutor(max_held_outputs=..., max_held_bytes=...)`` bounds the
    outputs held in shared memory (packed and not yet released).  When the budget stays
    full longer than ``WorkerOptions.lease_timeout``, the output that needed room fails
    with this error (its waiter gets a ``RemoteError`` whose ``failure.type_name`` is
    ``"HeldOutputsFull"``), naming the budget and how to raise it.
    """


class SegmentTooLarge(UsageError, ValueError):
    """One tensor needs more bytes than the pool's largest size class (or its byte budget)."""

    def __init__(self, nbytes: int, limit: int) -> None:
        super().__init__(f"a {nbytes}-byte item exceeds the pool's largest segment ({limit} bytes)")
        self.nbytes = nbytes
        self.limit = limit


class LeaseAlreadyReleased(UsageError):
    """A lease (or a packed output) was released a second time, or used after its release.

    Also raised by any use of an unpacked output after ``release_output`` took it back,
    and by an unpack of a packed output whose segment already went back: loud where a
    view would otherwise show bytes of a later request.
    """

    def __init__(self, segment: str, detail: str | None = None) -> None:
        super().__init__(f"segment {segment!r} was already released" + (f": {detail}" if detail else ""))
        self.segment = segment


class OutputStillViewed(UsageError):
    """``release_output`` (or a release of the packed output) while tensors or arrays viewing
    the output's segment are still alive elsewhere.

    The zero-copy views of an unpacked output hold its segment: it goes back to the pool
    only when the last of them is gone, so a kept view can never show another request's
    bytes.  An explicit release says "I am done": if views are still alive it fails with
    this error instead of returning the segment under them.  Nothing leaks either way --
    the segment goes back by itself once those views are dropped.  ``views`` counts the
    output's tensors/arrays still referenced (directly or through views derived from
    them); ``segment`` names the segment.
    """

    def __init__(self, output_id: str, views: int, segment: str) -> None:
        super().__init__(
            f"output {output_id!r}: {views} tensor(s)/array(s) viewing its shared-memory segment {segment} "
            "are still alive, so the segment cannot go back to the pool now.  Drop them (the segment then goes "
            "back by itself; nothing leaks) or copy what you keep (tensor.clone(), array.copy(), or unpack with "
            "copy=True / MultiprocDiffusionExecutor(copy_outputs=True)) before releasing"
        )
        self.output_id = output_id
        self.views = views
        self.segment = segment


class UnknownSegment(UsageError, KeyError):
    """A handle names a segment this pool never created (wrong pool, or a forged handle)."""

    def __str__(self) -> str:  # KeyError's str() adds quotes around the message
        return str(self.args[0]) if self.args else ""


# -- packing ----------------------------------------------------------------------------


class UnsupportedOutputType(UsageError, TypeError):
    """An output contains a value the packer cannot carry; names where it was found, and,
    where there is more to say than the type (``reason``), why and what to do."""

    def __init__(self, path: str, value_type: type, reason: str = "") -> None:
        msg = f"cannot pack a {value_type.__module__}.{value_type.__qualname__} at {path}"
        super().__init__(f"{msg}: {reason}" if reason else msg)
        self.path = path
        self.value_type = value_type
        self.reason = reason


class DeviceSyncUnavailable(TransportError):
    """The producing device can neither record an event nor be synchronized."""
