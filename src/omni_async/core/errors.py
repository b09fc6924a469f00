"""Error types.

Two families, as in h11: ``UsageError`` is raised when the local caller misuses the
API (the caller can fix it); ``ProtocolError`` is raised when a peer sends
something the protocol does not allow (the caller cannot fix it, but it must
never crash the pump: the pump counts it and carries on).  Both derive from
``OmniAsyncError`` so an engine can catch everything of ours with one clause.
"""

from __future__ import annotations

from omni_async.core.failure import Failure


class OmniAsyncError(Exception):
    """Base class of every error raised by omni_async."""


class UsageError(OmniAsyncError):
    """The local caller misused the API."""


class MessageValidationError(UsageError, ValueError):
    """A protocol message was constructed with a field combination the protocol forbids."""


class ProtocolError(OmniAsyncError):
    """A peer sent a message the protocol does not allow (duplicate, unknown id, ...)."""

    def __init__(self, message: str, *, output_id: str | None = None) -> None:
        super().__init__(message)
        self.output_id = output_id


class IllegalTransition(OmniAsyncError):
    """An event was applied to a state machine in a state where the table has no entry.

    The machine's state is left unchanged.
    """

    def __init__(self, machine: str, key: str, state: object, event: object) -> None:
        super().__init__(f"{machine} {key!r}: event {event} is illegal in state {state}")
        self.machine = machine
        self.key = key
        self.state = state
        self.event = event


class OutputError(OmniAsyncError):
    """Base class of the errors a waiter of an output can receive."""

    def __init__(self, message: str, *, output_id: str | None = None) -> None:
        super().__init__(message)
        self.output_id = output_id


class RemoteError(OutputError):
    """The worker failed while computing or packing; carries the typed remote failure (F2)."""

    def __init__(self, failure: Failure, *, output_id: str | None = None, rank: int | None = None) -> None:
        where = f" (output {output_id})" if output_id is not None else ""
        on_rank = f" on rank {rank}" if rank is not None else ""
        super().__init__(
            f"{failure.type_name}: {failure.message}{where}{on_rank}\n--- remote traceback ---\n{failure.traceback}",
            output_id=output_id,
        )
        self.failure = failure
        self.rank = rank


class OutputDropped(OutputError):
    """The output was dropped (aborted) while a waiter was waiting for it."""


class OutputTimeout(OutputError, TimeoutError):
    """The output was not delivered within its output deadline (measured from COMPUTE_DONE)."""


class OutputOrphaned(OutputError):
    """An output arrived (OUTPUT_READY) but no COMPUTE_DONE named it before its deadline.

    Its call had ended by then (the deadline is no earlier than the compute deadline of
    every call pending at its arrival), so nobody could ever claim it: the registry
    released it.  Recorded in ``OutputRegistry.orphans`` and counted in the executor's
    ``metrics()["orphaned_outputs"]`` (defect 3's backstop).
    """


class ComputeTimeout(OmniAsyncError, TimeoutError):
    """An RPC did not get every rank's answer within its compute deadline."""


class ExecutorShutdown(OutputError):
    """The executor (or its pump) shut down while the caller was waiting."""


class WorkerDied(OutputError):
    """A worker process died; names the rank and exit code."""

    def __init__(self, rank: int, exitcode: int | None, *, output_id: str | None = None) -> None:
        super().__init__(f"worker rank {rank} died with exit code {exitcode}", output_id=output_id)
        self.rank = rank
        self.exitcode = exitcode


class RpcFailed(OmniAsyncError):
    """At least one rank answered an RPC with a failure (F12: one failed rank fails the call)."""

    def __init__(self, rpc_id: str, method: str, failures: dict[int, Failure]) -> None:
        lines = [f"rpc {method} ({rpc_id}) failed on rank(s) {sorted(failures)}:"]
        for rank in sorted(failures):
            f = failures[rank]
            lines.append(f"  rank {rank}: {f.type_name}: {f.message}")
        super().__init__("\n".join(lines))
        self.rpc_id = rpc_id
        self.method = method
        self.failures = failures
