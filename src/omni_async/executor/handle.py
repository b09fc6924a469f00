"""``RequestHandle``: one object per request, both phases of its output (``submit_handle``)."""

from __future__ import annotations

from concurrent.futures import Future

import attrs

from omni_async.core.messages import DiffusionOutput, RunnerOutput
from omni_async.executor.stream import RequestStream

__all__ = ["RequestHandle"]


@attrs.frozen
class RequestHandle:
    """A request submitted with ``DiffusionExecutor.submit_handle``.

    ``computed``: as ``submit_request``'s future (COMPUTE_DONE, or the forward's typed
    failure).  ``output``: the request's output, claimed for this handle by the pump as
    it dispatches the COMPUTE_DONE (no id travels back through ``wait_output_ready``;
    a ``wait_output_ready`` for the same id gets ``OutputAlreadyClaimed``); it fails
    with the forward's error if the forward failed.  Cancelling ``output`` abandons the
    output: it is released the moment it arrives (F9).  Release a delivered output with
    ``release_output``, as one from ``wait_output_ready``.
    """

    request_id: str
    computed: Future[RunnerOutput]
    output: Future[DiffusionOutput]
    stream: RequestStream | None = None
