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


def executor_request(plan: Plan, life: Life, output_timeout: float) -> str:
    """Run one request as its plan says; returns its outcome (raises what ended it otherwise)."""
    ex, fault = life.ex, plan.fault
    consumer = f"soak-consumer-{plan.index}" if fault == "consumer-gone" else None
    call = ex.submit_request(plan.request(), consumer=consumer)
    if fault == "kill":
        life.kill_one(random.Random(plan.index))
    if fault == "cancel-call":
        time.sleep(plan.delay)
        if call.cancel():
            return CANCELLED
    if consumer is not None:
        if plan.early:
            ex.release_consumer(consumer)
        try:
            oid = call.result(timeout=WAIT_S).async_output_id
        except OutputDropped:
            return CONSUMER_GONE  # gone before the call resolved
        ex.release_consumer(consumer)
        assert oid is not None
        try:
            ex.release_output(ex.wait_output_ready(oid).result(timeout=WAIT_S))
        except OutputError as exc:
            if isinstance(exc, OutputDropped) or type(exc) is OutputError:  # abandoned, or released already
                return CONSUMER_GONE
            raise
        raise AssertionError(f"{plan.request_id}: delivered after its consumer was released")  # untyped: fails
    oid = call.result(timeout=WAIT_S).async_output_id
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
