"""``InProcessExecutor``: every rank's worker loop on a thread of this process.

Its rank link is ``ThreadRanks`` (an inbox and a thread per rank, cancels straight into
each loop's cancel table) and its store an ``InlineStore`` (outputs travel whole inside
their message; the channel still pickles every one).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from omni_async.core.config import Deadlines
from omni_async.core.errors import ExecutorShutdown, OmniAsyncError, UsageError
from omni_async.core.messages import CancelMessage, DiffusionRequest, RpcRequest
from omni_async.core.registry import ReleaseHook, no_release
from omni_async.core.trace import Tracer
from omni_async.executor.api import DiffusionExecutor
from omni_async.executor.checks import stop_budget
from omni_async.executor.config import check_in_process_arguments
from omni_async.executor.link import RankEvents, RankLink, shut_down_error
from omni_async.executor.store import InlineStore
from omni_async.transport.channel import InProcessChannel, ResultSender
from omni_async.worker.host import WorkerSpec
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.packer import Packer
from omni_async.worker.postprocess import get_postprocess
from omni_async.worker.validation import BatchKeyer, model_batch_keyer, model_validator

__all__ = ["InProcessExecutor", "ThreadRanks"]

log = logging.getLogger(__name__)


class ThreadRanks(RankLink):
    """Ranks on threads of this process: each rank's ``WorkerLoop`` fed from an inbox by a
    thread of its own, its ``Packer`` on another; results through ``channel``."""

    def __init__(self, channel: InProcessChannel, loops: list[WorkerLoop], packers: list[Packer]) -> None:
        self.channel = channel
        self.receiver = channel
        self.loops = loops
        self.packers = packers
        self._stopped = False
        self._inboxes: list[queue.Queue[RpcRequest | None]] = [queue.Queue() for _ in loops]
        self._threads = [
            threading.Thread(target=self._serve, args=(loop, inbox), name=f"omni-worker-{loop.rank}", daemon=True)
            for loop, inbox in zip(loops, self._inboxes, strict=True)
        ]

    def start(self, events: RankEvents | None, deadline: float, start_timeout: float) -> None:
        """Nothing to wait for: the models are built (``make_worker``)."""

    def started(self) -> None:
        for p, t in zip(self.packers, self._threads, strict=True):
            p.start()
            t.start()

    @staticmethod
    def _serve(loop: WorkerLoop, inbox: queue.Queue[RpcRequest | None]) -> None:
        while (req := inbox.get()) is not None:
            try:
                loop.handle_rpc(req)
            except Exception:
                log.exception("worker %d: handling %s failed", loop.rank, req.method)

    def broadcast(self, req: RpcRequest, wire: list[bytes] | None) -> None:
        if self._stopped:
            raise shut_down_error()
        for inbox in self._inboxes:
            inbox.put(req)

    def deliver_cancels(self, cancels: list[CancelMessage]) -> None:
        # The "control channel" in process: straight into each loop's cancel table,
        # which its worker thread reads between steps (thread safe, never blocks).
        for loop in self.loops:
            for msg in cancels:
                loop.cancel(msg)

    def failure(self) -> OmniAsyncError | None:
        for rank, (t, p) in enumerate(zip(self._threads, self.packers, strict=True)):
            if not t.is_alive() or not p.alive():
                return ExecutorShutdown(f"worker thread of rank {rank} is not running")
        return None

    def stop(self, deadline: float | None) -> None:
        if self._stopped:
            return
        self._stopped = True
        # Threads cannot be terminated: each gets what is left of the deadline (5 s
        # without one), all at once, and one still in a forward is left behind (a
        # daemon thread), logged.
        end = time.monotonic() + stop_budget(deadline, 5.0, 0.7)
        for inbox in self._inboxes:
            inbox.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, end - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        # Close before stopping the packers: nobody reads any more, so a packer's put
        # must fail at once rather than wait for room (F16: joins never hang).
        self.channel.close()
        end = time.monotonic() + stop_budget(deadline, 5.0)
        for p in self.packers:
            if not p.stop(max(0.0, end - time.monotonic())):
                stuck.append(f"omni-packer-{p.rank}")
        if stuck:
            log.warning("shutdown: thread(s) %s still running; left behind (daemon threads)", stuck)


class InProcessExecutor(DiffusionExecutor):
    """Every rank's ``WorkerLoop`` on a thread of this process, with a real pump and packer threads.

    The protocol is the real one end to end (the channel even pickles every
    message); only the process boundary is missing.
    """

    @classmethod
    def from_spec(
        cls,
        spec: WorkerSpec,
        *,
        world_size: int = 1,
        deadlines: Deadlines | None = None,
        max_outputs_in_flight: int = 4,
        tracer: Tracer | None = None,
    ) -> InProcessExecutor:
        """The ranks of ``spec`` on threads, with everything the spec carries that worker
        processes would get: its model (``spec.build``), its post-process's device stage
        (``spec.postprocess``: without it a ``decode="device"`` output reaches the channel
        undecoded) and its request check (``spec.request_validator()``)."""
        if not isinstance(spec, WorkerSpec):
            raise UsageError(f"InProcessExecutor.from_spec: spec must be a WorkerSpec, got {type(spec).__name__}")
        return cls(
            spec.build,
            world_size=world_size,
            deadlines=deadlines,
            max_outputs_in_flight=max_outputs_in_flight,
            tracer=tracer,
            validate_request=spec.request_validator(),
            postprocess=spec.postprocess,
        )

    def __init__(
        self,
        make_worker: Callable[[int], object],
        *,
        world_size: int = 1,
        reply_rank: int = 0,
        step_mode: bool = False,
        deadlines: Deadlines | None = None,
        max_outputs_in_flight: int = 4,
        tracer: Tracer | None = None,
        channel: InProcessChannel | None = None,
        make_packer: Callable[[int, ResultSender], Packer] | None = None,
        loop_options: Mapping[str, Any] | None = None,
        release_hook: ReleaseHook = no_release,
        validate_request: Callable[[DiffusionRequest], None] | None = None,
        postprocess: str | None = None,
        final_step_async: bool = False,
    ) -> None:
        """``make_packer`` and ``loop_options`` (extra ``WorkerLoop`` arguments) let a
        caller build the worker side itself, e.g. a packer with its own pack function.
        ``postprocess``: a registered pipeline name whose device stage the packers run on
        every output before it travels (as ``WorkerSpec.postprocess``; ignored by a
        packer from ``make_packer``, which chooses its own).
        ``validate_request``: checked on every request in the caller's thread before it is
        sent; by default the model's own ``validate_request``, found as with worker
        processes: a static or class method of the model's class (or an attribute of
        ``make_worker``).  A model whose class defines it as an instance method is refused
        (``UsageError``), as ``WorkerSpec`` refuses it: one rule for both executors."""
        check_in_process_arguments(
            make_worker,
            world_size=world_size,
            reply_rank=reply_rank,
            step_mode=step_mode,
            deadlines=deadlines,
            max_outputs_in_flight=max_outputs_in_flight,
            tracer=tracer,
            channel=channel,
            make_packer=make_packer,
            loop_options=loop_options,
            release_hook=release_hook,
            validate_request=validate_request,
            postprocess=postprocess,
            final_step_async=final_step_async,
        )
        if postprocess is not None and (not isinstance(postprocess, str) or not postprocess):
            raise UsageError(f"postprocess must be a registered pipeline name (str) or None, got {postprocess!r}")
        if world_size < 1:
            raise UsageError(f"world_size must be >= 1, got {world_size}")
        stage = get_postprocess(postprocess).device if postprocess is not None else None
        self.channel = channel if channel is not None else InProcessChannel()
        self.packers: list[Packer] = []
        self.loops: list[WorkerLoop] = []
        for rank in range(world_size):
            sender: ResultSender = self.channel
            packer = (
                make_packer(rank, sender)
                if make_packer is not None
                else Packer(rank, sender, max_outputs=max_outputs_in_flight, tracer=tracer, device_stage=stage)
            )
            loop = WorkerLoop(
                rank,
                make_worker(rank),
                sender,
                reply_rank=reply_rank,
                packer=packer,
                tracer=tracer,
                **{"device_stage": stage, **dict(loop_options or {})},
            )
            self.packers.append(packer)
            self.loops.append(loop)
        # One rule with worker processes (omni_async.worker.validation): the model's
        # validate_request runs without an instance; an instance method is refused.
        found = model_validator(make_worker, "InProcessExecutor(make_worker)")
        for loop in self.loops:
            in_class = model_validator(type(loop.worker), "InProcessExecutor")
            found = found if found is not None else in_class
        # The model's batch_key, found by the same rule (AsyncDiffusionEngine's batching).
        keyer: BatchKeyer | None = model_batch_keyer(make_worker, "InProcessExecutor(make_worker)")
        for loop in self.loops:
            keyer = keyer if keyer is not None else model_batch_keyer(type(loop.worker), "InProcessExecutor")
        self.ranks = ThreadRanks(self.channel, self.loops, self.packers)
        super().__init__(
            self.ranks,
            InlineStore(release_hook),
            world_size=world_size,
            reply_rank=reply_rank,
            step_mode=step_mode,
            deadlines=deadlines,
            tracer=tracer,
            validate_request=validate_request if validate_request is not None else found,
            final_step_async=final_step_async,
            batch_key=keyer,
        )
        self._start(None, 0.0, probe=False)
