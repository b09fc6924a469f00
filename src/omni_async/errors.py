"""Every error ``omni_async`` raises, for code that catches them.

All of them derive from ``OmniAsyncError``; ``UsageError`` (you called the API wrongly)
and ``ProtocolError`` (a peer broke the protocol) split misuse from faults, as "Errors" in
``docs/engine.md`` describes.  ``import omni_async.errors`` imports no torch: the three
errors defined beside torch code are loaded on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_async.core.config import InvalidConfig
from omni_async.core.encoding import InvalidEncoding
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
from omni_async.core.sinks import InvalidSink
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

if TYPE_CHECKING:
    from omni_async.worker.output_path import InvalidOutputPath
    from omni_async.worker.postprocess import UnknownPostProcess

_LAZY: dict[str, str] = {
    "InvalidOutputPath": "omni_async.worker.output_path",
    "UnknownPostProcess": "omni_async.worker.postprocess",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = [
    "ActorDied",
    "ChannelClosed",
    "ChannelFull",
    "ComputeTimeout",
    "DeviceSyncUnavailable",
    "EncodeFailed",
    "EngineClosed",
    "EngineDead",
    "EngineError",
    "EngineNotStarted",
    "EngineOverloaded",
    "ExecutorShutdown",
    "HeldOutputsFull",
    "IllegalTransition",
    "InvalidConfig",
    "InvalidEncoding",
    "InvalidOutputPath",
    "InvalidRequest",
    "InvalidSink",
    "LeaseAlreadyReleased",
    "MessageTooLarge",
    "MessageValidationError",
    "OmniAsyncError",
    "OutputAlreadyClaimed",
    "OutputDropped",
    "OutputError",
    "OutputFileGone",
    "OutputOrphaned",
    "OutputStillViewed",
    "OutputTimeout",
    "OutputUnpackFailed",
    "PoolClosed",
    "PoolExhausted",
    "PostProcessFailed",
    "ProtocolError",
    "RemoteError",
    "RequestAborted",
    "RequestNotSendable",
    "RpcFailed",
    "SegmentTooLarge",
    "SinkUnavailable",
    "TransportError",
    "UnknownPostProcess",
    "UnknownSegment",
    "UnpicklableMessage",
    "UnsupportedOutputType",
    "UsageError",
    "WorkerDied",
    "WorkerStartupFailed",
    "WorkerStuck",
]
