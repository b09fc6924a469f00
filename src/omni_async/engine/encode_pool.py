"""Encoded outputs in the engine: the pixels of a request that asked for a format, and
the process pool that encodes them.

A request with a ``format`` (``DiffusionRequest(..., format="png")``) skips its pipeline's
host stage.  On its ``omni-postprocess`` thread ``take_for_encoding`` reads its output:

* pixels the worker's GPU encoded already (JPEG, ``omni_async.worker.encode``): their
  bytes are copied out of shared memory and are the result (``EncodedOutput`` with
  ``encoded_on="cuda"``);
* otherwise the pixels (uint8, channel-last: ``"frames"``, else ``"image"``) are copied
  out of shared memory into one uint8 numpy array, an ``EncodeJob``; the segment goes
  back to the pool before anything is encoded.

The job goes to ``EncoderPool``: a ``concurrent.futures.ProcessPoolExecutor`` of spawned
processes (``os.cpu_count()`` by default, ``AsyncDiffusionEngine(encode_workers=...)``),
started on first use, so an engine whose requests never ask for a format starts none.
The event loop awaits the job's future; the encoding never holds the engine's GIL.  Only
uint8 pixels travel to the pool (a float tensor is refused before: it would pickle 2-4x
the bytes, and its scale is the pipeline's to know).  ``shutdown`` (the engine's close,
whatever ended it) cancels the jobs not started, waits for the running ones up to its
deadline, then terminates what is left: no encoder process outlives its engine.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures.process import BrokenProcessPool

import attrs
import numpy as np
import torch

from omni_async.core.encoding import Encoding
from omni_async.core.errors import UsageError
from omni_async.engine.encoders import EncodedOutput, EncodeJob, encode
from omni_async.engine.errors import EncodeFailed
from omni_async.worker.encode import DeviceEncoded, pixel_key

__all__ = ["EncoderPool", "HostEncode", "PendingEncode", "encoded_value", "take_for_encoding"]

log = logging.getLogger("omni_async.engine.engine")

EncodeResult = tuple[list[bytes], float]
Encoded = EncodedOutput | tuple[EncodedOutput, ...]
#: Seconds an idle encoder process gets to leave at shutdown before it is terminated.
IDLE_EXIT_S = 2.0


@attrs.frozen
class HostEncode:
    """Pixels for the encoder pool (``job``), and why the GPU did not encode them
    (``note``; empty when the request's format is not one the GPU encodes)."""

    job: EncodeJob
    note: str = ""


class PendingEncode:
    """A request's pixels on their way through the encoder pool: the future of the files,
    and what the result needs besides them."""

    def __init__(self, future: concurrent.futures.Future[EncodeResult], host: HostEncode) -> None:
        self.future = future
        self.encoding = host.job.encoding
        self.sequence = host.job.sequence
        self.shape = host.job.pixels.shape
        self.note = host.note
        self.submitted_at = time.perf_counter()


class EncoderPool:
    """The engine's encoder processes (see the module docstring); thread-safe."""

    def __init__(self, workers: int | None = None) -> None:
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise UsageError(f"encode_workers must be a positive int or None (os.cpu_count()), got {workers!r}")
        self.workers = workers if workers is not None else max(1, os.cpu_count() or 1)
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._closed = False
        self._unfinished = 0  # jobs submitted whose future is not done

    def submit(self, job: EncodeJob) -> concurrent.futures.Future[EncodeResult]:
        """Queue ``job``; the first call starts the processes (spawned: safe beside the
        engine's threads and a CUDA context).  A pool broken by a process that died is
        replaced."""
        with self._lock:
            if self._closed:
                raise EncodeFailed("the engine's encoder pool is shut down (the engine is closing)")
            for attempt in range(2):
                if self._pool is None:
                    self._pool = self._start()
                try:
                    future = self._pool.submit(encode, job)
                except BrokenProcessPool:
                    if attempt:
                        raise
                    log.warning("engine: an encoder process died; starting a new encoder pool")
                    self._pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = None
                    continue
                self._unfinished += 1
                future.add_done_callback(self._finished)
                return future
            raise AssertionError("unreachable")

    def _start(self) -> concurrent.futures.ProcessPoolExecutor:
        """A new pool with all its processes starting at once.  A spawned pool makes a
        process only when a job finds none idle, one job at a time: on the H200 the first
        burst of 1024x1024 PNG requests then waited about 3 s for processes still importing
        (p99 4.4 s against p50 1.2 s).  One quick job per process, submitted together,
        finds none idle each time, so every process is spawned now and they import side
        by side."""
        pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        for _ in range(self.workers):
            pool.submit(os.getpid)
        return pool

    def _finished(self, _: concurrent.futures.Future[EncodeResult]) -> None:
        with self._lock:
            self._unfinished -= 1

    def pids(self) -> list[int]:
        """The encoder processes' ids (none before the first encode, nor after ``shutdown``)."""
        with self._lock:
            return sorted(_processes(self._pool))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the encoder processes: jobs not started are cancelled, running ones get
        until ``timeout`` seconds, then their processes are terminated.  With no job
        running the processes get ``IDLE_EXIT_S`` to leave, whatever ``timeout`` says:
        an idle process that does not leave has nothing to lose (in 4 of 34 closes of
        ``bench/encoded_images.py``'s engines on a 2-core machine, one process of an idle
        pool was still there after the engine's whole close deadline, 60 s).  Idempotent; a later
        ``submit`` raises ``EncodeFailed``."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            running = self._unfinished
        if pool is None:
            return
        procs = list(_processes(pool).values())
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + (timeout if running else min(timeout, IDLE_EXIT_S))
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        left = [p for p in procs if p.is_alive()]
        if left and running:
            log.warning(
                "engine close: %d encoder process(es) still encoding after %.1f s; terminating them", len(left), timeout
            )
        elif left:
            log.warning(
                "engine close: %d idle encoder process(es) did not leave within %.1f s; terminating them",
                len(left),
                IDLE_EXIT_S,
            )
        for p in left:
            p.terminate()
        for p in left:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)


def _processes(pool: concurrent.futures.ProcessPoolExecutor | None) -> dict[int, multiprocessing.Process]:
    # The executor's own table of its processes: the only handle on them it keeps.
    procs: dict[int, multiprocessing.Process] | None = getattr(pool, "_processes", None)
    return dict(procs or {})


def _owned_pixels(value: object, rid: str, encoding: Encoding, key: str) -> np.ndarray:
    """The pixels as an owned, contiguous uint8 numpy array (a ``"frames"`` of grey
    ``[T, H, W]`` as ``[T, H, W, 1]``), or ``EncodeFailed`` saying why not."""
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8:
            raise _not_uint8(rid, encoding, key, str(value.dtype))
        array = value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise _not_uint8(rid, encoding, key, str(value.dtype))
        array = value
    else:
        raise EncodeFailed(
            f"request {rid!r} asked for format {encoding.format!r}, but its output's {key!r} is a "
            f"{type(value).__name__}, not uint8 pixels (a tensor or numpy array)",
            request_id=rid,
            format=encoding.format,
        )
    if key == "frames" and array.ndim == 3:
        array = array[..., None]
    if array.ndim not in (2, 3, 4) or (array.ndim >= 3 and array.shape[-1] not in (1, 3, 4)):
        raise EncodeFailed(
            f"request {rid!r} asked for format {encoding.format!r}, but its output's {key!r} has shape "
            f"{tuple(array.shape)}; an encoder takes channel-last pixels [H, W], [H, W, C] or [N, H, W, C] with "
            "C 1, 3 or 4",
            request_id=rid,
            format=encoding.format,
        )
    # A copy: the view's segment goes back to the pool before the job is pickled.
    return np.array(array, dtype=np.uint8, copy=True, order="C")


def _not_uint8(rid: str, encoding: Encoding, key: str, dtype: str) -> EncodeFailed:
    return EncodeFailed(
        f"request {rid!r} asked for format {encoding.format!r}, but its output's {key!r} is {dtype}, not uint8 "
        "pixels; name the pipeline's post-process in WorkerSpec(postprocess=...) so that its device stage "
        "converts them on the worker (its scale, 0..1, -1..1 or 0..255, is the pipeline's to know)",
        request_id=rid,
        format=encoding.format,
    )


def take_for_encoding(output: Mapping[str, object] | object, rid: str, encoding: Encoding) -> Encoded | HostEncode:
    """The result of a request that asked for ``encoding``, from its unpacked output: the
    files its worker's GPU encoded, or the job for the encoder pool (pixels copied) and
    why the GPU did not encode them (empty: it was not asked to)."""
    key = pixel_key(output)
    if key is None or not isinstance(output, Mapping):
        keys = f" with keys {sorted(map(str, output))[:8]}" if isinstance(output, Mapping) else ""
        raise EncodeFailed(
            f"request {rid!r} asked for format {encoding.format!r}, but its output ({type(output).__name__}{keys}) "
            "has no 'image' or 'frames' to encode",
            request_id=rid,
            format=encoding.format,
        )
    value = output[key]
    note = ""
    if isinstance(value, DeviceEncoded):
        if value.parts:
            files = tuple(
                EncodedOutput(part.numpy().tobytes(), value.media_type, value.width, value.height, encoded_on="cuda")
                for part in value.parts
            )
            return files if value.batched or key == "frames" else files[0]
        note = value.reason
        value = value.pixels
    pixels = _owned_pixels(value, rid, encoding, key)
    fps = output.get("fps", 24.0)
    rate = float(fps) if isinstance(fps, (int, float)) else 24.0
    return HostEncode(EncodeJob(pixels, encoding, sequence=pixels.ndim == 4, fps=rate), note)


def encoded_value(pending: PendingEncode, files: list[bytes]) -> Encoded:
    """The ``EncodedOutput``(s) of a finished job."""
    shape = pending.shape
    if pending.sequence:
        frames, height, width = int(shape[0]), int(shape[1]), int(shape[2])
    else:
        frames, height, width = 1, int(shape[0]), int(shape[1])
    media = pending.encoding.media_type
    if pending.encoding.is_video:
        return EncodedOutput(files[0], media, width, height, frames=frames, note=pending.note)
    out = tuple(EncodedOutput(f, media, width, height, note=pending.note) for f in files)
    return out if pending.sequence else out[0]
