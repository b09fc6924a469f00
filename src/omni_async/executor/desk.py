"""``OutputDesk``: the executor's outputs after COMPUTE_DONE -- claimed, delivered once,
dropped in any state, and taken back from the engine.

Exactly one taker per output: a ``RequestHandle``'s ``output`` (claimed by the dispatcher
as it dispatches the call's COMPUTE_DONE, ``ClaimSlots``), a stream's chunk, or one
``wait_output_ready`` (the seed's shape); a second claim of the same id gets
``OutputAlreadyClaimed``, decided by the registry (``OutputRegistry.claim``).  The desk
turns what the registry delivers into what the engine gets through the output store it
is handed (``OutputStore.receive``), times every delivery, and tells the workers about
drops through the sender's ``notify_drop``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

from omni_async.core.calls import ClaimSlots
from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import OutputAlreadyClaimed, ProtocolError, RequestAborted
from omni_async.core.messages import DiffusionOutput, RunnerOutput
from omni_async.core.stream import ChunkFeed
from omni_async.executor.checks import check_output, check_output_id
from omni_async.executor.futures import all_done, map_future
from omni_async.executor.pump import ResultPump
from omni_async.executor.store import OutputStore
from omni_async.executor.stream import OutputChunk, RequestStream

__all__ = ["OutputDesk", "link_output"]

log = logging.getLogger("omni_async.executor.api")


class OutputDesk:
    """Claims, deliveries, drops and releases of outputs (module docstring)."""

    def __init__(self, pump: ResultPump, store: OutputStore, notify_drop: Callable[[list[str]], None]) -> None:
        self._pump = pump
        self._store = store
        self._notify_drop = notify_drop
        # How long the engines waited for what was delivered (written from future
        # callbacks on any thread).
        self._wait_lock = threading.Lock()
        self._waits = 0
        self._wait_s_total = 0.0
        self._wait_s_max = 0.0

    # ------------------------------------------------------------------ claims

    def wait_output_ready(self, async_output_id: str) -> Future[DiffusionOutput]:
        """The future of an output announced by COMPUTE_DONE: exactly one waiter per id
        (``DiffusionExecutor.wait_output_ready``)."""
        check_output_id(async_output_id, "wait_output_ready")
        t0 = time.monotonic()
        fut = self._pump.call(lambda d: d.registry.claim(async_output_id))
        if fut.done() and isinstance(fut.exception(), OutputAlreadyClaimed):
            return fut
        return self._watch(fut, async_output_id, t0)

    def attach(
        self, call: Future[tuple[RunnerOutput, ...]], slots: ClaimSlots, outputs: Sequence[Future[DiffusionOutput]]
    ) -> None:
        """Relay the outputs the dispatcher claimed into ``slots`` into ``outputs`` (one per
        request), once ``call`` resolves; on the thread that resolves it, without the
        pump's lock (the claim was made under it)."""
        t0 = time.monotonic()

        def on_call(f: Future[tuple[RunnerOutput, ...]]) -> None:
            exc = None if f.cancelled() else f.exception()
            result = () if f.cancelled() or exc is not None else f.result()
            for i, output in enumerate(outputs):
                if f.cancelled():
                    output.cancel()
                    continue
                announced = result[i] if i < len(result) else None
                waiter = slots.waiters[i] if exc is None and i < len(slots.waiters) else None
                err: BaseException | None = exc
                if announced is not None and announced.aborted:
                    err = RequestAborted(announced.request_id, detail="cancelled while the rest of its batch went on")
                if waiter is None or announced is None or announced.async_output_id is None:
                    if output.set_running_or_notify_cancel():
                        output.set_exception(
                            err
                            if err is not None
                            else ProtocolError(f"request {i} of the call: its COMPUTE_DONE announced no output")
                        )
                    continue
                # Linked even when ``output`` was cancelled already: the link then cancels
                # the claim at once, and the registry releases the output on arrival (F9)
                # -- never a drop sent from here, which would write a pipe on the pump's thread.
                link_output(self._watch(waiter, announced.async_output_id, t0), output, self._release_quietly)

        call.add_done_callback(on_call)

    def _watch(self, fut: Future[DiffusionOutput], async_output_id: str, t0: float) -> Future[DiffusionOutput]:
        """A claimed output's future for the engine: cancelling it abandons the output (F9);
        its delivery is timed; the store turns what travelled into what the engine gets."""

        def on_done(f: Future[DiffusionOutput]) -> None:
            if f.cancelled():
                self._pump.call(lambda d: d.registry.cancel(async_output_id, f))
            elif f.exception() is None:
                self._record_wait(time.monotonic() - t0)

        fut.add_done_callback(on_done)
        return map_future(fut, self._store.receive, discard=self._release_quietly, run=self._store.run_unpack)

    def _release_quietly(self, output: DiffusionOutput) -> None:
        # Unpacked for a waiter that was cancelled meanwhile: nobody else holds its views.
        try:
            self._store.release(output)
        except Exception:
            log.exception("releasing the output %s failed", output.async_output_id)

    def _record_wait(self, waited: float) -> None:
        with self._wait_lock:
            self._waits += 1
            self._wait_s_total += waited
            self._wait_s_max = max(self._wait_s_max, waited)

    def wait_stats(self) -> tuple[int, float, float]:
        """Deliveries, their total and their longest wait (seconds)."""
        with self._wait_lock:
            return self._waits, self._wait_s_total, self._wait_s_max

    # ------------------------------------------------------------------ streams

    def stream_of(self, feed: ChunkFeed) -> RequestStream:
        """The ``RequestStream`` over ``feed``: each chunk claimed for it as it is taken."""
        return RequestStream(feed, self._take_chunk, self._peek_stream, self._close_stream)

    def _take_chunk(self, feed: ChunkFeed) -> tuple[OutputChunk | None, bool, BaseException | None]:
        """The next chunk of ``feed``, claimed (or None), whether the feed is finished, and
        how it ended: one look under the pump's lock."""
        t0 = time.monotonic()

        def take(d: Dispatcher) -> tuple[str | None, int, Future[DiffusionOutput] | None, bool, BaseException | None]:
            ref = d.take_chunk(feed)
            if ref is None:
                return None, 0, None, feed.exhausted, feed.error
            return ref.output_id, ref.seq, d.registry.claim(ref.output_id), feed.exhausted, feed.error

        oid, seq, fut, finished, error = self._pump.call(take)
        if oid is None or fut is None:
            return None, finished, error
        return OutputChunk(feed.request_id, seq, oid, self._watch(fut, oid, t0)), False, error

    def _peek_stream(self, feed: ChunkFeed) -> tuple[bool, BaseException | None]:
        return self._pump.call(lambda _: (feed.exhausted, feed.error))

    def _close_stream(self, feed: ChunkFeed) -> Future[None]:
        def close(d: Dispatcher) -> tuple[list[Future[None]], list[str]]:
            return d.close_stream(feed), d.take_worker_drops()

        acks, drops = self._pump.call(close)
        if drops:
            self._notify_drop(drops)  # a chunk still queued in a packer is skipped (F15)
        return all_done(acks)

    # ------------------------------------------------------------ drops, releases

    def drop_output(self, async_output_id: str) -> Future[None]:
        """Drop an output in any state (F10); resolves once nothing of it remains."""
        check_output_id(async_output_id, "drop_output")
        done = self._pump.call(lambda d: d.registry.drop(async_output_id))
        if not done.done():
            self._notify_drop([async_output_id])
        return done

    def drop_runner_outputs(self, outputs: Iterable[RunnerOutput]) -> None:
        """Drop the outputs these ``RunnerOutput``s announced (their caller went away)."""
        for ro in outputs:
            if ro.async_output_id is not None:
                self.drop_output(ro.async_output_id)

    def abort_outputs(self, async_output_ids: Iterable[str], timeout: float | None = None) -> None:
        """Drop several outputs; return once all of them are gone."""
        futs = [self.drop_output(oid) for oid in async_output_ids]
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in futs:
            f.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))

    def release_output(self, output: DiffusionOutput) -> int:
        check_output(output, "release_output")
        return self._store.release(output)

    def release_consumer(self, consumer: str) -> int:
        """Everything ``consumer`` owned, released (F11)."""
        return self._pump.call(lambda d: d.release_consumer(consumer))


