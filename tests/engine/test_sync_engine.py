"""DiffusionEngine, the synchronous facade: the same engine on a loop of its own thread."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.executor_harness import GATES, RELAXED, gate_name, make_toy, req
from omni_async.core.errors import RequestAborted, RpcFailed
from omni_async.engine.errors import EngineClosed
from omni_async.engine.sync import DiffusionEngine
from omni_async.executor.inprocess import InProcessExecutor


def _toy() -> InProcessExecutor:
    return InProcessExecutor(make_toy, deadlines=RELAXED)


def test_generate_from_several_threads_and_close() -> None:
    with DiffusionEngine.from_factory(_toy) as engine:
        assert engine.add_req_and_wait_for_response(req("warm-up")).request_id == "warm-up"
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: engine.generate(req(f"t{i}", value=float(i))), range(8)))
        assert [float(r.output["image"][0]) for r in results] == [float(i) for i in range(8)]
        with pytest.raises(RpcFailed):
            engine.generate(req("bad", fail_on=[0]))
        engine.check_health()
        m = engine.metrics()
        assert m.requests["finished"] == 9 and m.requests["failed"] == 1
        ex = engine.executor
    assert ex._closed  # the facade's engine owned it
    with pytest.raises(EngineClosed):
        engine.generate(req("late"))
    engine.close()  # idempotent
    assert not any(t.name == "omni-engine-thread" and t.is_alive() for t in threading.enumerate())


@pytest.mark.slow
def test_a_timeout_aborts_the_request_and_releases_it() -> None:
    ex = _toy()
    try:
        # The toy's gate ignores cancellation: the facade waits for the release at most
        # close_timeout, then says the request is still being released.
        with DiffusionEngine(ex, close_timeout=0.5) as engine:
            fwd = gate_name()
            with pytest.raises(TimeoutError, match="still being released"):
                engine.generate(req("slow", gate=fwd), timeout=0.2)
            GATES.open(fwd)
            deadline = time.monotonic() + 10
            while len(engine.engine) or ex.metrics().pending_outputs or ex.metrics().pending_rpcs:
                assert time.monotonic() < deadline, "the timed-out request was not released"
                time.sleep(0.01)
            assert engine.metrics().requests["cancelled"] == 1
            assert engine.generate(req("next")).request_id == "next"
        assert not ex._closed  # not the facade's: the caller shuts it down
    finally:
        GATES.open_all()
        ex.shutdown()


def test_abort_from_another_thread() -> None:
    ex = _toy()
    try:
        with DiffusionEngine(ex, max_running=1) as engine:
            fwd = gate_name()
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(engine.generate, req("a", gate=fwd))
                assert GATES.wait_entered(fwd)
                engine.abort("a")
                GATES.open(fwd)
                with pytest.raises(RequestAborted):
                    pending.result(timeout=10)
            engine.abort(["a"], wait=True)  # finished ids are ignored
    finally:
        GATES.open_all()
        ex.shutdown()
