"""An ``OutputPath`` of a test's own (``WorkerOptions.output_path="helpers.output_paths:BOXED"``):
the extension point with nothing of the bench's paths in it.

``BOXED`` ships each output inside its message, boxed with the id of the process that
packed it; ``receive`` unboxes it and adds that id as ``output["packed_in"]``.  What
``discard`` freed is recorded in ``DISCARDED`` of the process that called it.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from omni_async.core.messages import DiffusionOutput
from omni_async.transport.platform import CopyStream, DeviceEvent, wait_device_event

DISCARDED: list[str] = []


@attrs.frozen
class Box:
    tree: Any
    packed_in: int


@attrs.frozen
class BoxedPath:
    step_mode: bool | None = None

    def pack(
        self,
        output: DiffusionOutput,
        stream: CopyStream,
        event: DeviceEvent | None,
        *,
        prefix: str,
        inline_threshold: int,
    ) -> DiffusionOutput:
        wait_device_event(event)
        return attrs.evolve(output, output=Box(output.output, os.getpid()))

    def owns(self, packed: DiffusionOutput) -> bool:
        return isinstance(packed.output, Box)

    def receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        box = packed.output
        assert isinstance(box, Box)
        return attrs.evolve(packed, output={**box.tree, "packed_in": box.packed_in})

    def discard(self, packed: DiffusionOutput) -> int:
        DISCARDED.append(packed.async_output_id or "")
        return 1


BOXED = BoxedPath()
NOT_A_PATH = object()

BAD_STEP_MODE = BoxedPath(step_mode=3)  # type: ignore[arg-type]  # the mistake under test
