"""Issue 20: the host's encoders and the device's JPEG, each decoded again.

Every host encoder round-trips: PNG (every level) and lossless WebP give back the uint8
pixels exactly (grey, RGB, RGBA), JPEG and lossy WebP within a PSNR bound, MP4 (PyAV,
H.264) its frames within a PSNR bound at the right count and size.  The request's
format is checked when the request is built (``InvalidEncoding``).  The worker's JPEG
on the GPU (``worker.encode``) falls back on the CPU with its reason; on CUDA (``-m
cuda``) it is a decodable JPEG of the right size, batched, ordered after the forward's
event.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest
import torch
from PIL import Image

from omni_async.core.encoding import (
    FORMATS,
    MEDIA_TYPES,
    SPECS,
    Encoding,
    Format,
    InvalidEncoding,
    check_encoding,
    format_spec,
)
from omni_async.core.errors import InvalidRequest
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.encoders import EncodeJob, encode, encode_image, encode_video
from omni_async.worker.encode import DeviceEncoded, encode_on_device, encodes_on_device, run_device_encode

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

Pixels = npt.NDArray[np.uint8]


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds (a state of other processes, which send no event)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come to hold"
        time.sleep(0.01)


def smooth(h: int, w: int, c: int, seed: int = 0) -> Pixels:
    """A smooth image (gradients and a little noise): what JPEG is for; PSNR stays high."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    rng = np.random.default_rng(seed)
    chans = [127 + 100 * np.sin(x / (7 + i) + y / (11 + 2 * i) + seed) + rng.normal(0, 2, (h, w)) for i in range(c)]
    out: Pixels = np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8)
    return out


def psnr(a: Pixels, b: Pixels) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def decode(data: bytes) -> Pixels:
    return np.asarray(Image.open(io.BytesIO(data)))


@pytest.mark.parametrize("level", [None, 0, 1, 6, 9])
@pytest.mark.parametrize("channels", [0, 1, 3, 4])
def test_png_gives_back_the_pixels_exactly(level: int | None, channels: int) -> None:
    image = smooth(37, 53, max(channels, 1), seed=channels)
    if channels == 0:
        image = image[..., 0]  # [H, W]
    data = encode_image(image, Encoding("png", level))
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    want = image[..., 0] if channels == 1 else image
    assert np.array_equal(decode(data), want)


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_lossless_webp_gives_back_the_pixels_exactly(channels: int) -> None:
    image = smooth(40, 24, channels, seed=5)
    data = encode_image(image, Encoding("webp"))
    assert data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    back = decode(data)
    if channels == 1:
        assert np.array_equal(back[..., 0], image[..., 0]) and np.array_equal(back[..., 2], image[..., 0])
    else:
        assert np.array_equal(back, image)


@pytest.mark.parametrize(("fmt", "quality", "bound"), [("jpeg", None, 33.0), ("jpeg", 95, 36.0), ("webp", 90, 33.0)])
def test_lossy_formats_stay_within_a_psnr_bound(fmt: str, quality: int | None, bound: float) -> None:
    image = smooth(64, 96, 3, seed=2)
    data = encode_image(image, Encoding(fmt, quality))
    back = decode(data)
    assert back.shape == image.shape and psnr(back, image) > bound, psnr(back, image)
    rgba = np.concatenate([image, np.full((*image.shape[:2], 1), 7, np.uint8)], -1)
    if fmt == "jpeg":  # JPEG drops the alpha channel
        assert psnr(decode(encode_image(rgba, Encoding("jpeg"))), image) > bound


def test_mp4_gives_back_its_frames_within_a_psnr_bound() -> None:
    av = pytest.importorskip("av")  # the encode extra; the rest of this module runs without it
    frames = np.stack([smooth(48, 64, 3, seed=i % 3) for i in range(12)])
    data = encode_video(frames, Encoding("mp4"), fps=12)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and (stream.width, stream.height) == (64, 48)
        back = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert back.shape == frames.shape
    assert psnr(back, frames) > 28.0, psnr(back, frames)
    grey = encode_video(frames[..., :1], Encoding("mp4", 100), fps=12)  # [T, H, W, 1]
    with av.open(io.BytesIO(grey)) as container:
        assert len(list(container.decode(video=0))) == 12


