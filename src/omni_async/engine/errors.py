"""The engine's errors: what ``AsyncDiffusionEngine`` raises on its own account.

An aborted request raises ``RequestAborted`` (``omni_async.core.errors``, shared with
the executor, whose cancelled forwards fail with it); everything the executor raises
(``RpcFailed``, ``ComputeTimeout``, ``OutputTimeout``, ``WorkerDied``, ...) reaches the
caller of ``generate`` as it is.
"""

from __future__ import annotations

from omni_async.core.errors import InvalidRequest, OmniAsyncError


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


class OutputFileGone(EngineError):
    """``engine.files.get(file_id)`` of a file that is no longer there: ``why`` is
    ``"expired"`` (its ttl passed: the engine deleted it), ``"deleted"``
    (``files.delete``), ``"closed"`` (the engine closed, which removes every file) or
    ``"unknown"`` (never an id of this engine's, or gone too long ago to remember).
    Names the id (``file_id``) and the request that made it when known (``request_id``)."""

    def __init__(self, file_id: str, why: str, *, request_id: str | None = None) -> None:
        whose = f" (request {request_id!r})" if request_id is not None else ""
        hint = {
            "expired": "its ttl passed and the engine deleted it; ask for a longer sink_ttl_s, or read it sooner",
            "deleted": "it was deleted (files.delete)",
            "closed": "the engine closed, which removes every file it wrote",
        }.get(why, "no file of this engine has that id (or it went long ago)")
        super().__init__(f"output file {file_id!r}{whose} is gone: {hint}", request_id=request_id)
        self.file_id = file_id
        self.why = why


class SinkUnavailable(InvalidRequest):
    """A request asked for a sink its engine cannot serve: ``sink="segment"`` over an
    executor whose outputs are not in a shared-memory segment of this host that it can
    lend (``InProcessExecutor`` holds none; ``RayDiffusionExecutor``'s may be on another
    node; ``copy_outputs=True`` copies them out).  Refused at ``generate``, before it
    queues.  Names the request (``request_id``) and the executor (``executor``)."""

    def __init__(self, request_id: str, executor: str, why: str) -> None:
        super().__init__(request_id, "sink", why)
        self.executor = executor


__all__ = [
    "EncodeFailed",
    "EngineClosed",
    "EngineDead",
    "EngineError",
    "EngineNotStarted",
    "EngineOverloaded",
    "OutputFileGone",
    "PostProcessFailed",
    "SinkUnavailable",
]
