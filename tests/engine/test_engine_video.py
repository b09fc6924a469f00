"""Issue 31: zero copy to the encoders, and video encoded while it decodes.

Over a worker process and real shared memory: an encoder process reads the pixels from
the output's segment (the same bytes as the copy path's), the output is held until the
encode ends and released once, also when its encoder process is SIGKILLed (the request
fails with ``EncodeFailed`` naming the signal); a video whose model emits its frames in
parts (``emit_frames``) is encoded part by part within the bound of bytes in flight, as a
plain MP4 (the same frames as the whole-video encode) or a fragmented one whose bytes
parse as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import struct
from collections.abc import Iterator

import av
import numpy as np
import pytest

from helpers.engine_harness import assert_quiescent, eventually, run
from helpers.leaks import kept_for_the_module
from omni_async.core.config import Deadlines
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.encoders import EncodedOutput, VideoBytes, encode_image
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EncodeFailed
from omni_async.engine.metrics import GenerationResult
from omni_async.engine.sync import DiffusionEngine
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.models.video import FrameVideoWorker

DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)
VIDEO = WorkerSpec("omni_async.models.video:FrameVideoWorker", {})


@pytest.fixture(scope="module")
def video() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(VIDEO, deadlines=DEADLINES))


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Process ``pid`` stopped (SIGSTOP) for the block, so a job waits in its pipe; resumed
    after it, unless the block killed it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def held(ex: MultiprocDiffusionExecutor) -> int:
    return ex.metrics().held_outputs


def decoded(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data), mode="r") as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def boxes(data: bytes) -> list[str]:
    """The top-level MP4 boxes of ``data``, which must end on a box's end."""
    names, at = [], 0
    while at < len(data):
        assert at + 8 <= len(data), f"a box header cut at byte {at} of {len(data)}"
        size, kind = struct.unpack(">I4s", data[at : at + 8])
        assert size >= 8 and at + size <= len(data), f"box {kind!r} at {at}: {size} bytes, only {len(data) - at} here"
        names.append(kind.decode())
        at += size
    return names


def test_the_encoder_reads_the_segment_and_writes_the_copy_paths_bytes(video: MultiprocDiffusionExecutor) -> None:
    """PNGs of a video's frames: read from the output's segment over a worker process,
    copied over ``InProcessExecutor`` (no segment): the same files, the same as encoding
    the plain result's frames here.  A video in parts takes the copy path there too."""
    params = {"frames": 3, "height": 96, "width": 128, "seed": 4}  # above the inline threshold: in shm
    png = DiffusionRequest("x", {}, format="png").encoding
    assert png is not None

    async def body() -> list[bytes]:
        async with AsyncDiffusionEngine(video, encode_workers=1) as engine:
            plain = await engine.generate(DiffusionRequest("plain", params))
            frames = plain.output["frames"].numpy()
            got = await engine.generate(DiffusionRequest("png", params, format="png"))
            assert (engine._post.encoders.jobs_shared, engine._post.encoders.jobs_copied) == (1, 0)
            assert isinstance(got.output, tuple) and len(got.output) == 3
            assert [enc.data for enc in got.output] == [encode_image(frame, png) for frame in frames]
            await assert_quiescent(engine)
            return [enc.data for enc in got.output]

    async def inline() -> list[bytes]:
        ex = InProcessExecutor(lambda rank: FrameVideoWorker(), deadlines=DEADLINES)
        try:
            async with AsyncDiffusionEngine(ex, encode_workers=1) as engine:
                got = await engine.generate(DiffusionRequest("png", params, format="png"))
                parts = [
                    item
                    async for item in engine.generate_video(
                        DiffusionRequest("parts", dict(params, frames=6, chunk_frames=2), format="mp4")
                    )
                ]
                assert (engine._post.encoders.jobs_shared, engine._post.encoders.jobs_copied) == (0, 4)
                (result,) = parts
                assert isinstance(result, GenerationResult) and isinstance(result.output, EncodedOutput)
                assert len(decoded(result.output.data)) == 6
                assert isinstance(got.output, tuple)
                return [enc.data for enc in got.output]
        finally:
            ex.shutdown()

    assert run(body()) == run(inline())


