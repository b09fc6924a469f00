"""omni_async: move finished diffusion outputs off the GPU path.

The public names come in three audiences (``docs/names.md`` lists each): an engine
author imports from ``omni_async`` (``__all__`` below), a model author from
``omni_async.worker``, and code that catches errors from ``omni_async.errors``.
``spec/PROTOCOL.md`` describes the protocol.  The layers, from the top:

* ``omni_async.engine``: the asyncio engine (``AsyncDiffusionEngine``), its scheduler,
  post-processing off the event loop, metrics, and the synchronous ``DiffusionEngine``;
* ``omni_async.executor``: the executor API (``DiffusionExecutor``), the result pump,
  ``InProcessExecutor``, ``MultiprocDiffusionExecutor`` and (imported lazily, it needs
  the ray extra) ``RayDiffusionExecutor``;
* ``omni_async.worker``: the worker loop and the background packer;
* ``omni_async.transport``: the result channel, pooled shared memory, pack/unpack,
  device events;
* ``omni_async.core``: sans-IO protocol: messages, state tables, registry, dispatch,
  errors, deadlines;

and beside them ``omni_async.models`` (reference models: their names here are imported
when first used) and ``omni_async.verify`` (TLA+ generation, TLC, trace checking; not
imported here).  ``import omni_async`` imports neither torch nor the reference models:
the names that need them are loaded on first use (``__getattr__``, PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# What needs neither torch nor numpy is imported now; the rest (the engine, the executors,
# the transport's packing and shared memory, the worker loop, the reference models, Ray)
# is imported the first time one of its names is used (``__getattr__`` below, PEP 562),
# so that ``import omni_async`` and ``omni-async --help`` do not pay for importing torch.
from omni_async.core.config import Deadlines, InvalidConfig
from omni_async.core.encoding import InvalidEncoding
from omni_async.core.engine_states import EngineState, StageState
from omni_async.core.errors import (
    ActorDied,
    ComputeTimeout,
    ExecutorShutdown,
    IllegalTransition,
    InvalidRequest,
    MessageValidationError,
    OmniAsyncError,
    OutputAlreadyClaimed,
    OutputDropped,
    OutputError,
    OutputOrphaned,
    OutputTimeout,
    OutputUnpackFailed,
    ProtocolError,
    RemoteError,
    RequestAborted,
    RequestNotSendable,
    RpcFailed,
    UsageError,
    WorkerDied,
    WorkerStartupFailed,
    WorkerStuck,
)
from omni_async.core.lazy import lazy_exports
from omni_async.core.messages import (
    AbortCause,
    AsyncDiffusionOutput,
    AsyncOutputKind,
    BatchDiffusionOutput,
    CancelMessage,
    DiffusionOutput,
    DiffusionRequest,
    Failure,
    RpcRequest,
    RunnerOutput,
)
from omni_async.core.sinks import InvalidSink, Sink
from omni_async.core.states import (
    LIFECYCLE_TABLE,
    REQUEST_TABLE,
    LifecycleEvent,
    LifecycleState,
    RequestEvent,
    RequestState,
)
from omni_async.engine.encoders import EncodedOutput, VideoBytes
from omni_async.engine.errors import (
    EncodeFailed,
    EngineClosed,
    EngineDead,
    EngineError,
    EngineNotStarted,
    EngineOverloaded,
    OutputFileGone,
    PostProcessFailed,
    SinkUnavailable,
)
from omni_async.engine.metrics import (
    EngineMetrics,
    GenerationChunk,
    GenerationResult,
    HistogramSnapshot,
    RequestTimings,
)
from omni_async.engine.scheduler import SchedulerPhase
from omni_async.executor.handle import RequestHandle
from omni_async.executor.stream import OutputChunk, RequestStream
from omni_async.transport.errors import (
    ChannelClosed,
    ChannelFull,
    DeviceSyncUnavailable,
    HeldOutputsFull,
    LeaseAlreadyReleased,
    MessageTooLarge,
    OutputStillViewed,
    PoolClosed,
    PoolExhausted,
    SegmentTooLarge,
    TransportError,
    UnknownSegment,
    UnpicklableMessage,
    UnsupportedOutputType,
)
from omni_async.worker.cancel import cancel_requested, raise_if_cancelled
from omni_async.worker.stream import emit_chunk, emit_frames, streaming_requested

__version__ = "0.1.0"

if TYPE_CHECKING:
    from omni_async.core.encoding import Encoding
    from omni_async.engine.config import EngineConfig
    from omni_async.engine.engine import AsyncDiffusionEngine
    from omni_async.engine.sinks import OutputFile, OutputFiles, SegmentLease, SegmentTensor
    from omni_async.engine.sync import DiffusionEngine
    from omni_async.executor.api import DiffusionExecutor
    from omni_async.executor.config import ExecutorConfig, Prewarm, ProcessGroupConfig
    from omni_async.executor.inprocess import InProcessExecutor
    from omni_async.executor.metrics import ExecutorMetrics
    from omni_async.executor.multiproc import MultiprocDiffusionExecutor
    from omni_async.executor.ray_executor import RayDiffusionExecutor
    from omni_async.models.dit import DiTPipelineWorker
    from omni_async.models.tiny import SyntheticVideoWorker, TinyDiffusionWorker
    from omni_async.transport.budget import OutputBudget
    from omni_async.transport.packing import (
        PackInFlight,
        pack_diffusion_output_shm,
        packed_nbytes,
        release_packed_output,
        release_unpacked_output,
        start_pack_shm,
        unpack_diffusion_output_shm,
    )
    from omni_async.transport.platform import CopyStream, DeviceEvent, record_device_event, wait_device_event
    from omni_async.transport.shm import Lease, PoolStats, SegmentPool, list_segments, sweep_dead_executors
    from omni_async.worker.dist import DistContext
    from omni_async.worker.encode import DeviceEncoded
    from omni_async.worker.finalize import FusedPointwise
    from omni_async.worker.graphs import CudaGraphForward
    from omni_async.worker.host import WorkerOptions, WorkerSpec
    from omni_async.worker.loop import DiffusionWorkerModel, WorkerInfo, WorkerLoop
    from omni_async.worker.output_path import InvalidOutputPath
    from omni_async.worker.packer import Packer, PackerMetrics
    from omni_async.worker.postprocess import (
        PostProcess,
        UnknownPostProcess,
        get_postprocess,
        register_postprocess,
        registered_postprocesses,
    )

#: The public names imported when first used, and the module of each.
_LAZY: dict[str, str] = {
    "AsyncDiffusionEngine": "omni_async.engine.engine",
    "DiffusionEngine": "omni_async.engine.sync",
    "EngineConfig": "omni_async.engine.config",
    "DiffusionExecutor": "omni_async.executor.api",
    "InProcessExecutor": "omni_async.executor.inprocess",
    "MultiprocDiffusionExecutor": "omni_async.executor.multiproc",
    "ExecutorConfig": "omni_async.executor.config",
    "Prewarm": "omni_async.executor.config",
    "ProcessGroupConfig": "omni_async.executor.config",
    "ExecutorMetrics": "omni_async.executor.metrics",
    "OutputBudget": "omni_async.transport.budget",
    "DistContext": "omni_async.worker.dist",
    "CudaGraphForward": "omni_async.worker.graphs",
    "WorkerOptions": "omni_async.worker.host",
    "WorkerSpec": "omni_async.worker.host",
    "DiTPipelineWorker": "omni_async.models.dit",
    "SyntheticVideoWorker": "omni_async.models.tiny",
    "TinyDiffusionWorker": "omni_async.models.tiny",
    "pack_diffusion_output_shm": "omni_async.transport.packing",
    "start_pack_shm": "omni_async.transport.packing",
    "PackInFlight": "omni_async.transport.packing",
    "packed_nbytes": "omni_async.transport.packing",
    "release_packed_output": "omni_async.transport.packing",
    "release_unpacked_output": "omni_async.transport.packing",
    "unpack_diffusion_output_shm": "omni_async.transport.packing",
    "CopyStream": "omni_async.transport.platform",
    "DeviceEvent": "omni_async.transport.platform",
    "record_device_event": "omni_async.transport.platform",
    "wait_device_event": "omni_async.transport.platform",
    "Lease": "omni_async.transport.shm",
    "PoolStats": "omni_async.transport.shm",
    "SegmentPool": "omni_async.transport.shm",
    "list_segments": "omni_async.transport.shm",
    "sweep_dead_executors": "omni_async.transport.shm",
    "InvalidOutputPath": "omni_async.worker.output_path",
    "DiffusionWorkerModel": "omni_async.worker.loop",
    "WorkerLoop": "omni_async.worker.loop",
    "WorkerInfo": "omni_async.worker.loop",
    "Packer": "omni_async.worker.packer",
    "PackerMetrics": "omni_async.worker.packer",
    "PostProcess": "omni_async.worker.postprocess",
    "UnknownPostProcess": "omni_async.worker.postprocess",
    "get_postprocess": "omni_async.worker.postprocess",
    "register_postprocess": "omni_async.worker.postprocess",
    "registered_postprocesses": "omni_async.worker.postprocess",
    # The ray extra: ``import omni_async`` works without Ray.
    "RayDiffusionExecutor": "omni_async.executor.ray_executor",
    "Encoding": "omni_async.core.encoding",
    "DeviceEncoded": "omni_async.worker.encode",
    "FusedPointwise": "omni_async.worker.finalize",
    "OutputFile": "omni_async.engine.sinks",
    "OutputFiles": "omni_async.engine.sinks",
    "SegmentLease": "omni_async.engine.sinks",
    "SegmentTensor": "omni_async.engine.sinks",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


#: The engine author's names (docs/names.md).  Model authors import from
#: ``omni_async.worker``, code that catches errors from ``omni_async.errors``; the
#: transport's, the protocol's and the reference models' names live in their modules.
#: Every name this package exported before that grouping still resolves here (above).
__all__ = [
    "AsyncDiffusionEngine",
    "Deadlines",
    "DiffusionEngine",
    "DiffusionExecutor",
    "DiffusionOutput",
    "DiffusionRequest",
    "EncodedOutput",
    "EngineConfig",
    "EngineMetrics",
    "EngineState",
    "ExecutorConfig",
    "ExecutorMetrics",
    "GenerationChunk",
    "GenerationResult",
    "HistogramSnapshot",
    "InProcessExecutor",
    "MultiprocDiffusionExecutor",
    "OutputBudget",
    "OutputChunk",
    "OutputFile",
    "OutputFiles",
    "PackerMetrics",
    "Prewarm",
    "ProcessGroupConfig",
    "RayDiffusionExecutor",
    "RequestHandle",
    "RequestStream",
    "RequestTimings",
    "RunnerOutput",
    "SchedulerPhase",
    "SegmentLease",
    "SegmentTensor",
    "Sink",
    "StageState",
    "VideoBytes",
    "WorkerInfo",
    "WorkerOptions",
    "WorkerSpec",
]
