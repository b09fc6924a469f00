"""A rig for the executor's collaborators, without workers: a real pump, dispatcher and
registry over an in-process channel, and a rank link that records what it is asked to
send (``RecordingRanks``); the tests play the workers' answers through the pump."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future

from omni_async.core.dispatch import Dispatcher
from omni_async.core.messages import AsyncDiffusionOutput, CancelMessage, DiffusionOutput, RpcRequest
from omni_async.core.registry import OutputRegistry
from omni_async.executor.desk import OutputDesk
from omni_async.executor.link import RankEvents, RankLink
from omni_async.executor.pump import ResultPump
from omni_async.executor.sender import RpcIds, RpcSender
from omni_async.executor.store import InlineStore
from omni_async.executor.submitter import BatchSubmitter
from omni_async.transport.channel import InProcessChannel


class RecordingRanks(RankLink):
    """A link whose ranks never answer: what was sent is in ``sent``, cancels in ``cancels``."""

    def __init__(self) -> None:
        self.channel = InProcessChannel()
        self.receiver = self.channel
        self.sent: list[RpcRequest] = []
        self.cancels: list[CancelMessage] = []
        self.refuse: BaseException | None = None

    def start(self, events: RankEvents | None, deadline: float, start_timeout: float) -> None:
        pass

    def broadcast(self, req: RpcRequest, wire: list[bytes] | None) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.sent.append(req)

    def deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        self.cancels.extend(cancels)

    def stop(self, deadline: float | None) -> None:
        pass


class Released(InlineStore):
    """An inline store that records every output released for nobody."""

    def __init__(self) -> None:
        self.released: list[str | None] = []
        super().__init__(lambda out: self.released.append(out.async_output_id))


class Rig:
    """Pump, dispatcher, registry, sender, desk and submitter, as ``DiffusionExecutor`` wires them."""

    def __init__(self, world_size: int = 1) -> None:
        self.ranks = RecordingRanks()
        self.store = Released()
        ids = RpcIds()
        self.registry = OutputRegistry(release_hook=self.store.release_packed)
        self.dispatcher = Dispatcher(self.registry, world_size=world_size, known_call=ids.issued_here)
        self.pump = ResultPump(self.ranks.receiver, self.dispatcher, on_cancel=self.ranks.deliver_cancels)
        self.sender = RpcSender(self.pump, self.ranks, ids)
        self.desk = OutputDesk(self.pump, self.store, self.sender.notify_drop)
        self.health_checks = 0
        self.submitter = BatchSubmitter(
            self.pump, self.sender, self.desk, self._health, step_mode=False, batch_key=None
        )

    def _health(self) -> None:
        self.health_checks += 1

    def play(self, msg: AsyncDiffusionOutput) -> None:
        """A worker's message, dispatched as the pump's thread would (resolutions after the lock)."""
        self.pump.call(lambda d: d.handle(msg, now=self.pump.now()))

    def output(self, oid: str, rid: str, value: int = 0) -> DiffusionOutput:
        return DiffusionOutput(rid, {"value": value}, async_output_id=oid)


def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.pump.stop("the test ended", timeout=1.0)


def done_value(fut: Future[DiffusionOutput]) -> DiffusionOutput:
    assert fut.done(), "the future should be resolved by now"
    return fut.result(0)
