"""One soak request, from submit to its one outcome: through the executor
(``executor_request``) or the engine (``engine_request``), its fault applied, its bytes
checked against the digest the worker took (``host_digest``)."""

from __future__ import annotations

import random
import time

import attrs

from omni_async.cli.soak_lives import EngineThread, Life
from omni_async.cli.soak_plans import (
    ABORTED,
    CANCELLED,
    CHANGED,
    CONSUMER_GONE,
    RESULT,
    WAIT_S,
    WIDTH,
    Plan,
)
from omni_async.core.errors import OmniAsyncError, OutputDropped, OutputError, RequestAborted
from omni_async.core.messages import DiffusionOutput
from omni_async.engine.metrics import GenerationResult
from omni_async.models.tiny import host_digest

__all__ = ["engine_request", "executor_request", "host_digest"]


# ------------------------------------------------------------------------------ one request


def _intact(out: DiffusionOutput, plan: Plan) -> bool:
    image = out.output["image"]
    return bool(
        out.request_id == plan.request_id
        and tuple(image.shape) == (plan.height, WIDTH)
        and host_digest(image) == int(out.output["digest"])
        and len(out.output["latents"]) == (plan.steps if plan.keep_trajectory else 0)
    )


def _consume(life: Life, out: DiffusionOutput, plan: Plan) -> str:
    intact = _intact(out, plan)
    life.ex.release_output(out)
    return RESULT if intact else CHANGED


# The faults that act on the call before its COMPUTE_DONE: through a handle.  Those that act
# on the claim of an output by its id: the seed's shape.  Every other request takes either,
# by its index's parity, so that both paths carry plain requests and the other faults.
HANDLE_FAULTS = frozenset({"kill", "cancel-call", "consumer-gone"})
BY_ID_FAULTS = frozenset({"abort", "tight-wait", "expire"})


def executor_request(plan: Plan, life: Life, output_timeout: float) -> str:
    """Run one request as its plan says; returns its outcome (raises what ended it otherwise).

    Through a handle (``submit``: the output claimed for it at COMPUTE_DONE) or in the
    seed's shape (``execute_request``, then ``wait_output_ready`` of the output's id); a
    'cancel-wait' cancels ``handle.output`` or the future ``wait_output_ready`` gave."""
    if plan.fault in HANDLE_FAULTS or (plan.fault not in BY_ID_FAULTS and plan.index % 2 == 0):
        return _through_a_handle(plan, life)
    return _by_id(plan, life, output_timeout)


def _through_a_handle(plan: Plan, life: Life) -> str:
    ex, fault = life.ex, plan.fault
    consumer = f"soak-consumer-{plan.index}" if fault == "consumer-gone" else None
    h = ex.submit(plan.request(), consumer=consumer)
    if fault == "kill":
        life.kill_one(random.Random(plan.index))
    elif fault == "cancel-call":
        time.sleep(plan.delay)
        if h.computed.cancel():
            return CANCELLED
    elif fault == "cancel-wait":
        time.sleep(plan.delay)
        if h.output.cancel():  # abandoned: the executor releases it on arrival (F9)
            return CANCELLED
    elif consumer is not None:
        if plan.early:
            ex.release_consumer(consumer)
        try:
            h.computed.result(timeout=WAIT_S)
        except OutputDropped:
            return CONSUMER_GONE  # gone before the call resolved
        ex.release_consumer(consumer)
        try:
            out = h.output.result(timeout=WAIT_S)
        except OutputError as exc:
            if isinstance(exc, OutputDropped) or type(exc) is OutputError:  # abandoned on its way
                return CONSUMER_GONE
            raise
        # Claimed for the handle at COMPUTE_DONE, and delivered before the consumer went:
        # the caller's, as any delivered output.
        return _consume(life, out, plan)
    return _consume(life, h.output.result(timeout=WAIT_S), plan)


def _by_id(plan: Plan, life: Life, output_timeout: float) -> str:
    ex, fault = life.ex, plan.fault
    oid = ex.execute_request(plan.request()).async_output_id
    assert oid is not None
    if fault == "abort" and plan.early:
        ex.drop_output(oid).result(timeout=WAIT_S)
        return ABORTED
    if fault == "expire":
        time.sleep(output_timeout + 0.25)
    waiter = ex.wait_output_ready(oid)
    if fault == "cancel-wait":
        time.sleep(plan.delay)
        if waiter.cancel():
            return CANCELLED
    elif fault == "tight-wait":
        try:
            return _consume(life, waiter.result(timeout=plan.delay), plan)
        except TimeoutError as exc:
            if isinstance(exc, OmniAsyncError):  # OutputTimeout: the executor's deadline, an outcome
                raise
            if waiter.cancel():  # abandoned: the executor releases it on arrival
                return CANCELLED
    elif fault == "abort":
        time.sleep(plan.delay)
        ex.drop_output(oid).result(timeout=WAIT_S)
        err = waiter.exception(timeout=WAIT_S)
        if isinstance(err, OutputDropped):
            return ABORTED
        if err is not None:
            raise err
        return _consume(life, waiter.result(), plan)  # delivered before the drop
    return _consume(life, waiter.result(timeout=WAIT_S), plan)


def engine_request(plan: Plan, life: Life, eng: EngineThread) -> str:
    """Run one request through the life's engine as its plan says (``ENGINE_FAULTS``)."""
    fault, rid = plan.fault, plan.request_id
    deadlines = None
    tight = max(plan.delay, 1e-4)  # a deadline must be > 0
    if fault == "tight-wait":
        deadlines = attrs.evolve(life.deadlines, compute_timeout=tight)
    elif fault == "expire":
        deadlines = attrs.evolve(life.deadlines, output_timeout=tight)
    call = eng.call(eng.generate(plan.request(), deadlines))
    if fault == "kill":
        life.kill_one(random.Random(plan.index))
    elif fault in ("cancel-call", "cancel-wait"):
        if fault == "cancel-wait":
            time.sleep(plan.delay)
        if call.cancel():
            return CANCELLED
    elif fault in ("abort", "consumer-gone"):
        if not plan.early:
            time.sleep(plan.delay)
        eng.call(eng.engine.abort(rid, wait=fault == "consumer-gone")).result(timeout=WAIT_S)
        if fault == "consumer-gone" and not eng.call(eng.gone(rid)).result(timeout=WAIT_S):
            raise AssertionError(f"{rid}: still in the engine after abort(wait=True)")  # untyped: fails
    try:
        result = call.result(timeout=WAIT_S)
    except RequestAborted:
        if fault in ("abort", "consumer-gone"):
            return ABORTED
        raise
    return RESULT if _intact_result(result, plan) else CHANGED


def _intact_result(result: GenerationResult, plan: Plan) -> bool:
    """The engine's result (an owned copy of the output): the bytes the worker computed."""
    out = result.output
    image = out["image"]
    return bool(
        result.request_id == plan.request_id
        and tuple(image.shape) == (plan.height, WIDTH)
        and host_digest(image) == int(out["digest"])
        and len(out["latents"]) == (plan.steps if plan.keep_trajectory else 0)
    )
