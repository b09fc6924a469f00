"""A model and a post-process that report the autograd mode they ran in, for the tests of
``WorkerOptions.inference_mode``.

Importing this module (the worker does, to build its model) registers the pipeline
``"test-mode-probe"``: its device stage adds what mode the packer's thread ran it in, and
whether its warm-up ran in that same mode (a compiled stage's guards check the mode).
"""

from __future__ import annotations

import attrs
import torch

from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.worker.postprocess import PostProcess, register_postprocess

# The mode the warm-up ran in, in this worker process (None: no warm-up ran).
_WARMED_IN: list[bool] = []


def _flag(value: bool) -> torch.Tensor:
    return torch.tensor([int(value)], dtype=torch.int64)


def probe_stage(output: DiffusionOutput) -> DiffusionOutput:
    """Adds ``packer`` (this thread's mode) and ``warmed`` (the warm-up's) to the output."""
    here = torch.is_inference_mode_enabled()
    warmed = _WARMED_IN[-1] if _WARMED_IN else not here
    return attrs.evolve(output, output={**dict(output.output), "packer": _flag(here), "warmed": _flag(warmed)})


def probe_warmup(device: torch.device) -> None:
    _WARMED_IN.append(torch.is_inference_mode_enabled())


PROBE = register_postprocess(PostProcess("test-mode-probe", device=probe_stage, warmup=probe_warmup))


class ModeWorker:
    """Its forward answers with the mode it ran in, and with a tensor made there
    (``made``), which it then changes in place: an inference tensor allows that only
    inside inference mode, which is what a forward runs in."""

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        made = torch.zeros(4)
        made.add_(float(request.params.get("add", 1.0)))
        return DiffusionOutput(
            request.request_id,
            {"forward": _flag(torch.is_inference_mode_enabled()), "inference_tensor": _flag(made.is_inference()),
             "made": made},
        )  # fmt: skip

    def mode_outside_forwards(self) -> bool:
        """A call that is not a forward: it runs in the process's ordinary mode."""
        return torch.is_inference_mode_enabled()


def make_mode_worker() -> ModeWorker:
    return ModeWorker()
