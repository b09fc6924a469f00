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
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, TypeAlias

import attrs

from omni_async.core.encoding import Encoding, check_encoding
from omni_async.core.errors import MessageValidationError
from omni_async.core.failure import Failure
from omni_async.core.sinks import Sink, check_sink, check_sink_ttl
from omni_async.core.stats import OutputStats, as_stats

__all__ = [
    "AbortCause",
    "AsyncDiffusionOutput",
    "AsyncOutputKind",
    "BatchDiffusionOutput",
    "CancelMessage",
    "Chunk",
    "ComputeDone",
    "DiffusionOutput",
    "DiffusionRequest",
    "Failure",
    "OutputReady",
    "OutputStats",
    "RpcRequest",
    "RpcResult",
    "RunnerOutput",
    "check_wire_message",
]


class AsyncOutputKind(enum.Enum):
    RPC_RESULT = "rpc_result"
    COMPUTE_DONE = "compute_done"
    OUTPUT_READY = "output_ready"
    CHUNK = "chunk"

    def __repr__(self) -> str:
        return self.name


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
    # Typed per-output stats (``omni_async.core.stats``); a mapping given here is converted.
    metrics: OutputStats = attrs.field(factory=OutputStats, converter=as_stats)


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


def _id_tuple(ids: Iterable[str]) -> tuple[str, ...]:
    return tuple(ids)


