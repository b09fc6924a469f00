"""The soak's executor lives: one executor (and, with ``--engine``, its engine on a
thread of its own) from the moment it goes live to its checks at the end; a life's
report (``LifeReport``), and the driver's own memory (``DriverMemory``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import TypeVar

import attrs

from omni_async.cli.parsers import WARMUP_REQUESTS
from omni_async.cli.soak_plans import SETTLE_S, WAIT_S, WIDTH
from omni_async.core.config import Deadlines
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.transport.shm.files import entries

__all__ = ["DriverMemory", "EngineThread", "Life", "LifeReport", "rss_kib"]

T = TypeVar("T")


# ------------------------------------------------------------------------------ executors


def rss_kib(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon) of a process in KiB, or None when it is gone.

    VmRSS also counts the pages of shared libraries the process has touched (torch's are
    large, and a forward of a new shape touches more of them) and of the shared-memory
    segments it wrote into (bounded by the budget of held outputs); RssAnon is the
    process's own heap and stacks, where a leak would show.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    try:
        return int(fields["VmRSS"].split()[0]), int(fields["RssAnon"].split()[0])
    except (KeyError, ValueError, IndexError):
        return None


@attrs.frozen
class LifeReport:
    """How one executor's life ended (``used`` False: a warm spare that never went live)."""

    killed: bool
    registry_empty: bool
    leases_outstanding: int
    files_left: int
    rss_growth_kib: int  # VmRSS from going live, the largest growth among the workers alive at the end
    anon_growth_kib: int | None  # RssAnon from the end of the warm-up, likewise: the check (None: no warm-up)
    serial: int = 0  # the order in which its construction began, from 1
    slot: int = 0  # the slot (``--executors``) it ran on
    used: bool = True
    requests: int = 0  # requests dispatched to it
    built_s: float = 0.0  # construction finished, seconds from the soak's start
    live_s: float | None = None  # went live (its first request)
    failed_s: float | None = None  # a worker died (killed, or seen dead by a request)
    spare_ready: bool | None = None  # a replacement: was it built before its predecessor failed?
    prefix: str = ""  # its pool's names under /dev/shm
    pids: tuple[int, ...] = ()  # its workers
    # --engine: requests its engine accepted, how many of its outcomes it counted, and
    # how many requests it still held at the end (None: no engine).
    engine_accepted: int | None = None
    engine_outcomes: int | None = None
    engine_left: int | None = None

    def problems(self, rss_bound_mib: int) -> list[str]:
        """What failed a check in this life, in words (empty: nothing)."""
        found = []
        if not self.registry_empty:
            found.append("registry not empty (pending or held outputs) at the end of its life")
        if self.leases_outstanding:
            found.append(f"{self.leases_outstanding} lease(s) out at the end of its life")
        if self.files_left:
            found.append(f"{self.files_left} segment(s) left in /dev/shm after its shutdown")
        if self.engine_accepted is not None and self.engine_outcomes != self.engine_accepted:
            found.append(
                f"its engine accepted {self.engine_accepted} request(s) and counted {self.engine_outcomes} outcome(s)"
            )
        if self.engine_left:
            found.append(f"its engine still held {self.engine_left} request(s) at the end")
        if self.anon_growth_kib is not None and self.anon_growth_kib >= rss_bound_mib * 1024:
            found.append(f"worker RssAnon grew {self.anon_growth_kib / 1024:.1f} MiB (bound {rss_bound_mib})")
        return found

    def name(self) -> str:
        what = "killed" if self.killed else ("unused spare" if not self.used else "ended")
        return f"executor {self.serial} (slot {self.slot}, {self.requests} requests, {what})"


