"""Cooperative cancellation of a running forward: what the model checks between steps.

The executor cancels requests of an execute call in flight (``cancel_requests``, or
the call's compute deadline).  A worker's main thread is busy in the forward then, so
the cancel does not travel on the RPC channel that thread reads: it comes as a
``CancelMessage`` on a control channel that a worker-side thread reads
(``omni-cancel-<rank>`` with worker processes; the caller's thread in process), and
lands in the loop's ``CancelTable``.

The model's side is one function, called between denoising steps::

    from omni_async.worker import cancel_requested

    for step in range(steps):
        if cancel_requested():        # every request of this call is cancelled
            raise RequestAborted(request.request_id)   # or raise_if_cancelled()
        latents = denoise(latents, step)

``cancel_requested()`` with no argument is True when every request of the call the
forward computes is cancelled: the forward should stop (raise; any exception will do,
``raise_if_cancelled()`` raises the right one).  ``cancel_requested(request_id)`` asks
about one request of the call (a batched model may drop it from its batch; it need
not).  Outside a forward run by a worker loop both are False, so a model works
unchanged in a plain script, and a model that never calls them still works: its
forward runs to the end and its outputs are discarded.

The rules the worker loop applies (``WorkerLoop``):

* a call whose requests are all cancelled before its forward starts never runs;
* a forward that raises after all its requests were cancelled, or returns while they
  are, answers the call with a ``RequestAborted`` failure: no output id is announced,
  nothing is packed;
* a batch goes on while only some of its requests are cancelled; their outputs are
  not packed (the executor drops their ids, ``RunnerOutput.aborted``).

The table is keyed by call (``rpc_id``), not by request id alone, so a cancel never
reaches a later call that reuses the request id; a cancel that arrives after its call
ended on this worker is ignored (a bounded memory of finished calls).

Check cost: one context-variable read and a dict lookup under a lock, a microsecond
or so; once per denoising step is free.
"""

from __future__ import annotations

import collections
import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import attrs

from omni_async.core.errors import RequestAborted, UsageError
from omni_async.core.messages import AbortCause, CancelMessage

__all__ = ["CancelTable", "CallScope", "cancel_requested", "raise_if_cancelled"]


@attrs.define(eq=False)
class CallScope:
    """One execute call on this worker, as its cancellation checks see it."""

    table: CancelTable
    rpc_id: str
    request_ids: tuple[str, ...]

    def cancelled(self) -> dict[str, AbortCause]:
        """The call's cancelled requests and why."""
        return self.table.cancelled(self.rpc_id)

    def all_cancelled(self) -> bool:
        got = self.cancelled()
        return bool(self.request_ids) and all(r in got for r in self.request_ids)

    def cause(self) -> AbortCause:
        got = self.cancelled()
        return next(iter(got.values()), AbortCause.ABORT)


_current: contextvars.ContextVar[CallScope | None] = contextvars.ContextVar("omni_async_call", default=None)


class CancelTable:
    """The cancelled requests of the calls on one worker; thread safe.

    ``cancel`` is called by the control channel's reader; ``begin``/``end`` by the
    worker's main thread around a call; the model reads it through ``cancel_requested``.
    """

    def __init__(self, *, max_finished: int = 4096) -> None:
        self._lock = threading.Lock()
        self._cancelled: dict[str, dict[str, AbortCause]] = {}
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._max_finished = max_finished
        self.received = 0
        self.ignored = 0

    def cancel(self, msg: CancelMessage) -> None:
        """Mark ``msg``'s requests of its call cancelled (before or while the call runs)."""
        with self._lock:
            self.received += 1
            if msg.rpc_id in self._finished:
                self.ignored += 1  # the call ended here already (its answer is on its way)
                return
            marks = self._cancelled.setdefault(msg.rpc_id, {})
            for rid in msg.request_ids:
                marks.setdefault(rid, msg.cause)

    def cancelled(self, rpc_id: str) -> dict[str, AbortCause]:
        with self._lock:
            return dict(self._cancelled.get(rpc_id, {}))

    def pending(self) -> int:
        """Calls with cancel marks that have not ended here (a gauge for tests and metrics)."""
        with self._lock:
            return len(self._cancelled)

    @contextmanager
    def running(self, rpc_id: str, request_ids: tuple[str, ...]) -> Iterator[CallScope]:
        """The call ``rpc_id`` runs on this thread: ``cancel_requested`` sees it meanwhile.

        On exit the call has ended here: its marks go, and a later cancel of it is ignored.
        """
        scope = CallScope(self, rpc_id, request_ids)
        token = _current.set(scope)
        try:
            yield scope
        finally:
            _current.reset(token)
            self.end(rpc_id)

    def end(self, rpc_id: str) -> None:
        with self._lock:
            self._cancelled.pop(rpc_id, None)
            self._finished[rpc_id] = None
            while len(self._finished) > self._max_finished:
                self._finished.popitem(last=False)


def current_call() -> CallScope | None:
    """The call the calling thread's forward computes, or None outside a worker loop's forward."""
    return _current.get()


def cancel_requested(request_id: str | None = None) -> bool:
    """True when the forward should stop: every request of its call was cancelled.

    With ``request_id``: whether that request of the call was cancelled (a
    ``UsageError`` if the call has no such request).  False outside a forward that a
    worker loop runs (a script, a test calling the model directly).  Call it from the
    thread that runs the forward, between denoising steps.
    """
    scope = _current.get()
    if scope is None:
        return False
    if request_id is None:
        return scope.all_cancelled()
    if request_id not in scope.request_ids:
        raise UsageError(
            f"cancel_requested({request_id!r}): the call {scope.rpc_id} computes {list(scope.request_ids)}, "
            "not that request"
        )
    return request_id in scope.cancelled()


def raise_if_cancelled() -> None:
    """Raise ``RequestAborted`` when every request of the running call is cancelled (see ``cancel_requested``)."""
    scope = _current.get()
    if scope is None or not scope.all_cancelled():
        return
    raise RequestAborted(
        scope.request_ids[0],
        by=scope.cause().value,
        detail="the forward stopped at a cancellation check",
        request_ids=scope.request_ids,
        rpc_id=scope.rpc_id,
    )