def test_a_sigkilled_encoder_releases_the_held_output_once_and_fails_its_request(
    video: MultiprocDiffusionExecutor,
) -> None:
    """The encoder process is stopped (SIGSTOP) before the job reaches it: the output is
    held in shared memory meanwhile (zero copy: nothing was copied out); SIGKILL then
    fails the request with ``EncodeFailed`` naming the signal, and the output's segment
    is back in the executor's pool."""
    params = {"frames": 8, "height": 64, "width": 64}

    async def body() -> None:
        async with AsyncDiffusionEngine(video, encode_workers=1) as engine:
            await engine.generate(DiffusionRequest("warm", params, format="mp4"))  # starts the process
            pool = engine._post.encoders
            (pid,) = pool.pids()
            with stopped(pid):
                task = asyncio.ensure_future(engine.generate(DiffusionRequest("victim", params, format="mp4")))
                await eventually(lambda: pool.running() == {pid: "victim"}, what="the job in its process's pipe")
                assert held(video) == 1  # the encoder reads the segment: the output stays held
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(EncodeFailed, match="SIGKILL") as err:
                await task
            assert err.value.request_id == "victim" and err.value.format == "mp4"
            assert held(video) == 0  # released before the request failed
            again = await engine.generate(DiffusionRequest("after", params, format="mp4"))
            assert isinstance(again.output, EncodedOutput) and len(decoded(again.output.data)) == 8
            await assert_quiescent(engine)

    run(body())


def test_parts_in_flight_stay_within_the_byte_bound_behind_a_slow_consumer(video: MultiprocDiffusionExecutor) -> None:
    """Twelve parts come at once (no forward time) and the caller reads slowly: the
    frames handed to the encoder and not yet encoded never exceed the bound."""
    chunk = 8 * 160 * 160 * 3
    params = {"frames": 96, "height": 160, "width": 160, "chunk_frames": 8}

    async def body() -> None:
        async with AsyncDiffusionEngine(video, encode_workers=1, video_bytes_in_flight=2 * chunk) as engine:
            pieces: list[VideoBytes] = []
            request = DiffusionRequest("bounded", params, format="mp4")
            encode = None
            result = None
            async for item in engine.generate_video(request, fragmented=True):
                rec = engine._admission.records.get("bounded")
                encode = rec.video if rec is not None else encode
                if isinstance(item, VideoBytes):
                    pieces.append(item)
                    await asyncio.sleep(0.02)  # the slow consumer
                else:
                    result = item
            assert encode is not None
            peak = encode.peak_in_flight
            assert chunk <= peak <= 2 * chunk, peak
            assert isinstance(result, GenerationResult) and isinstance(result.output, EncodedOutput)
            assert b"".join(p.data for p in pieces) == result.output.data
            assert len(decoded(result.output.data)) == 96
            await assert_quiescent(engine)

    run(body())


def test_a_video_encoded_in_parts_matches_the_whole_video_encode_and_streams_fragments(
    video: MultiprocDiffusionExecutor,
) -> None:
    params = {"frames": 24, "height": 64, "width": 96, "chunk_frames": 8, "forward_ms": 150}

    async def body() -> None:
        async with AsyncDiffusionEngine(video, encode_workers=2) as engine:
            whole = await engine.generate(DiffusionRequest("whole", params, format="mp4"))
            items = [i async for i in engine.generate_video(DiffusionRequest("plain", params, format="mp4"))]
            assert len(items) == 1 and isinstance(items[0], GenerationResult)
            plain = items[0].output
            pieces: list[VideoBytes] = []
            seen: list[list[str]] = []
            fragmented = None
            async for item in engine.generate_video(DiffusionRequest("frag", params, format="mp4"), fragmented=True):
                if isinstance(item, VideoBytes):
                    assert item.offset == sum(len(p.data) for p in pieces)
                    pieces.append(item)
                    seen.append(boxes(b"".join(p.data for p in pieces)))  # whole boxes as they arrive
                else:
                    fragmented = item.output
            assert isinstance(whole.output, EncodedOutput) and isinstance(plain, EncodedOutput)
            assert isinstance(fragmented, EncodedOutput)
            assert len(pieces) >= 2 and seen[0][:2] == ["ftyp", "moov"] and "moof" in seen[-1]
            assert any(len(s) > 2 for s in seen[:-1])  # fragments came before the last piece
            # As near the model's frames as the whole-video encode is (H.264 is lossy).
            source = (await engine.generate(DiffusionRequest("source", params))).output["frames"].numpy().astype(int)
            whole_error = np.abs(decoded(whole.output.data) - source).mean()
            assert whole_error < 20.0, whole_error  # the same video (another would be off by ~60)
            for data in (plain.data, fragmented.data):
                frames = decoded(data)
                assert frames.shape == source.shape == (24, 64, 96, 3)
                assert np.abs(frames - source).mean() < whole_error + 1.0
            assert plain.frames == fragmented.frames == 24 and (plain.width, plain.height) == (96, 64)
            await assert_quiescent(engine)

    run(body())