@attrs.frozen
class DriverMemory:
    """The driver's (this process's) memory at the points its check reads: each a
    ``(VmRSS, RssAnon)`` in KiB (``rss_kib``), None where the run never got there.

    ``warm``: when request ``warm_index`` (a tenth of the requests) was handed out;
    ``last``: when the last one was; ``end``: after every executor shut down.  The check
    is on RssAnon (the heap, where what the engines and executors keep per finished
    request shows; VmRSS also counts the pages of torch's libraries touched late, and
    of shared-memory segments) from ``warm`` to the larger of ``last`` and ``end``.
    """

    start: tuple[int, int]
    warm: tuple[int, int] | None
    last: tuple[int, int] | None
    end: tuple[int, int] | None
    warm_index: int
    requests: int

    def growth_kib(self) -> int | None:
        """RssAnon growth after the warm-up (None: the run never finished its warm-up)."""
        ends = [p[1] for p in (self.last, self.end) if p is not None]
        if self.warm is None or not ends:
            return None
        return max(ends) - self.warm[1]

    def per_1000_kib(self) -> float | None:
        growth = self.growth_kib()
        after = self.requests - self.warm_index
        return None if growth is None or after <= 0 else growth * 1000 / after

    def vmrss_kib(self) -> list[int]:
        return [p[0] for p in (self.start, self.warm, self.last, self.end) if p is not None]


