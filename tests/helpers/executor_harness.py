"""Workers and executors for the in-process tests (test_inprocess_executor, test_failure_modes).

* ``ToyWorker``: a worker model whose requests say what to do (fail on a rank, block on a
  named gate until the test opens it), returning small tensors.
* ``PickleGate``: a value whose pickling blocks until its gate opens.  The in-process
  channel pickles every message in the sender's thread, so an output holding one makes
  the packer thread "pack slowly" -- for as long as the test wants, with no sleep.
* ``HarnessExecutor``: ``InProcessExecutor`` over ``ToyWorker`` with the packers and
  worker-loop options given by the test (a pack function that raises or blocks, a
  record_event that fails).
* ``req``, ``gate_name``, ``exc_of``, ``on_a_thread``, ``wait_until``: small helpers the test modules use.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from omni_async.core.config import Deadlines
from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput, DiffusionRequest
from omni_async.core.registry import ReleaseHook
from omni_async.core.trace import Tracer
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.transport.channel import ResultSender
from omni_async.worker.packer import Packer
from omni_async.worker.stream import emit_chunk

T = TypeVar("T")

TIMEOUT = 10.0
# Long enough never to fire in a test unless the test means it to.
RELAXED = Deadlines(compute_timeout=60.0, output_timeout=60.0, rpc_timeout=60.0)


class Gates:
    """Named events a test opens; ``entered`` tells the test a thread reached the gate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, threading.Event] = {}
        self._entered: dict[str, threading.Event] = {}

    def _get(self, table: dict[str, threading.Event], name: str) -> threading.Event:
        with self._lock:
            return table.setdefault(name, threading.Event())

    def pass_(self, name: str) -> None:
        self._get(self._entered, name).set()
        if not self._get(self._open, name).wait(TIMEOUT):
            raise TimeoutError(f"gate {name!r} never opened")

    def open(self, name: str) -> None:
        self._get(self._open, name).set()

    def open_all(self) -> None:
        with self._lock:
            names = list(self._open) + list(self._entered)
        for n in names:
            self.open(n)

    def wait_entered(self, name: str, timeout: float = TIMEOUT) -> bool:
        return self._get(self._entered, name).wait(timeout)


GATES = Gates()  # module level: PickleGate must find its gate from a bare name


class PickleGate:
    """Pickling waits until ``GATES.open(name)``: a slow pack in the packer thread."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Callable[[str], PickleGate], tuple[str]]:
        GATES.pass_(self.name)
        return (PickleGate, (self.name,))


class ToyWorker:
    """Request params: ``fail_on`` (ranks that raise), ``gate`` (block the forward of the ranks in
    ``gate_ranks``, default all), ``pickle_gate`` (block the packing), ``value`` (the image),
    ``chunks`` (that many chunks emitted before the gate, when the call streams)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.forwards = 0

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        return self._forward(request)

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self._forward(r) for r in requests))

    def ping(self) -> tuple[str, int]:
        return ("pong", self.rank)

    def fail_on(self, ranks: Sequence[int], message: str = "requested failure") -> int:
        if self.rank in ranks:
            raise RuntimeError(f"{message} on rank {self.rank}")
        return self.rank

    def wait_gate(self, name: str) -> int:
        GATES.pass_(name)
        return self.rank

    def _secret(self) -> None:  # pragma: no cover - must never be reachable
        raise AssertionError("private methods are not RPCs")

    def _forward(self, request: DiffusionRequest) -> DiffusionOutput:
        p = request.params
        self.forwards += 1
        for i in range(int(p.get("chunks", 0))):
            emit_chunk(request.request_id, {"chunk": torch.full((2,), float(i))})
        if "gate" in p and self.rank in p.get("gate_ranks", (self.rank,)):
            GATES.pass_(str(p["gate"]))
        if self.rank in p.get("fail_on", ()):
            raise ValueError(f"forward of {request.request_id} failed on rank {self.rank}")
        value = float(p.get("value", 1.0))
        out: dict[str, Any] = {"image": torch.full((8,), value), "rank": self.rank, "request": request.request_id}
        if "pickle_gate" in p:
            out["slow"] = PickleGate(str(p["pickle_gate"]))
        return DiffusionOutput(request.request_id, out)


def expected_image(value: float = 1.0) -> torch.Tensor:
    return torch.full((8,), value)


def make_toy(rank: int) -> ToyWorker:
    return ToyWorker(rank)


class HarnessExecutor(InProcessExecutor):
    """``InProcessExecutor`` over ``ToyWorker`` with relaxed deadlines, for building the
    worker side in a test (packers with their own pack function, loop options)."""

    def __init__(
        self,
        *,
        world_size: int = 1,
        reply_rank: int = 0,
        deadlines: Deadlines = RELAXED,
        make_packer: Callable[[int, ResultSender], Packer] | None = None,
        loop_options: dict[str, Any] | None = None,
        release_hook: ReleaseHook | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        kw: dict[str, Any] = {} if release_hook is None else {"release_hook": release_hook}
        super().__init__(
            make_toy,
            world_size=world_size,
            reply_rank=reply_rank,
            deadlines=deadlines,
            tracer=tracer,
            make_packer=make_packer or (lambda rank, ch: Packer(rank, ch)),
            loop_options=loop_options,
            **kw,
        )


def req(rid: str, **params: Any) -> DiffusionRequest:
    return DiffusionRequest(rid, params)


def gate_name() -> str:
    return f"gate-{uuid.uuid4().hex[:8]}"


def exc_of(fut: Future[Any]) -> BaseException:
    e = fut.exception(timeout=TIMEOUT)
    assert e is not None
    return e


def on_a_thread(call: Callable[[], T]) -> Future[T]:
    """``call()`` run on a thread of its own: a blocking call (``execute_request``) that the
    test goes on beside, with its outcome in the future.  The thread is a daemon: a call
    that never returns does not hold the interpreter at exit."""
    fut: Future[T] = Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(call())
        except BaseException as exc:  # noqa: BLE001  # the test reads it from the future
            fut.set_exception(exc)

    threading.Thread(target=run, name="blocking-call", daemon=True).start()
    return fut


def wait_until(pred: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    """For counters that no event reports (an output released on the pump thread): poll, bounded."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


@contextmanager
def opened_gates_on_exit() -> Iterator[Gates]:
    """Open every gate at the end, so no worker or packer thread stays blocked after a test."""
    try:
        yield GATES
    finally:
        GATES.open_all()
