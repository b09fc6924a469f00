"""``WorkerOptions.inference_mode``: a worker's forwards, and the packer's threads that
post-process and copy their outputs, run under ``torch.inference_mode()`` (no autograd
bookkeeping on each op: a forward bound by its kernel launches runs faster); other calls
run in the process's ordinary mode; ``inference_mode=False`` turns it off.

Real worker processes (``MultiprocDiffusionExecutor``), the mode read inside them by the
model and by a registered post-process (``helpers.mode_workers``)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from omni_async.core.config import InvalidConfig
from omni_async.core.messages import DiffusionRequest
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec
from omni_async.worker.host import WorkerOptions

PROBED = WorkerSpec("helpers.mode_workers:make_mode_worker", postprocess="test-mode-probe")


def flags(output: object) -> dict[str, int]:
    assert isinstance(output, Mapping)
    return {k: int(v.item()) for k, v in output.items() if k != "made"}


def run_both_paths(options: WorkerOptions) -> tuple[dict[str, int], dict[str, int], torch.Tensor, bool]:
    """(the async path's flags, the synchronous path's, the async output's ``made``, the
    mode of a call that is no forward) from one executor."""
    with MultiprocDiffusionExecutor(PROBED, options=options) as ex:
        claim = ex.execute_request(DiffusionRequest("async-0", {"add": 2.0})).async_output_id
        assert claim is not None
        packed = ex.wait_output_ready(claim).result(timeout=60).output
        answered = ex.execute_request(DiffusionRequest("sync-0", {}), sync_output=True).result
        (outside,) = ex.collective_rpc("mode_outside_forwards", timeout=30)
        assert isinstance(packed, Mapping)
        made = packed["made"].clone()
        return flags(packed), flags(getattr(answered, "output", answered)), made, bool(outside)


def test_forwards_and_the_packer_run_in_inference_mode_by_default() -> None:
    assert WorkerOptions().inference_mode is True
    packed, answered, made, outside = run_both_paths(WorkerOptions())
    # The forward, its in-place change to a tensor it made (refused for an inference
    # tensor outside the mode), the packer's device stage, and the stage's warm-up.
    assert packed == {"forward": 1, "inference_tensor": 1, "packer": 1, "warmed": 1}
    # The synchronous path packs on the main thread, inside the forward's call.
    assert answered == {"forward": 1, "inference_tensor": 1, "packer": 1, "warmed": 1}
    assert torch.equal(made, torch.full((4,), 2.0))
    assert outside is False  # a call that is not a forward: the ordinary mode


def test_inference_mode_off_runs_everything_in_the_ordinary_mode() -> None:
    packed, answered, made, outside = run_both_paths(WorkerOptions(inference_mode=False))
    assert packed == {"forward": 0, "inference_tensor": 0, "packer": 0, "warmed": 0}
    assert answered == {"forward": 0, "inference_tensor": 0, "packer": 0, "warmed": 0}
    assert torch.equal(made, torch.full((4,), 2.0))
    assert outside is False


@pytest.mark.parametrize("value", [1, "yes", None])
def test_inference_mode_must_be_a_bool(value: object) -> None:
    with pytest.raises(InvalidConfig, match=r"WorkerOptions\.inference_mode"):
        WorkerOptions(inference_mode=value)  # type: ignore[arg-type]
