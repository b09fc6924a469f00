"""Streams of chunks: the executor's side of one streaming request (sans-IO).

A streaming call (``RpcRequest.stream``) sends, while its forward runs, a ``CHUNK``
message per intermediate output of a request (a preview every k denoising steps, a
chunk of video).  Each names an output id of its own, whose output then travels like
any other: OUTPUT_READY, the same record in the registry, the same budget of held
outputs, the same deadlines.  A chunk is never an answer of the call: the call still
resolves on its ranks' answers (COMPUTE_DONE of the reply rank), and its final
output comes through ``wait_output_ready`` as in request mode.

``ChunkFeed`` is what the dispatcher keeps of one request's stream, under the
pump's lock like everything in the dispatcher: the chunks announced and not yet
taken by the consumer, in order, and how the stream ended.  The rules (the
dispatcher applies them; ``tla/AsyncOutputExecutor.tla`` states them as ``HandleChunk``):

* A CHUNK of a pending call, from its reply rank, the next in its request's stream,
  is registered like a COMPUTE_DONE of its one id and appended to the feed (its id is
  now the consumer's to claim or drop, like an id a resolved call hands out).
* A CHUNK nobody wants -- its call no longer pending (ended, timed out, its consumer
  gone: an orphan), the call's future cancelled, the request cancelled
  (``cancel_requests``), the feed closed by its consumer -- is registered and dropped
  at once: its output is released the moment it arrives (F9, F10).
* A CHUNK out of place (another rank's, one that skips a place, one of a request that
  asked for no stream) is a protocol error, registered and dropped the same way.
* When the call ends the feed ends with it: on success it keeps the chunks not yet
  taken (the consumer takes them, then sees the end); otherwise (failed, timed out,
  cancelled, aborted, unsent) they are dropped and the feed ends with the call's
  error.  A shutdown or a worker's death releases every record anyway.
* The consumer closing the feed drops what it did not take, and every later chunk
  is dropped on arrival.

So every chunk id ends in exactly one terminal state, as every output id does, and a
feed holds at most the chunks announced and not yet taken -- each of them an output
of the budget of held outputs, so a slow consumer slows the worker's packer and,
through it, the forward (back-pressure), and is never dropped.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import attrs

__all__ = ["ChunkFeed", "ChunkRef"]


@attrs.frozen
class ChunkRef:
    """One announced chunk: its place in the stream and its output id."""

    seq: int
    output_id: str


def _refs() -> collections.deque[ChunkRef]:
    return collections.deque()


@attrs.define(eq=False)
class ChunkFeed:
    """One request's stream of chunks, as the dispatcher announces them (see the module docstring).

    ``listener``: called (without arguments, outside the pump's lock, on whichever
    thread made the change) whenever a chunk is announced or the feed ends; it must not
    block.  The consumer then reads the feed again, under the lock.
    """

    request_id: str
    listener: Callable[[], None] | None = None
    rpc_id: str | None = None
    announced: collections.deque[ChunkRef] = attrs.field(factory=_refs)
    # The place the next CHUNK of this request must have.
    next_seq: int = 0
    # Chunks the consumer took (claimed).
    taken: int = 0
    # Chunks dropped: on arrival (nobody wanted them) or at the call's end or at close.
    dropped: int = 0
    # The call ended (no chunk comes any more); ``error``: how, when it failed.
    ended: bool = False
    error: BaseException | None = None
    # The consumer closed it: chunks are dropped on arrival.
    closed: bool = False

    @property
    def exhausted(self) -> bool:
        """Nothing more to take: the call ended (or the feed closed) and every chunk announced was taken."""
        return (self.ended or self.closed) and not self.announced
