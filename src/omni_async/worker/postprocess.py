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
  It takes the output, ``host(output)``, or, when it takes two positional arguments,
  ``host(output, request)`` (the ``DiffusionRequest``, so it can read the request's
  parameters; the form is detected once, when the ``PostProcess`` is built), and
  returns the user's result.  The result must own its memory: copy
  (``tensor.clone()``, ``bytes(...)``, a PIL image) what you keep.

  **The host stage's input never writes into shared memory.**  By default the stage
  gets an owned copy of the output (``owned_copy``: the segment goes back to the pool
  before the stage runs), so nothing it does -- ``t.float()`` returns ``t`` itself for
  a float32 tensor, and an in-place op on it would otherwise write into the segment --
  can reach the shared memory.  A stage that only reads declares it,
  ``host_reads_only=True``, and gets the zero-copy views of the segment instead (no
  copy: the built-in stages do); the engine then checks after the stage that no tensor
  of the input was written in place (its version counter) and fails the request with
  ``PostProcessFailed`` if one was, and hands numpy arrays over read-only.

Both stages are found by name (``get_postprocess``), so the worker process and the
engine process each look the pipeline up in their own registry: the module that
defines a pipeline registers it at import time (``register_postprocess``), and
importing the worker's factory module in the worker registers it there too.

The device stage in the worker: ``WorkerSpec(..., postprocess="name")`` (worker
processes) or ``InProcessExecutor(..., postprocess="name")``; the worker looks the name
up after building its model (an unknown name fails its start-up).  The packer's
stager queues the stage (``launch_device_stage``) on a stream of its own after the
forward's event, one output ahead of the copy (``worker.packer``), and the packer then
copies what the stage returned: the in-flight byte budget and the budget
of held outputs count those bytes, and the output's ``metrics`` carry
``device_postprocess_s`` beside the pack's timings.  A stage that raises fails that
output like a pack failure: its waiter gets ``RemoteError`` with the stage's exception.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from typing import cast

import attrs
import torch

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.core.stats import as_stats
from omni_async.transport.platform import CopyStream, DeviceEvent, wait_device_event

log = logging.getLogger(__name__)

DeviceStage = Callable[[DiffusionOutput], DiffusionOutput]
HostStage = Callable[[DiffusionOutput], object]
#: A host stage that also reads the request's parameters.
RequestHostStage = Callable[[DiffusionOutput, DiffusionRequest], object]


# Where the reference models and the integrations register their pipelines (for the
# error's hint only: the worker layer never imports a model or an integration).
_REFERENCE_PIPELINES = {
    "tiny": "omni_async.models.tiny",
    "dit": "omni_async.models.dit",
    "dit-seed": "omni_async.models.dit",
    "bench-u8": "omni_async.models.synthetic",
    "diffusers": "omni_async.integrations.diffusers",
    "bench-client": "omni_async.models.synthetic",
    "bench-u8-client": "omni_async.models.synthetic",
}


class UnknownPostProcess(UsageError, KeyError):
    """No post-process is registered under the pipeline name asked for."""

    def __init__(self, name: str, known: list[str], *, request_id: str | None = None) -> None:
        # ``import omni_async`` imports no reference model, so their pipelines are
        # registered only once their module is imported: say which one.
        where = _REFERENCE_PIPELINES.get(name)
        hint = (
            f"pipeline {name!r} is registered by {where}: import {where} first"
            if where is not None
            else "import the module that defines it, or register it with register_postprocess()"
        )
        who = "" if request_id is None else f"request {request_id!r} asks for post-process {name!r}: "
        super().__init__(f"{who}no post-process is registered for pipeline {name!r} (registered: {known}); {hint}")
        self.name = name
        self.known = known
        self.request_id = request_id

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


