"""The engine's record of one request: where it is (its stage machine), what ended it,
and what the driver, the stream's consumer and the clean-up share about it."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

import attrs

from omni_async.core.config import Deadlines
from omni_async.core.engine_states import OUTCOME_OF, StageEvent, StageState
from omni_async.core.messages import DiffusionRequest, RunnerOutput
from omni_async.core.states import Machine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.handle import RequestHandle
from omni_async.executor.stream import RequestStream
from omni_async.worker.postprocess import PostProcess

if TYPE_CHECKING:
    from omni_async.engine.video import VideoEncode

__all__ = ["BatchGroup", "MemberSend", "RequestRecord", "retrieve"]

T = TypeVar("T")


#: What a batch's send gave one member: its handle (the asynchronous path), its
#: ``RunnerOutput`` with its output (the synchronous path), or the error that ended it.
MemberSend = RequestHandle | RunnerOutput | BaseException


@attrs.define(eq=False)
class BatchGroup:
    """Requests the scheduler admitted together (``max_batch_size > 1``): one
    ``execute_model_batch`` for all of them.  ``send``: the task that sends it (and, on
    the synchronous path, runs it); its result maps each member it sent to what the
    member got; a member not in it had ended before the send and never left the engine."""

    records: list[RequestRecord]
    send: asyncio.Task[dict[str, MemberSend]] | None = None
    # How many members the batched call carried (0: not sent as one).
    sent: int = 0


@attrs.define(eq=False)
class RequestRecord:
    """One request in the engine, from ``generate`` (or ``generate_stream``) until nothing
    of it remains anywhere."""

    request: DiffusionRequest
    deadlines: Deadlines | None
    result: asyncio.Future[GenerationResult]
    enqueued_at: float
    # Where the request is, and how it ended: the only state that decides what the
    # engine does with it (``omni_async.core.engine_states``).
    machine: Machine[StageState, StageEvent]
    # The error an early end gave the caller (an abort, close, a failed chunk): what a
    # stream's consumer raises instead of a result set before that end.
    error: BaseException | None = None
    # The executor's handle once sent (asynchronous path): its COMPUTE_DONE, its output
    # claimed for it, its stream, and the drop of its output after COMPUTE_DONE.
    handle: RequestHandle | None = None
    drop: asyncio.Future[Future[None]] | None = None
    driver: asyncio.Task[None] | None = None
    # Set once nothing of the request remains anywhere (what abort(wait=True) awaits).
    gone: asyncio.Event = attrs.field(factory=asyncio.Event)
    # The post-process whose host stage makes its result (its own, or the engine's:
    # None for an owned copy), and its name (GenerationResult.pipeline).
    postprocess: PostProcess | None = None
    pipeline: str | None = None
    # The batch it was admitted in (None: alone): its members share one send.
    group: BatchGroup | None = None
    # Sent again alone after its batch's forward failed (once at most).
    retried: bool = False
    submitted_at: float = 0.0
    compute_done_at: float = 0.0
    output_ready_at: float = 0.0
    # Streaming (generate_stream): the executor's stream once sent; ``changed`` wakes the
    # consumer (a chunk, the stream's end, the request's end); ``consumed``: the consumer
    # is done with the stream (took every chunk, or went away); ``taking``: chunks the
    # consumer took and has not yet post-processed (each holds an output); ``close``: the
    # stream's close, on the control thread (its result: the drops' acknowledgement).
    # The driver forgets the request once the consumer is done, or the stream is closed
    # and the consumer holds no chunk (``poke`` wakes it when either may have happened).
    streaming: bool = False
    stream: RequestStream | None = None
    changed: asyncio.Event = attrs.field(factory=asyncio.Event)
    consumed: bool = False
    taking: int = 0
    poke: asyncio.Event = attrs.field(factory=asyncio.Event)
    close: asyncio.Future[Future[None]] | None = None
    # generate_video: its video, encoded part by part (the final output is its last part).
    video: VideoEncode | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def stage(self) -> StageState:
        return self.machine.state

    def ended(self) -> bool:
        """An end was decided (abort, cancelled caller, close, failure), or the request
        is over.  A call, not a property: it changes across the driver's awaits, and a
        type checker narrows a property once tested."""
        return self.machine.state in OUTCOME_OF or self.machine.terminal


def retrieve(fut: asyncio.Future[T]) -> None:
    # A caller that went away never reads its future: mark the exception retrieved, so
    # asyncio does not log "Future exception was never retrieved".
    if not fut.cancelled():
        fut.exception()