def link_output(
    delivered: Future[DiffusionOutput],
    output: Future[DiffusionOutput],
    release_abandoned: Callable[[DiffusionOutput], None],
) -> None:
    """Relay a claimed output's future ``delivered`` into the caller's ``output``:
    cancelling ``output`` before the arrival cancels the claim (the registry releases
    the output when it comes, F9); an output delivered to a future already cancelled is
    handed to ``release_abandoned``."""
    # ``output`` and ``delivered`` each call back into the other: hold ``delivered``
    # in a box that the relay empties, so the two futures form no reference cycle
    # (cycles wait for the garbage collector: its pauses showed as a p99 of 130 ms
    # instead of 54 ms at the engine's ceiling, bench/engine_ceiling.py).
    box: list[Future[DiffusionOutput] | None] = [delivered]

    def relay(g: Future[DiffusionOutput]) -> None:
        box[0] = None
        if g.cancelled():
            output.cancel()
            return
        err = g.exception()
        if not output.set_running_or_notify_cancel():
            if err is None:  # cancelled as it was delivered: nobody else holds it
                release_abandoned(g.result())
            return
        if err is not None:
            output.set_exception(err)
        else:
            output.set_result(g.result())

    def on_output(o: Future[DiffusionOutput]) -> None:
        pending = box[0]
        if o.cancelled() and pending is not None:
            pending.cancel()  # before arrival: the registry releases it when it comes

    output.add_done_callback(on_output)
    delivered.add_done_callback(relay)
    del delivered