def _check_rank(rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise MessageValidationError(f"rank must be a non-negative int, got {rank!r}")


def _check_output_ids(kind: str, ids: tuple[str, ...]) -> None:
    for oid in ids:
        _check_id(f"{kind} async_output_id", oid)
    if len(set(ids)) != len(ids):
        raise MessageValidationError(f"{kind} names an id twice: {ids}")


def _check_failure(failure: Failure | None) -> None:
    if failure is not None and not isinstance(failure, Failure):
        raise MessageValidationError(f"failure must be a Failure, got {type(failure).__qualname__}")


# The wire: one class per kind ----------------------------------------------------------
#
# Each message of the result channel is one of four frozen classes, one per
# ``AsyncOutputKind``; ``AsyncDiffusionOutput`` (the seed's name) is their union, and a
# reader dispatches with an exhaustive ``match`` on the class.  Each class validates only
# its own fields, so a message that exists is well formed for its kind: no reader asserts
# a field again.  ``kind`` is a field (not a class constant) with the class's one value,
# fixed at construction (``init=False``): the trace records it, and a peer that sets
# another one by hand is refused when the channel reads it (``check_wire_message``).


@attrs.frozen
class ComputeDone:
    """COMPUTE_DONE: the forward of call ``rpc_id`` is done; one output id per request (F6)."""

    rpc_id: str
    async_output_ids: tuple[str, ...] = attrs.field(converter=_id_tuple)
    request_ids: tuple[str, ...] = attrs.field(converter=_id_tuple)
    rank: int = attrs.field(default=0, kw_only=True)
    kind: Literal[AsyncOutputKind.COMPUTE_DONE] = attrs.field(default=AsyncOutputKind.COMPUTE_DONE, init=False)

    def __attrs_post_init__(self) -> None:
        _check_rank(self.rank)
        _check_id("COMPUTE_DONE rpc_id", self.rpc_id)
        if not self.async_output_ids:
            raise MessageValidationError("COMPUTE_DONE must name at least one async_output_id")
        _check_output_ids("COMPUTE_DONE", self.async_output_ids)
        if len(self.request_ids) != len(self.async_output_ids):
            raise MessageValidationError(
                f"COMPUTE_DONE needs one request id per output id "
                f"({len(self.request_ids)} request ids, {len(self.async_output_ids)} output ids)"
            )

    @property
    def names_outputs(self) -> bool:
        return True


@attrs.frozen
class OutputReady:
    """OUTPUT_READY: the output of one id is in shared memory, or its packing failed (F2).

    One class for both outcomes, so the wire's kinds and its classes correspond one to
    one; it carries exactly one of ``output`` and ``failure`` (``OutputReady.failed``).
    """

    async_output_id: str
    output: DiffusionOutput | None = None
    rank: int = attrs.field(default=0, kw_only=True)
    failure: Failure | None = attrs.field(default=None, kw_only=True)
    kind: Literal[AsyncOutputKind.OUTPUT_READY] = attrs.field(default=AsyncOutputKind.OUTPUT_READY, init=False)

    def __attrs_post_init__(self) -> None:
        _check_rank(self.rank)
        _check_id("OUTPUT_READY async_output_id", self.async_output_id)
        if self.output is not None and not isinstance(self.output, DiffusionOutput):
            raise MessageValidationError(f"output must be a DiffusionOutput, got {type(self.output).__qualname__}")
        _check_failure(self.failure)
        if (self.output is None) == (self.failure is None):
            raise MessageValidationError("OUTPUT_READY carries exactly one of output or failure")
        if self.output is not None and self.output.async_output_id not in (None, self.async_output_id):
            raise MessageValidationError(
                f"OUTPUT_READY for {self.async_output_id!r} carries the output of {self.output.async_output_id!r}"
            )

    @classmethod
    def failed(cls, async_output_id: str, failure: Failure, *, rank: int = 0) -> OutputReady:
        """The OUTPUT_READY of an id whose packing failed: its typed ``Failure`` (F2)."""
        return cls(async_output_id, rank=rank, failure=failure)


@attrs.frozen
class Chunk:
    """CHUNK: chunk ``seq`` of ``request_id``'s stream in call ``rpc_id``; its output will
    come as the OUTPUT_READY of ``async_output_id``."""

    rpc_id: str
    request_id: str
    seq: int
    async_output_id: str
    rank: int = attrs.field(default=0, kw_only=True)
    kind: Literal[AsyncOutputKind.CHUNK] = attrs.field(default=AsyncOutputKind.CHUNK, init=False)

    def __attrs_post_init__(self) -> None:
        _check_rank(self.rank)
        _check_id("CHUNK rpc_id", self.rpc_id)
        _check_id("CHUNK async_output_id", self.async_output_id)
        _check_id("CHUNK request_id", self.request_id)
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
            raise MessageValidationError(f"CHUNK seq must be a non-negative int, got {self.seq!r}")


@attrs.frozen
class RpcResult:
    """RPC_RESULT: a rank's answer to call ``rpc_id``: its ``result``, or its ``failure``.

    A failed answer may name output ids (``compute_failed``): the answer that replaces a
    COMPUTE_DONE that could not be sent after those outputs went to the packer.  One
    class for the ordinary and the failed answer: ``collective_rpc`` collects every
    rank's answer alike and reads ``result`` or ``failure`` from each.
    """

    rpc_id: str
    # Whatever the called method returned (``collective_rpc`` is open-ended).
    result: object = None
    rank: int = attrs.field(default=0, kw_only=True)
    failure: Failure | None = attrs.field(default=None, kw_only=True)
    async_output_ids: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=_id_tuple)
    kind: Literal[AsyncOutputKind.RPC_RESULT] = attrs.field(default=AsyncOutputKind.RPC_RESULT, init=False)

    def __attrs_post_init__(self) -> None:
        _check_rank(self.rank)
        _check_id("RPC_RESULT rpc_id", self.rpc_id)
        _check_failure(self.failure)
        if self.failure is not None and self.result is not None:
            raise MessageValidationError("RPC_RESULT carries a result or a failure, not both")
        if self.async_output_ids and self.failure is None:
            raise MessageValidationError("only a failed RPC_RESULT names output ids (compute_failed)")
        _check_output_ids("RPC_RESULT", self.async_output_ids)

    @classmethod
    def failed(cls, rpc_id: str, failure: Failure, *, rank: int = 0) -> RpcResult:
        return cls(rpc_id, rank=rank, failure=failure)

    @classmethod
    def error(cls, rpc_id: str, exc: BaseException, *, rank: int = 0) -> RpcResult:
        """The answer of a call that raised ``exc``: ``failed`` with its typed ``Failure`` (F2)."""
        return cls.failed(rpc_id, Failure.from_exception(exc), rank=rank)

    @classmethod
    def compute_failed(
        cls, rpc_id: str, async_output_ids: tuple[str, ...], failure: Failure, *, rank: int = 0
    ) -> RpcResult:
        """The failed answer that replaces a COMPUTE_DONE that could not be sent: it names
        the ids already handed to the packer, so the executor drops them (their
        OUTPUT_READY is released on arrival) instead of holding them for nobody."""
        return cls(rpc_id, rank=rank, failure=failure, async_output_ids=async_output_ids)

    @property
    def names_outputs(self) -> bool:
        """The failure that replaces a COMPUTE_DONE (``compute_failed``)."""
        return bool(self.async_output_ids)


