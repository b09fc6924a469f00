"""The multiprocess executor with CUDA workers (skipped without CUDA; run on the H200).

Worker processes compute on the GPU, pack on their side stream into pooled pinned
segments, and the engine side checks every output bit-exactly against the same
forward run in the test process on the same device.
"""

from __future__ import annotations

import pytest
import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.tiny import TinyDiffusionWorker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WIDTH = 512


def test_cuda_workers_request_mode_bit_exact_and_pooled() -> None:
    spec = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"device": "cuda", "width": WIDTH, "steps": 8})
    reference = TinyDiffusionWorker(device="cuda", width=WIDTH, steps=8)
    deadlines = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)
    with MultiprocDiffusionExecutor(spec, deadlines=deadlines, options=WorkerOptions(device="cuda")) as ex:
        created: list[int] = []
        for rnd in range(4):
            reqs = [DiffusionRequest(f"g{rnd}-{i}", {"seed": 10 * rnd + i, "height": 1024}) for i in range(4)]
            ros = ex.execute_batch(reqs)
            for ro, rq in zip(ros, reqs, strict=True):
                assert ro.async_output_id is not None
                out = ex.wait_output_ready(ro.async_output_id).result(timeout=120)
                expected = reference.execute_model(rq).output["image"].cpu()
                got = out.output["image"]
                assert got.device.type == "cpu" and got.dtype == expected.dtype
                assert torch.equal(got, expected), f"{rq.request_id}: output differs from the forward"
                assert out.metrics["pack_pinned"] == 1.0  # copied into a cudaHostRegister'ed segment
                del got  # a view still alive would make the release fail (OutputStillViewed)
                ex.release_output(out)
            created.append(ex.pool.stats().created)
        assert created[-1] == created[1], f"segments created per round: {created}"
        assert ex.metrics().pending_outputs == 0