@attrs.frozen
class PostProcess:
    """The two stages of one pipeline's post-processing (either may be ``None``)."""

    name: str
    host: HostStage | RequestHostStage | None = None
    device: DeviceStage | None = None
    # The host stage only reads its input: it gets the zero-copy views of the shared
    # memory instead of an owned copy (see the module docstring).
    host_reads_only: bool = attrs.field(default=False, kw_only=True)
    # Run once in each worker process that runs the device stage, with the worker's
    # device, after the model is built and before the first request: compile a fused
    # kernel there (``omni_async.worker.finalize``), not in the first pack.
    warmup: Callable[[torch.device], None] | None = attrs.field(default=None, kw_only=True)
    # Whether ``host`` takes the request too (detected once, from its signature).
    host_takes_request: bool = attrs.field(init=False, default=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(f"PostProcess name must be a non-empty str, got {self.name!r:.60}")
        for stage, value in (("host", self.host), ("device", self.device), ("warmup", self.warmup)):
            if value is not None and not callable(value):
                raise UsageError(
                    f"PostProcess {stage}: must be callable or None, got {type(value).__name__} {value!r:.60}"
                )
        if not isinstance(self.host_reads_only, bool):
            raise UsageError(f"PostProcess {self.name!r}: host_reads_only must be a bool, got {self.host_reads_only!r}")
        if self.host is not None:
            object.__setattr__(self, "host_takes_request", _takes_request(self.host, self.name))

    def warm_up(self, device: torch.device) -> None:
        """Run ``warmup`` on ``device`` when there is one and a device stage to warm; a
        warm-up that raises is logged, never fatal (the stage then warms on first use)."""
        if self.warmup is None or self.device is None:
            return
        try:
            self.warmup(device)
        except Exception:
            log.warning(
                "post-process %r: its warm-up on %s failed; it warms on first use", self.name, device, exc_info=True
            )

    def run_host(self, output: DiffusionOutput, request: DiffusionRequest) -> object:
        """Call the host stage in the form it was written in (``UsageError`` without one)."""
        if self.host is None:
            raise UsageError(f"PostProcess {self.name!r} has no host stage")
        if self.host_takes_request:
            return cast("RequestHostStage", self.host)(output, request)
        return cast("HostStage", self.host)(output)


def _takes_request(host: Callable[..., object], name: str) -> bool:
    """Whether ``host`` is ``host(output, request)``: it accepts two positional
    arguments.  ``UsageError`` for one that cannot take the output."""
    try:
        sig = inspect.signature(host)
    except (TypeError, ValueError):  # a builtin without a signature: the one-argument form
        return False
    positional = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 2 or (not positional and not varargs):
        raise UsageError(
            f"PostProcess {name!r}: the host stage must take (output) or (output, request), got a callable "
            f"with signature {sig}"
        )
    return varargs or len(positional) >= 2


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


def get_postprocess(name: str, *, request_id: str | None = None) -> PostProcess:
    """The post-process registered for pipeline ``name``; ``UnknownPostProcess`` if none
    (naming ``request_id`` when a request asked for it)."""
    with _lock:
        found = _registry.get(name)
        if found is None:
            raise UnknownPostProcess(name, sorted(_registry), request_id=request_id)
        return found


def registered_postprocesses() -> list[str]:
    """The pipeline names that have a post-process in this process."""
    with _lock:
        return sorted(_registry)


def launch_device_stage(
    stage: DeviceStage, output: DiffusionOutput, stream: CopyStream = None, event: DeviceEvent | None = None
) -> DiffusionOutput:
    """Queue a device stage's work on ``output`` on ``stream`` (the stager's), after ``event``.

    Returns what the stage returned, with the output's ``async_output_id`` and ``metrics``
    kept.  The stage's kernels may still run when this returns: whoever reads the result
    orders itself after ``stream`` (the packer's copy waits for an event recorded there).
    No ``device_postprocess_s``: the caller adds it (``with_stage_time``) once the stage's
    device time can be read.  Raises what the stage raised, or ``UsageError`` when it
    returns something other than a ``DiffusionOutput`` of the same request."""
    wait_device_event(event, stream)
    if stream is not None:
        with torch.cuda.stream(stream):
            out = stage(output)
    else:
        out = stage(output)
    if not isinstance(out, DiffusionOutput) or out.request_id != output.request_id:
        raise UsageError(
            f"a post-process device stage must return the DiffusionOutput of request {output.request_id!r}, "
            f"got {type(out).__name__} {getattr(out, 'request_id', '')!r}"
        )
    metrics = as_stats({**output.metrics, **out.metrics})
    return attrs.evolve(out, async_output_id=output.async_output_id, metrics=metrics)


def with_stage_time(output: DiffusionOutput, seconds: float) -> DiffusionOutput:
    """``output`` with ``metrics.device_postprocess_s`` set to ``seconds``."""
    return attrs.evolve(output, metrics=attrs.evolve(output.metrics, device_postprocess_s=seconds))