def test_the_blocking_engine_streams_a_video_and_an_early_close_aborts_it(video: MultiprocDiffusionExecutor) -> None:
    params = {"frames": 16, "height": 32, "width": 48, "chunk_frames": 4, "forward_ms": 50}
    with DiffusionEngine(video, encode_workers=1) as engine:
        *pieces, result = engine.generate_video(DiffusionRequest("sync", params, format="mp4"), fragmented=True)
        assert pieces and all(isinstance(p, VideoBytes) for p in pieces)
        assert isinstance(result, GenerationResult) and isinstance(result.output, EncodedOutput)
        assert b"".join(p.data for p in pieces if isinstance(p, VideoBytes)) == result.output.data
        assert decoded(result.output.data).shape == (16, 32, 48, 3)
        slow = dict(params, forward_ms=2000)
        items = engine.generate_video(DiffusionRequest("left", slow, format="mp4"), fragmented=True)
        first = next(items)  # the fragmented MP4's head, before the forward ends
        assert isinstance(first, VideoBytes) and first.offset == 0
        items.close()  # returns once nothing of the request is left
        assert engine.metrics().requests["cancelled"] == 1 and held(video) == 0  # the caller ended it
        with pytest.raises(UsageError, match="format='mp4'"):
            next(engine.generate_video(DiffusionRequest("png", params, format="png")))


def test_a_sigkilled_encoder_mid_video_fails_it_and_releases_every_part(video: MultiprocDiffusionExecutor) -> None:
    """The process encoding a video's parts is SIGKILLed with parts in its pipe and behind
    it: the request fails with ``EncodeFailed`` naming the signal, every part's output goes
    back once (nothing held), and the next video is encoded by the process in its place."""
    params = {"frames": 48, "height": 96, "width": 128, "chunk_frames": 8}

    async def body() -> None:
        async with AsyncDiffusionEngine(video, encode_workers=1) as engine:
            await engine.generate(DiffusionRequest("warm", dict(params, frames=2), format="mp4"))
            pool = engine._post.encoders
            (pid,) = pool.pids()

            async def consume() -> list[object]:
                return [i async for i in engine.generate_video(DiffusionRequest("victim", params, format="mp4"))]

            with stopped(pid):
                task = asyncio.ensure_future(consume())
                await eventually(lambda: pool.running() == {pid: "victim"}, what="a part in its process's pipe")
                await eventually(lambda: held(video) >= 2, what="parts held behind it")
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(EncodeFailed, match="SIGKILL") as err:
                await task
            assert err.value.request_id == "victim"
            # Every part's output went back, also those whose views the error's traceback saw.
            await eventually(lambda: held(video) == 0, timeout=5.0, what="every part released")
            items = [i async for i in engine.generate_video(DiffusionRequest("after", params, format="mp4"))]
            assert isinstance(items[-1], GenerationResult) and len(decoded(items[-1].output.data)) == 48
            await assert_quiescent(engine)

    run(body())


def test_what_is_not_a_video_is_refused_where_it_is_written(video: MultiprocDiffusionExecutor) -> None:
    import torch

    from omni_async.core.errors import UsageError
    from omni_async.worker import emit_frames

    with pytest.raises(UsageError, match=r"uint8 \[T, H, W, C\]"):
        emit_frames("r", torch.zeros(2, 8, 8, 3))  # float frames: convert on the device
    assert emit_frames("r", torch.zeros(2, 8, 8, 3, dtype=torch.uint8)) is None  # no stream: nothing shipped

    async def body() -> None:
        async with AsyncDiffusionEngine(video, encode_workers=1) as engine:
            with pytest.raises(UsageError, match="format='mp4'"):
                async for _ in engine.generate_video(DiffusionRequest("png", {}, format="png")):
                    pass
            assert len(engine) == 0

    run(body())
