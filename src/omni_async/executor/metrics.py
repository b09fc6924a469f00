"""``ExecutorMetrics``: the executor's counters, one typed snapshot.

``metrics()`` used to return a ``dict[str, float]`` whose keys a reader had to know
and whose counts came back as floats.  The fields keep those names (so the docs, the
Prometheus collector and the tests map one to one), with their real types: counts are
``int``, durations ``float`` seconds, ``pool_full`` a ``bool``.  The executors with
a budget of held outputs (processes, Ray) give ``HeldOutputMetrics``, which adds the
budget's fields; ``stored_outputs`` is ``RayDiffusionExecutor``'s alone (None
elsewhere).  ``as_dict`` gives the old mapping (floats, None fields left out), for
exporters that iterate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:  # annotations only: the engine's metrics import this, and the pump pulls in torch
    from omni_async.core.dispatch import Dispatcher
    from omni_async.executor.pump import ResultPump

__all__ = ["ExecutorMetrics", "HeldOutputMetrics", "read_metrics"]


@attrs.frozen(kw_only=True)
class ExecutorMetrics:
    """A snapshot of the executor side (``DiffusionExecutor.metrics``).

    ``output_waits``/``output_wait_s_total``/``output_wait_s_max``: the
    ``wait_output_ready`` futures that delivered an output, and how long they took
    from the call.  An executor with a budget of held outputs gives
    ``HeldOutputMetrics``, these and the budget's.
    """

    pending_rpcs: int
    pending_outputs: int
    pending_waiters: int
    held_payloads: int
    delivered: int
    released: int
    timeouts: int
    # Outputs that arrived but that no COMPUTE_DONE named before their call ended:
    # released by their deadline (OutputOrphaned, defect 3).
    orphaned_outputs: int
    protocol_errors: int
    # Of which (M3): execute calls the reply rank answered without COMPUTE_DONE;
    # COMPUTE_DONEs, CHUNKs and RPC_RESULTs of a call never made (or ended longer ago
    # than remembered); answers a rank repeated in a collective_rpc.
    answers_without_compute_done: int
    unknown_call_compute_done: int
    unknown_call_chunk: int
    unknown_call_rpc_result: int
    unexpected_sync_answers: int
    # COMPUTE_DONEs of no pending call, whose ids are dropped: late ones (not errors)
    # and those of a call never made (counted above too); late answers of an earlier
    # collective_rpc (not errors).
    orphan_compute_done: int
    stale_sync_answers: int
    # Late answers of execute calls that already ended (their compute deadline):
    # discarded, never kept in the synchronous buffer (S2).
    late_rpc_results: int
    # DROPPING records of an unknown call given up at their deadline (M6).
    orphan_drops_expired: int
    compute_timeouts: int
    # Calls ended by their compute deadline that a rank has not answered yet (their
    # forward was cancelled; see check_health's WorkerStuck).
    overdue_calls: int
    dispatch_errors: int
    messages: int
    output_waits: int
    output_wait_s_total: float
    output_wait_s_max: float

    def as_dict(self) -> dict[str, float]:
        """The fields as floats by name, the None ones left out (``metrics()``'s old shape)."""
        return {k: float(v) for k, v in attrs.asdict(self, recurse=False).items() if v is not None}


@attrs.frozen(kw_only=True)
class HeldOutputMetrics(ExecutorMetrics):
    """``ExecutorMetrics`` and the budget of held outputs (executors with ranks).

    ``max_held_outputs``/``max_held_bytes``: the budget; ``held_outputs``/``held_bytes``:
    what is held now (packed and not yet released; for Ray, ``held_outputs`` counts the
    outputs in its object store too; 0 once the executor shut down, which unlinked
    everything); ``pool_full``: a worker's packing waits for room now, for
    ``pool_full_s``; ``pool_waits``/``pool_wait_s_total``: packs that had to wait, and
    how long in all; ``pool_exhausted``: outputs that found no room in time
    (``HeldOutputsFull``).  ``stored_outputs`` (Ray): received outputs whose buffer in
    the object store is not read yet.
    """

    max_held_outputs: int
    max_held_bytes: int
    held_outputs: int
    held_bytes: int
    pool_full: bool
    pool_full_s: float
    pool_waits: int
    pool_wait_s_total: float
    pool_exhausted: int
    stored_outputs: int | None = None


def read_metrics(
    d: Dispatcher,
    pump: ResultPump,
    waits: tuple[int, float, float],
    unexpected_sync_answers: int,
    stale_sync_answers: int,
) -> ExecutorMetrics:
    """The executor's counters, read under the pump's lock (``pump.call``): the
    dispatcher's and registry's, the pump's, the desk's ``waits`` (deliveries, their total
    and longest wait) and the synchronous calls' discarded answers."""
    s = d.registry.stats
    c = d.counters
    return ExecutorMetrics(
        pending_rpcs=d.pending_rpcs(),
        pending_outputs=len(d.registry),
        pending_waiters=d.registry.pending_waiters(),
        held_payloads=d.registry.held_payloads(),
        delivered=s.delivered,
        released=s.released,
        timeouts=s.timeouts,
        orphaned_outputs=s.orphaned,
        protocol_errors=s.protocol_errors + c["protocol_errors"] + unexpected_sync_answers,
        answers_without_compute_done=c["answers_without_compute_done"],
        unknown_call_compute_done=c["unknown_call_compute_done"],
        unknown_call_chunk=c["unknown_call_chunk"],
        unknown_call_rpc_result=c["unknown_call_rpc_result"],
        unexpected_sync_answers=unexpected_sync_answers,
        orphan_compute_done=c["orphan_compute_done"],
        stale_sync_answers=stale_sync_answers,
        late_rpc_results=c["late_rpc_results"],
        orphan_drops_expired=s.orphan_drops_expired,
        compute_timeouts=c["compute_timeouts"],
        overdue_calls=d.overdue_calls(),
        dispatch_errors=pump.dispatch_errors,
        messages=pump.messages,
        output_waits=waits[0],
        output_wait_s_total=waits[1],
        output_wait_s_max=waits[2],
    )
