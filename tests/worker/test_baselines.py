"""The bench's comparison paths (``WorkerOptions.output_path``, ``omni_async.bench.paths``): real worker processes, real
fresh segments; every path delivers the model's bytes, and no fresh segment outlives its read."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from omni_async import DiffusionOutput, DiffusionRequest, MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.bench.paths import FreshPayload, pack_reference_fresh, pack_sync_fresh, receive_fresh_output
from omni_async.core.config import Deadlines
from omni_async.models.synthetic import DTYPES, synthetic_output
from omni_async.models.tiny import image_digest
from omni_async.transport.shm import SHM_DIR, SegmentPool
from omni_async.transport.shm.files import entries
from omni_async.worker.output_path import InvalidOutputPath, check_output_path

# WorkerOptions.output_path's registered names.
OutputPath = str

SYNTH = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker")
TINY = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker")
DEADLINES = Deadlines(compute_timeout=60, output_timeout=60, rpc_timeout=60)


def _executor(spec: WorkerSpec, path: OutputPath) -> MultiprocDiffusionExecutor:
    return MultiprocDiffusionExecutor(
        spec, step_mode=path == "sync", deadlines=DEADLINES, options=WorkerOptions(output_path=path)
    )


def _run(ex: MultiprocDiffusionExecutor, path: OutputPath, request: DiffusionRequest) -> DiffusionOutput:
    ro = ex.execute_request(request)
    if path == "sync":
        assert ro.result is not None
        return ro.result
    assert ro.async_output_id is not None
    return ex.wait_output_ready(ro.async_output_id).result(timeout=60)


def _fresh_left(ex: MultiprocDiffusionExecutor) -> list[str]:
    return entries(f"{ex.pool.prefix}fresh-")


# The fast tier (pytest -m "not slow") runs the omni path; the baselines only in the full run.
@pytest.mark.parametrize(
    "path", [pytest.param("sync", marks=pytest.mark.slow), pytest.param("reference", marks=pytest.mark.slow), "omni"]
)
def test_every_path_delivers_the_models_bytes_and_leaves_no_fresh_segment(path: OutputPath) -> None:
    """bfloat16 and float32 outputs past the inline threshold, through real worker processes:
    the bytes that arrive are the model's, bit for bit (the reference path's upcast and
    cast back included), and once each is read no fresh segment is left in /dev/shm."""
    with _executor(SYNTH, path) as ex:
        for i, (dtype, shape) in enumerate(
            [("bfloat16", (3, 96, 128)), ("float32", (2, 3, 64, 80)), ("bfloat16", (5, 7, 1031))]
        ):
            params: dict[str, Any] = {"shape": shape, "dtype": dtype, "seed": 11 + i}
            out = _run(ex, path, DiffusionRequest(f"r{i}", params))
            video = out.output["video"]
            want = synthetic_output(shape, DTYPES[dtype], 11 + i, "cpu")
            assert video.dtype == want.dtype and video.shape == want.shape
            assert torch.equal(video.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
            nbytes = want.numel() * want.element_size()
            if path == "omni":
                assert out.metrics["pack_shm_bytes"] == nbytes
            else:
                # One fresh segment, in the shipped dtype (float32 for the reference's upcast bfloat16).
                assert out.metrics["pack_segments"] == 1
                widened = 2 if path == "reference" and dtype == "bfloat16" else 1
                assert out.metrics["pack_shm_bytes"] == nbytes * widened
                assert _fresh_left(ex) == []
            assert out.metrics["forward_ended_at"] >= out.metrics["forward_started_at"] > 0
            del video
            ex.release_output(out)
        assert _fresh_left(ex) == []


@pytest.mark.parametrize("path", ["sync", "reference"])
@pytest.mark.slow
def test_a_nested_output_ships_one_fresh_segment_per_large_tensor(path: OutputPath) -> None:
    """TinyDiffusionWorker with its trajectory: a dict holding the image, a list of latents,
    an inline digest and plain values.  Each large tensor gets a segment of its own; the
    image's bytes match the digest the worker took; nothing is left after the read."""
    with _executor(TINY, path) as ex:
        out = _run(ex, path, DiffusionRequest("t", {"height": 512, "steps": 3, "keep_trajectory": True, "seed": 4}))
        image = out.output["image"]
        assert image.shape == (512, 64) and image.dtype == torch.float32
        assert int(image_digest(image)) == int(out.output["digest"])
        assert [t.shape for t in out.output["latents"]] == [(512, 64)] * 3
        assert out.output["info"]["steps"] == 3
        assert out.metrics["pack_segments"] == 4
        assert _fresh_left(ex) == []


@pytest.mark.slow
def test_a_dropped_output_on_the_reference_path_unlinks_its_segment() -> None:
    """An output dropped after it arrived is never read: its fresh segment is unlinked at the drop."""
    with _executor(SYNTH, "reference") as ex:
        ro = ex.execute_request(DiffusionRequest("d", {"shape": [3, 128, 128]}))
        assert ro.async_output_id is not None
        deadline = time.monotonic() + 30
        while not _fresh_left(ex) and time.monotonic() < deadline:
            time.sleep(0.01)  # the packer wrote it
        time.sleep(0.2)  # and its OUTPUT_READY reached the executor
        ex.drop_output(ro.async_output_id).result(timeout=30)
        deadline = time.monotonic() + 10
        while _fresh_left(ex) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _fresh_left(ex) == []


def test_a_bad_output_path_raises_the_typed_error() -> None:
    with pytest.raises(InvalidOutputPath, match="must be one of"):
        WorkerOptions(output_path="fast")
    # Each baseline belongs to one mode; the executor refuses the other before spawning anything.
    with pytest.raises(InvalidOutputPath, match="step mode"):
        MultiprocDiffusionExecutor(SYNTH, options=WorkerOptions(output_path="sync"))
    with pytest.raises(InvalidOutputPath, match="request mode"):
        MultiprocDiffusionExecutor(SYNTH, step_mode=True, options=WorkerOptions(output_path="reference"))
    # "omni" is the pool's own path: no OutputPath, either mode.
    assert check_output_path("omni", step_mode=True) is None
    assert check_output_path("omni", step_mode=False) is None


@pytest.mark.parametrize("pack", [pack_sync_fresh, pack_reference_fresh])
def test_the_consumer_unlinks_every_segment_even_when_a_read_fails(pack: Any) -> None:
    """In one process: two large tensors, one of whose segments is cut short before the read.
    The read fails, and both segments are gone all the same."""
    with SegmentPool(max_segments=2) as pool:
        a, b = torch.arange(40000, dtype=torch.float32), torch.ones(30000, dtype=torch.bfloat16)
        packed = pack(
            DiffusionOutput("x", {"a": a, "b": [b, 3]}), None, None, prefix=pool.prefix, inline_threshold=1024
        )
        payload = packed.output
        assert isinstance(payload, FreshPayload) and len(payload.segments) == 2
        assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in payload.segments)
        os.truncate(os.path.join(SHM_DIR, payload.segments[1]), 16)
        with pytest.raises(OSError, match="expected"):
            receive_fresh_output(packed)
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in payload.segments)
        # And an intact one round-trips, its structure kept.
        packed = pack(
            DiffusionOutput("y", {"a": a, "b": [b, 3]}), None, None, prefix=pool.prefix, inline_threshold=1024
        )
        got = receive_fresh_output(packed).output
        assert torch.equal(got["a"], a) and torch.equal(got["b"][0], b) and got["b"][1] == 3
        assert entries(f"{pool.prefix}fresh-") == []
