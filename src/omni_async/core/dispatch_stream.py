"""The streaming half of the dispatcher: CHUNK messages and the feeds they fill.

A ``CHUNK`` registers its one output id like a COMPUTE_DONE's, then goes to its
request's ``ChunkFeed`` (``omni_async.core.stream``) or is dropped on arrival (a feed
closed, a request cancelled, a call ended, a chunk out of order); a chunk never
answers its call.  When a call ends, so do its feeds.  ``StreamDispatch`` is the base
of ``Dispatcher``: it also holds the primitives both halves use (dropping ids, counting
a protocol error), over the state the dispatcher sets up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future

from omni_async.core.calls import PendingRpc
from omni_async.core.errors import OutputDropped, OutputError, ProtocolError, RequestAborted
from omni_async.core.messages import Chunk
from omni_async.core.registry import DEFAULT, OutputRegistry, Settle, Wake
from omni_async.core.stream import ChunkFeed, ChunkRef
from omni_async.core.trace import Tracer, emit

__all__ = ["StreamDispatch"]


class StreamDispatch:
    """CHUNK routing, the feeds' ends, and the dispatcher's drop and error primitives."""

    # Set by Dispatcher.__init__.
    registry: OutputRegistry
    counters: Counter[str]
    _compute_timeout: float | None
    _trace: Tracer | None
    _pending: dict[str, PendingRpc]
    _outbox: list[Settle]
    _worker_drops: list[str]

    def _on_chunk(self, msg: Chunk, now: float, made: bool) -> None:
        """A CHUNK: register its id, then hand it to its feed or drop it (``omni_async.core.stream``)."""
        rid = msg.request_id
        rpc = self._pending.get(msg.rpc_id)
        accepted = self.registry.on_compute_done(
            [msg.async_output_id],
            now=now,
            rank=msg.rank,
            request_ids=[rid],
            consumer=None if rpc is None else rpc.consumer,
            output_timeout=DEFAULT if rpc is None else rpc.output_timeout,
        )
        if not accepted:
            return  # a repeated or finished id: the registry counted it (never another call's to drop)
        if rpc is None:
            # Its call ended (timed out, cancelled, its consumer gone): nobody will take it.
            self.counters["orphan_chunks"] += 1
            self._drop_all(accepted, msg.rpc_id, "orphan")
            if not made:
                # A call never made: a protocol error (M3); its OUTPUT_READY may never
                # come, so the DROPPING record is given up at a deadline (M6).
                self.counters["unknown_call_chunk"] += 1
                self._protocol_error(f"CHUNK {msg.seq} of rpc {msg.rpc_id}, a call never made (a broken worker?)")
                self.registry.give_up_dropping(accepted, self._orphan_deadline(now))
            return
        feed = rpc.streams.get(rid)
        if msg.rank != rpc.reply_rank or feed is None or msg.seq != feed.next_seq:
            where = (
                f"from rank {msg.rank} (reply rank {rpc.reply_rank})"
                if msg.rank != rpc.reply_rank
                else "of a request that asked for no stream"
                if feed is None
                else f"out of order (expected {feed.next_seq})"
            )
            self._protocol_error(f"rpc {rpc.rpc_id}: CHUNK {msg.seq} of request {rid!r} {where}")
            self._drop_all(accepted, rpc.rpc_id, "rejected")
            return
        feed.next_seq += 1
        cancelled = rpc.future.cancelled()
        if feed.closed or rid in rpc.cancelled or cancelled:
            # Nobody wants it any more: released the moment it arrives (F9, F10).  The
            # reason says why, for the trace: the caller cancelled the call's future
            # (which nothing else records), or the stream was closed / the call aborted.
            feed.dropped += 1
            rpc.unwanted.extend(accepted)
            self._drop_all(accepted, rpc.rpc_id, "cancelled" if cancelled else "unwanted")
            return
        feed.announced.append(ChunkRef(msg.seq, msg.async_output_id))
        self._wake(feed)

    def take_chunk(self, feed: ChunkFeed) -> ChunkRef | None:
        """The next chunk of ``feed`` for its consumer (who claims its id at once), or None."""
        if not feed.announced:
            return None
        feed.taken += 1
        return feed.announced.popleft()

    def close_stream(self, feed: ChunkFeed) -> list[Future[None]]:
        """The consumer closed ``feed``: drop what it did not take; later chunks are dropped on
        arrival.  Returns the acknowledgements of the drops (see ``OutputRegistry.drop``)."""
        emit(self._trace, "StreamClose", rpc_id=feed.rpc_id, request_id=feed.request_id)
        feed.closed = True
        ids = [ref.output_id for ref in feed.announced]
        feed.announced.clear()
        feed.dropped += len(ids)
        done = self._drop_all(ids, feed.rpc_id or "", "closed")
        self._wake(feed)
        return done

    def _end_streams(self, rpc: PendingRpc, error: BaseException | None, reason: str | None) -> None:
        """``rpc`` ended: so do its feeds.  ``reason`` (a failed end): drop the chunks not taken."""
        self._end_streams_of(rpc, rpc.streams.values(), error, reason)

    def _stream_error(self, rpc: PendingRpc, why: str) -> OutputError:
        """What a feed ends with when its call ended without an error of its own."""
        if why == "aborted" and rpc.cancelled:
            cause = next(iter(rpc.cancelled.values()))
            return RequestAborted(
                rpc.request_ids[0] if rpc.request_ids else "?",
                by=cause.value,
                detail="its chunks not taken were dropped",
                request_ids=rpc.request_ids,
                rpc_id=rpc.rpc_id,
            )
        return OutputDropped(f"rpc {rpc.method} ({rpc.rpc_id}) was {why}; its chunks not taken were dropped")

    def _end_streams_of(
        self, rpc: PendingRpc, feeds: Iterable[ChunkFeed], error: BaseException | None, reason: str | None
    ) -> None:
        for feed in feeds:
            if reason is not None and feed.announced:
                ids = [ref.output_id for ref in feed.announced]
                feed.announced.clear()
                feed.dropped += len(ids)
                self._drop_all(ids, rpc.rpc_id, reason)
            self._end_feed(feed, error)

    def _end_feed(self, feed: ChunkFeed, error: BaseException | None) -> None:
        if feed.ended:
            return
        feed.ended = True
        feed.error = error
        self._wake(feed)

    def _wake(self, feed: ChunkFeed) -> None:
        if feed.listener is not None:
            self._outbox.append(Wake(feed.listener))

    # ---------------------------------------------------------------- primitives

    def _drop_all(self, output_ids: Iterable[str], rpc_id: str, reason: str) -> list[Future[None]]:
        """Drop these ids; their acknowledgements (see ``OutputRegistry.drop``)."""
        # rpc_id and reason are for the trace only: why the dispatcher drops these ids.
        done: list[Future[None]] = []
        for oid in output_ids:
            emit(self._trace, "DispatchDrop", output_id=oid, rpc_id=rpc_id, reason=reason)
            done.append(self.registry.drop(oid))
            if oid in self.registry:
                # Still expected from the worker: tell its packer, which can skip it (F15).
                self._worker_drops.append(oid)
        return done

    def take_worker_drops(self) -> list[str]:
        """Ids this dispatcher dropped whose output a worker may still be packing."""
        out, self._worker_drops = self._worker_drops, []
        return out

    def _protocol_error(self, reason: str) -> None:
        self.counters["protocol_errors"] += 1
        self.registry.errors.append(ProtocolError(reason))
        emit(self._trace, "ProtocolError", output_id=None, reason=reason)

    def _orphan_deadline(self, now: float) -> float | None:
        """When the DROPPING records of a COMPUTE_DONE of an unknown call are given up on:
        ``compute_timeout`` from now (no worker computes for that call), else the
        output deadline (None: kept until its OUTPUT_READY or shutdown)."""
        return None if self._compute_timeout is None else now + self._compute_timeout