class EngineThread:
    """An ``AsyncDiffusionEngine`` over one executor (not owned: the life shuts it down),
    on an event loop of its own thread; the soak's engine threads hand it coroutines."""

    def __init__(self, ex: MultiprocDiffusionExecutor, serial: int) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"soak-engine-loop-{serial}", daemon=True)
        self._thread.start()
        self.engine = AsyncDiffusionEngine(ex)
        self.accepted = 0  # generate calls that reached the engine (counted on its loop)
        try:
            self.call(self.engine.start()).result(timeout=WAIT_S)
        except BaseException:
            self._stop()
            raise

    def call(self, coro: Coroutine[object, None, T]) -> Future[T]:
        """Run ``coro`` on the engine's loop; cancelling the future cancels its task."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def generate(self, request: DiffusionRequest, deadlines: Deadlines | None) -> GenerationResult:
        # A task cancelled before its first step never gets here: the engine never saw it.
        self.accepted += 1
        return await self.engine.generate(request, deadlines=deadlines)

    async def gone(self, rid: str) -> bool:
        """Nothing of request ``rid`` is in the engine (read on its loop)."""
        return self.engine.phase_of(rid) is None

    async def _left(self) -> int:
        return len(self.engine)

    def settle(self) -> tuple[int, int, int]:
        """(accepted, outcomes counted, requests still held) once the engine holds nothing,
        or SETTLE_S has passed (a cancelled task returns before its request's clean-up)."""
        deadline = time.monotonic() + SETTLE_S
        while (left := self.call(self._left()).result(timeout=WAIT_S)) and time.monotonic() < deadline:
            time.sleep(0.02)
        m = self.engine.metrics()
        outcomes = sum(n for outcome, n in m.requests.items() if outcome != "rejected")
        return self.accepted - m.requests.get("rejected", 0), outcomes, left

    def close(self) -> None:
        try:
            self.call(self.engine.close()).result(timeout=WAIT_S)
        finally:
            self._stop()

    def _stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()


class Life:
    """One executor, from its construction (possibly as a warm spare) to its checked shutdown."""

    def __init__(self, args: argparse.Namespace, *, slot: int = 0, serial: int = 0, t0: float = 0.0) -> None:
        self.deadlines = Deadlines(compute_timeout=60.0, output_timeout=args.output_timeout, rpc_timeout=60.0)
        self.ex = MultiprocDiffusionExecutor(
            WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", {"width": WIDTH, "steps": 2}),
            world_size=args.world_size,
            deadlines=self.deadlines,
            options=WorkerOptions(lease_timeout=30.0),
            max_held_outputs=args.max_held_outputs,
        )
        self.engine: EngineThread | None = None
        if getattr(args, "engine", False):
            try:
                self.engine = EngineThread(self.ex, serial)
            except BaseException:
                self.ex.shutdown("the soak's engine failed to start")
                raise
        self.slot, self.serial, self.t0 = slot, serial, t0
        self.built_at = time.monotonic()
        self.prefix = self.ex.pool.prefix
        self.pids = [p.pid for p in self.ex.procs if p.pid is not None]
        # Memory is measured from going live, not from construction: a spare idles meanwhile.
        self.rss_start: dict[int, tuple[int, int] | None] | None = None
        self.rss_warm: dict[int, tuple[int, int] | None] | None = None
        self.rss_last: dict[int, tuple[int, int] | None] = {}  # a killed worker's, just before the kill
        self.dispatched = 0
        self.live_at: float | None = None
        self.failed_at: float | None = None
        self.spare_ready: bool | None = None
        self.failed = threading.Event()  # a worker died: no new request goes to this executor
        self._kill_lock = threading.Lock()

    def go_live(self, predecessor: Life | None) -> None:
        """This executor takes its slot's requests from now on (slot thread)."""
        self.live_at = time.monotonic()
        self.rss_start = {pid: rss_kib(pid) for pid in self.pids}
        if predecessor is not None and predecessor.failed_at is not None:
            self.spare_ready = self.built_at <= predecessor.failed_at

    def dispatch(self) -> None:
        """One more request goes to this executor (slot thread)."""
        self.dispatched += 1
        if self.dispatched == WARMUP_REQUESTS + 1:
            self.rss_warm = {pid: rss_kib(pid) for pid in self.pids}

    def mark_failed(self) -> None:
        """A worker of this executor died: its slot moves on to the spare."""
        with self._kill_lock:
            if self.failed_at is None:
                self.failed_at = time.monotonic()
            self.failed.set()

    def kill_one(self, rng: random.Random) -> None:
        """SIGKILL one worker of this executor (once per life: the executor is finished after it)."""
        with self._kill_lock:
            if self.failed.is_set():
                return
            victim = rng.choice(self.pids)
            self.rss_last[victim] = rss_kib(victim)  # its life's end, for the RSS check
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.failed_at = time.monotonic()
            self.failed.set()

    def end(self) -> LifeReport:
        """Check what the ended requests left, shut down, and check what the shutdown left."""
        ex = self.ex
        engine: tuple[int, int, int] | None = None
        if self.engine is not None:
            try:
                engine = self.engine.settle()
            finally:
                self.engine.close()
        deadline = time.monotonic() + SETTLE_S
        while True:
            m = ex.metrics()
            leases = ex.pool.stats().outstanding
            empty = m.pending_outputs == 0 and m.held_payloads == 0
            if (empty and leases == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        growth, anon = 0, None
        for pid, start in (self.rss_start or {}).items():
            end = self.rss_last[pid] if pid in self.rss_last else rss_kib(pid)
            if start is None or end is None:
                continue
            growth = max(growth, end[0] - start[0])
            warm = None if self.rss_warm is None else self.rss_warm.get(pid)
            if warm is not None:
                anon = max(anon or 0, end[1] - warm[1])
        ex.shutdown("the soak ended this executor")

        def since(t: float | None) -> float | None:
            return None if t is None else round(t - self.t0, 3)

        return LifeReport(
            killed=self.failed.is_set(),
            registry_empty=empty,
            leases_outstanding=leases,
            files_left=len(entries(self.prefix)),
            rss_growth_kib=growth,
            anon_growth_kib=anon,
            serial=self.serial,
            slot=self.slot,
            used=self.live_at is not None,
            requests=self.dispatched,
            built_s=round(self.built_at - self.t0, 3),
            live_s=since(self.live_at),
            failed_s=since(self.failed_at),
            spare_ready=self.spare_ready,
            prefix=self.prefix,
            pids=tuple(self.pids),
            engine_accepted=None if engine is None else engine[0],
            engine_outcomes=None if engine is None else engine[1],
            engine_left=None if engine is None else engine[2],
        )
