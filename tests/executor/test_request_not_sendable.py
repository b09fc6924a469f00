"""A request parameter that does not pickle fails at the call, typed (issue 17, defect 10).

Through real worker processes: the executor stays healthy, nothing of the call stays
registered, no rank got any of it, and the next request succeeds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import omni_async.core.errors as errors
from helpers.leaks import kept_for_the_module
from helpers.mp_workers import expected_image
from omni_async.core.config import Deadlines
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

SPEC = WorkerSpec("helpers.mp_workers:ScriptedWorker", pass_rank=True)
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


@pytest.fixture(scope="module")
def ex() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(SPEC, world_size=2, deadlines=DEADLINES))


def _ok(ex: MultiprocDiffusionExecutor, rid: str) -> None:
    params = {"numel": 1 << 15, "seed": 5}
    ro = ex.execute_request(DiffusionRequest(rid, params))
    assert ro.async_output_id is not None
    out = ex.wait_output_ready(ro.async_output_id).result(timeout=30)
    assert torch.equal(out.output["image"], expected_image(params))
    ex.release_output(out)


@pytest.mark.parametrize("bad", [lambda: 1, threading.Lock()], ids=["lambda", "lock"])
@pytest.mark.slow
def test_unpicklable_parameter_raises_request_not_sendable_naming_it(
    ex: MultiprocDiffusionExecutor, bad: object
) -> None:
    req = DiffusionRequest("r-bad", {"seed": 1, "fn": bad})
    with pytest.raises(errors.RequestNotSendable) as err:
        ex.submit(req)
    e = err.value
    assert isinstance(e, UsageError)
    assert e.request_id == "r-bad" and e.parameter == "fn", str(e)
    assert "'r-bad'" in str(e) and "'fn'" in str(e)
    assert ex.metrics().pending_rpcs == 0
    ex.check_health()
    _ok(ex, "r-next")


def test_unpicklable_parameter_in_a_batch_and_in_a_collective_rpc(ex: MultiprocDiffusionExecutor) -> None:
    with pytest.raises(errors.RequestNotSendable) as err:
        ex.submit_batch([DiffusionRequest("fine", {"seed": 1}), DiffusionRequest("worse", {"cb": lambda: 2})])
    assert err.value.request_id == "worse" and err.value.parameter == "cb"
    with pytest.raises(errors.RequestNotSendable) as err2:
        ex.collective_rpc("pid", (lambda: 3,))
    assert err2.value.request_id is None and err2.value.parameter == "args[0]"
    assert ex.metrics().pending_rpcs == 0
    # Both ranks answer the next call: neither holds half of a failed one.
    pids = ex.collective_rpc("pid")
    assert pids == [p.pid for p in ex.procs]
    _ok(ex, "after-batch")