def test_a_job_encodes_each_image_of_a_sequence_or_one_video() -> None:
    pytest.importorskip("av")
    batch = np.stack([smooth(16, 16, 3, seed=i) for i in range(3)])
    files, seconds = encode(EncodeJob(batch, Encoding("png"), sequence=True))
    assert len(files) == 3 and seconds > 0
    assert all(np.array_equal(decode(f), img) for f, img in zip(files, batch, strict=True))
    (video,), _ = encode(EncodeJob(batch, Encoding("mp4"), sequence=True))
    assert video[4:8] == b"ftyp"
    with pytest.raises(ValueError, match="mp4 encodes frames"):
        encode(EncodeJob(batch[0], Encoding("mp4"), sequence=False))
    with pytest.raises(ValueError, match="even width and height"):
        encode_video(np.zeros((2, 15, 16, 3), np.uint8), Encoding("mp4"))


def test_a_bad_format_or_quality_fails_when_the_request_is_built() -> None:
    for kwargs, parameter, needle in [
        ({"format": "tiff"}, "format", "'tiff'; the formats are ['png', 'jpeg', 'webp', 'mp4']"),
        ({"format": "jpg"}, "format", "'jpg' is spelt 'jpeg'"),
        ({"format": "jpeg", "quality": 101}, "quality", "for jpeg it is an int 1..100"),
        ({"format": "png", "quality": 10}, "quality", "the zlib compression level"),
        ({"format": "webp", "quality": 9.5}, "quality", "for webp it is an int 1..100"),
        ({"quality": 90}, "quality", "quality needs a format"),
    ]:
        with pytest.raises(InvalidEncoding) as info:
            DiffusionRequest("req-7", {"height": 8}, **kwargs)  # type: ignore[arg-type]
        err = info.value
        assert isinstance(err, InvalidRequest) and isinstance(err, ValueError)
        assert err.request_id == "req-7" and err.parameter == parameter
        assert "request 'req-7'" in str(err) and needle in str(err), str(err)
    ok = DiffusionRequest("r", format="webp", quality=80)
    assert ok.encoding == Encoding("webp", 80) and ok.encoding.media_type == "image/webp"
    assert DiffusionRequest("r").encoding is None
    assert set(FORMATS) == set(MEDIA_TYPES) == {"png", "jpeg", "webp", "mp4"}


def test_off_cuda_the_device_jpeg_leaves_the_pixels_and_says_why() -> None:
    pixels = torch.from_numpy(smooth(16, 24, 3))
    out = run_device_encode(DiffusionOutput("r", {"image": pixels, "info": 1}), Encoding("jpeg"))
    value = out.output["image"]
    assert isinstance(value, DeviceEncoded) and not value.parts and value.pixels is pixels
    assert "on cpu" in value.reason and out.output["info"] == 1
    assert "device_encode_s" not in out.metrics
    same = DiffusionOutput("r", {"image": pixels})
    assert encode_on_device(same, Encoding("png")) is same  # only JPEG is the GPU's


# ------------------------------------------------------------------------------ CUDA


@cuda
@pytest.mark.cuda
def test_nvjpeg_gives_decodable_jpegs_of_the_right_size_in_one_batch() -> None:
    pytest.importorskip("torchvision")
    batch = np.stack([smooth(1024, 768, 3, seed=i) for i in range(8)])
    pixels = torch.from_numpy(batch).cuda()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
    out = run_device_encode(DiffusionOutput("r", {"image": pixels}), Encoding("jpeg", 90), side)
    value = out.output["image"]
    assert isinstance(value, DeviceEncoded) and value.reason == "" and len(value.parts) == 8
    assert (value.width, value.height, value.batched) == (768, 1024, True)
    for part, image in zip(value.parts, batch, strict=True):
        back = decode(part.cpu().numpy().tobytes())
        assert back.shape == image.shape and psnr(back, image) > 33.0
    assert out.metrics["device_encode_out_bytes"] < out.metrics["device_encode_in_bytes"] / 4


