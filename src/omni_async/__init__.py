"""omni_async: move finished diffusion outputs off the GPU path.

Everything an engine author uses is importable from here; ``docs/guide.md`` describes
each name, ``spec/PROTOCOL.md`` the protocol.  The layers, from the top:

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

and beside them ``omni_async.models`` (reference models) and ``omni_async.verify``
(TLA+ generation, TLC, trace checking; not imported here).
"""

from omni_async.core.config import Deadlines
from typing import TYPE_CHECKING

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
from omni_async.core.states import (
    LIFECYCLE_TABLE,
    REQUEST_TABLE,
    LifecycleEvent,
    LifecycleState,
    RequestEvent,
    RequestState,
)
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.errors import (
    EngineClosed,
    EngineDead,
    EngineError,
    EngineNotStarted,
    EngineOverloaded,
    PostProcessFailed,
)
from omni_async.engine.metrics import (
    EngineMetrics,
    GenerationChunk,
    GenerationResult,
    HistogramSnapshot,
    RequestTimings,
)
from omni_async.engine.scheduler import SchedulerPhase
from omni_async.core.engine_states import EngineState, StageState
from omni_async.engine.sync import DiffusionEngine
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.executor.stream import OutputChunk, RequestStream
from omni_async.models.dit import DiTPipelineWorker
from omni_async.models.tiny import SyntheticVideoWorker, TinyDiffusionWorker
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
from omni_async.transport.packing import (
    pack_diffusion_output_shm,
    packed_nbytes,
    release_packed_output,
    release_unpacked_output,
    unpack_diffusion_output_shm,
)
from omni_async.transport.platform import CopyStream, DeviceEvent, record_device_event, wait_device_event
from omni_async.transport.shm import Lease, PoolStats, SegmentPool, list_segments, sweep_dead_executors
from omni_async.worker.baselines import InvalidOutputPath
from omni_async.worker.cancel import cancel_requested, raise_if_cancelled
from omni_async.worker.loop import DiffusionWorkerModel, WorkerLoop
from omni_async.worker.packer import Packer
from omni_async.worker.postprocess import (
    PostProcess,
    UnknownPostProcess,
    get_postprocess,
    register_postprocess,
    registered_postprocesses,
)
from omni_async.worker.stream import emit_chunk, streaming_requested

if TYPE_CHECKING:
    from omni_async.executor.ray_executor import RayDiffusionExecutor


def __getattr__(name: str) -> object:
    # Lazily: ``import omni_async`` must work without Ray (the ray extra).
    if name == "RayDiffusionExecutor":
        from omni_async.executor.ray_executor import RayDiffusionExecutor

        return RayDiffusionExecutor
    raise AttributeError(f"module 'omni_async' has no attribute {name!r}")


__all__ = [
    "LIFECYCLE_TABLE",
    "REQUEST_TABLE",
    "AbortCause",
    "ActorDied",
    "AsyncDiffusionEngine",
    "AsyncDiffusionOutput",
    "AsyncOutputKind",
    "BatchDiffusionOutput",
    "CancelMessage",
    "ChannelClosed",
    "ChannelFull",
    "ComputeTimeout",
    "CopyStream",
    "Deadlines",
    "DeviceEvent",
    "DeviceSyncUnavailable",
    "DiTPipelineWorker",
    "DiffusionEngine",
    "DiffusionExecutor",
    "DiffusionOutput",
    "DiffusionRequest",
    "DiffusionWorkerModel",
    "EngineClosed",
    "EngineDead",
    "EngineError",
    "EngineMetrics",
    "EngineNotStarted",
    "EngineOverloaded",
    "EngineState",
    "ExecutorShutdown",
    "Failure",
    "GenerationChunk",
    "GenerationResult",
    "HeldOutputsFull",
    "HistogramSnapshot",
    "IllegalTransition",
    "InProcessExecutor",
    "InvalidOutputPath",
    "InvalidRequest",
    "Lease",
    "LeaseAlreadyReleased",
    "LifecycleEvent",
    "LifecycleState",
    "MessageTooLarge",
    "MessageValidationError",
    "MultiprocDiffusionExecutor",
    "OmniAsyncError",
    "OutputAlreadyClaimed",
    "OutputChunk",
    "OutputDropped",
    "OutputError",
    "OutputOrphaned",
    "OutputStillViewed",
    "OutputTimeout",
    "OutputUnpackFailed",
    "Packer",
    "PoolClosed",
    "PoolExhausted",
    "PoolStats",
    "PostProcess",
    "PostProcessFailed",
    "ProtocolError",
    "RayDiffusionExecutor",
    "RemoteError",
    "RequestAborted",
    "RequestNotSendable",
    "RequestEvent",
    "RequestState",
    "RequestStream",
    "RequestTimings",
    "RpcFailed",
    "RpcRequest",
    "RunnerOutput",
    "SchedulerPhase",
    "StageState",
    "SegmentPool",
    "SegmentTooLarge",
    "SyntheticVideoWorker",
    "TinyDiffusionWorker",
    "TransportError",
    "UnknownPostProcess",
    "UnknownSegment",
    "UnpicklableMessage",
    "UnsupportedOutputType",
    "UsageError",
    "WorkerDied",
    "WorkerLoop",
    "WorkerOptions",
    "WorkerSpec",
    "WorkerStartupFailed",
    "WorkerStuck",
    "cancel_requested",
    "emit_chunk",
    "get_postprocess",
    "list_segments",
    "pack_diffusion_output_shm",
    "packed_nbytes",
    "raise_if_cancelled",
    "record_device_event",
    "register_postprocess",
    "registered_postprocesses",
    "release_packed_output",
    "release_unpacked_output",
    "streaming_requested",
    "sweep_dead_executors",
    "unpack_diffusion_output_shm",
    "wait_device_event",
]
