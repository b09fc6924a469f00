"""The device stage of post-processing: run by the worker's packer before the copy.

``WorkerSpec(..., postprocess="tiny")`` (worker processes) and
``InProcessExecutor(..., postprocess="tiny")``: the reference pipeline's device stage
turns the float image into uint8 before it travels; its host stage makes a PIL image.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers.executor_harness import exc_of
from helpers.leaks import LONG_LIVED, with_prefix
from helpers.postprocess_workers import DeviceStageFailed
from omni_async.core.config import Deadlines
from omni_async.core.errors import RemoteError, UsageError, WorkerStartupFailed
from omni_async.core.messages import DiffusionOutput, DiffusionRequest, RunnerOutput
from omni_async.core.states import RequestEvent, request_machine
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.models.tiny import TinyDiffusionWorker, image_digest
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.worker.packer import Packer
from omni_async.worker.postprocess import UnknownPostProcess, get_postprocess

RELAXED = Deadlines(compute_timeout=60.0, output_timeout=60.0, rpc_timeout=60.0)
HEIGHT, WIDTH = 2048, 64  # float32: 512 KiB in shared memory; uint8: 128 KiB


def _expected_u8(rid: str, **params: Any) -> torch.Tensor:
    out = TinyDiffusionWorker().execute_model(DiffusionRequest(rid, params))
    image: torch.Tensor = out.output["image"]
    return image.round().clamp(0, 255).to(torch.uint8)


@pytest.fixture(scope="module", params=["inprocess", "multiproc"])
def ex(request: pytest.FixtureRequest) -> Iterator[DiffusionExecutor]:
    executor: DiffusionExecutor
    if request.param == "inprocess":
        import helpers.postprocess_workers  # noqa: F401  # registers the pipeline here

        executor = InProcessExecutor(
            lambda rank: TinyDiffusionWorker(), deadlines=RELAXED, postprocess="test-tiny-failing"
        )
        try:
            yield executor
        finally:
            executor.shutdown()
        return
    spec = WorkerSpec("helpers.postprocess_workers:make_tiny", postprocess="test-tiny-failing")
    mp = MultiprocDiffusionExecutor(spec, deadlines=RELAXED)
    prefix = mp.pool.prefix
    LONG_LIVED.add(prefix)
    try:
        yield mp
    finally:
        mp.shutdown()
        LONG_LIVED.discard(prefix)
    assert not with_prefix(prefix), with_prefix(prefix)


def _get(ex: DiffusionExecutor, ro: RunnerOutput) -> DiffusionOutput:
    assert ro.async_output_id is not None
    return ex.wait_output_ready(ro.async_output_id).result(timeout=30)


@pytest.mark.slow
def test_the_device_stage_ships_uint8_and_is_timed(ex: DiffusionExecutor) -> None:
    params = {"height": HEIGHT, "seed": 3}
    out = _get(ex, ex.execute_request(DiffusionRequest("img", params)))
    image = out.output["image"]
    exp = _expected_u8("img", **params)
    assert image.dtype == torch.uint8 and image.shape == (HEIGHT, WIDTH)
    assert (image.to(torch.int16) - exp.to(torch.int16)).abs().max() <= 1  # CPU BLAS: last-bit noise
    assert int(out.output["digest"]) == int(image_digest(image))  # the bytes that arrived are the ones sent
    assert out.output["latents"] == []
    assert out.metrics["device_postprocess_s"] > 0
    if isinstance(ex, MultiprocDiffusionExecutor):
        assert out.metrics["pack_shm_bytes"] == HEIGHT * WIDTH  # a quarter of the float image
        assert "pack_s" in out.metrics
    # The host stage, as the engine runs it: a PIL image that owns its pixels.
    post = get_postprocess("test-tiny-failing")
    assert post.host is not None
    picture: Any = post.run_host(out, DiffusionRequest("img"))
    arrived = image.clone()
    del image, out.output["image"]
    ex.release_output(out)  # the picture owns its pixels: the segment can go back
    assert picture.size == (WIDTH, HEIGHT) and picture.mode == "L"
    pixels = torch.frombuffer(bytearray(picture.tobytes()), dtype=torch.uint8).reshape(HEIGHT, WIDTH)
    assert torch.equal(pixels, arrived)


def test_the_packer_counts_the_bytes_it_actually_copies(ex: DiffusionExecutor) -> None:
    if not isinstance(ex, MultiprocDiffusionExecutor):
        pytest.skip("the worker's packer metrics: worker processes")
    before = ex.worker_metrics()[0].packer.bytes_packed
    out = _get(ex, ex.execute_request(DiffusionRequest("count", {"height": HEIGHT})))
    del out.output["image"]
    ex.release_output(out)
    # The packer counts an output once its OUTPUT_READY is sent, so the count can trail
    # the delivery by a moment: wait for it.
    deadline = time.monotonic() + 10
    while (packed := ex.worker_metrics()[0].packer.bytes_packed - before) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert HEIGHT * WIDTH <= packed < 2 * HEIGHT * WIDTH, packed  # uint8 plus a few small leaves, not 4x


def test_a_failing_device_stage_fails_that_output_typed(ex: DiffusionExecutor) -> None:
    ro = ex.execute_request(DiffusionRequest("fail-1", {"height": 8}))
    err = exc_of(ex.wait_output_ready(ro.async_output_id or ""))
    assert isinstance(err, RemoteError), err
    assert err.failure.type_name == DeviceStageFailed.__qualname__ and "failed on purpose" in str(err)
    # The next output goes through.
    out = _get(ex, ex.execute_request(DiffusionRequest("ok-after", {"height": 8})))
    assert out.output["image"].dtype == torch.uint8
    del out.output["image"]
    ex.release_output(out)
    m = ex.metrics()
    assert m.pending_outputs == 0 and m.held_payloads == 0


def test_step_mode_runs_the_device_stage_too() -> None:
    import helpers.postprocess_workers  # noqa: F401

    ex = InProcessExecutor(
        lambda rank: TinyDiffusionWorker(), step_mode=True, deadlines=RELAXED, postprocess="test-tiny-failing"
    )
    try:
        ro = ex.execute_request(DiffusionRequest("step", {"height": 4}))
        assert ro.result is not None and ro.result.output["image"].dtype == torch.uint8
        # Timed like the packer's: the stage's own time, the copy's start after it.
        m = ro.result.metrics
        assert m.device_postprocess_s is not None and m.device_postprocess_s >= 0
        assert m.pack_started_at is not None and m.forward_ended_at is not None
        assert m.pack_started_at >= m.forward_ended_at
    finally:
        ex.shutdown()


def test_an_unknown_pipeline_fails_at_construction() -> None:
    with pytest.raises(UnknownPostProcess, match="no-such-pipeline"):
        WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", postprocess="no-such-pipeline")
    with pytest.raises(UnknownPostProcess, match="no-such-pipeline"):
        InProcessExecutor(lambda rank: TinyDiffusionWorker(), postprocess="no-such-pipeline")
    with pytest.raises(UsageError, match="postprocess must be"):
        WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", postprocess="")


@pytest.mark.slow
def test_an_unknown_pipeline_in_the_worker_fails_its_start_up() -> None:
    spec = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", postprocess="no-such-pipeline", check_import=False)
    with pytest.raises(WorkerStartupFailed) as info:
        MultiprocDiffusionExecutor(spec, deadlines=RELAXED, start_timeout=60)
    assert info.value.failure is not None and info.value.failure.type_name == "UnknownPostProcess"


def test_the_packers_byte_budget_counts_what_the_device_stage_returned() -> None:
    """In flight, an output counts the bytes of what the stage returned (uint8), not of the
    forward's float output: the packer resizes its job once the stage ran."""
    seen: list[int] = []
    entered = threading.Event()

    def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        seen.append(packer.metrics.in_flight_bytes)
        entered.set()
        return output

    def shrink(output: DiffusionOutput) -> DiffusionOutput:
        return DiffusionOutput(output.request_id, {"image": output.output["image"].to(torch.uint8)})

    channel = InProcessChannel()
    packer = Packer(0, channel, pack=pack, device_stage=shrink)
    packer.start()
    try:
        image = torch.zeros(1000, dtype=torch.float32)
        m = request_machine("o1")
        m.fire(RequestEvent.FORWARD)
        m.fire(RequestEvent.COMPUTE_DONE)
        packer.submit("o1", DiffusionOutput("r1", {"image": image}), m, nbytes=4000)
        assert entered.wait(10)
        assert packer.drain(10)
    finally:
        packer.stop()
        channel.close()
    assert seen == [1000]
    assert packer.metrics.bytes_packed == 1000 and packer.metrics.in_flight_bytes == 0
