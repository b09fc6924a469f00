"""Issue 31: output sinks through the engine, over worker processes.

A request names where its result goes (``DiffusionRequest(..., sink=...)``): ``"file"``
writes its encoded file(s) under a directory the engine owns (``engine.files``), each
whole under its final name (a temporary name, then a rename), deleted at its expiry, on
``delete`` and at close, never left by a request that ended first; ``"segment"`` lends
the output's shared-memory segment to a consumer on the host, held in the budget until
``release()`` or its expiry, released exactly once.  One executor and one engine serve
the module (the blocking ``DiffusionEngine``: its loop runs on its own thread).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from helpers.engine_harness import run
from helpers.executor_harness import RELAXED, make_toy
from helpers.leaks import kept_for_the_module
from omni_async.core.errors import RequestAborted
from omni_async.core.messages import DiffusionRequest
from omni_async.core.sinks import InvalidSink
from omni_async.engine.encoders import EncodedOutput
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import EncodeFailed, OutputFileGone, PostProcessFailed, SinkUnavailable
from omni_async.engine.sinks import OutputFile, OutputFiles, SegmentLease
from omni_async.engine.sync import DiffusionEngine
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

DIT = WorkerSpec(
    "omni_async.models.dit:make_worker",
    {"device": "cpu", "hidden_size": 32, "depth": 1, "heads": 2, "decoder_width": 16, "steps": 2},
    postprocess="dit",
)
SMALL = {"height": 32, "width": 48, "seed": 3}
# 256x256x3 uint8 (192 KiB): over the packer's inline threshold, so it crosses in a segment.
LARGE = {"height": 256, "width": 256, "seed": 5}


@pytest.fixture(scope="module")
def ex() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(DIT, deadlines=RELAXED))


@pytest.fixture(scope="module")
def de(ex: MultiprocDiffusionExecutor) -> Iterator[DiffusionEngine]:
    engine = DiffusionEngine(ex, pipeline="dit", encode_workers=2)
    try:
        yield engine
    finally:
        directory = engine.engine.files.directory
        engine.close()
        assert directory is not None and not os.path.exists(directory)  # its private directory went with it


def until(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.01)


def listing(de: DiffusionEngine) -> list[str]:
    directory = de.files.directory
    assert directory is not None
    return sorted(os.listdir(directory))


def held(de: DiffusionEngine) -> tuple[int, float]:
    """The scheduler's lent outputs and the executor's held outputs."""
    sched = de.engine._admission.scheduler
    assert sched is not None
    return sched.lent, de.executor.metrics().as_dict()["held_outputs"]


# ---------------------------------------------------------------------------- files


def test_png_and_mp4_files_hold_the_bytes_the_value_sink_returns(de: DiffusionEngine) -> None:
    video = {**SMALL, "num_frames": 4}
    with ThreadPoolExecutor(4) as pool:
        png_v, png_f, mp4_v, mp4_f = pool.map(
            de.generate,
            [
                DiffusionRequest("png-v", SMALL, format="png"),
                DiffusionRequest("png-f", SMALL, format="png", sink="file"),
                DiffusionRequest("mp4-v", video, format="mp4"),
                DiffusionRequest("mp4-f", video, format="mp4", sink="file"),
            ],
        )
    for value, filed, media, frames in ((png_v, png_f, "image/png", 1), (mp4_v, mp4_f, "video/mp4", 4)):
        f = filed.output
        assert isinstance(f, OutputFile) and isinstance(value.output, EncodedOutput)
        assert Path(f.path).read_bytes() == value.data  # the same seed, the same bytes
        assert (f.media_type, f.size, f.width, f.height, f.frames) == (media, len(value.data or b""), 48, 32, frames)
        assert os.path.dirname(f.path) == de.files.directory
        assert de.files.get(f.file_id) == f
        assert 590 < f.expires_at - time.time() <= 600  # the engine's output_ttl_s
        assert de.files.delete(f.file_id)
    assert not [n for n in listing(de) if n.endswith(".part")]


def test_an_expired_file_is_deleted_and_get_says_so(de: DiffusionEngine) -> None:
    f = de.generate(DiffusionRequest("short", SMALL, format="png", sink="file", sink_ttl_s=0.3)).output
    assert isinstance(f, OutputFile) and os.path.exists(f.path)
    assert de.files.get(f.file_id) == f
    until(lambda: not os.path.exists(f.path), "the sweeper's delete at expiry")
    with pytest.raises(OutputFileGone) as err:
        de.files.get(f.file_id)
    assert err.value.why == "expired" and err.value.file_id == f.file_id and err.value.request_id == "short"
    assert "ttl passed" in str(err.value)


def test_delete_removes_the_file_once(de: DiffusionEngine) -> None:
    before = de.metrics().files_held
    f = de.generate(DiffusionRequest("del", SMALL, format="webp", sink="file")).output
    files = de.files
    assert de.metrics().files_held == before + 1
    assert files.delete(f.file_id) is True
    assert de.metrics().files_held == before
    with pytest.raises(OutputFileGone) as err:
        files.get(f.file_id)
    assert err.value.why == "deleted"
    until(lambda: not os.path.exists(f.path), "the unlink on the sweeper")
    assert files.delete(f.file_id) is False
    with pytest.raises(OutputFileGone) as unknown:
        files.get("no-such-id")
    assert unknown.value.why == "unknown"


def test_an_abort_while_encoding_leaves_no_file(de: DiffusionEngine) -> None:
    pool = de.engine._post.encoders
    de.generate(DiffusionRequest("warm", SMALL, format="png"))  # the encoder processes are up
    pids = pool.pids()
    before = listing(de)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as caller:
            fut = caller.submit(de.generate, DiffusionRequest("gone", SMALL, format="png", sink="file"))
            until(lambda: "gone" in pool.running().values(), "the job in an encoder process")
            de.abort("gone")
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            with pytest.raises(RequestAborted, match="gone"):
                fut.result(30)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    until(lambda: not pool.running(), "the encode's end")
    # The driver forgets the request only after its post-processing (a write included) ended.
    until(lambda: len(de.engine) == 0, "the request's end")
    assert listing(de) == before and len(de.files) == 0


def test_failed_encodes_and_writes_leave_no_file_and_close_removes_everything(
    de: DiffusionEngine, tmp_path: Path
) -> None:
    before = listing(de)
    with pytest.raises(EncodeFailed, match="mp4 encodes frames"):
        de.generate(DiffusionRequest("still", SMALL, format="mp4", sink="file"))
    assert listing(de) == before

    async def body() -> None:
        async with AsyncDiffusionEngine(de.executor, pipeline="dit", encode_workers=1, output_dir=str(out)) as eng:
            os.rmdir(out)  # the directory vanished under the engine: the write fails
            with pytest.raises(PostProcessFailed) as err:
                await eng.generate(DiffusionRequest("nowhere", SMALL, format="png", sink="file"))
            assert "request 'nowhere'" in str(err.value) and str(out) in str(err.value)
            assert len(eng.files) == 0
            os.mkdir(out)
            ok = (await eng.generate(DiffusionRequest("after", SMALL, format="png", sink="file"))).output
            assert isinstance(ok, OutputFile) and os.listdir(out) == [os.path.basename(ok.path)]
            kept = (await eng.generate(DiffusionRequest("kept", LARGE, sink="segment"))).output
            assert isinstance(kept, SegmentLease) and eng.executor.metrics().as_dict()["held_outputs"] == 1
        # The close: a directory given is kept, emptied of the engine's files; every lease released.
        assert os.listdir(out) == [] and kept.released
        assert de.executor.metrics().as_dict()["held_outputs"] == 0
        with pytest.raises(OutputFileGone) as gone:
            eng.files.get(ok.file_id)
        assert gone.value.why == "closed"

    out = tmp_path / "out"
    run(body())


def test_a_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    """A watcher stats every visible name while a 64 MB file is written: a name it sees is
    always the whole file (the write goes to a hidden ``.part`` name, then is renamed)."""
    files = OutputFiles(str(tmp_path), 60.0)
    files.open()
    data = os.urandom(1 << 16) * 1024
    sizes: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for entry in os.scandir(tmp_path):
                if not entry.name.startswith("."):
                    try:
                        sizes.add(entry.stat().st_size)
                    except FileNotFoundError:
                        pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        (f,) = files.write("big", [EncodedOutput(data, "video/mp4", 64, 64, frames=2)], None)
        time.sleep(0.05)
    finally:
        stop.set()
        watcher.join()
        files.close()
    assert sizes == {len(data)} and f.size == len(data)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------- segments

READER = """
import hashlib, mmap, os, sys
name, offset, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open("/dev/shm/" + name, os.O_RDONLY)
with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
    print(hashlib.sha256(m[offset : offset + nbytes]).hexdigest())
