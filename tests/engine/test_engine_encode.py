"""Issue 20: encoded outputs through the engine, over worker processes.

Each request picks its format (``DiffusionRequest(..., format=..., quality=...)``); one
engine serves them side by side, and a request without one gets the pipeline's result
as before.  The pixels cross in uint8 (the pipeline's device stage), the engine copies
them out of shared memory and its encoder processes encode them; PNG and lossless WebP
decode to the very pixels the plain request gets.  The encoder processes start with the
first encode and none outlives the engine, however it ends.  A request whose output has
no uint8 pixels fails with ``EncodeFailed`` saying what to do, and the engine goes on.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.engine_harness import assert_quiescent, run
from helpers.leaks import kept_for_the_module
from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.encoders import EncodedOutput
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EncodeFailed
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

WIDTH = 48
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)
TINY = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": WIDTH, "steps": 2}, postprocess="tiny")
DIT = WorkerSpec(
    "omni_async.models.dit:make_worker",
    {"device": "cpu", "hidden_size": 32, "depth": 1, "heads": 2, "decoder_width": 16, "steps": 2},
    postprocess="dit",
)


@pytest.fixture(scope="module")
def tiny() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(TINY, deadlines=DEADLINES))


def decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


def alive(pids: list[int]) -> list[int]:
    """Which of ``pids`` still run as our children (``active_children`` reaps the dead)."""
    ours = {p.pid for p in multiprocessing.active_children()}
    return [pid for pid in pids if pid in ours or os.path.exists(f"/proc/{pid}")]


def test_each_request_gets_the_format_it_asked_for_in_one_engine(tiny: MultiprocDiffusionExecutor) -> None:
    formats: list[tuple[str | None, int | None]] = [
        (None, None), ("png", None), ("png", 1), ("jpeg", 90), ("webp", None), ("webp", 80)
    ]  # fmt: skip

    async def body() -> list[int]:
        async with AsyncDiffusionEngine(tiny, pipeline="tiny", encode_workers=2) as engine:
            results = await asyncio.gather(
                *(
                    engine.generate(DiffusionRequest(f"r{i}", {"height": 32, "seed": 5}, format=f, quality=q))
                    for i, (f, q) in enumerate(formats)
                )
            )
            pids = engine._post.encoders.pids()
            assert len(pids) == 2 and alive(pids) == pids
            plain = np.asarray(results[0].output)  # the pipeline's PIL image, as before
            assert plain.shape == (32, WIDTH) and results[0].media_type is None and results[0].encoded == ()
            assert results[0].timings.encode is None
            for res, (fmt, _) in zip(results[1:], formats[1:], strict=True):
                assert isinstance(res.output, EncodedOutput), res.output
                enc = res.output
                assert res.media_type == enc.media_type == f"image/{fmt}" and res.data == enc.data
                assert (enc.width, enc.height, enc.frames, enc.encoded_on) == (WIDTH, 32, 1, "host")
                assert res.timings.encode is not None and res.timings.encode > 0
                back = decode(enc.data)
                back = back[..., 0] if back.ndim == 3 else back  # lossless WebP decodes grey as RGB
                if fmt == "png" or res.request_id == "r4":
                    assert np.array_equal(back, plain), res.request_id
                else:
                    assert np.abs(back.astype(int) - plain.astype(int)).mean() < 8
            jpeg = results[3].output
            assert "JPEG on the GPU needs CUDA" in jpeg.note and results[1].output.note == ""
            assert engine.metrics().latency["encode"].count == 5
            await assert_quiescent(engine)
        return pids

    pids = run(body())
    assert alive(pids) == []  # the engine's close stopped its encoder processes


def test_no_encoder_process_outlives_an_engine_left_by_an_error(tiny: MultiprocDiffusionExecutor) -> None:
    seen: list[int] = []

    async def body() -> None:
        async with AsyncDiffusionEngine(tiny, pipeline="tiny", encode_workers=1) as engine:
            assert engine._post.encoders.pids() == []  # started with the first encode, not before
            res = await engine.generate(DiffusionRequest("e", {"height": 16}, format="png"))
            assert res.media_type == "image/png"
            seen.extend(engine._post.encoders.pids())
            raise RuntimeError("the caller's own failure")

    with pytest.raises(RuntimeError, match="the caller's own failure"):
        run(body())
    assert len(seen) == 1 and alive(seen) == []


def test_pixels_not_uint8_fail_the_request_with_what_to_do() -> None:
    plain = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": WIDTH, "steps": 1})  # no device stage

    async def body(ex: MultiprocDiffusionExecutor) -> None:
        async with AsyncDiffusionEngine(ex, encode_workers=1) as engine:
            with pytest.raises(EncodeFailed) as info:
                await engine.generate(DiffusionRequest("floaty", {"height": 16}, format="webp"))
            err = info.value
            assert err.request_id == "floaty" and err.format == "webp"
            assert "'image' is torch.float32, not uint8" in str(err) and "WorkerSpec(postprocess=" in str(err)
            assert engine._post.encoders.pids() == []  # refused before any process started
            ok = await engine.generate(DiffusionRequest("after", {"height": 16}))  # the engine goes on
            assert tuple(ok.output["image"].shape) == (16, WIDTH)
            await assert_quiescent(engine)

    for ex in kept_for_the_module(MultiprocDiffusionExecutor(plain, deadlines=DEADLINES)):
        run(body(ex))


def test_an_encode_that_fails_in_the_encoder_process_fails_its_request_and_the_engine_goes_on(
    tiny: MultiprocDiffusionExecutor,
) -> None:
    """The encoder process itself raises: the tiny pipeline's output is one image, and
    mp4 encodes frames.  The engine refuses nothing before the encoder (the pixels are
    uint8, channel-last); the request fails with ``EncodeFailed`` naming it, its format
    and the encoder's reason, the process lives on, and the engine serves the next one."""

    async def body() -> None:
        async with AsyncDiffusionEngine(tiny, pipeline="tiny", encode_workers=1) as engine:
            with pytest.raises(EncodeFailed) as info:
                await engine.generate(DiffusionRequest("still-as-video", {"height": 16}, format="mp4"))
            err = info.value
            assert err.request_id == "still-as-video" and err.format == "mp4"
            assert "request 'still-as-video'" in str(err) and "as mp4 failed" in str(err), str(err)
            assert "mp4 encodes frames" in str(err) and "ask for an image format" in str(err)
            (pid,) = engine._post.encoders.pids()  # the encoder raised in its process, which lives on
            ok = await engine.generate(DiffusionRequest("after", {"height": 16, "seed": 2}, format="png"))
            assert isinstance(ok.output, EncodedOutput) and decode(ok.output.data).shape == (16, WIDTH)
            assert engine._post.encoders.pids() == [pid]
            counts = engine.metrics().requests
            assert counts["failed"] >= 1 and counts["finished"] >= 1, counts
            await assert_quiescent(engine)

    run(body())


