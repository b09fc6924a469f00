"""The executor API's argument checks: API misuse fails at the call, with a
``UsageError`` naming the argument, never after a round trip to a worker; and the
small rules the executors share (a shutdown step's time budget)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from omni_async.core.config import Deadlines
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest


def check_deadlines(deadlines: object, method: str) -> None:
    if deadlines is not None and not isinstance(deadlines, Deadlines):
        raise UsageError(
            f"{method}: deadlines must be a Deadlines or None, got {type(deadlines).__name__} {deadlines!r:.80}"
        )


def check_consumer(consumer: object) -> None:
    if consumer is not None and (not isinstance(consumer, str) or not consumer):
        raise UsageError(f"consumer must be a non-empty str or None, got {consumer!r}")


def check_output_id(async_output_id: object, method: str) -> None:
    if not isinstance(async_output_id, str) or not async_output_id:
        raise UsageError(
            f"{method}: async_output_id must be a non-empty str (a RunnerOutput's async_output_id), "
            f"got {type(async_output_id).__name__} {async_output_id!r:.80}"
        )


def check_output(output: object, method: str) -> None:
    if not isinstance(output, DiffusionOutput):
        raise UsageError(
            f"{method}: output must be the DiffusionOutput that wait_output_ready delivered, "
            f"got {type(output).__name__} {output!r:.80}"
        )


def check_batch(
    requests: object, method: str, check_request: Callable[[object, str, str], None]
) -> list[DiffusionRequest]:
    """A batch's requests as a list: a non-empty sequence of distinct requests, each
    passing ``check_request(request, method, argument)``."""
    if isinstance(requests, (DiffusionRequest, str, bytes, Mapping)) or not isinstance(requests, Iterable):
        raise UsageError(
            f"{method}: requests must be a sequence of DiffusionRequest, got {type(requests).__name__}"
            + (" (for one request use submit/execute_request)" if isinstance(requests, DiffusionRequest) else "")
        )
    reqs = list(requests)
    if not reqs:
        raise UsageError(f"{method} needs at least one request")
    seen: set[str] = set()
    for i, r in enumerate(reqs):
        check_request(r, method, f"requests[{i}]")
        assert isinstance(r, DiffusionRequest)
        if r.request_id in seen:
            raise UsageError(f"{method}: request id {r.request_id!r} appears more than once in the batch")
        seen.add(r.request_id)
    return reqs


def check_request_ids(request_ids: object) -> list[str]:
    """``cancel_requests``' argument: an iterable of non-empty str (one id is refused: wrap it)."""
    if isinstance(request_ids, (str, bytes, Mapping)) or not isinstance(request_ids, Iterable):
        raise UsageError(
            f"cancel_requests: request_ids must be an iterable of request ids (str), got "
            f"{type(request_ids).__name__} {request_ids!r:.80}"
            + (" (wrap one id in a list)" if isinstance(request_ids, str) else "")
        )
    ids = list(request_ids)
    bad = [r for r in ids if not isinstance(r, str) or not r]
    if bad:
        raise UsageError(f"cancel_requests: request ids must be non-empty str, got {bad!r:.80}")
    return ids


def final_async(per_call: object, method: str, step_mode: bool, default: bool) -> bool:
    """Whether a step-mode execute call takes the final-step asynchronous path
    (``per_call`` None: the executor's ``default``)."""
    if per_call is None:
        return step_mode and default
    if not isinstance(per_call, bool):
        raise UsageError(f"{method}: final_step_async must be a bool or None, got {per_call!r}")
    if per_call and not step_mode:
        raise UsageError(
            f"{method}: final_step_async=True is an option of step mode; request mode always takes the "
            "asynchronous path"
        )
    return per_call


def stop_budget(deadline: float | None, default: float, fraction: float = 1.0) -> float:
    """How long one step of a shutdown may wait: ``default`` seconds without a deadline,
    else ``fraction`` of what is left of it (at most ``default``, never negative)."""
    if deadline is None:
        return default
    return min(default, max(0.0, deadline - time.monotonic()) * fraction)


def check_final_step_async(final_step_async: object, step_mode: bool) -> None:
    """An executor's ``final_step_async`` argument: a bool, True only in step mode (``UsageError``)."""
    if not isinstance(final_step_async, bool):
        raise UsageError(f"final_step_async must be a bool, got {final_step_async!r}")
    if final_step_async and not step_mode:
        raise UsageError(
            "final_step_async=True is an option of step mode (step_mode=True); request mode always "
            "takes the asynchronous path"
        )


def requests_in(method: str, args: tuple[Any, ...]) -> list[DiffusionRequest]:
    """The requests of an execute call made through ``collective_rpc`` (what cancel finds it by)."""
    try:
        found = list(args[0]) if method == "execute_model_batch" else list(args[:1])
    except (IndexError, TypeError):
        return []  # malformed: the worker fails the call with a typed error
    return [r for r in found if isinstance(r, DiffusionRequest)]


__all__ = [
    "check_batch",
    "check_consumer",
    "check_deadlines",
    "check_final_step_async",
    "check_output",
    "check_output_id",
    "check_request_ids",
    "final_async",
    "requests_in",
    "stop_budget",
]
