"""Protocol messages: everything that travels on the result channel.

Every message is a frozen, slotted ``attrs`` class that validates itself on
construction, so a malformed message fails at the sender with
``MessageValidationError`` instead of confusing the pump later.

One request's completion travels as two messages on one channel:

* ``COMPUTE_DONE`` (sent by the worker's main thread right after the forward): the
  device is free; it names one output id per request (a batch names all of its
  ids), so the executor never needs a map from batch to requests (F6).
* ``OUTPUT_READY`` (sent by the packer thread): the output for one id is in shared
  memory, or packing failed and the message carries a typed ``Failure`` (F2).

A streaming call (``RpcRequest.stream``) also sends ``CHUNK`` messages while its forward
runs: each announces one intermediate output (a preview, a video chunk) under an output
id of its own, with the request it belongs to and its place in that request's stream
(``seq``); the chunk's output then comes as an ``OUTPUT_READY`` like any other.  The
worker puts the CHUNK before it hands the chunk to its packer, so on the one channel of
a rank the CHUNK always comes first, and every CHUNK of a call comes before its
COMPUTE_DONE.  A CHUNK never answers the call.

Every other RPC answer is an ``RPC_RESULT``.  A failed ``RPC_RESULT`` may name output
ids (``compute_failed``): the reply rank's answer when its COMPUTE_DONE could not be
sent after it had already handed those outputs to its packer, whose OUTPUT_READY
will come all the same; the executor registers and drops them (defect 3).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Any, assert_never

import attrs

from omni_async.core.errors import MessageValidationError
from omni_async.core.failure import Failure

__all__ = [
    "AbortCause",
    "AsyncDiffusionOutput",
    "AsyncOutputKind",
    "BatchDiffusionOutput",
    "CancelMessage",
    "DiffusionOutput",
    "DiffusionRequest",
    "Failure",
    "RpcRequest",
    "RunnerOutput",
]


class AsyncOutputKind(enum.Enum):
    RPC_RESULT = "rpc_result"
    COMPUTE_DONE = "compute_done"
    OUTPUT_READY = "output_ready"
    CHUNK = "chunk"

    def __repr__(self) -> str:
        return self.name


def _str_dict() -> dict[str, float]:
    return {}


@attrs.frozen
class DiffusionOutput:
    """The finished output of one request.

    ``output`` is any nested structure of tensors, arrays and small plain values
    (dicts, lists, tuples, attrs/dataclass instances).  Between the packer and the
    consumer it holds the packed form (shared-memory handles); ``unpack`` restores it.
    """

    request_id: str
    output: Any = None
    async_output_id: str | None = None
    metrics: Mapping[str, float] = attrs.field(factory=_str_dict)


@attrs.frozen
class BatchDiffusionOutput:
    """The output of a batched forward: one ``DiffusionOutput`` per request, in request order."""

    outputs: tuple[DiffusionOutput, ...]

    def __attrs_post_init__(self) -> None:
        if not self.outputs:
            raise MessageValidationError("a batch output needs at least one request output")
        ids = [o.request_id for o in self.outputs]
        if len(set(ids)) != len(ids):
            raise MessageValidationError(f"duplicate request ids in batch output: {ids}")

    def per_request(self) -> Iterator[DiffusionOutput]:
        yield from self.outputs


@attrs.frozen
class RunnerOutput:
    """What an execute RPC returns to the engine.

    In request mode ``result`` is None and ``async_output_id`` is the claim token for
    ``wait_output_ready``; in step mode ``result`` carries the output directly (with
    final-step async, the final step's output comes as in request mode).  ``finished``
    False: an intermediate step of step mode (the model returned no output).
    ``aborted``: the request was cancelled (``cancel_requests``) while the rest of its
    batch went on; it has no output (neither ``result`` nor ``async_output_id``).
    """

    request_id: str
    finished: bool = True
    result: DiffusionOutput | None = None
    async_output_id: str | None = None
    aborted: bool = False

    def __attrs_post_init__(self) -> None:
        if self.result is not None and self.async_output_id is not None:
            raise MessageValidationError("a RunnerOutput carries either a result or an async_output_id, not both")
        if self.aborted and (self.result is not None or self.async_output_id is not None):
            raise MessageValidationError("an aborted RunnerOutput carries no result and no async_output_id")


def _check_id(name: str, value: str | None) -> None:
    if value is None or not isinstance(value, str) or not value:
        raise MessageValidationError(f"{name} must be a non-empty string, got {value!r}")


@attrs.frozen
class AsyncDiffusionOutput:
    """The envelope of every message on the result channel.

    Use the named constructors (``compute_done``, ``output_ready``, ``output_failed``,
    ``chunk``, ``rpc_result``, ``rpc_failed``, ``rpc_error``); the raw constructor
    validates the same rules.
    """

    kind: AsyncOutputKind
    rank: int = 0
    rpc_id: str | None = None
    # COMPUTE_DONE: one id per request, aligned with request_ids.  A failed RPC_RESULT
    # (compute_failed): the ids the worker had handed to its packer, no request ids.
    async_output_ids: tuple[str, ...] = ()
    request_ids: tuple[str, ...] = ()
    # OUTPUT_READY: the one id this message completes.  CHUNK: the id it announces.
    async_output_id: str | None = None
    output: DiffusionOutput | None = None
    # RPC_RESULT: the ordinary return value.
    result: Any = None
    failure: Failure | None = None
    # CHUNK: the chunk's place in its request's stream (0, 1, ...).
    seq: int | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.kind, AsyncOutputKind):
            raise MessageValidationError(f"kind must be an AsyncOutputKind, got {self.kind!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise MessageValidationError(f"rank must be a non-negative int, got {self.rank!r}")
        if self.output is not None and not isinstance(self.output, DiffusionOutput):
            raise MessageValidationError(f"output must be a DiffusionOutput, got {type(self.output).__qualname__}")
        if self.failure is not None and not isinstance(self.failure, Failure):
            raise MessageValidationError(f"failure must be a Failure, got {type(self.failure).__qualname__}")
        if self.kind is not AsyncOutputKind.CHUNK and self.seq is not None:
            raise MessageValidationError(f"{self.kind.name} must not set seq")
        match self.kind:
            case AsyncOutputKind.COMPUTE_DONE:
                _check_id("COMPUTE_DONE rpc_id", self.rpc_id)
                if not self.async_output_ids:
                    raise MessageValidationError("COMPUTE_DONE must name at least one async_output_id")
                self._check_output_ids("COMPUTE_DONE")
                if len(self.request_ids) != len(self.async_output_ids):
                    raise MessageValidationError(
                        f"COMPUTE_DONE needs one request id per output id "
                        f"({len(self.request_ids)} request ids, {len(self.async_output_ids)} output ids)"
                    )
                self._forbid("COMPUTE_DONE", async_output_id=None, output=None, result=None, failure=None)
            case AsyncOutputKind.OUTPUT_READY:
                _check_id("OUTPUT_READY async_output_id", self.async_output_id)
                if (self.output is None) == (self.failure is None):
                    raise MessageValidationError("OUTPUT_READY carries exactly one of output or failure")
                if self.output is not None and self.output.async_output_id not in (None, self.async_output_id):
                    raise MessageValidationError(
                        f"OUTPUT_READY for {self.async_output_id!r} "
                        f"carries the output of {self.output.async_output_id!r}"
                    )
                self._forbid("OUTPUT_READY", rpc_id=None, async_output_ids=(), request_ids=(), result=None)
            case AsyncOutputKind.RPC_RESULT:
                _check_id("RPC_RESULT rpc_id", self.rpc_id)
                if self.failure is not None and self.result is not None:
                    raise MessageValidationError("RPC_RESULT carries a result or a failure, not both")
                if self.async_output_ids and self.failure is None:
                    raise MessageValidationError("only a failed RPC_RESULT names output ids (compute_failed)")
                self._check_output_ids("RPC_RESULT")
                self._forbid("RPC_RESULT", request_ids=(), async_output_id=None, output=None)
            case AsyncOutputKind.CHUNK:
                _check_id("CHUNK rpc_id", self.rpc_id)
                _check_id("CHUNK async_output_id", self.async_output_id)
                if len(self.request_ids) != 1:
                    raise MessageValidationError(f"CHUNK names exactly one request id, got {self.request_ids!r}")
                _check_id("CHUNK request_id", self.request_ids[0])
                if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
                    raise MessageValidationError(f"CHUNK seq must be a non-negative int, got {self.seq!r}")
                self._forbid("CHUNK", async_output_ids=(), output=None, result=None, failure=None)
            case _:
                assert_never(self.kind)

    def _check_output_ids(self, kind: str) -> None:
        for oid in self.async_output_ids:
            _check_id(f"{kind} async_output_id", oid)
        if len(set(self.async_output_ids)) != len(self.async_output_ids):
            raise MessageValidationError(f"{kind} names an id twice: {self.async_output_ids}")

    def _forbid(self, kind: str, **expected: object) -> None:
        for name, empty in expected.items():
            if getattr(self, name) != empty:
                raise MessageValidationError(f"{kind} must not set {name}")

    # Named constructors -------------------------------------------------------------

    @classmethod
    def compute_done(
        cls, rpc_id: str, async_output_ids: tuple[str, ...], request_ids: tuple[str, ...], *, rank: int = 0
    ) -> AsyncDiffusionOutput:
        return cls(
            AsyncOutputKind.COMPUTE_DONE,
            rank=rank,
            rpc_id=rpc_id,
            async_output_ids=tuple(async_output_ids),
            request_ids=tuple(request_ids),
        )

    @classmethod
    def output_ready(cls, async_output_id: str, output: DiffusionOutput, *, rank: int = 0) -> AsyncDiffusionOutput:
        return cls(AsyncOutputKind.OUTPUT_READY, rank=rank, async_output_id=async_output_id, output=output)

    @classmethod
    def output_failed(cls, async_output_id: str, failure: Failure, *, rank: int = 0) -> AsyncDiffusionOutput:
        return cls(AsyncOutputKind.OUTPUT_READY, rank=rank, async_output_id=async_output_id, failure=failure)

    @classmethod
    def chunk(
        cls, rpc_id: str, request_id: str, seq: int, async_output_id: str, *, rank: int = 0
    ) -> AsyncDiffusionOutput:
        """Announce chunk ``seq`` of ``request_id``'s stream in call ``rpc_id``: its output
        will come as the OUTPUT_READY of ``async_output_id``."""
        return cls(
            AsyncOutputKind.CHUNK,
            rank=rank,
            rpc_id=rpc_id,
            request_ids=(request_id,),
            async_output_id=async_output_id,
            seq=seq,
        )

    @classmethod
    def rpc_result(cls, rpc_id: str, result: Any, *, rank: int = 0) -> AsyncDiffusionOutput:
        return cls(AsyncOutputKind.RPC_RESULT, rank=rank, rpc_id=rpc_id, result=result)

    @classmethod
    def rpc_failed(cls, rpc_id: str, failure: Failure, *, rank: int = 0) -> AsyncDiffusionOutput:
        return cls(AsyncOutputKind.RPC_RESULT, rank=rank, rpc_id=rpc_id, failure=failure)

    @classmethod
    def rpc_error(cls, rpc_id: str, exc: BaseException, *, rank: int = 0) -> AsyncDiffusionOutput:
        """The answer of a call that raised ``exc``: ``rpc_failed`` with its typed ``Failure`` (F2)."""
        return cls.rpc_failed(rpc_id, Failure.from_exception(exc), rank=rank)

    @classmethod
    def compute_failed(
        cls, rpc_id: str, async_output_ids: tuple[str, ...], failure: Failure, *, rank: int = 0
    ) -> AsyncDiffusionOutput:
        """The failed answer that replaces a COMPUTE_DONE that could not be sent: it names
        the ids already handed to the packer, so the executor drops them (their
        OUTPUT_READY is released on arrival) instead of holding them for nobody."""
        return cls(
            AsyncOutputKind.RPC_RESULT,
            rank=rank,
            rpc_id=rpc_id,
            async_output_ids=tuple(async_output_ids),
            failure=failure,
        )

    @property
    def names_outputs(self) -> bool:
        """A COMPUTE_DONE, or the failure that replaces one (``compute_failed``)."""
        return bool(self.async_output_ids)


@attrs.frozen
class DiffusionRequest:
    """One generation request as the worker sees it: an id and the model's parameters."""

    request_id: str
    params: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        _check_id("request_id", self.request_id)
        if not isinstance(self.params, Mapping):
            raise MessageValidationError(
                f"DiffusionRequest {self.request_id!r}: params must be a mapping of parameter names to values, "
                f"got {type(self.params).__name__} {self.params!r:.80}"
            )
        bad = [k for k in self.params if not isinstance(k, str)]
        if bad:
            raise MessageValidationError(
                f"DiffusionRequest {self.request_id!r}: params keys must be str, got {bad!r:.80}"
            )


@attrs.frozen
class RpcRequest:
    """An RPC broadcast from the executor to every worker rank."""

    rpc_id: str
    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    # True: execute_model/execute_model_batch answer with COMPUTE_DONE and pack in the
    # background (request mode).  False: the ordinary synchronous answer (step mode).
    async_output: bool = False
    # With async_output: the caller wants the forward's chunks (CHUNK messages,
    # ``omni_async.worker.emit_chunk``); without it the worker ships none.
    stream: bool = False
    # With async_output: a step of step mode (final-step async): a forward that returns
    # no output (an intermediate step, None) is answered with an ordinary RPC_RESULT;
    # one that returns its output (the final step) takes the asynchronous path.
    step: bool = False

    def __attrs_post_init__(self) -> None:
        _check_id("rpc_id", self.rpc_id)
        _check_id("method", self.method)


class AbortCause(enum.Enum):
    """Why the executor cancelled requests of a call in flight."""

    ABORT = "abort"  # the engine called cancel_requests()
    DEADLINE = "deadline"  # the call's compute deadline expired

    def __repr__(self) -> str:
        return self.name

    @property
    def phrase(self) -> str:
        """How an error message names the cause: "by cancel_requests()" / "by its compute deadline"."""
        return "by cancel_requests()" if self is AbortCause.ABORT else "by its compute deadline"


@attrs.frozen
class CancelMessage:
    """Executor -> worker, on the control channel (not the RPC channel): stop these requests.

    Names the execute call (``rpc_id``) and which of its requests are cancelled, and why.
    The worker's cancel table marks them; the model sees it through
    ``omni_async.worker.cancel_requested`` between denoising steps, and the worker loop
    never starts a forward whose requests are all cancelled (see ``spec/PROTOCOL.md``).
    """

    rpc_id: str
    request_ids: tuple[str, ...]
    cause: AbortCause = AbortCause.ABORT

    def __attrs_post_init__(self) -> None:
        _check_id("CancelMessage rpc_id", self.rpc_id)
        if not self.request_ids:
            raise MessageValidationError("a CancelMessage names at least one request id")
        for rid in self.request_ids:
            _check_id("CancelMessage request_id", rid)
        if not isinstance(self.cause, AbortCause):
            raise MessageValidationError(f"cause must be an AbortCause, got {self.cause!r}")