@pytest.mark.slow
def test_a_killed_encoder_process_fails_only_its_request_through_the_engine(
    tiny: MultiprocDiffusionExecutor,
) -> None:
    """Three requests encode at once, one in each of three encoder processes, held there
    (the processes are stopped, SIGSTOP, before the jobs reach them; a small job fits in
    its pipe).  One process is SIGKILLed and the others continued: the killed one's
    request fails with ``EncodeFailed`` naming it, the process and the signal; the other
    two get their files; the engine serves on, a new process in the dead one's place."""
    import signal

    async def body() -> None:
        async with AsyncDiffusionEngine(tiny, pipeline="tiny", encode_workers=3) as engine:
            await engine.generate(DiffusionRequest("warm", {"height": 16}, format="png"))  # starts the processes
            pool = engine._post.encoders
            pids = pool.pids()
            assert len(pids) == 3
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                tasks = [
                    asyncio.ensure_future(engine.generate(DiffusionRequest(f"k{i}", {"height": 16}, format="png")))
                    for i in range(3)
                ]
                while len(pool.running()) < 3:  # each job is in its process's pipe
                    await asyncio.sleep(0.01)
                holders = pool.running()
                victim_pid, victim = next(iter(holders.items()))
                os.kill(victim_pid, signal.SIGKILL)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            by_id = {f"k{i}": r for i, r in enumerate(results)}
            err = by_id.pop(victim)
            assert isinstance(err, EncodeFailed) and err.request_id == victim and err.format == "png", err
            assert f"pid {victim_pid}" in str(err) and "SIGKILL" in str(err), str(err)
            for rid, res in by_id.items():
                assert not isinstance(res, BaseException), (rid, res)
                assert isinstance(res.output, EncodedOutput) and decode(res.output.data).shape == (16, WIDTH)
            again = await engine.generate(DiffusionRequest("after", {"height": 16}, format="png"))
            assert isinstance(again.output, EncodedOutput) and decode(again.output.data).shape == (16, WIDTH)
            assert len(pool.pids()) == 3 and victim_pid not in pool.pids()
            assert set(pids) - {victim_pid} <= set(pool.pids())  # the others lived on
            await assert_quiescent(engine)

    run(body())


