"""The engine's errors: what ``AsyncDiffusionEngine`` raises on its own account.

An aborted request raises ``RequestAborted`` (``omni_async.core.errors``, shared with
the executor, whose cancelled forwards fail with it); everything the executor raises
(``RpcFailed``, ``ComputeTimeout``, ``OutputTimeout``, ``WorkerDied``, ...) reaches the
caller of ``generate`` as it is.
"""

from __future__ import annotations

from omni_async.core.errors import OmniAsyncError


class EngineError(OmniAsyncError):
    """Base class of the errors the engine raises on its own account."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class EngineClosed(EngineError):
    """The engine is closed or closing: a request it had not finished fails with this,
    and so does every call after ``close()`` (``generate``, ``abort``)."""


class EngineNotStarted(EngineError):
    """A call that needs a running engine (``generate``, ``abort``) before ``start()``
    (or outside ``async with engine``)."""


class EngineOverloaded(EngineError):
    """``generate`` found the engine's waiting queue full (``max_waiting`` requests wait
    already): the request was refused at the call and reached nothing.  Retry later, or
    raise ``max_waiting``."""

    def __init__(self, message: str, *, request_id: str | None = None, max_waiting: int = 0) -> None:
        super().__init__(message, request_id=request_id)
        self.max_waiting = max_waiting


class EngineDead(EngineError):
    """The engine's own scheduling task ended with an error; ``check_health`` raises this
    (its ``__cause__`` is that error), and so does every later ``generate``.  Close the
    engine and build a new one."""


class PostProcessFailed(EngineError):
    """The host stage of the request's pipeline raised (``__cause__``), or returned a
    result that still views the output's shared memory (``OutputStillViewed``): the
    result must own its memory, so copy what it keeps.  Names the request and the
    pipeline (``pipeline``)."""

    def __init__(self, message: str, *, request_id: str | None = None, pipeline: str | None = None) -> None:
        super().__init__(message, request_id=request_id)
        self.pipeline = pipeline


class EncodeFailed(PostProcessFailed):
    """A request that asked for a format could not be encoded: its output has no uint8
    pixels to encode (``"image"`` or ``"frames"``, channel-last), an encoder refused them
    (mp4 of one image, an odd size for H.264, PyAV missing) or raised, or the engine's
    encoder pool is shut down.  Names the request and the format (``format``)."""

    def __init__(self, message: str, *, request_id: str | None = None, format: str | None = None) -> None:
        super().__init__(message, request_id=request_id)
        self.format = format


__all__ = [
    "EncodeFailed",
    "EngineClosed",
    "EngineDead",
    "EngineError",
    "EngineNotStarted",
    "EngineOverloaded",
    "PostProcessFailed",
]
