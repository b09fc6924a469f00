"""Batches: requests the scheduler admitted together go to the workers as one
``execute_model_batch``, and each member then goes its own way.

Theory of operation
-------------------
With ``max_batch_size > 1`` the scheduler admits groups of requests whose
compatibility keys are equal (the model's ``batch_key``, the deadlines, streaming or
not: ``EngineBase._compat_key``).  The loop starts one ``BatchGroup`` per group of two
or more: its ``send`` task sends the members that have not ended yet in one call
(``submit_batch_handles`` on the send thread; with ``async_output=False``,
``execute_batch(sync_output=True)`` on a sync thread), and every member keeps a driver
of its own that awaits that send and then walks exactly as a request sent alone
(``driver``): its own output id, its own abort (``cancel_requests`` of one member: the
others go on), deadlines (one call carries the members' common deadlines, which each
would have alone), stream, host stage and result.  A member that ended before the send
is not in the call and never left the engine.

One member must not fail the others:

* a forward that raises fails the whole call (``RpcFailed``): each member not ended
  is then sent again *alone*, once, so the request that raises fails alone and the
  others finish (their forward runs twice; a stream's chunks may have been taken
  already, so a streaming member is not sent again and fails with the call);
* a batch that cannot be sent because a member's data does not travel
  (``RequestNotSendable``) is sent member by member instead;
* a member's output, packing, host stage and abort are its own already.

The stage machine sees a member as a request sent alone: ADMIT, SENT, COMPUTE_DONE,
... fired member by member in the group's order, which the engine's TLA+ model
allows (its send path takes queued requests in order; a resend after a failed batch
is part of "the worker runs its forward", which fires nothing).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Future

from omni_async.core.errors import RequestNotSendable, RpcFailed
from omni_async.core.messages import DiffusionOutput, RunnerOutput
from omni_async.engine.record import BatchGroup, MemberSend, RequestRecord, retrieve
from omni_async.engine.streaming import EngineStreams
from omni_async.executor.handle import RequestHandle
from omni_async.executor.stream import RequestStream

__all__ = ["EngineBatches"]

#: What a send gives a request's driver: the future of its COMPUTE_DONE and, claimed
#: for it, of its output (None: a stream's, taken with ``wait_output_ready``).
Sent = tuple["Future[RunnerOutput]", "Future[DiffusionOutput] | None"]


class EngineBatches(EngineStreams):
    """The batches' send and their members' retries (see the module docstring)."""

    def _start_group(self, records: list[RequestRecord]) -> None:
        """Admitted together: one send for all of them (the members' drivers await it)."""
        assert self._loop is not None
        group = BatchGroup(records)
        for rec in records:
            rec.group = group
        send = self._send_group if self._async_output else self._run_group_sync
        group.send = self._loop.create_task(send(group), name=f"omni-engine-batch-{records[0].request_id}")
        group.send.add_done_callback(retrieve)

    def _attach_stream(self, rec: RequestRecord, stream: RequestStream) -> None:
        """``rec`` was sent as a stream: its consumer wakes at each chunk."""
        rec.stream = stream
        loop = self._loop
        assert loop is not None

        def wake() -> None:  # on the pump's thread: only schedule
            try:
                loop.call_soon_threadsafe(rec.changed.set)
            except RuntimeError:  # the loop closed: nobody consumes the stream any more
                pass

        stream.add_listener(wake)
        rec.changed.set()

    def _release_output_later(self, output: DiffusionOutput) -> None:
        if self._post is not None:
            try:
                self._post.submit(self._release_quietly, output)
                return
            except RuntimeError:  # the engine's threads are gone: release here
                pass
        self._release_quietly(output)

    async def _send_group(self, group: BatchGroup) -> dict[str, MemberSend]:
        members = [r for r in group.records if not r.ended()]
        if not members:
            return {}
        first = members[0]
        try:
            handles = await self._on_io(
                functools.partial(
                    self.executor.submit_batch_handles,
                    [r.request for r in members],
                    deadlines=first.deadlines,
                    stream=first.streaming,
                )
            )
        except Exception as exc:
            # Every member gets the send's error; for RequestNotSendable (one member's
            # data does not travel) each driver then sends its member alone
            # (``_member_sent``), and only that one fails.
            return {r.request_id: exc for r in members}
        group.sent = len(members)
        return {h.request_id: h for h in handles}

    async def _member_sent(self, rec: RequestRecord) -> Sent | None:
        """``rec``'s part of its batch's send (None: it ended before the send and was not
        in it); raises the send's error.  A member the batch could not carry because of
        another member's data is sent alone here."""
        group = rec.group
        assert group is not None and group.send is not None
        got = (await asyncio.shield(group.send)).get(rec.request_id)
        if got is None:
            return None
        if isinstance(got, RequestNotSendable) and len(group.records) > 1 and not rec.ended():
            return await self._send_alone(rec)
        if isinstance(got, BaseException):
            raise got
        assert isinstance(got, RequestHandle)
        if got.stream is not None:
            self._attach_stream(rec, got.stream)
        return got.computed, got.output

    async def _send_alone(self, rec: RequestRecord) -> Sent:
        """Send ``rec`` in a call of its own (a stream: ``submit_stream``)."""
        ex = self.executor
        if rec.streaming:
            stream = await self._on_io(functools.partial(ex.submit_stream, rec.request, deadlines=rec.deadlines))
            self._attach_stream(rec, stream)
            return stream.result, None
        # One handle: its COMPUTE_DONE, and its output, claimed by the pump as it
        # dispatches that COMPUTE_DONE (no id travels back down to claim it).
        handle = await self._on_io(functools.partial(ex.submit_handle, rec.request, deadlines=rec.deadlines))
        return handle.computed, handle.output

    async def _alone_after_batch_failed(self, rec: RequestRecord, exc: BaseException) -> Sent | None:
        """``rec``'s batched forward failed with ``exc``: when the batch's forward raised
        (``RpcFailed``, which fails every member), send ``rec`` again alone, once; None
        when ``exc`` is ``rec``'s own end (its driver fails it with ``exc``)."""
        group = rec.group
        if (
            group is None
            or group.sent < 2
            or rec.retried
            or rec.streaming
            or rec.ended()
            or not isinstance(exc, RpcFailed)
        ):
            return None
        rec.retried = True
        try:
            sent = await self._send_alone(rec)
        except Exception as err:  # the resend failed: that is its end (the caller's FAIL is then a no-op)
            err.__context__ = exc
            self._fail(rec, err)
            return None
        if rec.ended():  # aborted during the resend: stop the new forward too
            self._cancel_forward(rec)
        return sent

    # ------------------------------------------------------------ synchronous path

    async def _run_group_sync(self, group: BatchGroup) -> dict[str, MemberSend]:
        """``async_output=False``: the batch's one call on the synchronous path (a sync
        thread), each member's ``RunnerOutput`` with its output; when the forward raised,
        each member alone, so only the one that raises fails."""
        assert self._loop is not None and self._sync is not None
        members = [r for r in group.records if not r.ended()]
        if not members:
            return {}
        ex = self.executor
        group.sent = len(members)
        try:
            outs = await self._loop.run_in_executor(
                self._sync, functools.partial(ex.execute_batch, [r.request for r in members], sync_output=True)
            )
            return {ro.request_id: ro for ro in outs}
        except (RpcFailed, RequestNotSendable) as exc:
            if len(members) == 1:
                return {members[0].request_id: exc}
        except Exception as exc:
            return {r.request_id: exc for r in members}
        got: dict[str, MemberSend] = {}
        for rec in members:
            if rec.ended():
                continue  # aborted meanwhile: not sent again (its driver sees it is not in the call)
            try:
                got[rec.request_id] = await self._loop.run_in_executor(
                    self._sync, functools.partial(ex.execute_request, rec.request, sync_output=True)
                )
            except Exception as exc:
                got[rec.request_id] = exc
        return got

    def _release_member_late(self, rid: str, send: asyncio.Task[dict[str, MemberSend]]) -> None:
        """A member's driver was cancelled while its batch's synchronous call ran: release
        that member's output when the call ends."""
        if send.cancelled() or send.exception() is not None:
            return
        got = send.result().get(rid)
        if isinstance(got, RunnerOutput) and got.result is not None:
            self._release_output_later(got.result)
