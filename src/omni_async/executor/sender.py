"""``RpcSender``: how the executor's calls leave for the ranks.

It owns the executor's RPC ids (``RpcIds``: a token and a counter, so the dispatcher can
tell a late answer of ours from an answer to a call never made, M3) and sends each RPC
through the rank link, preceded by the drops the workers have not heard of yet.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid

from omni_async.core.messages import RpcRequest
from omni_async.core.methods import DROP_OUTPUTS
from omni_async.executor.link import RankLink
from omni_async.executor.pump import ResultPump

__all__ = ["RpcIds", "RpcSender"]

log = logging.getLogger(__name__)


class RpcIds:
    """The executor's RPC ids, ``"{token}-{n}"``; safe from any thread."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex[:8]
        self._seq = itertools.count()
        self._issued = 0  # ids with n below this were issued
        self._lock = threading.Lock()  # callers on several threads: no lost update

    def next(self) -> str:
        with self._lock:
            n = next(self._seq)
            self._issued = n + 1
        return f"{self.token}-{n}"

    def issued_here(self, rpc_id: str | None) -> bool:
        """Whether ``rpc_id`` is one of ours (the dispatcher's ``known_call``)."""
        if rpc_id is None:
            return False
        token, _, n = rpc_id.rpartition("-")
        return token == self.token and n.isdigit() and int(n) < self._issued


class RpcSender:
    """Sends RPCs to every rank through ``link`` (module docstring)."""

    def __init__(self, pump: ResultPump, link: RankLink, ids: RpcIds) -> None:
        self._pump = pump
        self._link = link
        self.ids = ids

    def encode(self, req: RpcRequest) -> list[bytes] | None:
        return self._link.encode(req)

    def send(self, req: RpcRequest, wire: list[bytes] | None = None) -> None:
        """Broadcast ``req``, preceded by the drops the workers have not heard of yet.

        Drops the dispatcher makes itself (a failed or timed-out call, an orphan
        COMPUTE_DONE) happen on the pump thread, which must never block on a worker's
        pipe; they travel with the next RPC instead, still ahead of its forward.
        """
        drops = self._pump.call(lambda d: d.take_worker_drops())
        if drops:
            self.notify_drop(drops)
        self._link.broadcast(req, wire)

    def notify_drop(self, output_ids: list[str]) -> None:
        """Tell the workers these outputs were dropped (a packing not started is skipped, F15)."""
        try:
            self._link.broadcast(RpcRequest(self.ids.next(), DROP_OUTPUTS, (output_ids,)), None)
        except Exception as exc:  # best effort: the registry already released everything
            log.debug("cannot tell the workers about dropped outputs: %s", exc)
