"""worker layer, and the names a model author uses.

What a model implements (``DiffusionWorkerModel``: ``execute_model`` and
``execute_model_batch`` over ``DiffusionRequest`` / ``DiffusionOutput``), how worker
processes build it (``WorkerSpec``, ``WorkerOptions``), what a model split across
ranks is told of its world (``DistContext``), its post-processing
(``PostProcess`` and its registry), cooperative cancellation between denoising steps
(``cancel_requested``, ``raise_if_cancelled``) and intermediate outputs of a streaming
request (``emit_chunk``, ``streaming_requested``; ``emit_frames`` for a video's parts),
and a launch-bound forward replayed as CUDA graphs (``CudaGraphForward``).  The names that need torch load on
first use (PEP 562), so ``import omni_async.worker`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_async.core.lazy import lazy_exports
from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput, DiffusionRequest
from omni_async.worker.cancel import cancel_requested, raise_if_cancelled
from omni_async.worker.stream import emit_chunk, emit_frames, streaming_requested

if TYPE_CHECKING:
    from omni_async.worker.dist import DistContext
    from omni_async.worker.graphs import CudaGraphForward
    from omni_async.worker.host import WorkerOptions, WorkerSpec
    from omni_async.worker.loop import DiffusionWorkerModel
    from omni_async.worker.postprocess import (
        PostProcess,
        get_postprocess,
        register_postprocess,
        registered_postprocesses,
    )

_LAZY: dict[str, str] = {
    "CudaGraphForward": "omni_async.worker.graphs",
    "DistContext": "omni_async.worker.dist",
    "WorkerOptions": "omni_async.worker.host",
    "WorkerSpec": "omni_async.worker.host",
    "DiffusionWorkerModel": "omni_async.worker.loop",
    "PostProcess": "omni_async.worker.postprocess",
    "get_postprocess": "omni_async.worker.postprocess",
    "register_postprocess": "omni_async.worker.postprocess",
    "registered_postprocesses": "omni_async.worker.postprocess",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = [
    "BatchDiffusionOutput",
    "CudaGraphForward",
    "DiffusionOutput",
    "DiffusionRequest",
    "DiffusionWorkerModel",
    "DistContext",
    "PostProcess",
    "WorkerOptions",
    "WorkerSpec",
    "cancel_requested",
    "emit_chunk",
    "emit_frames",
    "get_postprocess",
    "raise_if_cancelled",
    "register_postprocess",
    "registered_postprocesses",
    "streaming_requested",
]
