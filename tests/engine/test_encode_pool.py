"""Issue 29: the engine's encoder pool, with real spawned encoder processes.

* A job that has finished by the time ``submit`` reaches its bookkeeping must not
  deadlock the pool: the pool ran ``future.add_done_callback(self._finished)`` under its
  own plain lock, and a done future runs the callback at once, in the same thread, where
  ``_finished`` waited for that lock.  The test holds ``submit`` at that point (the pool's
  ``_on_queued`` hook) until the job's future is done.
* A SIGKILLed encoder process fails only the job it had: every job in flight used to fail
  (``BrokenProcessPool``: a ``ProcessPoolExecutor`` breaks as a whole).  The others finish
  in their own processes, and a new process takes the dead one's place.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from omni_async.core.encoding import Encoding
from omni_async.engine.encode_pool import IDLE_EXIT_S, EncodeResult, EncoderPool
from omni_async.engine.encoders import EncodeJob, encode
from omni_async.engine.errors import EncodeFailed
from omni_async.transport.shm import pid_alive

pytestmark = pytest.mark.slow  # spawned encoder processes take seconds to import

Pixels = npt.NDArray[np.uint8]


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds (a state of other processes, which send no event)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come to hold"
        time.sleep(0.01)


def decode(data: bytes) -> Pixels:
    return np.asarray(Image.open(io.BytesIO(data)))


def test_a_job_done_before_submit_returns_does_not_deadlock_the_pool() -> None:
    pool = EncoderPool(1)
    pixels = np.random.default_rng(1).integers(0, 256, size=(16, 24, 3), dtype=np.uint8)
    job = EncodeJob(pixels, Encoding("png"), sequence=False, request_id="quick")
    done_inside: list[bool] = []

    def finish_first(future: concurrent.futures.Future[EncodeResult]) -> None:
        # Held here, inside submit, until the encoder process has sent the files back.
        future.result(timeout=120)
        done_inside.append(future.done())

    pool._on_queued = finish_first
    got: list[concurrent.futures.Future[EncodeResult]] = []
    submitter = threading.Thread(target=lambda: got.append(pool.submit(job)), daemon=True)
    try:
        submitter.start()
        submitter.join(90)
        assert not submitter.is_alive(), "submit deadlocked on the pool's own lock after its job had finished"
        assert done_inside == [True]
        (files, _) = got[0].result(timeout=0)
        assert np.array_equal(decode(files[0]), pixels)
        pool._on_queued = None
        again, _ = pool.submit(job).result(timeout=60)  # the pool still serves
        assert again == files
    finally:
        pids = pool.pids()
        t0 = time.monotonic()
        pool.shutdown(timeout=10.0)
    assert time.monotonic() - t0 < 10.0 and pool.pids() == [] and not any(pid_alive(p) for p in pids)


def test_a_killed_encoder_process_fails_only_its_own_job() -> None:
    rng = np.random.default_rng(2)
    # Random pixels at zlib level 9: a few seconds of PNG per job, so all three are in flight at the kill.
    pixels = {f"r{i}": rng.integers(0, 256, (24, 512, 512, 3), np.uint8) for i in range(3)}
    jobs = {rid: EncodeJob(p, Encoding("png", 9), True, request_id=rid) for rid, p in pixels.items()}
    pool = EncoderPool(3)
    try:
        futures = {rid: pool.submit(job) for rid, job in jobs.items()}
        wait_until(lambda: len(pool.running()) == 3)
        holders = pool.running()
        victim_pid, victim = next(iter(holders.items()))
        os.kill(victim_pid, signal.SIGKILL)
        with pytest.raises(EncodeFailed) as info:
            futures[victim].result(timeout=120)
        err = info.value
        assert err.request_id == victim and err.format == "png"
        assert f"request {victim!r}" in str(err) and f"pid {victim_pid}" in str(err) and "SIGKILL" in str(err)
        assert "send the request again" in str(err)
        for pid, rid in holders.items():
            if rid == victim:
                continue
            files, _ = futures[rid].result(timeout=300)  # finished in its own process, which lived on
            assert len(files) == 24 and all(
                np.array_equal(decode(f), image) for f, image in zip(files, pixels[rid], strict=True)
            )
            assert pid_alive(pid) and pid in pool.pids()
        # A new process took the dead one's place, and encodes.
        wait_until(lambda: len(pool.pids()) == 3)
        assert victim_pid not in pool.pids()
        corner = pixels["r0"][0, :8, :8]
        (data,), _ = pool.submit(EncodeJob(corner, Encoding("webp"), False, request_id="after")).result(timeout=120)
        assert np.array_equal(decode(data), corner)
    finally:
        pids = pool.pids()
        pool.shutdown(timeout=10.0)
    assert pool.pids() == [] and not any(pid_alive(p) for p in pids)


def test_an_encoder_that_raises_fails_its_job_with_the_request_and_format() -> None:
    pool = EncoderPool(1)
    try:
        one_image = EncodeJob(np.zeros((8, 8, 3), np.uint8), Encoding("mp4"), sequence=False, request_id="still")
        with pytest.raises(EncodeFailed) as info:
            pool.submit(one_image).result(timeout=120)
        assert info.value.request_id == "still" and info.value.format == "mp4"
        assert "request 'still'" in str(info.value) and "mp4 encodes frames" in str(info.value), str(info.value)
        (pid,) = pool.pids()
        ok = EncodeJob(np.zeros((8, 8, 3), np.uint8), Encoding("png"), sequence=False, request_id="next")
        assert pool.submit(ok).result(timeout=60) is not None and pool.pids() == [pid]  # the process lived on
    finally:
        pool.shutdown(timeout=10.0)


def test_jobs_waiting_at_shutdown_fail_naming_their_request() -> None:
    pool = EncoderPool(1)
    rng = np.random.default_rng(3)
    long = EncodeJob(rng.integers(0, 256, (24, 512, 512, 3), np.uint8), Encoding("png", 9), True, request_id="long")
    waiting = EncodeJob(np.zeros((8, 8, 3), np.uint8), Encoding("webp"), sequence=False, request_id="waiting")
    try:
        first = pool.submit(long)
        wait_until(lambda: pool.running() == {pool.pids()[0]: "long"})
        second = pool.submit(waiting)
    finally:
        pool.shutdown(timeout=60.0)
    files, _ = first.result(timeout=0)  # the running job had until the deadline
    assert len(files) == 24
    with pytest.raises(EncodeFailed) as info:
        second.result(timeout=0)
    assert info.value.request_id == "waiting" and info.value.format == "webp" and "shut down" in str(info.value)
    with pytest.raises(EncodeFailed, match="shut down"):
        pool.submit(waiting)


def test_the_encode_function_is_what_the_processes_run() -> None:
    # The pool's files are the encoder's own, byte for byte (the pipe changes nothing).
    pixels = np.random.default_rng(4).integers(0, 256, size=(2, 16, 16, 4), dtype=np.uint8)
    job = EncodeJob(pixels, Encoding("webp"), sequence=True, request_id="same")
    pool = EncoderPool(1)
    try:
        files, _ = pool.submit(job).result(timeout=120)
    finally:
        pool.shutdown(timeout=10.0)
    assert files == encode(job)[0]


def test_idle_encoder_processes_leave_at_once_when_told(caplog: pytest.LogCaptureFixture) -> None:
    """An idle process told to leave exits without finalizing its interpreter: the normal
    exit (numpy, Pillow) took over IDLE_EXIT_S of a loaded 2-core machine, every time, and
    each close then waited IDLE_EXIT_S and terminated processes that were leaving."""
    pool = EncoderPool(2)
    job = EncodeJob(np.zeros((8, 8, 3), np.uint8), Encoding("png"), sequence=False, request_id="one")
    for future in [pool.submit(job), pool.submit(job)]:
        future.result(timeout=120)
    pids = pool.pids()
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="omni_async.engine.engine"):
        pool.shutdown(timeout=10.0)
    took = time.monotonic() - t0
    assert not any(pid_alive(p) for p in pids)
    assert not [r.getMessage() for r in caplog.records], "the processes had to be terminated"
    assert took < IDLE_EXIT_S, f"an idle pool took {took:.2f} s to close"