def test_rgb_images_and_frames_as_mp4_from_the_dit_pipeline() -> None:
    av = pytest.importorskip("av")  # the encode extra's video container (only this test needs it)

    async def body(ex: MultiprocDiffusionExecutor) -> None:
        async with AsyncDiffusionEngine(ex, pipeline="dit", encode_workers=2) as engine:
            size = {"height": 32, "width": 48, "seed": 3}
            plain, png, video, frames_png = await asyncio.gather(
                engine.generate(DiffusionRequest("plain", size)),
                engine.generate(DiffusionRequest("png", size, format="png")),
                engine.generate(DiffusionRequest("video", {**size, "num_frames": 4}, format="mp4", quality=90)),
                engine.generate(DiffusionRequest("frames", {**size, "num_frames": 3}, format="png")),
            )
            pixels = np.asarray(plain.output["image"])
            assert pixels.shape == (32, 48, 3)
            assert png.data is not None and np.array_equal(
                decode(png.data), pixels
            )  # the dit host stage's pixels, bit for bit
            enc = video.output
            assert isinstance(enc, EncodedOutput) and enc.media_type == "video/mp4" == video.media_type
            assert (enc.width, enc.height, enc.frames) == (48, 32, 4)
            with av.open(io.BytesIO(enc.data)) as container:
                decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
            assert len(decoded) == 4 and decoded[0].shape == (32, 48, 3)
            # Frames in an image format: one file per frame.
            assert len(frames_png.encoded) == 3 and all(e.media_type == "image/png" for e in frames_png.encoded)
            with pytest.raises(Exception, match="3 encoded files"):
                _ = frames_png.data
            await assert_quiescent(engine)

    for ex in kept_for_the_module(MultiprocDiffusionExecutor(DIT, deadlines=DEADLINES)):
        run(body(ex))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_jpeg_is_encoded_on_the_workers_gpu_and_only_its_bytes_cross() -> None:
    pytest.importorskip("torchvision")
    spec = WorkerSpec(
        "omni_async.models.dit:make_worker",
        {"device": "cuda", "hidden_size": 32, "depth": 1, "heads": 2, "decoder_width": 16, "steps": 2},
        postprocess="dit",
    )

    async def body(ex: MultiprocDiffusionExecutor) -> None:
        async with AsyncDiffusionEngine(ex, pipeline="dit", encode_workers=1) as engine:
            size = {"height": 256, "width": 256, "seed": 4}
            plain, jpeg, batch = await asyncio.gather(
                engine.generate(DiffusionRequest("plain", size)),
                engine.generate(DiffusionRequest("jpeg", size, format="jpeg", quality=95)),
                engine.generate(DiffusionRequest("frames", {**size, "num_frames": 8}, format="jpeg")),
            )
            enc = jpeg.output
            assert isinstance(enc, EncodedOutput) and enc.encoded_on == "cuda" and enc.note == ""
            assert (enc.width, enc.height) == (256, 256)
            pixels = np.asarray(plain.output["image"]).astype(np.float64)
            mse = float(np.mean((decode(enc.data).astype(np.float64) - pixels) ** 2))
            assert mse < 200.0, mse  # PSNR above 25 dB
            assert jpeg.timings.encode == jpeg.metrics["device_encode_s"]
            # Only the JPEG's bytes crossed: fewer than the uint8 pixels.
            assert jpeg.metrics.get("pack_shm_bytes", 0.0) + jpeg.metrics.get("pack_inline_bytes", 0.0) < 256 * 256 * 3
            assert len(batch.encoded) == 8 and all(e.encoded_on == "cuda" for e in batch.encoded)
            assert engine._post.encoders.pids() == []  # the host encoders never started
            await assert_quiescent(engine)

    for ex in kept_for_the_module(MultiprocDiffusionExecutor(spec, deadlines=DEADLINES)):
        run(body(ex))
