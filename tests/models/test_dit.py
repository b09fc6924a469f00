"""The DiT reference pipeline: shapes, determinism, batching, validation, post-process,
and end to end through both executors (real threads; real worker processes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_async.core.config import Deadlines
from omni_async.core.errors import RequestAborted, RpcFailed
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.engine.scheduler import SchedulerPhase
from omni_async.errors import InvalidRequest, UsageError
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import (
    MultiprocDiffusionExecutor,
    WorkerOptions,
    WorkerSpec,
)
from omni_async.models.dit import (
    POSTPROCESS,
    DiTPipelineWorker,
    device_stage,
    host_stage,
    make_worker,
    pixels_to_uint8,
)
from omni_async.models.tiny import image_digest
from omni_async.worker import get_postprocess

DEADLINES = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)
# A small model for the tests that only need the pipeline's behaviour.
SMALL: dict[str, Any] = {"hidden_size": 32, "depth": 2, "heads": 2, "decoder_width": 16, "steps": 3}


@pytest.fixture(scope="module")
def model() -> DiTPipelineWorker:
    return DiTPipelineWorker(**SMALL)


def _req(rid: str, **params: object) -> DiffusionRequest:
    return DiffusionRequest(rid, params)


def _pixels(out: DiffusionOutput) -> torch.Tensor:
    px = out.output.get("image")
    return out.output["frames"] if px is None else px  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- the forward


def test_image_shape_dtype_range_and_info(model: DiTPipelineWorker) -> None:
    out = model.execute_model(_req("img", seed=3))
    image = out.output["image"]
    assert out.request_id == "img"
    assert image.shape == (3, 128, 128) and image.dtype == torch.float32 and image.device.type == "cpu"
    assert 0.0 <= image.min().item() and image.max().item() <= 1.0
    assert image.std().item() > 0.05  # not blank
    assert "frames" not in out.output and "digest" not in out.output
    assert out.output["info"] == {
        "height": 128,
        "width": 128,
        "num_frames": 1,
        "steps": 3,
        "seed": 3,
        "dtype": "torch.float32",
    }


def test_video_frames_and_sides_that_are_not_whole_patches(model: DiTPipelineWorker) -> None:
    # 72 / 8 = 9 latent rows: an odd side, padded to whole patches and cropped back.
    out = model.execute_model(_req("vid", num_frames=3, height=72, width=48, steps=2))
    frames = out.output["frames"]
    assert frames.shape == (3, 3, 72, 48) and frames.dtype == torch.float32
    assert "image" not in out.output and out.output["info"]["num_frames"] == 3
    # The frames differ from each other (frame index embedding, temporal attention).
    assert (frames[0] - frames[1]).abs().mean().item() > 1e-3


def test_model_dtype_is_the_output_dtype() -> None:
    m = DiTPipelineWorker(**{**SMALL, "dtype": "bfloat16"})
    image = m.execute_model(_req("bf", height=32, width=32)).output["image"]
    assert image.dtype == torch.bfloat16 and image.shape == (3, 32, 32)


def test_same_seed_same_output_on_another_instance(model: DiTPipelineWorker) -> None:
    other = DiTPipelineWorker(**SMALL)
    for (name, a), (_, b) in zip(model.denoiser.state_dict().items(), other.denoiser.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # the weights come from the model's seed alone
    x = model.execute_model(_req("a", seed=5, height=64, width=64)).output["image"]
    y = other.execute_model(_req("b", seed=5, height=64, width=64)).output["image"]
    torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    # The global RNG is not touched: building a model and a forward draw nothing from it.
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    DiTPipelineWorker(**SMALL).execute_model(_req("c", height=32, width=32))
    assert torch.equal(torch.random.get_rng_state(), before)


def test_different_seeds_and_model_seeds_differ(model: DiTPipelineWorker) -> None:
    a = model.execute_model(_req("a", seed=1, height=64, width=64)).output["image"]
    b = model.execute_model(_req("b", seed=2, height=64, width=64)).output["image"]
    c = DiTPipelineWorker(**{**SMALL, "seed": 1}).execute_model(_req("c", seed=1, height=64, width=64)).output["image"]
    assert (a - b).abs().mean().item() > 0.02
    assert (a - c).abs().mean().item() > 0.02


def test_batch_equals_singles_and_keeps_request_order(model: DiTPipelineWorker) -> None:
    reqs = [
        _req("b0", seed=0, height=64, width=64),
        _req("v0", seed=1, height=32, width=48, num_frames=2),  # another shape: its own group
        _req("b1", seed=2, height=64, width=64),
        _req("b2", seed=3, height=64, width=64, steps=2),  # other steps: its own group
        _req("b3", seed=4, height=64, width=64),
    ]
    batch = model.execute_model_batch(reqs)
    assert [o.request_id for o in batch.per_request()] == [r.request_id for r in reqs]
    for r, out in zip(reqs, batch.per_request(), strict=True):
        # Bit-exact: the stacked forward is batch-invariant (one product per sample, each
        # request decoded on its own); before, a member was 1e-6 off its pixels alone.
        assert torch.equal(_pixels(out), _pixels(model.execute_model(r))), r.request_id


def test_the_batch_is_stacked_into_one_forward(model: DiTPipelineWorker) -> None:
    seen: list[tuple[list[str], int, tuple[int, ...]]] = []

    def record(requests: object, step: int, latents: torch.Tensor) -> None:
        assert isinstance(requests, list)
        seen.append(([r.request_id for r in requests], step, tuple(latents.shape)))

    m = DiTPipelineWorker(**SMALL, step_callback=record)
    m.execute_model_batch([_req(f"s{i}", seed=i, height=32, width=32) for i in range(3)])
    assert seen == [(["s0", "s1", "s2"], step, (3, 1, 4, 4, 4)) for step in range(3)]


def test_step_callback_sees_every_step_and_can_stop_the_forward() -> None:
    steps: list[int] = []

    def stop_at_two(requests: object, step: int, latents: torch.Tensor) -> None:
        steps.append(step)
        if step == 1:
            raise RuntimeError("cancelled between steps")

    m = DiTPipelineWorker(**SMALL, step_callback=stop_at_two)
    with pytest.raises(RuntimeError, match="cancelled between steps"):
        m.execute_model(_req("c", height=32, width=32, steps=5))
    assert steps == [0, 1]
    assert torch.is_grad_enabled()  # a stopped generator leaves no grad mode behind


def test_denoise_yields_each_step_and_decode_maps_to_pixels(model: DiTPipelineWorker) -> None:
    r = _req("g", seed=9, height=32, width=32, steps=3)
    z0 = model.initial_latents([r])
    assert z0.shape == (1, 1, 4, 4, 4)
    trajectory = list(model.denoise(z0, 3))
    assert len(trajectory) == 3 and torch.is_grad_enabled()  # the generator leaves grad mode as it was
    pixels = model.decode(trajectory[-1])
    assert pixels.shape == (1, 1, 3, 32, 32)
    torch.testing.assert_close(pixels[0, 0], model.execute_model(r).output["image"], rtol=0, atol=1e-5)


def test_digest_on_request_is_the_checksum_of_the_pixels(model: DiTPipelineWorker) -> None:
    out = model.execute_model(_req("d", seed=2, height=32, width=32, digest=True))
    assert int(out.output["digest"]) == int(image_digest(out.output["image"]))


def test_sleep_offloads_and_fails_forwards_until_wake_up() -> None:
    m = DiTPipelineWorker(**SMALL)
    before = m.execute_model(_req("a", height=32, width=32)).output["image"]
    m.sleep()
    with pytest.raises(UsageError, match="request 'b': the DiT pipeline is asleep"):
        m.execute_model(_req("b", height=32, width=32))
    m.wake_up()
    after = m.execute_model(_req("c", height=32, width=32)).output["image"]
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    assert m.ping() == "pong"


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("params", "parameter", "problem"),
    [
        ({"heigth": 64}, "heigth", "is not a parameter of this pipeline"),
        ({"height": 100}, "height", "must be a multiple of 8"),
        ({"width": 0}, "width", r"must be in 8\.\.16384, got 0"),
        ({"width": 64.0}, "width", "must be int, got 64.0"),
        ({"steps": True}, "steps", "must be int, got True"),
        ({"steps": 0}, "steps", "must be in 1..1000"),
        ({"num_frames": 0}, "num_frames", "must be in 1..4096"),
        ({"seed": -1}, "seed", "must be in 0.."),
        ({"seed": "7"}, "seed", "must be int"),
        ({"digest": 1}, "digest", "must be bool, got 1"),
    ],
)
def test_validation_names_the_request_and_parameter(params: dict[str, object], parameter: str, problem: str) -> None:
    request = DiffusionRequest("bad", params)
    with pytest.raises(InvalidRequest, match=f"request 'bad': parameter '{parameter}' {problem}") as info:
        DiTPipelineWorker.validate_request(request)
    assert info.value.request_id == "bad" and info.value.parameter == parameter


def test_numpy_integers_are_ints_and_a_batch_is_checked_whole(model: DiTPipelineWorker) -> None:
    DiTPipelineWorker.validate_request(_req("np", height=np.int64(64), seed=np.uint32(3)))
    seen: list[int] = []
    m = DiTPipelineWorker(**SMALL, step_callback=lambda rs, step, z: seen.append(step))
    with pytest.raises(InvalidRequest, match="parameter 'steps'"):
        m.execute_model_batch([_req("ok", height=32, width=32), _req("bad", steps=0)])
    assert seen == []  # no forward ran


def test_constructor_arguments_are_checked() -> None:
    with pytest.raises(UsageError, match="hidden_size .* multiple of heads"):
        DiTPipelineWorker(hidden_size=30, heads=4)
    with pytest.raises(UsageError, match="depth must be >= 1"):
        DiTPipelineWorker(depth=0)
    with pytest.raises(UsageError, match="floating torch dtype"):
        DiTPipelineWorker(dtype="int8")


# --------------------------------------------------------------------------- post-process


def test_postprocess_is_registered_under_the_pipeline_name() -> None:
    assert get_postprocess("dit") is POSTPROCESS
    assert DiTPipelineWorker.pipeline == "dit"
    assert POSTPROCESS.device is device_stage and POSTPROCESS.host is host_stage


def test_device_stage_makes_channel_last_uint8_and_a_new_digest(model: DiTPipelineWorker) -> None:
    out = model.execute_model(_req("p", seed=4, height=48, width=64, digest=True))
    before = out.output["image"].clone()
    shipped = device_stage(out)
    assert torch.equal(out.output["image"], before)  # its input is not changed (float32: .to() is no copy)
    px = shipped.output["image"]
    assert shipped.request_id == "p" and px.dtype == torch.uint8 and px.shape == (48, 64, 3)
    expected = (out.output["image"].permute(1, 2, 0) * 255).round().to(torch.uint8)
    assert torch.equal(px, expected)
    assert int(shipped.output["digest"]) == int(image_digest(px))
    assert shipped.output["info"] == out.output["info"]
    assert px.numel() * px.element_size() * 4 == out.output["image"].numel() * 4  # 4x fewer bytes than fp32

    video = device_stage(model.execute_model(_req("v", num_frames=3, height=32, width=40))).output["frames"]
    assert video.dtype == torch.uint8 and video.shape == (3, 32, 40, 3)


def test_pixels_to_uint8_chunks_give_the_same_bytes() -> None:
    px = torch.rand(5, 3, 16, 8)
    assert torch.equal(pixels_to_uint8(px, chunk=2), pixels_to_uint8(px, chunk=8))
    assert pixels_to_uint8(torch.tensor([-0.5, 0.5, 2.0]).view(1, 3, 1, 1)).flatten().tolist() == [0, 128, 255]


def test_host_stage_gives_a_pil_image_that_owns_its_memory(model: DiTPipelineWorker) -> None:
    shipped = device_stage(model.execute_model(_req("h", seed=6, height=48, width=64, digest=True)))
    source = shipped.output["image"]
    result = host_stage(shipped)
    image = result["image"]
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (64, 48)
    pixels = np.asarray(image)
    assert np.array_equal(pixels, source.numpy())
    assert result["digest"] == int(image_digest(torch.from_numpy(pixels.copy())))
    assert result["info"]["height"] == 48
    source.fill_(0)  # the shared-memory segment is reused after the stage returns
    assert np.array_equal(np.asarray(image), pixels)


def test_host_stage_gives_frames_that_do_not_alias_the_input(model: DiTPipelineWorker) -> None:
    shipped = device_stage(model.execute_model(_req("hv", num_frames=2, height=32, width=32)))
    source = shipped.output["frames"]
    frames = host_stage(shipped)["frames"]
    assert isinstance(frames, np.ndarray) and frames.dtype == np.uint8 and frames.shape == (2, 32, 32, 3)
    assert not np.shares_memory(frames, source.numpy())
    assert np.array_equal(frames, source.numpy())


def test_host_stage_without_the_device_stage_gives_the_same_result(model: DiTPipelineWorker) -> None:
    raw = model.execute_model(_req("r", seed=8, height=32, width=48, digest=True))
    direct, staged = host_stage(raw), host_stage(device_stage(raw))
    assert np.array_equal(np.asarray(direct["image"]), np.asarray(staged["image"]))
    assert direct["digest"] == staged["digest"]


# --------------------------------------------------------------------------- executors


def test_in_process_executor_end_to_end() -> None:
    reference = DiTPipelineWorker(**SMALL)
    reqs = [_req(f"e{i}", seed=i, height=32, width=32) for i in range(4)]
    reqs.append(_req("ev", num_frames=2, height=32, width=32))
    ex = InProcessExecutor(lambda rank: DiTPipelineWorker(**SMALL), deadlines=DEADLINES)
    try:
        # The model's static validate_request runs in the caller's thread.
        with pytest.raises(InvalidRequest, match="parameter 'height'"):
            ex.submit(_req("bad", height=12))
        handles = [ex.submit(r) for r in reqs[:2]]
        outs = [h.output.result(timeout=60) for h in handles]
        for ro in ex.execute_batch(reqs[2:]):
            assert ro.async_output_id is not None
            outs.append(ex.wait_output_ready(ro.async_output_id).result(timeout=60))
        for r, out in zip(reqs, outs, strict=True):
            assert out.request_id == r.request_id
            torch.testing.assert_close(_pixels(out), _pixels(reference.execute_model(r)), rtol=0, atol=1e-4)
            ex.release_output(out)
        ex.collective_rpc("sleep")
        with pytest.raises(RpcFailed, match="asleep"):
            ex.execute_request(_req("asleep", height=32, width=32))
        ex.collective_rpc("wake_up")
        assert ex.execute_request(_req("awake", height=32, width=32)).async_output_id is not None
    finally:
        ex.shutdown()


@pytest.fixture
def multiproc() -> Iterator[MultiprocDiffusionExecutor]:
    # The reference forwards run on the CPU: noise is drawn on the model's device.
    spec = WorkerSpec("omni_async.models.dit:make_worker", {**SMALL, "device": "cpu", "dtype": "float32"})
    ex = MultiprocDiffusionExecutor(spec, deadlines=DEADLINES)
    try:
        yield ex
    finally:
        ex.shutdown()


@pytest.mark.slow
def test_worker_process_end_to_end_with_the_postprocess(multiproc: MultiprocDiffusionExecutor) -> None:
    ex = multiproc
    reference = DiTPipelineWorker(**SMALL)
    with pytest.raises(InvalidRequest, match="parameter 'width' must be a multiple of 8"):
        ex.submit(_req("bad", width=33))  # make_worker carries validate_request
    reqs = [_req(f"m{i}", seed=i, height=128, width=128, digest=True) for i in range(3)]
    reqs.append(_req("mv", seed=5, num_frames=3, height=64, width=64, digest=True))
    ros = ex.execute_batch(reqs)
    for r, ro in zip(reqs, ros, strict=True):
        assert ro.async_output_id is not None
        out = ex.wait_output_ready(ro.async_output_id).result(timeout=60)
        got = _pixels(out)
        assert int(out.output["digest"]) == int(image_digest(got))  # the bytes arrived exactly
        torch.testing.assert_close(got, _pixels(reference.execute_model(r)), rtol=0, atol=1e-4)
        result = host_stage(out)  # what the engine runs for "dit" (registered: tested above)
        del got
        ex.release_output(out)  # the host stage's result owns its memory: it outlives the segment
        if r.params.get("num_frames", 1) == 1:
            assert result["image"].size == (128, 128)
            assert np.asarray(result["image"]).std() > 5  # not blank
        else:
            assert result["frames"].shape == (3, 64, 64, 3)
    assert ex.pool.stats().outstanding == 0


@pytest.mark.slow
def test_previews_stream_through_the_engine_then_the_result() -> None:
    """``preview_every=k`` on a stream: a preview after every k-th step but the last, each
    decoded from that step's latents and post-processed by "dit" like the result; without
    a stream the same request emits none."""
    spec = WorkerSpec(
        "omni_async.models.dit:make_worker",
        {**SMALL, "steps": 5, "device": "cpu", "dtype": "float32"},
        postprocess="dit",
    )
    reference = DiTPipelineWorker(**{**SMALL, "steps": 5})
    # The previews' expected pixels: the reference's latents after steps 2 and 4, decoded.
    seen: dict[int, torch.Tensor] = {}
    reference.step_callback = lambda reqs, step, latents: seen.__setitem__(step + 1, reference.decode(latents)[0, 0])
    expected = reference.execute_model(_req("p", seed=7, height=64, width=64))

    async def body() -> None:
        engine = AsyncDiffusionEngine.from_factory(
            lambda: MultiprocDiffusionExecutor(spec, deadlines=DEADLINES), pipeline="dit"
        )
        async with engine:
            items = [i async for i in engine.generate_stream(_req("p", seed=7, height=64, width=64, preview_every=2))]
            *chunks, result = items
            assert [type(c).__name__ for c in chunks] == ["GenerationChunk", "GenerationChunk"]
            assert [c.output["info"]["step"] for c in chunks] == [2, 4]
            for c in chunks:
                assert c.output["info"]["preview"] is True and c.output["image"].size == (64, 64)
                want = pixels_to_uint8(seen[c.output["info"]["step"]]).numpy()
                assert np.abs(np.asarray(c.output["image"]).astype(int) - want.astype(int)).max() <= 1
            assert isinstance(result, GenerationResult) and "preview" not in result.output["info"]
            got = np.asarray(result.output["image"]).astype(int)
            assert np.abs(got - pixels_to_uint8(_pixels(expected)).numpy().astype(int)).max() <= 1
            plain = await engine.generate(_req("q", seed=7, height=64, width=64, preview_every=2))
            assert np.array_equal(np.asarray(plain.output["image"]), np.asarray(result.output["image"]))
            assert engine.metrics().chunks == 2

    asyncio.run(body())


@pytest.mark.slow
def test_an_aborted_request_stops_at_the_next_denoising_step() -> None:
    """Abort while computing: the forward checks for cancellation between steps, so a
    request of many steps ends long before its forward would have (and the worker counts
    an aborted call)."""
    spec = WorkerSpec("omni_async.models.dit:make_worker", {**SMALL, "device": "cpu", "dtype": "float32"})

    async def body() -> None:
        async with AsyncDiffusionEngine.from_factory(
            lambda: MultiprocDiffusionExecutor(spec, deadlines=DEADLINES)
        ) as engine:
            took = []
            for steps in (100, 300):
                t0 = time.monotonic()
                await engine.generate(_req(f"s{steps}", height=256, width=256, steps=steps))
                took.append(time.monotonic() - t0)
            full = 1000 * (took[1] - took[0]) / 200  # what the denoising of 1000 steps takes
            task = asyncio.create_task(engine.generate(_req("long", height=256, width=256, steps=1000)))
            while engine.phase_of("long") is not SchedulerPhase.RUNNING:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            t1 = time.monotonic()
            await engine.abort(["long"], wait=True)
            stopped_in = time.monotonic() - t1
            with pytest.raises(RequestAborted):
                await task
            # The abort waits for one step, not for the rest of the forward.
            assert stopped_in < max(1.0, full / 3), (stopped_in, full)
            info = await asyncio.to_thread(engine.executor.worker_metrics)
            assert info[0].aborted_calls >= 1

    asyncio.run(body())


# --------------------------------------------------------------------------- measurement


def test_cpu_time_per_request_at_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """A benchmark print (``-s`` shows it), not a timed assertion: the CPU time of one
    default request (128 x 128 image, 8 steps) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = DiTPipelineWorker()
        m.execute_model(_req("warm"))
        cpu = []
        for i in range(5):
            start = time.process_time()
            m.execute_model(_req(f"t{i}", seed=i))
            cpu.append(time.process_time() - start)
    finally:
        torch.set_num_threads(threads)
    with capsys.disabled():
        print(
            f"\nDiTPipelineWorker default request (128x128, 8 steps, 1 thread): "
            f"CPU {sorted(cpu)[2] * 1e3:.1f} ms median, {min(cpu) * 1e3:.1f} ms min"
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_large_image_and_video() -> None:
    m = make_worker(dtype="bfloat16")
    assert m.device.type == "cuda"
    image = m.execute_model(_req("big", height=1024, width=1024, steps=4)).output["image"]
    assert image.shape == (3, 1024, 1024) and image.dtype == torch.bfloat16 and image.is_cuda
    video = m.execute_model(_req("vid", num_frames=9, height=720, width=1280, steps=2)).output["frames"]
    assert video.shape == (9, 3, 720, 1280)
    shipped = device_stage(DiffusionOutput("vid", {"frames": video}))
    assert shipped.output["frames"].dtype == torch.uint8 and shipped.output["frames"].is_cuda
    assert shipped.output["frames"].shape == (9, 720, 1280, 3)
    a = m.execute_model(_req("a", height=256, width=256, seed=1)).output["image"]
    b = m.execute_model(_req("b", height=256, width=256, seed=1)).output["image"]
    assert torch.equal(a, b)  # deterministic on one device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_process_bf16() -> None:
    spec = WorkerSpec("omni_async.models.dit:make_worker", {"dtype": "bfloat16"})
    reference = make_worker(dtype="bfloat16")
    reqs = [_req(f"g{i}", seed=i, height=512, width=512, digest=True) for i in range(3)]
    reqs.append(_req("gv", seed=3, num_frames=5, height=256, width=384, digest=True))
    with MultiprocDiffusionExecutor(spec, deadlines=DEADLINES, options=WorkerOptions(device="cuda")) as ex:
        for r, ro in zip(reqs, ex.execute_batch(reqs), strict=True):
            assert ro.async_output_id is not None
            out = ex.wait_output_ready(ro.async_output_id).result(timeout=120)
            got = _pixels(out)
            assert got.device.type == "cpu" and got.dtype == torch.bfloat16
            assert int(out.output["digest"]) == int(image_digest(got))  # the bytes arrived exactly
            expected = _pixels(reference.execute_model(r)).cpu()
            torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=2e-2)
            result = host_stage(out)
            del got
            ex.release_output(out)
            assert ("image" in result) == (r.request_id != "gv")
        assert ex.pool.stats().outstanding == 0
