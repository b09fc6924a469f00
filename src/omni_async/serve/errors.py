"""Errors in OpenAI's shape, and the one place the engine's typed errors become HTTP statuses.

Every error a client gets is ``{"error": {"message", "type", "param", "code"}}`` (what the
``openai`` client parses into ``APIStatusError.body``), with the status the OpenAI API uses
for it: 400 for a bad request (``param`` names the field), 404 for an unknown id, 429 with
``Retry-After`` when the engine's queue is full, 503 when the engine cannot serve (closed,
or a worker died: the operator restarts it), 500
otherwise (the message carries the request id, to find it in the server's log).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from omni_async.core.errors import ExecutorShutdown, InvalidRequest, MessageValidationError, RequestAborted, WorkerDied
from omni_async.engine.errors import EngineClosed, EngineDead, EngineNotStarted, EngineOverloaded

__all__ = ["ApiError", "RETRY_AFTER_S", "api_error", "bad_request", "not_found"]

#: What a 429 asks the client to wait (seconds, ``Retry-After``): about one tiny forward's
#: queue to drain; the openai client honours it in its retries.
RETRY_AFTER_S = 1


@attrs.frozen
class ApiError(Exception):
    """An error a route answers with: its HTTP ``status``, and the fields of OpenAI's error
    object (``type``, ``param``: the request field at fault, ``code``), plus headers
    (``Retry-After`` on a 429)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: Mapping[str, str] = attrs.field(factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str, *, code: str = "invalid_value") -> ApiError:
    """A 400 naming the request field at fault (``param``)."""
    return ApiError(400, message, param=param, code=code)


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"no {what} with id {ident!r} (unknown, or deleted)", param="id", code="not_found")


def api_error(exc: BaseException, request_id: str, *, reserved: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP error of an engine call that raised ``exc`` for ``request_id``.

    ``reserved``: model parameter -> the OpenAI field that sets it, so a refusal of a
    parameter the server derived (``height`` from ``size``) names the field the client sent."""
    match exc:
        case ApiError():
            return exc
        case InvalidRequest():
            param = (reserved or {}).get(exc.parameter, exc.parameter)
            return bad_request(param, str(exc).replace(f"request {exc.request_id!r}: ", ""))
        case EngineOverloaded():
            return ApiError(
                429,
                f"the server's queue is full ({exc.max_waiting} requests wait); retry after {RETRY_AFTER_S} s",
                type="rate_limit_exceeded",
                code="engine_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        case EngineClosed() | EngineNotStarted() | EngineDead() | WorkerDied() | ExecutorShutdown():
            return ApiError(503, f"the server cannot serve: {exc}", type="server_error", code="unavailable")
        case RequestAborted():
            return ApiError(500, f"request {request_id} was aborted: {exc}", type="server_error", code="aborted")
        case MessageValidationError():
            return bad_request(None, f"request {request_id}: {exc}")
        case _:
            return ApiError(
                500,
                f"request {request_id} failed: {type(exc).__name__}: {exc}",
                type="server_error",
                code="internal_error",
            )