"""


def test_a_second_process_reads_the_lent_segment_and_release_frees_the_budget(de: DiffusionEngine) -> None:
    value = de.generate(DiffusionRequest("plain", LARGE)).output["image"]
    res = de.generate(DiffusionRequest("lent", LARGE, sink="segment"))
    lease = res.output
    assert isinstance(lease, SegmentLease) and lease.request_id == "lent" and lease.segment is not None
    (t,) = lease.tensors
    assert (t.key, t.shape, t.dtype, t.nbytes) == ("image", (256, 256, 3), "uint8", 256 * 256 * 3)
    assert held(de) == (1, 1.0)  # held in the engine's budget and the executor's
    assert de.metrics().leases_held == 1 and de.metrics().as_dict()["leases_held"] == 1.0
    assert "omni_async_engine_leases_held 1.0" in generate_latest(de.prometheus_registry()).decode()
    out = subprocess.run(
        [sys.executable, "-c", READER, lease.segment, str(t.offset), str(t.nbytes)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    expected = np.ascontiguousarray(np.asarray(value, dtype=np.uint8)).tobytes()
    assert out.stdout.strip() == hashlib.sha256(expected).hexdigest()
    assert lease.release() is True and lease.released
    until(lambda: held(de) == (0, 0.0), "the release")
    assert de.metrics().leases_held == 0
    assert lease.release() is False  # a second release is harmless
    assert held(de) == (0, 0.0)


def test_an_expired_lease_is_released_once(de: DiffusionEngine) -> None:
    lease = de.generate(DiffusionRequest("brief", LARGE, sink="segment", sink_ttl_s=0.3)).output
    assert isinstance(lease, SegmentLease) and held(de) == (1, 1.0)
    until(lambda: lease.released and held(de) == (0, 0.0), "the release at expiry")
    assert lease.release() is False
    again = de.generate(DiffusionRequest("next", LARGE, sink="segment")).output  # the segment serves again
    assert isinstance(again, SegmentLease) and again.release()


def test_an_output_small_enough_to_travel_inline_is_lent_as_values_holding_nothing(de: DiffusionEngine) -> None:
    plain = de.generate(DiffusionRequest("inline-v", SMALL)).output["image"]
    lease = de.generate(DiffusionRequest("inline", SMALL, sink="segment")).output
    assert isinstance(lease, SegmentLease) and lease.segment is None and lease.tensors == ()
    assert np.array_equal(np.asarray(lease.values["image"]), np.asarray(plain))
    assert held(de) == (0, 0.0) and lease.released and lease.release() is False


def test_sinks_a_request_cannot_use_are_refused_at_generate(de: DiffusionEngine) -> None:
    with pytest.raises(InvalidSink, match="add format="):
        de.generate(DiffusionRequest("nofmt", SMALL, sink="file"))
    with pytest.raises(InvalidSink, match="drop format='png'"):
        de.generate(DiffusionRequest("fmt", SMALL, sink="segment", format="png"))
    toy = InProcessExecutor(make_toy, deadlines=RELAXED)
    try:
        with DiffusionEngine(toy) as eng, pytest.raises(SinkUnavailable) as err:
            eng.generate(DiffusionRequest("inproc", {}, sink="segment"))
    finally:
        toy.shutdown()
    assert err.value.request_id == "inproc" and err.value.executor == "InProcessExecutor"
    assert "use MultiprocDiffusionExecutor" in str(err.value)


def test_an_output_dir_that_cannot_be_made_fails_the_start_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    toy = InProcessExecutor(make_toy, deadlines=RELAXED)
    try:
        with pytest.raises(OSError, match="EngineConfig.output_dir .*a-file/out"):
            DiffusionEngine(toy, output_dir=str(blocker / "out"))
    finally:
        toy.shutdown()
