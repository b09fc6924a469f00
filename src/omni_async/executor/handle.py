"""``RequestHandle``: one object per request, both phases of its output (``submit``, ``submit_batch``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import attrs

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput, RunnerOutput
from omni_async.executor.stream import RequestStream

__all__ = ["RequestHandle"]


@attrs.frozen
class RequestHandle:
    """A request submitted with ``DiffusionExecutor.submit`` (or one of ``submit_batch``).

    ``computed``: its ``RunnerOutput`` at COMPUTE_DONE, or the forward's typed failure
    (``RequestAborted`` once ``cancel_requests`` stopped it).  ``output``: the request's
    output, claimed for this handle by the dispatcher as the pump dispatches the
    COMPUTE_DONE, under its lock (no id travels back through ``wait_output_ready``; a
    ``wait_output_ready`` for the same id gets ``OutputAlreadyClaimed``); it fails with
    the forward's error if the forward failed.  ``stream``: the intermediate outputs,
    with ``submit(stream=True)``.  Cancelling ``output`` abandons the
    output: it is released the moment it arrives (F9).  Release a delivered output with
    ``release_output``, as one from ``wait_output_ready``.
    """

    request_id: str
    computed: Future[RunnerOutput]
    output: Future[DiffusionOutput]
    stream: RequestStream | None = None
    _drop: Callable[[str], Future[None]] | None = attrs.field(default=None, alias="drop_fn", repr=False)

    def drop(self) -> Future[None]:
        """Drop this request's output after its COMPUTE_DONE, in any state (F10): the
        future resolves once nothing of it remains in the executor (an acknowledged
        drop; a packing that has not started is cancelled, F15).  ``output`` then fails
        with ``OutputDropped`` unless it was delivered already (release that with
        ``release_output``).  Before COMPUTE_DONE stop the forward with
        ``cancel_requests`` instead: this raises ``UsageError``."""
        if not self.computed.done() or self.computed.cancelled() or self.computed.exception() is not None:
            raise UsageError(
                f"request {self.request_id!r}: drop() needs its COMPUTE_DONE; before it, cancel the "
                "forward with cancel_requests"
            )
        oid = self.computed.result().async_output_id
        if oid is None or self._drop is None:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return self._drop(oid)
