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


class InvalidRequest(MessageValidationError):
    """A request parameter the model cannot take (wrong type, out of range).

    Names the request and the parameter: ``request_id``, ``parameter``.  Raised by a
    model's ``validate_request`` -- in the caller's thread when the executor can run it
    before sending, otherwise in the worker, where it fails that request's call.
    """

    def __init__(self, request_id: str, parameter: str, problem: str) -> None:
        super().__init__(f"request {request_id!r}: parameter {parameter!r} {problem}")
        self.request_id = request_id
        self.parameter = parameter


class RequestNotSendable(UsageError):
    """A call whose arguments cannot travel to the worker processes: one does not pickle.

    Raised at the call (``submit``, ``execute_request``, ``collective_rpc``...),
    before any rank got it and with nothing of the call left in the executor, which
    stays healthy.  Names the request and the parameter that fails (``request_id``,
    ``parameter``: a key of its ``params``), or for an RPC that carries no request
    (``request_id`` None) the argument (``"args[0]"``, ``"kwargs['x']"``); ``parameter``
    is None when no single one fails alone.  Parameters are data: numbers, strings,
    tensors, arrays -- not functions, locks or open handles.
    """

    def __init__(self, method: str, request_id: str | None, parameter: str | None, cause: BaseException) -> None:
        what = f"request {request_id!r}" if request_id is not None else f"the {method} call"
        where = f": parameter {parameter!r} does not pickle" if parameter is not None else " does not pickle"
        super().__init__(
            f"{what} cannot be sent to the worker processes{where} ({type(cause).__name__}: {cause}); "
            "parameters travel by pickle: pass data (numbers, strings, tensors, arrays), not functions, "
            "locks or open handles"
        )
        self.method = method
        self.request_id = request_id
        self.parameter = parameter


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


class OutputAlreadyClaimed(OutputError, UsageError):
    """``wait_output_ready`` for an id an earlier call already claimed.

    Each output id is delivered to exactly one waiter: the first ``wait_output_ready``
    call claims it; every later call for the same id fails at once with this error,
    whether the first is still waiting or already got the output, failed or was
    cancelled.  Share the first future (or the output it delivers) instead.
    """


class OutputTimeout(OutputError, TimeoutError):
    """The output was not delivered within its output deadline (measured from COMPUTE_DONE)."""


class OutputOrphaned(OutputError):
    """An output arrived (OUTPUT_READY) but no COMPUTE_DONE named it before its deadline.

    Its call had ended by then (the deadline is no earlier than the compute deadline of
    every call pending at its arrival), so nobody could ever claim it: the registry
    released it.  Recorded in ``OutputRegistry.orphans`` and counted in the executor's
    ``metrics()["orphaned_outputs"]`` (defect 3's backstop).
    """


class OutputUnpackFailed(OutputError):
    """An output arrived but the executor could not unpack it (M2): its shared-memory
    segment does not exist or is smaller than its lease says, or its payload is not packed.

    Names the output id and its request; ``cause`` is the underlying error (also the
    ``__cause__``).  The segment, if it was leased, has gone back to the pool.
    """

    def __init__(self, output_id: str | None, request_id: str | None, cause: BaseException) -> None:
        super().__init__(
            f"output {output_id!r} of request {request_id!r} could not be unpacked: "
            f"{type(cause).__name__}: {cause}.  The worker sent an output this executor cannot "
            f"read (a broken worker, or one running another omni_async): check the worker's log, "
            f"then submit the request again",
            output_id=output_id,
        )
        self.request_id = request_id
        self.cause = cause


class ComputeTimeout(OmniAsyncError, TimeoutError):
    """An RPC did not get every rank's answer within its compute deadline.

    For an execute call the executor also cancels the forward on every rank (it stops
    at the model's next cancellation check, see ``RequestAborted``).
    """


class RequestAborted(OutputError):
    """A request of an execute call was aborted: its forward never ran, or stopped, and
    nothing of it is kept (no output id is handed out).

    ``by`` says what aborted it: ``"abort"`` (``DiffusionExecutor.cancel_requests``) or
    ``"deadline"`` (its call's compute deadline).  ``request_id`` is the first request of
    the call, ``request_ids`` all of them (a batch fails with this error only when every
    request of it was cancelled), ``rpc_id`` the call.
    """

    def __init__(
        self,
        request_id: str,
        *,
        by: str = "abort",
        detail: str = "",
        request_ids: tuple[str, ...] = (),
        rpc_id: str | None = None,
    ) -> None:
        ids = tuple(request_ids) or (request_id,)
        what = f"request {request_id!r}" if len(ids) == 1 else f"requests {list(ids)}"
        who = "by cancel_requests()" if by == "abort" else "by its compute deadline"
        call = f" (call {rpc_id})" if rpc_id is not None else ""
        super().__init__(f"{what}{call} aborted {who}" + (f": {detail}" if detail else "") + "; nothing of it is kept")
        self.request_id = request_id
        self.request_ids = ids
        self.by = by
        self.rpc_id = rpc_id


