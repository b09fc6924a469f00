"""Exactly-once delivery of an output: the claims of ``wait_output_ready`` and
``submit_handle``, and how long the engines waited for what they were delivered.

The first claim of an id is the only one ever to get its output; a later claim gets
``OutputAlreadyClaimed`` naming what became of the first (``DiffusionExecutor.
wait_output_ready`` documents the rule).  ``claim`` runs under the pump's lock (inside
``pump.call``), so the table needs no lock of its own; the wait statistics are written
from future callbacks on any thread and have one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import OutputAlreadyClaimed
from omni_async.core.messages import DiffusionOutput


class OutputClaims:
    def __init__(self, max_claims: int = 4096) -> None:
        # The ids claimed, oldest first, each with what became of its claim (a
        # one-element list the claim's future updates); bounded: an older id is
        # "unknown" again.
        self._claims: OrderedDict[str, list[str]] = OrderedDict()
        self._max = max_claims
        self._wait_lock = threading.Lock()
        self._waits = 0
        self._wait_s_total = 0.0
        self._wait_s_max = 0.0

    def claim(self, d: Dispatcher, async_output_id: str, status: list[str]) -> Future[DiffusionOutput]:
        """Under the pump's lock: the registry's future of ``async_output_id``, claimed once
        (``OutputAlreadyClaimed`` for a second claim; see ``wait_output_ready``)."""
        earlier = self._claims.get(async_output_id)
        if earlier is not None and not d.registry.closed:  # closed: that error says more
            refused: Future[DiffusionOutput] = Future()
            refused.set_exception(
                OutputAlreadyClaimed(
                    f"output {async_output_id!r} was already claimed by an earlier wait_output_ready "
                    f"({earlier[0]}): an output is delivered to exactly one waiter; share that future "
                    "or the output it delivered (copy what you keep)",
                    output_id=async_output_id,
                )
            )
            return refused
        fut = d.registry.wait(async_output_id)
        if not fut.done():  # a claim; a future failed at once claims nothing
            self._claims[async_output_id] = status
            while len(self._claims) > self._max:
                self._claims.popitem(last=False)
        return fut

    def record_wait(self, waited: float) -> None:
        """A claimed output was delivered ``waited`` seconds after its claim."""
        with self._wait_lock:
            self._waits += 1
            self._wait_s_total += waited
            self._wait_s_max = max(self._wait_s_max, waited)

    def wait_stats(self) -> tuple[int, float, float]:
        """Deliveries, their total and their longest wait (seconds)."""
        with self._wait_lock:
            return self._waits, self._wait_s_total, self._wait_s_max


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


__all__ = ["OutputClaims", "link_output"]