#: Every message on the result channel (the seed's name, now the union of the four kinds).
AsyncDiffusionOutput: TypeAlias = ComputeDone | OutputReady | Chunk | RpcResult


def check_wire_message(msg: object) -> AsyncDiffusionOutput:
    """``msg`` validated again, as its constructor would: what the result channel's reader
    calls on a message it unpickled (unpickling skips the constructor, so a peer could
    have built any field by hand).  Raises ``MessageValidationError``."""
    if not isinstance(msg, AsyncDiffusionOutput):
        raise MessageValidationError(f"not a result-channel message: {type(msg).__qualname__}")
    fresh = attrs.evolve(msg)
    if msg.kind is not fresh.kind:
        raise MessageValidationError(f"a {type(msg).__name__} with kind {msg.kind!r}")
    return fresh


@attrs.frozen
class DiffusionRequest:
    """One generation request as the worker sees it: an id and the model's parameters.

    ``postprocess``: the registered post-process (pipeline name) whose host stage turns
    this request's output into its result in ``AsyncDiffusionEngine``, instead of the
    engine's ``pipeline``; None: the engine's.  Not a model parameter: the model's
    ``validate_request`` never sees it in ``params``.

    ``format`` (``"png"``, ``"jpeg"``, ``"webp"``, ``"mp4"``) and ``quality``: the result
    is the output's pixels encoded in that format (``omni_async.core.encoding``: what
    ``quality`` means for each) instead of the host stage's result; None: as before.
    Checked here: ``InvalidEncoding`` names the request, the value and the choices.

    ``sink`` (``"value"``, ``"file"``, ``"segment"``) and ``sink_ttl_s``: where the result
    goes (``omni_async.core.sinks``: the result carries the value; the engine writes the
    encoded file under its directory; the result is a lease on the output's shared-memory
    segment) and how long a file or lease lives (None: the engine's ``output_ttl_s``).
    Checked here (``InvalidSink``); what a sink needs of the rest of the request (a
    ``format`` for ``file``) is checked when the engine takes it."""

    request_id: str
    params: Mapping[str, Any] = attrs.field(factory=dict)
    postprocess: str | None = attrs.field(default=None, kw_only=True)
    format: str | None = attrs.field(default=None, kw_only=True)
    quality: int | None = attrs.field(default=None, kw_only=True)
    sink: str = attrs.field(default=Sink.VALUE.value, kw_only=True)
    sink_ttl_s: float | None = attrs.field(default=None, kw_only=True)

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
        if self.postprocess is not None and (not isinstance(self.postprocess, str) or not self.postprocess):
            raise MessageValidationError(
                f"DiffusionRequest {self.request_id!r}: postprocess must be a registered pipeline name (a "
                f"non-empty str) or None, got {self.postprocess!r:.80}"
            )
        check_encoding(self.request_id, self.format, self.quality)
        check_sink_ttl(self.request_id, check_sink(self.request_id, self.sink), self.sink_ttl_s)

    @property
    def sink_kind(self) -> Sink:
        """Where this request's result goes, as a ``Sink``."""
        return Sink(self.sink)

    @property
    def encoding(self) -> Encoding | None:
        """The format and quality this request asked for (None: no format)."""
        return check_encoding(self.request_id, self.format, self.quality)


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
