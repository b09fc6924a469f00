"""Post-processing by pipeline name: a device stage in the worker, a host stage in the engine.

A pipeline's output usually needs work before a user can take it (float latents to
uint8 pixels, frames to a video array, pixels to PNG bytes).  ``PostProcess`` names
that work in two optional stages:

* ``device``: runs in the worker, on the packer's side stream, after the forward's
  event and before the device-to-host copy.  It takes the output whose tensors are
  still on the worker's device and returns the output to ship.  The usual use is to
  shrink the bytes that cross PCIe (float32 -> uint8 is four times fewer).  It must
  not change ``request_id`` and must not keep references to its input.
* ``host``: runs in the engine process in a thread pool, never on the event loop.
  It takes the unpacked output (its tensors are zero-copy views of a shared-memory
  segment that is released once the stage returns) and returns the user's result.
  The result must own its memory: a view it returns would outlive the segment, so
  copy (``tensor.clone()``, ``bytes(...)``, a PIL image) what you keep.

Both stages are found by name (``get_postprocess``), so the worker process and the
engine process each look the pipeline up in their own registry: the module that
defines a pipeline registers it at import time (``register_postprocess``), and
importing the worker's factory module in the worker registers it there too.

The device stage in the worker: ``WorkerSpec(..., postprocess="name")`` (worker
processes) or ``InProcessExecutor(..., postprocess="name")``; the worker looks the name
up after building its model (an unknown name fails its start-up).  The packer runs
the stage (``run_device_stage``) on its side stream after waiting for the forward's
event, then copies what the stage returned: the in-flight byte budget and the budget
of held outputs count those bytes, and the output's ``metrics`` carry
``device_postprocess_s`` beside the pack's timings.  A stage that raises fails that
output like a pack failure: its waiter gets ``RemoteError`` with the stage's exception.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import attrs
import torch

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput
from omni_async.core.stats import as_stats
from omni_async.transport.platform import CopyStream, DeviceEvent, wait_device_event

DeviceStage = Callable[[DiffusionOutput], DiffusionOutput]
HostStage = Callable[[DiffusionOutput], object]


# Where the reference models and the integrations register their pipelines (for the
# error's hint only: the worker layer never imports a model or an integration).
_REFERENCE_PIPELINES = {
    "tiny": "omni_async.models.tiny",
    "dit": "omni_async.models.dit",
    "bench-u8": "omni_async.models.synthetic",
    "diffusers": "omni_async.integrations.diffusers",
}


class UnknownPostProcess(UsageError, KeyError):
    """No post-process is registered under the pipeline name asked for."""

    def __init__(self, name: str, known: list[str]) -> None:
        # ``import omni_async`` imports no reference model, so their pipelines are
        # registered only once their module is imported: say which one.
        where = _REFERENCE_PIPELINES.get(name)
        hint = (
            f"pipeline {name!r} is registered by {where}: import {where} first"
            if where is not None
            else "import the module that defines it, or register it with register_postprocess()"
        )
        super().__init__(f"no post-process is registered for pipeline {name!r} (registered: {known}); {hint}")
        self.name = name

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


@attrs.frozen
class PostProcess:
    """The two stages of one pipeline's post-processing (either may be ``None``)."""

    name: str
    host: HostStage | None = None
    device: DeviceStage | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(f"PostProcess name must be a non-empty str, got {self.name!r:.60}")
        for stage, value in (("host", self.host), ("device", self.device)):
            if value is not None and not callable(value):
                raise UsageError(
                    f"PostProcess {stage}: must be callable or None, got {type(value).__name__} {value!r:.60}"
                )


_lock = threading.Lock()
_registry: dict[str, PostProcess] = {}


def register_postprocess(postprocess: PostProcess, *, replace: bool = False) -> PostProcess:
    """Register ``postprocess`` under its name; returns it (usable at module level).

    Registering a second, different post-process under a taken name raises
    ``UsageError`` unless ``replace=True``; registering the same one again is a no-op,
    so a module imported twice is harmless.
    """
    if not isinstance(postprocess, PostProcess):
        raise UsageError(f"register_postprocess takes a PostProcess, got {type(postprocess).__name__}")
    with _lock:
        old = _registry.get(postprocess.name)
        if old is not None and old != postprocess and not replace:
            raise UsageError(
                f"a different post-process is already registered for pipeline {postprocess.name!r}; "
                "pass replace=True to replace it"
            )
        _registry[postprocess.name] = postprocess
    return postprocess


def get_postprocess(name: str) -> PostProcess:
    """The post-process registered for pipeline ``name``; ``UnknownPostProcess`` if none."""
    with _lock:
        found = _registry.get(name)
        if found is None:
            raise UnknownPostProcess(name, sorted(_registry))
        return found


def registered_postprocesses() -> list[str]:
    """The pipeline names that have a post-process in this process."""
    with _lock:
        return sorted(_registry)


def run_device_stage(
    stage: DeviceStage, output: DiffusionOutput, stream: CopyStream = None, event: DeviceEvent | None = None
) -> DiffusionOutput:
    """Run a device stage on ``output``, ordered after ``event``, on ``stream`` (the packer's side stream).

    Returns what the stage returned, with the output's ``async_output_id`` and
    ``metrics`` kept and ``metrics.device_postprocess_s`` added: the stage's time,
    its kernels included (on CUDA the side stream is synchronized once it is enqueued,
    so the time is the device's, not the launch's; the copy that follows waits for the
    same work anyway).  Raises what the stage raised, or ``UsageError`` when it returns
    something other than a ``DiffusionOutput`` of the same request.
    """
    t0 = time.perf_counter()
    wait_device_event(event, stream)
    if stream is not None:
        with torch.cuda.stream(stream):
            out = stage(output)
        stream.synchronize()
    else:
        out = stage(output)
    if not isinstance(out, DiffusionOutput) or out.request_id != output.request_id:
        raise UsageError(
            f"a post-process device stage must return the DiffusionOutput of request {output.request_id!r}, "
            f"got {type(out).__name__} {getattr(out, 'request_id', '')!r}"
        )
    metrics = attrs.evolve(as_stats({**output.metrics, **out.metrics}), device_postprocess_s=time.perf_counter() - t0)
    return attrs.evolve(out, async_output_id=output.async_output_id, metrics=metrics)
