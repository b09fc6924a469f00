"""``RequestEnds``: a request's early end (abort, a caller gone, close, failure) and what
it sets going, whatever stage the request is in.

The end is decided at once (the caller's future fails, the outcome is counted); the
clean-up follows the stage: a waiting request is forgotten (it never reached a worker),
a forward is cancelled (``cancel_requests``), an output after COMPUTE_DONE is dropped
through the request's handle (``RequestHandle.drop``, acknowledged), a stream is
closed; a request being sent or post-processed is left to its driver, which sees the
end at its next step.  Cancels, drops and closes go on the control thread, never behind
a send.
"""

from __future__ import annotations

import asyncio
import logging

from omni_async.core.engine_states import StageEvent, StageState
from omni_async.core.errors import RequestAborted
from omni_async.engine.admission import Admission
from omni_async.engine.errors import EngineClosed
from omni_async.engine.record import RequestRecord
from omni_async.engine.threads import EngineThreads
from omni_async.executor.api import DiffusionExecutor

__all__ = ["RequestEnds"]

log = logging.getLogger("omni_async.engine.engine")

SS = StageState
SE = StageEvent

# What an abort's error says of where the request was.
_WHERE: dict[StageState, str] = {
    SS.WAITING: "while waiting in the engine's queue; it never reached a worker",
    SS.SUBMITTED: "while it was being sent",
    SS.COMPUTING: "during its forward",
    SS.COMPUTED: "after its forward, before its output arrived",
    SS.POSTPROCESSING: "while its output was post-processed",
    SS.RESOLVED: "while its stream was read",
}


class RequestEnds:
    """Early ends and their clean-up (see the module docstring)."""

    def __init__(self, admission: Admission, threads: EngineThreads, executor: DiffusionExecutor) -> None:
        self._admission = admission
        self._threads = threads
        self._executor = executor

    def end_early(
        self, rec: RequestRecord, event: StageEvent, *, error: BaseException | None = None, outcome: str | None = None
    ) -> None:
        """Decide ``rec``'s end now (``ABORT``, ``CANCEL``: its caller went away,
        ``CLOSE``, ``FAIL`` with ``error``) unless one is decided already, fail its caller,
        and start its clean-up.  ``outcome``: what to count instead of the end's state."""
        if event is SE.CLOSE:
            self.close_stream(rec)  # also after its result: the chunks nobody took go
        if rec.ended():
            return  # the first end decided counts
        rid = rec.request_id
        where = rec.stage
        self._admission.fire(rec, event, outcome=outcome)
        if error is None:
            if event is SE.CLOSE:
                error = EngineClosed(f"the engine closed before request {rid!r} finished", request_id=rid)
            elif event is SE.ABORT:
                error = RequestAborted(rid, by="abort", detail=f"aborted in the engine {_WHERE[where]}")
        rec.error = error
        if not rec.result.done():
            if error is not None:
                rec.result.set_exception(error)
            else:
                rec.result.cancel()
        self.close_stream(rec)
        match where:
            case SS.WAITING:
                self._admission.forget(rec)  # nothing of it reached a worker
            case SS.SUBMITTED | SS.POSTPROCESSING | SS.RESOLVED:
                pass  # the driver sees the end at its next step
            case SS.COMPUTING:
                self.cancel_forward(rec)
            case SS.COMPUTED:
                self.drop_computed(rec)
            case _:
                raise AssertionError(f"request {rid!r}: an end decided in stage {where}")

    def fail(self, rec: RequestRecord, error: BaseException, *, outcome: str | None = None) -> None:
        self.end_early(rec, SE.FAIL, error=error, outcome=outcome)

    def cancel_forward(self, rec: RequestRecord) -> None:
        """Ask the workers to stop ``rec``'s forward (fire and forget: the driver awaits
        the handle's ``computed``, which fails with ``RequestAborted`` or resolves anyway)."""
        rid = rec.request_id
        cancel = self._executor.cancel_requests
        self._threads.control_logged(lambda: cancel([rid]), "cancel_requests", rid)

    def drop_computed(self, rec: RequestRecord) -> None:
        """After COMPUTE_DONE: drop ``rec``'s output through its handle (once); ``rec.drop``
        resolves to the executor's acknowledgement."""
        handle = rec.handle
        assert handle is not None, f"request {rec.request_id!r}: a drop after COMPUTE_DONE needs its handle"
        if rec.drop is None:
            rec.drop = self._threads.control(handle.drop)

    async def await_drop(self, rec: RequestRecord) -> None:
        """Until the executor acknowledged the drop of ``rec``'s output (nothing of it left)."""
        assert rec.drop is not None
        try:
            done = await rec.drop
            await asyncio.wrap_future(done)
        except Exception as exc:  # the executor shut down meanwhile: that released it
            log.debug("engine: dropping the output of %r: %s", rec.request_id, exc)

    def close_stream(self, rec: RequestRecord) -> None:
        """Close ``rec``'s stream on the control thread (once): the chunks not taken are dropped."""
        if rec.stream is None or rec.close is not None:
            rec.changed.set()
            return
        rec.close = self._threads.control(rec.stream.close)
        rec.changed.set()
        rec.poke.set()
