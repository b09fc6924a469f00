"""What the dispatcher knows about one execute call (``omni_async.core.dispatch``).

A pending call (``PendingRpc``: its ranks, their answers, its requests, cancels and
streams), one that ended by its compute deadline and that some rank has not answered yet
(``OverdueRpc``), and a fully cancelled one waiting for its dropped outputs to go
(``Aborting``).  Plain records: the dispatcher alone changes them, under the pump's lock.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TypeAlias, assert_never

import attrs

from omni_async.core.errors import RequestAborted
from omni_async.core.messages import AbortCause, ComputeDone, DiffusionOutput, Failure, RpcResult, RunnerOutput
from omni_async.core.stream import ChunkFeed

__all__ = ["Aborting", "Answer", "ClaimSlots", "OverdueRpc", "PendingRpc", "answer_failure"]

#: What a rank answers an execute call with: the reply rank's COMPUTE_DONE, or an RPC_RESULT.
Answer: TypeAlias = ComputeDone | RpcResult


def answer_failure(answer: Answer) -> Failure | None:
    match answer:
        case ComputeDone():
            return None
        case RpcResult():
            return answer.failure
        case _:
            assert_never(answer)


@attrs.define(eq=False)
class ClaimSlots:
    """The waiters the dispatcher attaches to a call's outputs as it dispatches the call's
    COMPUTE_DONE, under the pump's lock, before the call's future resolves: one per request
    of the call, in order (None: that request has no output -- it was cancelled while the
    rest of its batch went on).  The caller reads them once the call's future is done, so
    no output id travels back down to claim an output (a ``RequestHandle``'s ``output``)."""

    waiters: list[Future[DiffusionOutput] | None]


@attrs.define(eq=False)
class PendingRpc:
    rpc_id: str
    method: str
    ranks: frozenset[int]
    reply_rank: int
    future: Future[tuple[RunnerOutput, ...]]
    deadline: float | None
    consumer: str | None
    answers: dict[int, Answer] = attrs.field(factory=dict)
    # The call's requests, in order (empty when the caller did not say).
    request_ids: tuple[str, ...] = ()
    # The output deadline of the ids it announces (its own, or the registry's).
    output_timeout: float | None = None
    # Requests of this call that cancel() reached, and why.
    cancelled: dict[str, AbortCause] = attrs.field(factory=dict)
    compute_timeout: float | None = None
    # Streaming: the feed of each request that asked for its chunks.
    streams: dict[str, ChunkFeed] = attrs.field(factory=dict)
    # Chunks dropped on arrival while the call was pending (an abort waits for them too).
    unwanted: list[str] = attrs.field(factory=list)
    # A step of step mode (final-step async): the reply rank's plain answer is an
    # intermediate step, not a missing COMPUTE_DONE.
    step: bool = False
    # Outputs claimed for the caller at COMPUTE_DONE (``ClaimSlots``); None: the caller
    # claims them itself, by id.
    claims: ClaimSlots | None = None

    @property
    def fully_cancelled(self) -> bool:
        return bool(self.request_ids) and all(r in self.cancelled for r in self.request_ids)


@attrs.define(eq=False)
class OverdueRpc:
    """An execute call that ended by its compute deadline, and the ranks yet to answer it.

    Its forward was cancelled; each missing rank's late answer removes it.  A rank still
    missing ``cancel_grace`` after the deadline is stuck (``Dispatcher.stuck``).
    """

    rpc_id: str
    request_ids: tuple[str, ...]
    expired_at: float
    missing: set[int]


@attrs.define(eq=False)
class Aborting:
    """A fully cancelled call whose dropped outputs are not gone yet: its future fails
    with ``error`` once none of ``output_ids`` is in the registry any more."""

    future: Future[tuple[RunnerOutput, ...]]
    error: RequestAborted
    output_ids: tuple[str, ...]
