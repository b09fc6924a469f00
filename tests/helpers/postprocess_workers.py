"""A pipeline with a device stage that fails on demand, for the device post-processing tests.

Importing this module (the worker does, to build its model) registers the pipeline
``"test-tiny-failing"``: the reference model's uint8 device stage, except that it raises
for a request whose id starts with ``"fail"``.
"""

from __future__ import annotations

from typing import Any

from omni_async.core.messages import DiffusionOutput
from omni_async.models.tiny import TinyDiffusionWorker, tiny_to_pil, tiny_to_uint8
from omni_async.worker.postprocess import PostProcess, register_postprocess


class DeviceStageFailed(RuntimeError):
    """What the failing device stage raises."""


def failing_to_uint8(output: DiffusionOutput) -> DiffusionOutput:
    if output.request_id.startswith("fail"):
        raise DeviceStageFailed(f"device stage of {output.request_id} failed on purpose")
    return tiny_to_uint8(output)


FAILING = register_postprocess(PostProcess("test-tiny-failing", host=tiny_to_pil, device=failing_to_uint8))


def make_tiny(**kwargs: Any) -> TinyDiffusionWorker:
    return TinyDiffusionWorker(**kwargs)
