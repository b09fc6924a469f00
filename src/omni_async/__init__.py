"""omni_async: move finished diffusion outputs off the GPU path.

See README.md for the overview and spec/PROTOCOL.md for the protocol.
"""

from omni_async.core.errors import (
    ComputeTimeout,
    ExecutorShutdown,
    IllegalTransition,
    MessageValidationError,
    OmniAsyncError,
    OutputDropped,
    OutputError,
    OutputTimeout,
    ProtocolError,
    RemoteError,
    RpcFailed,
    UsageError,
    WorkerDied,
)
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    AsyncOutputKind,
    BatchDiffusionOutput,
    DiffusionOutput,
    Failure,
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

__all__ = [
    "LIFECYCLE_TABLE",
    "REQUEST_TABLE",
    "AsyncDiffusionOutput",
    "AsyncOutputKind",
    "BatchDiffusionOutput",
    "ComputeTimeout",
    "DiffusionOutput",
    "ExecutorShutdown",
    "Failure",
    "IllegalTransition",
    "LifecycleEvent",
    "LifecycleState",
    "MessageValidationError",
    "OmniAsyncError",
    "OutputDropped",
    "OutputError",
    "OutputTimeout",
    "ProtocolError",
    "RemoteError",
    "RequestEvent",
    "RequestState",
    "RpcFailed",
    "RunnerOutput",
    "UsageError",
    "WorkerDied",
]
