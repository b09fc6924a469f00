"""``Admission``: who is in the engine and where, and the loop that lets them in.

It owns the scheduler (``omni_async.engine.scheduler``: the queue, the running slots,
the budget of held outputs, batches), the records of the requests in the engine (each
with its stage machine), the count of outcomes, and the loop task that admits waiting
requests and hands each admitted group to whoever starts it (``run``'s ``start``).
Everything that can refuse a request does so in ``admit``, at the call and before
anything of the request exists; a refusal counts ``rejected``.

Every method runs on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from omni_async.core.config import Deadlines
from omni_async.core.engine_states import (
    OUTCOME_OF,
    STAGE_TERMINAL,
    StageEvent,
    StageObserver,
    stage_machine,
)
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.config import DEFAULT_MAX_IN_FLIGHT, EngineConfig
from omni_async.engine.errors import EngineOverloaded
from omni_async.engine.record import RequestRecord, retrieve
from omni_async.engine.scheduler import Scheduler, SchedulerPhase
from omni_async.executor.submitter import BatchKeyer
from omni_async.transport.budget import OutputBudget
from omni_async.worker.postprocess import PostProcess

__all__ = ["OUTCOMES", "Admission"]

log = logging.getLogger("omni_async.engine.engine")

SE = StageEvent

#: Every outcome ``metrics().requests`` counts.
OUTCOMES = (*(st.value for st in STAGE_TERMINAL), "rejected")


class Admission:
    """The queue, the running slots and the records (see the module docstring)."""

    def __init__(self, config: EngineConfig, trace_stage: StageObserver | None) -> None:
        self._config = config
        self._trace_stage = trace_stage
        self.scheduler: Scheduler | None = None
        self.records: dict[str, RequestRecord] = {}
        self.counts = dict.fromkeys(OUTCOMES, 0)
        # Set whenever the loop may admit more: a request queued, a slot freed.
        self.wake = asyncio.Event()
        self._validate: Callable[[DiffusionRequest], None] | None = None
        self._post_of: Callable[[DiffusionRequest], PostProcess | None] | None = None
        self._keyer: BatchKeyer | None = None

    def open(
        self,
        budget: OutputBudget | None,
        *,
        validate: Callable[[DiffusionRequest], None],
        post_of: Callable[[DiffusionRequest], PostProcess | None],
        batch_key: BatchKeyer,
    ) -> None:
        """At start, once the executor is known: its budget of held outputs, its check of
        a request's parameters, the post-processor's choice of a request's post-process,
        and the batch keyer (the config's, else the executor's)."""
        cfg = self._config
        cap = cfg.max_in_flight
        if cap is None and budget is None:
            cap = DEFAULT_MAX_IN_FLIGHT
        self.scheduler = Scheduler(
            max_waiting=cfg.max_waiting,
            max_running=cfg.running_slots,
            max_in_flight=cap,
            budget=budget,
            max_batch_size=cfg.max_batch_size,
            batch_wait_s=cfg.batch_wait_s,
        )
        self._validate, self._post_of = validate, post_of
        self._keyer = cfg.batch_key if cfg.batch_key is not None else batch_key

    # ------------------------------------------------------------------ requests

    def admit(
        self,
        request: DiffusionRequest,
        deadlines: Deadlines | None,
        what: str,
        *,
        streaming: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> RequestRecord:
        """Check the call and queue the request; everything that can refuse it does so
        here, before anything of it exists."""
        s = self.scheduler
        assert s is not None and self._validate is not None and self._post_of is not None
        rid = request.request_id
        if rid in self.records:
            raise UsageError(f"{what}: request id {rid!r} is already in the engine; request ids must be unique")
        now = time.monotonic()
        try:
            self._validate(request)
            post = self._post_of(request)
            key = self._compat_key(request, deadlines, streaming)
            machine = stage_machine(rid, self._trace_stage)
            rec = RequestRecord(request, deadlines, loop.create_future(), now, machine, streaming=streaming)
            # The last step, and the only one that changes anything: nothing that can
            # fail runs after the request is queued (the loop finds its record for every
            # id the scheduler admits).
            s.add(rid, key=key, now=now)
        except (EngineOverloaded, UsageError):
            self.counts["rejected"] += 1
            raise
        rec.postprocess = post
        rec.pipeline = request.postprocess if request.postprocess is not None else self._config.pipeline
        rec.result.add_done_callback(retrieve)
        rec.result.add_done_callback(lambda _: rec.changed.set())
        self.records[rid] = rec
        self.wake.set()
        return rec

    def _compat_key(self, request: DiffusionRequest, deadlines: Deadlines | None, streaming: bool) -> object:
        """What the requests of one batch share (None: ``request`` goes alone): the
        model's batch key, the deadlines (one call, one compute deadline: a member keeps
        the deadline it has alone) and whether it streams."""
        if self._config.max_batch_size == 1:
            return None
        assert self._keyer is not None
        try:
            key = self._keyer(request)
            hash(key)
        except (UsageError, EngineOverloaded):
            raise
        except Exception as exc:
            raise UsageError(
                f"request {request.request_id!r}: its batch key could not be taken ({type(exc).__name__}: {exc}); "
                "a batch_key must return a hashable value (or None: never batched) for every valid request"
            ) from exc
        return None if key is None else (key, deadlines, streaming)

    def fire(self, rec: RequestRecord, event: StageEvent, *, outcome: str | None = None) -> None:
        """Move ``rec``'s machine; the step that decides its end counts its outcome
        (``outcome`` instead of the state's: ``rejected`` for a request the executor
        refused at its send), so every request is counted exactly once."""
        was_ended = rec.ended()
        rec.machine.fire(event)
        if not was_ended and rec.ended():
            self.counts[outcome or OUTCOME_OF.get(rec.stage, rec.stage).value] += 1

    def forget(self, rec: RequestRecord) -> None:
        """Nothing of ``rec`` remains: it reaches its terminal state, frees its place and
        wakes the loop."""
        assert self.scheduler is not None
        if not rec.machine.terminal:
            self.fire(rec, SE.GONE)
        self.scheduler.remove(rec.request_id)
        if self.records.get(rec.request_id) is rec:
            del self.records[rec.request_id]
        rec.gone.set()
        self.wake.set()

    def compute_done(self, rec: RequestRecord) -> None:
        """``rec``'s forward is over: its running slot is free, the loop admits the next."""
        assert self.scheduler is not None
        self.scheduler.compute_done(rec.request_id)
        self.wake.set()

    def set_lent(self, count: int) -> None:
        """The outputs lent to callers now (``sink="segment"``): they hold the budget."""
        assert self.scheduler is not None
        self.scheduler.lent = count
        self.wake.set()

    def observe_output(self, nbytes: int) -> None:
        assert self.scheduler is not None
        self.scheduler.observe_output(nbytes)

    def phase_of(self, request_id: str) -> SchedulerPhase | None:
        return None if self.scheduler is None else self.scheduler.phase(request_id)

    async def await_gone(self, deadline: float) -> None:
        """Until every request in the engine is gone, or ``deadline`` (``time.monotonic()``):
        then the drivers left are cancelled, their requests abandoned to the executor."""
        recs = list(self.records.values())
        if not recs:
            return
        waits = [asyncio.ensure_future(r.gone.wait()) for r in recs]
        limit = max(0.0, deadline - time.monotonic())
        _, pending = await asyncio.wait(waits, timeout=limit)
        for w in pending:
            w.cancel()
        left = [r for r in recs if not r.gone.is_set()]
        if left:
            log.warning(
                "engine close: %d request(s) still on a worker after %.1f s (%s); abandoning them to the "
                "executor, which releases their outputs as they arrive",
                len(left),
                limit,
                [r.request_id for r in left][:10],
            )
            for r in left:
                if r.driver is not None:
                    r.driver.cancel()  # cancels the executor futures it awaits: abandoned (F9)
            # A driver stuck in a host stage returns from its cancel at once (the
            # stage's thread is abandoned): this gather does not wait for the stage.
            await asyncio.gather(*(r.driver for r in left if r.driver is not None), return_exceptions=True)

    # ------------------------------------------------------------------ the loop

    async def run(self, start: Callable[[list[RequestRecord]], None]) -> None:
        """The loop task: admit waiting requests as far as the scheduler allows (ADMIT)
        and hand each group to ``start`` (which must not raise: a group it cannot start
        it fails itself), then sleep until something changes."""
        s = self.scheduler
        assert s is not None
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None
        while True:
            self.wake.clear()
            for batch in s.schedule_batches(time.monotonic()):
                recs = [self.records[rid] for rid in batch]
                for rec in recs:
                    self.fire(rec, SE.ADMIT)
                start(recs)
            held = s.held_until
            if held is not None:
                # A batch waits for more members: look again when its wait ends.
                timer = loop.call_later(max(0.0, held - time.monotonic()), self.wake.set)
            try:
                await self.wake.wait()
            finally:
                if timer is not None:
                    timer.cancel()
                    timer = None
