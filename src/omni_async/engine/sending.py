"""``Sender``: a request's way to the workers, alone or in a batch.

A request sent alone is one ``executor.submit`` on the send thread; the
``RequestHandle`` it gets is the only path to its output (``handle.output``, claimed
by the pump at COMPUTE_DONE, streams included; ``handle.drop()`` after COMPUTE_DONE):
no output id travels back down from the engine.

Batches: with ``max_batch_size > 1`` the scheduler admits groups of requests whose
compatibility keys are equal (the model's ``batch_key``, the deadlines, streaming or
not: ``Admission``).  ``start_group`` starts one ``BatchGroup`` per group of two or
more: its ``send`` task sends the members that have not ended yet in one call
(``submit_batch`` on the send thread; with ``async_output=False``,
``execute_batch(sync_output=True)`` on a sync thread), and every member keeps a driver
of its own that awaits that send and then walks exactly as a request sent alone: its
own handle, its own abort (``cancel_requests`` of one member: the others go on),
deadlines (one call carries the members' common deadlines, which each would have
alone), stream, host stage and result.  A member that ended before the send is not in
the call and never left the engine.

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

from omni_async.core.errors import RequestNotSendable, RpcFailed
from omni_async.core.messages import RunnerOutput
from omni_async.engine.ends import RequestEnds
from omni_async.engine.postprocessor import PostProcessor
from omni_async.engine.record import BatchGroup, MemberSend, RequestRecord, retrieve
from omni_async.engine.streaming import StreamReader
from omni_async.engine.threads import EngineThreads
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.handle import RequestHandle

__all__ = ["Sender"]


class Sender:
    """Sends requests alone and in batches (see the module docstring)."""

    def __init__(
        self,
        executor: DiffusionExecutor,
        threads: EngineThreads,
        ends: RequestEnds,
        streams: StreamReader,
        post: PostProcessor,
        *,
        async_output: bool,
    ) -> None:
        self._executor = executor
        self._threads = threads
        self._ends = ends
        self._streams = streams
        self._post = post
        self._async_output = async_output

    def start_group(self, records: list[RequestRecord]) -> None:
        """Admitted together: one send for all of them (the members' drivers await it)."""
        group = BatchGroup(records)
        for rec in records:
            rec.group = group
        send = self._send_group if self._async_output else self._run_group_sync
        group.send = asyncio.get_running_loop().create_task(
            send(group), name=f"omni-engine-batch-{records[0].request_id}"
        )
        group.send.add_done_callback(retrieve)

    async def send(self, rec: RequestRecord) -> RequestHandle | None:
        """Send ``rec`` (alone, or its part of its batch's send): its handle, also kept as
        ``rec.handle`` (None: a member that ended before its batch was sent and was not in
        it).  Raises the send's error.  A member the batch could not carry because of
        another member's data is sent alone here."""
        group = rec.group
        if group is None:
            return await self._send_alone(rec)
        assert group.send is not None
        got = (await asyncio.shield(group.send)).get(rec.request_id)
        if got is None:
            return None
        if isinstance(got, RequestNotSendable) and len(group.records) > 1 and not rec.ended():
            return await self._send_alone(rec)
        if isinstance(got, BaseException):
            raise got
        assert isinstance(got, RequestHandle)
        self._took(rec, got)
        return got

    def _took(self, rec: RequestRecord, handle: RequestHandle) -> None:
        rec.handle = handle
        if handle.stream is not None:
            self._streams.attach(rec, handle.stream)

    async def _send_alone(self, rec: RequestRecord) -> RequestHandle:
        submit = functools.partial(self._executor.submit, rec.request, deadlines=rec.deadlines, stream=rec.streaming)
        handle = await self._threads.send(submit)
        self._took(rec, handle)
        return handle

    async def _send_group(self, group: BatchGroup) -> dict[str, MemberSend]:
        members = [r for r in group.records if not r.ended()]
        if not members:
            return {}
        first = members[0]
        # The one batch call site.
        submit = functools.partial(
            self._executor.submit_batch,
            [r.request for r in members],
            deadlines=first.deadlines,
            stream=first.streaming,
        )
        try:
            handles = await self._threads.send(submit)
        except Exception as exc:
            # Every member gets the send's error; for RequestNotSendable (one member's
            # data does not travel) each driver then sends its member alone (``send``),
            # and only that one fails.
            return {r.request_id: exc for r in members}
        group.sent = len(members)
        return {h.request_id: h for h in handles}

    async def resend_after_batch_failed(self, rec: RequestRecord, exc: BaseException) -> RequestHandle | None:
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
            handle = await self._send_alone(rec)
        except Exception as err:  # the resend failed: that is its end (the caller's FAIL is then a no-op)
            err.__context__ = exc
            self._ends.fail(rec, err)
            return None
        if rec.ended():  # aborted during the resend: stop the new forward too
            self._ends.cancel_forward(rec)
        return handle

    # ------------------------------------------------------------ synchronous path

    async def _run_group_sync(self, group: BatchGroup) -> dict[str, MemberSend]:
        """``async_output=False``: the batch's one call on the synchronous path (a sync
        thread), each member's ``RunnerOutput`` with its output; when the forward raised,
        each member alone, so only the one that raises fails."""
        members = [r for r in group.records if not r.ended()]
        if not members:
            return {}
        ex = self._executor
        group.sent = len(members)
        try:
            outs = await self._threads.sync(
                functools.partial(ex.execute_batch, [r.request for r in members], sync_output=True)
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
                got[rec.request_id] = await self._threads.sync(
                    functools.partial(ex.execute_request, rec.request, sync_output=True)
                )
            except Exception as exc:
                got[rec.request_id] = exc
        return got

    def release_member_late(self, rid: str, send: asyncio.Task[dict[str, MemberSend]]) -> None:
        """A member's driver was cancelled while its batch's synchronous call ran: release
        that member's output when the call ends."""
        if send.cancelled() or send.exception() is not None:
            return
        got = send.result().get(rid)
        if isinstance(got, RunnerOutput) and got.result is not None:
            self._post.release_later(got.result)