class WorkerStuck(OmniAsyncError):
    """A worker has not answered an execute call whose compute deadline expired and
    whose forward the executor then cancelled, for longer than the grace period
    (``Deadlines.cancel_grace``): its forward ignores the cancellation check, or the
    worker hangs.  Raised by ``check_health``; names the rank, the call and its requests.
    Restart the executor (``shutdown`` stops the worker) or make the model call
    ``cancel_requested`` between its steps.
    """

    def __init__(self, rank: int, rpc_id: str, request_ids: tuple[str, ...], overdue_s: float) -> None:
        super().__init__(
            f"worker rank {rank} is stuck: its forward of request(s) {list(request_ids)} (call {rpc_id}) "
            f"is still running {overdue_s:.1f} s after its compute deadline cancelled it; the model does not "
            "stop at cancel_requested() or the worker hangs -- shut the executor down to stop it"
        )
        self.rank = rank
        self.rpc_id = rpc_id
        self.request_ids = request_ids
        self.overdue_s = overdue_s


class ExecutorShutdown(OutputError):
    """The executor (or its pump) shut down while the caller was waiting."""


class WorkerDied(OutputError):
    """A worker process died; names the rank and exit code.

    ``failure`` is the exception that ended it, when the worker could still report one
    before exiting (None when it was killed, or crashed too hard to say).
    """

    def __init__(
        self, rank: int, exitcode: int | None, *, output_id: str | None = None, failure: Failure | None = None
    ) -> None:
        super().__init__(self._describe(rank, exitcode, failure), output_id=output_id)
        self.rank = rank
        self.exitcode = exitcode
        self.failure = failure

    @classmethod
    def _describe(cls, rank: int, exitcode: int | None, failure: Failure | None) -> str:
        head = f"worker rank {rank} died with exit code {exitcode}"
        if failure is None:
            return head
        return f"{head} after {_remote(failure)}"


class ActorDied(WorkerDied):
    """The Ray actor hosting a worker rank died (``RayDiffusionExecutor``): killed, its
    process crashed, or its node went away.  Names the rank and the node (id and
    address); ``cause`` is Ray's word on it.  ``exitcode`` and ``failure`` are None."""

    def __init__(self, rank: int, node: str, *, output_id: str | None = None, cause: str = "") -> None:
        OutputError.__init__(
            self,
            f"worker rank {rank} (a Ray actor on node {node}) died"
            + (f": {cause}" if cause else "")
            + "; the executor cannot recover: shut it down and start a new one",
            output_id=output_id,
        )
        self.rank = rank
        self.exitcode = None
        self.failure = None
        self.node = node
        self.cause = cause


class WorkerStartupFailed(WorkerDied):
    """A worker process failed while it started (building its model), so the executor
    was never up; raised by the executor's constructor.

    ``failure`` carries the remote exception's type, message and traceback; it is None
    only when the worker died without being able to report one (killed, crashed).
    ``actor``: the worker is a Ray actor (``RayDiffusionExecutor``), which has no exit
    code of ours: the message says "a Ray actor" where a process's says its exit code.
    """

    def __init__(
        self,
        rank: int,
        exitcode: int | None,
        *,
        output_id: str | None = None,
        failure: Failure | None = None,
        actor: bool = False,
    ) -> None:
        if actor:
            head = f"worker rank {rank} (a Ray actor)"
            message = (
                f"{head} died while starting" if failure is None else f"{head} failed to start: {_remote(failure)}"
            )
            OutputError.__init__(self, message, output_id=output_id)
            self.rank = rank
            self.exitcode = exitcode
            self.failure = failure
        else:
            super().__init__(rank, exitcode, output_id=output_id, failure=failure)
        self.actor = actor

    @classmethod
    def _describe(cls, rank: int, exitcode: int | None, failure: Failure | None) -> str:
        if failure is None:
            return f"worker rank {rank} died while starting, with exit code {exitcode}"
        return f"worker rank {rank} failed to start (exit code {exitcode}): {_remote(failure)}"


def _remote(failure: Failure) -> str:
    return f"{failure.type_name}: {failure.message}\n--- remote traceback ---\n{failure.traceback}"


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