@cuda
@pytest.mark.cuda
def test_nvjpeg_waits_for_the_forwards_event() -> None:
    pytest.importorskip("torchvision")
    image = torch.from_numpy(smooth(512, 512, 3, seed=9)).cuda()
    pixels = torch.zeros_like(image)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # the forward's tail, queued
    pixels.copy_(image)  # its last write, behind the sleep
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
    event.record()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
    out = run_device_encode(DiffusionOutput("r", {"image": pixels}), Encoding("jpeg", 95), side, event)
    (part,) = out.output["image"].parts
    assert psnr(decode(part.cpu().numpy().tobytes()), image.cpu().numpy()) > 36.0


@cuda
@pytest.mark.cuda
def test_nvjpeg_bytes_are_read_only_once_written_with_the_next_forward_queued() -> None:
    """torchvision hands the JPEG bytes over on the default stream, behind whatever the
    worker queued there (its next forward): the packer's copy on its side stream must
    wait for them (run_device_encode makes the side stream wait for the default one)."""
    pytest.importorskip("torchvision")
    image = torch.from_numpy(smooth(512, 512, 3, seed=11)).cuda()
    torch.cuda.synchronize()
    torch.cuda._sleep(300_000_000)  # type: ignore[no-untyped-call]  # the next forward, queued
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
    out = run_device_encode(DiffusionOutput("r", {"image": image}), Encoding("jpeg", 95), side)
    (part,) = out.output["image"].parts
    host = torch.empty(part.shape, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(side):
        host.copy_(part, non_blocking=True)  # as the packer copies: on its side stream
    side.synchronize()
    assert psnr(decode(host.numpy().tobytes()), image.cpu().numpy()) > 36.0


@pytest.mark.slow
def test_an_encoder_process_killed_fails_its_job_and_the_pool_is_replaced() -> None:
    """A real encoder process SIGKILLed: the job it had fails (EncodeFailed naming the
    request, the format and the signal), a new process takes its place and encodes right,
    and shutdown leaves no encoder process."""
    import os
    import signal

    from omni_async.engine.encode_pool import EncoderPool
    from omni_async.engine.errors import EncodeFailed
    from omni_async.transport.shm import pid_alive

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    big = rng.integers(0, 256, size=(24, 1024, 1024, 3), dtype=np.uint8)  # seconds of PNG at level 9
    pool = EncoderPool(1)
    try:
        files, _ = pool.submit(EncodeJob(pixels, Encoding("png"), sequence=False)).result(timeout=120)
        (first,) = pool.pids()
        doomed = pool.submit(EncodeJob(big, Encoding("png", 9), sequence=True, request_id="doomed"))
        wait_until(lambda: pool.running() == {first: "doomed"})
        os.kill(first, signal.SIGKILL)
        with pytest.raises(EncodeFailed) as info:
            doomed.result(timeout=60)
        assert info.value.request_id == "doomed" and info.value.format == "png"
        assert f"pid {first}" in str(info.value) and "SIGKILL" in str(info.value), str(info.value)
        again, _ = pool.submit(EncodeJob(pixels, Encoding("png"), sequence=False)).result(timeout=120)
        assert again == files  # the same pixels, the same file, from a new process
        (second,) = pool.pids()
        assert second != first and not pid_alive(first)
    finally:
        pids = pool.pids()
        pool.shutdown(timeout=5.0)
    assert pool.pids() == [] and not any(pid_alive(p) for p in pids)


@pytest.mark.slow
def test_an_idle_encoder_process_that_does_not_leave_does_not_hold_the_close() -> None:
    """Shutdown with no job running: an encoder process that does not take its exit
    (stopped here, SIGSTOP; seen as a process of an idle pool that never left) is
    terminated after IDLE_EXIT_S, not after the whole close deadline."""
    import os
    import signal

    from omni_async.engine.encode_pool import IDLE_EXIT_S, EncoderPool
    from omni_async.transport.shm import pid_alive

    pool = EncoderPool(1)
    pixels = np.random.default_rng(0).integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
    pool.submit(EncodeJob(pixels, Encoding("png"), sequence=False)).result(timeout=120)
    (pid,) = pool.pids()
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    pool.shutdown(timeout=60.0)
    took = time.monotonic() - t0
    assert not pid_alive(pid)
    assert took < IDLE_EXIT_S + 15.0, f"the close waited {took:.1f} s for an idle process"


@pytest.mark.slow
def test_the_first_encode_starts_every_encoder_process_at_once() -> None:
    """A spawned pool makes a process only when a job finds none idle: the first burst of
    requests then waited for processes still importing (3 s on the H200).  The pool
    starts all of its processes with the first job."""
    from omni_async.engine.encode_pool import EncoderPool

    pool = EncoderPool(3)
    try:
        pixels = np.zeros((8, 8, 3), dtype=np.uint8)
        pool.submit(EncodeJob(pixels, Encoding("png"), sequence=False)).result(timeout=120)
        assert len(pool.pids()) == 3
    finally:
        pool.shutdown(timeout=30.0)
    assert pool.pids() == []


# ------------------------------------------------------------------------------ the table of formats


@pytest.mark.parametrize("fmt", list(Format), ids=str)
def test_every_format_of_the_table_encodes_a_decodable_file_at_each_quality_bound(fmt: Format) -> None:
    """Every member of ``Format`` goes through every dispatch (the table, the request's
    check, the host encoder, the device's choice) to a non-empty file of its media type:
    a member a dispatch misses fails here (``assert_never``'s AssertionError, or the empty
    file an unmatched case used to return), as it fails ``mypy --strict``."""
    spec = format_spec(fmt)
    assert SPECS[fmt] == spec and MEDIA_TYPES[fmt] == spec.media_type and fmt.value in FORMATS
    assert isinstance(encodes_on_device(Encoding(fmt)), bool)
    frames = np.stack([smooth(32, 48, 3, seed=i) for i in range(4)])
    for quality in (None, spec.quality_min, spec.quality_max):
        encoding = check_encoding("r", fmt.value, quality)
        assert encoding == Encoding(fmt, quality) and encoding.media_type == spec.media_type
        files, _ = encode(EncodeJob(frames, encoding, sequence=True, request_id="r"))
        assert all(len(f) > 0 for f in files)
        if spec.video:
            av = pytest.importorskip("av")
            (video,) = files
            with av.open(io.BytesIO(video)) as container:
                back = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
            assert len(back) == 4 and back[0].shape == (32, 48, 3)
            continue
        assert len(files) == 4
        for data, image in zip(files, frames, strict=True):
            with Image.open(io.BytesIO(data)) as pil:
                assert pil.get_format_mimetype() == spec.media_type and pil.size == (48, 32)
            assert psnr(decode(data), image) > 15.0  # the image, even at JPEG quality 1 (about 20 dB)


def test_the_table_is_the_formats_a_request_names() -> None:
    assert tuple(Format) == tuple(SPECS) and FORMATS == ("png", "jpeg", "webp", "mp4")
    assert Format("jpeg") is Format.JPEG and str(Format.JPEG) == "jpeg" and f"{Format.MP4}" == "mp4"
    assert DiffusionRequest("r", format="png").encoding == Encoding(Format.PNG)
    assert [fmt for fmt in Format if encodes_on_device(Encoding(fmt))] == [Format.JPEG]


@pytest.mark.slow
def test_an_encoder_whose_engine_is_gone_leaves_quietly() -> None:
    """The engine's process gone while its encoder works (its end of the pipe closed): the
    encoder's reply finds a broken pipe and it leaves, exit 0.  The defect: the
    ``BrokenPipeError`` escaped, and every such exit printed "Process omni-encoder:" and a
    traceback (seen on the H200 when a bench was killed mid-run)."""
    import multiprocessing

    from omni_async.engine.encoders import serve

    big = np.random.default_rng(0).integers(0, 256, size=(8, 1024, 1024, 3), dtype=np.uint8)
    ctx = multiprocessing.get_context("spawn")
    mine, child = ctx.Pipe()
    process = ctx.Process(target=serve, args=(child,), name="omni-encoder", daemon=True)
    process.start()
    child.close()
    mine.send(EncodeJob(big, Encoding("png", 9), sequence=True, request_id="orphan"))  # about a second of work
    mine.close()  # as the engine's death closes it
    process.join(60)
    assert process.exitcode == 0, process.exitcode
