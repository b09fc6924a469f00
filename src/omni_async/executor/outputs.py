"""The output side of the executor API: claiming an output announced by COMPUTE_DONE,
delivering it once, dropping it in any state, and taking it back from the engine.

``DiffusionExecutor`` (``executor/api.py``) is built on this class: the calls live
there, what becomes of their outputs here.  A transport changes ``_deliver`` (what the
engine gets for what travelled) and ``release_output`` (giving its segments back).
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future

from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import OutputAlreadyClaimed, RequestAborted, UsageError
from omni_async.core.messages import DiffusionOutput, RpcRequest, RunnerOutput
from omni_async.core.methods import DROP_OUTPUTS
from omni_async.executor.checks import check_consumer, check_deadlines, check_output, check_output_id
from omni_async.executor.claims import OutputClaims, link_output
from omni_async.executor.pump import ResultPump

log = logging.getLogger("omni_async.executor.api")


class ExecutorOutputs(abc.ABC):
    pump: ResultPump
    _output_claims: OutputClaims

    # The argument checks every call uses (checks.py), reachable as methods.
    _check_deadlines = staticmethod(check_deadlines)
    _check_consumer = staticmethod(check_consumer)
    _check_output_id = staticmethod(check_output_id)
    _check_output = staticmethod(check_output)

    @abc.abstractmethod
    def _broadcast(self, req: RpcRequest, wire: list[bytes] | None = None) -> None:
        """Send ``req`` to every rank (the transport's job)."""

    @abc.abstractmethod
    def next_rpc_id(self) -> str:
        """A fresh RPC id of this executor."""

    def _claim_for(
        self, call: Future[tuple[RunnerOutput, ...]], output: Future[DiffusionOutput], index: int = 0
    ) -> None:
        """On the thread that resolved ``call`` (the pump's, right after its COMPUTE_DONE),
        before anyone else sees the id: claim the output of the call's ``index``-th
        request for ``output``."""
        if call.cancelled():
            output.cancel()
            return
        exc = call.exception()
        announced = None if exc is not None else call.result()[index]
        oid = None if announced is None else announced.async_output_id
        if exc is None and announced is not None and announced.aborted:
            exc = RequestAborted(announced.request_id, detail="cancelled while the rest of its batch went on")
        if exc is not None or oid is None:
            if output.set_running_or_notify_cancel():
                output.set_exception(exc if exc is not None else UsageError("the request has no output"))
            return
        # Claimed even when ``output`` was cancelled already: ``on_output`` below then
        # cancels the claim at once, and the registry releases the output on arrival
        # (F9) -- never a drop sent from here, which would write a pipe on the pump thread.
        t0 = time.monotonic()
        status = ["waiting"]
        try:
            delivered = self._watch_claim(self.pump.call(lambda d: self._claim(d, oid, status)), oid, t0, status)
        except Exception as err:  # a callback's exception would be logged and lost: fail the future
            if output.set_running_or_notify_cancel():
                output.set_exception(err)
            return

        link_output(delivered, output, self._release_abandoned)

    def _release_abandoned(self, output: DiffusionOutput) -> None:
        try:
            self.release_output(output)
        except Exception:
            log.exception("releasing the abandoned output %s failed", output.async_output_id)

    # ---------------------------------------------------------------- outputs

    def wait_output_ready(self, async_output_id: str) -> Future[DiffusionOutput]:
        """The future of an output announced by COMPUTE_DONE.

        **Exactly one waiter per id.**  The first call for an id claims it and is the
        only one ever to get its output (or its failure).  Every later call for the same
        id fails at once -- its future already holds ``OutputAlreadyClaimed``, a
        ``UsageError`` naming the id and what became of the first claim (waiting,
        delivered, failed, cancelled) -- never a second delivery of the same segment and
        never "unknown id".  Share the first future, or the output it delivers, instead.
        A call that fails at once for another reason (an id never announced, already
        dropped, a closed executor) claims nothing.  Claims are remembered for the
        last 4096 ids; an older id is "unknown" again.

        Cancelling the future abandons the output: it is released the moment it
        arrives (F9).
        """
        self._check_output_id(async_output_id, "wait_output_ready")
        t0 = time.monotonic()
        status = ["waiting"]
        fut = self.pump.call(lambda d: self._claim(d, async_output_id, status))
        if fut.done() and isinstance(fut.exception(), OutputAlreadyClaimed):
            return fut
        return self._watch_claim(fut, async_output_id, t0, status)

    def _claim(self, d: Dispatcher, async_output_id: str, status: list[str]) -> Future[DiffusionOutput]:
        return self._output_claims.claim(d, async_output_id, status)

    def _watch_claim(
        self, fut: Future[DiffusionOutput], async_output_id: str, t0: float, status: list[str]
    ) -> Future[DiffusionOutput]:
        """A claimed output's future for the engine: cancelling it abandons the output (F9);
        its delivery is timed; ``_deliver`` turns what travelled into what the engine gets."""

        def on_done(f: Future[DiffusionOutput]) -> None:
            if f.cancelled():
                status[0] = "cancelled"
                self.pump.call(lambda d: d.registry.cancel(async_output_id, f))
            elif (exc := f.exception()) is None:
                status[0] = "delivered"
                self._output_claims.record_wait(time.monotonic() - t0)
            else:
                status[0] = f"failed with {type(exc).__name__}"

        fut.add_done_callback(on_done)
        return self._deliver(fut)

    def _deliver(self, packed: Future[DiffusionOutput]) -> Future[DiffusionOutput]:
        """The future the engine gets for a claimed output (identity in process)."""
        return packed

    def drop_output(self, async_output_id: str) -> Future[None]:
        """Drop/abort an output in any state (F10).

        The returned future resolves once nothing of it remains in the executor
        (an acknowledged abort); a packing that has not started is cancelled (F15).
        """
        self._check_output_id(async_output_id, "drop_output")
        done = self.pump.call(lambda d: d.registry.drop(async_output_id))
        if not done.done():
            self._notify_drop([async_output_id])
        return done

    def abort_outputs(self, async_output_ids: Iterable[str], timeout: float | None = None) -> None:
        """Drop several outputs and return only when all of them are gone (before a weight update)."""
        futs = [self.drop_output(oid) for oid in async_output_ids]
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in futs:
            f.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))

    def release_output(self, output: DiffusionOutput) -> int:
        """The engine is done with a delivered output: give back what it holds (segments).

        Returns how many segments went back; 0 for an executor without shared memory.
        Where outputs are zero-copy views of shared memory (``MultiprocDiffusionExecutor``)
        the segment goes back only once no tensor or array viewing it is alive: this call
        takes the output's own views back (``output.output`` is unusable afterwards) and
        raises ``OutputStillViewed`` if the engine still holds others -- it never hands
        the segment to the next request under a live view.  Dropping every view without
        calling it releases the segment too.
        """
        self._check_output(output, "release_output")
        return 0

    def release_consumer(self, consumer: str) -> int:
        """The consumer went away without aborting (F11): release everything it owned."""
        return self.pump.call(lambda d: d.release_consumer(consumer))

    def _notify_drop(self, output_ids: list[str]) -> None:
        try:
            self._broadcast(RpcRequest(self.next_rpc_id(), DROP_OUTPUTS, (output_ids,)))
        except Exception as exc:  # best effort: the registry already released everything
            log.debug("cannot tell the workers about dropped outputs: %s", exc)


__all__ = ["ExecutorOutputs"]
