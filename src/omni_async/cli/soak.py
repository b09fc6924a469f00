"""``omni-async soak``: the whole stack under random load and faults, every request accounted for.

The soak drives ``MultiprocDiffusionExecutor`` over ``TinyDiffusionWorker`` from
``--concurrency`` engine threads, each running one request at a time from submit to
its end, so that many requests are in flight at once.  Every request gets random
sizes (inline images of up to 64 KiB and shared-memory ones of up to 1 MiB, some with
their trajectory) and, with probability ``--fault-rate``, one fault (``FAULTS``): a
forward that raises, an output the packer refuses, an abort (``drop_output``), a
cancelled call or wait (``Future.cancel``), the consumer going away
(``release_consumer``), the engine's own tight deadline, a claim after the output
deadline, or a SIGKILL of one worker.

Every request ends in exactly one recorded outcome: a result (its bytes checked against
the digest the worker took), a typed error (by class), aborted, or cancelled.

``--engine``: the requests go through an ``AsyncDiffusionEngine`` over each executor
(one engine per executor life, on an event loop of its own thread; the engine threads
hand it coroutines) instead of the executor directly.  The plans are the same; the
faults map onto the engine's calls (``ENGINE_FAULTS``): an abort is ``engine.abort``
(at once or after the plan's delay), a cancelled call or wait is the cancelled
``generate`` task (at once, or after the delay), the consumer going away is
``engine.abort(..., wait=True)`` (and the request must be gone from the engine when it
returns), the tight deadline and the expired claim are per-request ``deadlines=`` (a
compute, resp. output, deadline of the plan's 0-5 ms), and a kill is the same SIGKILL
of a worker.  A raising forward and an unpackable output are the same requests.  On
top of the checks below each engine is checked: every request it accepted ended in
exactly one of its outcomes (``metrics().requests``), and it holds nothing at the end
(no request waiting, running or holding).

``--executors K`` slots run side by side, each one executor life at a time with its own
``--concurrency`` engine threads, all drawing from the one plan sequence (request ``i``'s
plan is a function of ``(seed, i)``, whichever slot runs it).  The executor cannot
recover from a dead worker (``WorkerDied`` is final), so each slot keeps a warm spare:
the next executor for the slot is built in the background while the current one runs
(while a planned kill is still to come: after the last one a spare could only be shut
down unused; a death no plan asked for gets a cold start).  When a worker dies the slot
goes on with the spare at once and starts building the next one; a retiring thread
lets the dead life's requests in flight end, then checks and shuts that executor down.  Each life is checked on its own (registry empty, no lease
outstanding, no file left in /dev/shm, and the growth of its workers' own memory,
``RssAnon`` in ``/proc/<pid>/status``, from the end of the life's warm-up to its end;
memory is measured from the moment a life goes live, not from the spare's construction),
and so is every spare never used (built, then checked and shut down at the end).

Memory: per request only a byte of state (``Accounting``) and counters; the plan of a
request is drawn from ``(seed, index)`` when it starts, so ``--requests 100000`` costs
the driver 100 KB (and a few hundred bytes per executor life for its report).  The
driver's own memory is checked too (``DriverMemory``): its ``RssAnon`` (this process's
heap and stacks: the engines, executors, pumps and the soak's own threads) may grow at
most ``--driver-rss-bound-mib`` from the end of the warm-up (when the request at a tenth
of ``--requests`` is handed out) to the end (the larger of: when the last request is
handed out, and after every executor shut down).  A long-running server serves millions
of requests: what it keeps per finished request must be bounded, and so must this.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import shlex
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar
from pathlib import Path

import attrs
import numpy as np
import torch
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from omni_async.cli.parsers import DRIVER_RSS_BOUND_MIB as DRIVER_RSS_BOUND_MIB
from omni_async.cli.parsers import WARMUP_REQUESTS as WARMUP_REQUESTS
from omni_async.cli.parsers import add_soak as add_parser
from omni_async.core.config import Deadlines
from omni_async.core.errors import (
    OmniAsyncError,
    OutputDropped,
    OutputError,
    RemoteError,
    RequestAborted,
    RpcFailed,
    WorkerDied,
)
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.metrics import GenerationResult
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerOptions, WorkerSpec
from omni_async.models.tiny import image_digest
from omni_async.transport.shm.files import entries

__all__ = ["ENGINE_FAULTS", "FAULTS", "Accounting", "DriverMemory", "Plan", "Row", "add_parser", "build_rows", "host_digest", "plan_request", "run"]

# The faults a faulty request gets, with their weights.  Kills are rarer: each ends an
# executor's life (its slot goes on with the warm spare while the dead one is checked).
FAULTS: Mapping[str, float] = {
    "raise": 1.0,  # the forward raises: RpcFailed
    "unpackable": 1.0,  # the packer refuses the output: RemoteError (UnsupportedOutputType)
    "abort": 1.0,  # drop_output, before or after the output arrived
    "cancel-call": 1.0,  # cancel the future of submit_request
    "cancel-wait": 1.0,  # cancel the future of wait_output_ready
    "consumer-gone": 0.5,  # release_consumer, before or after the call resolved
    "tight-wait": 1.0,  # the engine's own deadline of 0-5 ms, then cancel (the guide's fetch)
    "expire": 0.25,  # claimed only after the output deadline: OutputTimeout
    "kill": 0.25,  # SIGKILL of one worker: WorkerDied, then a new executor
}
# With --engine: how each fault reaches the request (the soak's plans are the same).
ENGINE_FAULTS: Mapping[str, str] = {
    "raise": "the same request: the forward raises (RpcFailed from generate)",
    "unpackable": "the same request: the packer refuses the output (RemoteError from generate)",
    "abort": "engine.abort(request_id), at once (early) or after the plan's delay",
    "cancel-call": "the generate task cancelled at once",
    "cancel-wait": "the generate task cancelled after the plan's delay",
    "consumer-gone": "engine.abort(request_id, wait=True): nothing of it may remain in the engine after",
    "tight-wait": "deadlines=: a compute deadline of the plan's 0-5 ms (ComputeTimeout, or a result)",
    "expire": "deadlines=: an output deadline of the plan's 0-5 ms (OutputTimeout, or a result)",
    "kill": "the same SIGKILL of one worker after generate started (WorkerDied, then a new executor)",
}
T = TypeVar("T")
WIDTH = 64  # the model's width: an image of height h is h * 256 bytes
INLINE_HEIGHTS = (8, 32, 64, 128, 256)  # up to 64 KiB: inside the message
SHM_HEIGHTS = (512, 1024, 2048, 4096)  # 128 KiB to 1 MiB: a pooled segment
WAIT_S = 120.0  # a wait that runs out is a hang: an untyped TimeoutError, which fails the soak
SETTLE_S = 15.0  # how long an executor may take to release what ended requests left in flight
# WARMUP_REQUESTS and DRIVER_RSS_BOUND_MIB (the RSS checks' warm-up and the driver's bound) are in
# omni_async.cli.parsers: the options' help and defaults name them.

RESULT = "result"
CHANGED = "result with changed bytes"
CANCELLED = "cancelled"
ABORTED = "aborted"
CONSUMER_GONE = "aborted (consumer gone)"
TYPED = "typed error: "
UNTYPED = "untyped error: "


# ------------------------------------------------------------------------------ plans


@attrs.frozen
class Plan:
    """What request ``index`` does: its size and its fault (None: none)."""

    index: int
    fault: str | None
    height: int
    steps: int
    keep_trajectory: bool
    delay: float  # seconds before a cancel or a late abort; the engine's deadline for 'tight-wait'
    early: bool  # abort or release the consumer before the output arrives (or the call resolves)

    @property
    def request_id(self) -> str:
        return f"soak-{self.index}"

    def request(self) -> DiffusionRequest:
        params: dict[str, object] = {"seed": self.index, "height": self.height, "steps": self.steps}
        if self.keep_trajectory:
            params["keep_trajectory"] = True
        if self.fault in ("raise", "unpackable"):  # the model's switches, only where they are on
            params[self.fault] = True
        return DiffusionRequest(self.request_id, params)


def plan_request(seed: int, fault_rate: float, index: int) -> Plan:
    """Request ``index``'s plan: the same for the same seed, whatever ran before it."""
    rng = random.Random(f"omni-async-soak:{seed}:{index}")
    fault = None
    if rng.random() < fault_rate:
        fault = rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
    return Plan(
        index=index,
        fault=fault,
        height=rng.choice(INLINE_HEIGHTS if rng.random() < 0.5 else SHM_HEIGHTS),
        steps=rng.randint(1, 3),
        keep_trajectory=rng.random() < 0.2,
        delay=rng.uniform(0.0, 0.005),
        early=rng.random() < 0.5,
    )


def last_kill(seed: int, fault_rate: float, requests: int) -> int:
    """The index of the last request whose plan is a kill (-1: none); reads the plans
    backwards, so it costs about ``1 / P(kill)`` plans, not ``requests``."""
    if fault_rate == 0.0:
        return -1
    for index in range(requests - 1, -1, -1):
        if plan_request(seed, fault_rate, index).fault == "kill":
            return index
    return -1


# ------------------------------------------------------------------------------ accounting


class Accounting:
    """Every request's one outcome, in counters and one byte of state per request.

    ``start(i)`` when request ``i`` is handed to an engine thread, ``end(i, outcome)``
    when it ended; a request started or ended twice is counted in ``twice``, one that
    never ends is ``unaccounted``.
    """

    _NEW, _RUNNING, _ENDED = 0, 1, 2

    def __init__(self, requests: int) -> None:
        self.requests = requests
        self._state = bytearray(requests)
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.twice = 0

    def start(self, index: int) -> None:
        with self._lock:
            if self._state[index] != self._NEW:
                self.twice += 1
                return
            self._state[index] = self._RUNNING

    def end(self, index: int, outcome: str) -> None:
        with self._lock:
            if self._state[index] != self._RUNNING:
                self.twice += 1
                return
            self._state[index] = self._ENDED
            self.outcomes[outcome] += 1

    @property
    def ended(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())

    @property
    def unaccounted(self) -> int:
        """Requests without an outcome: started and never ended, or never run."""
        return self.requests - self.ended


def classify(exc: BaseException) -> str:
    """A request's outcome when it ended with ``exc``: a typed error by class, or untyped."""
    if isinstance(exc, RemoteError):
        return f"{TYPED}RemoteError ({exc.failure.type_name})"
    if isinstance(exc, RpcFailed):
        kinds = sorted({f.type_name for f in exc.failures.values()})
        return f"{TYPED}RpcFailed ({', '.join(kinds)})"
    if isinstance(exc, OmniAsyncError):
        return f"{TYPED}{type(exc).__name__}"
    return f"{UNTYPED}{type(exc).__name__}"


# ------------------------------------------------------------------------------ executors


def _rss_kib(pid: int) -> tuple[int, int] | None:
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
    ``(VmRSS, RssAnon)`` in KiB (``_rss_kib``), None where the run never got there.

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

    def vm_rss_kib(self) -> list[int]:
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

    def call(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
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
        self.rss_start = {pid: _rss_kib(pid) for pid in self.pids}
        if predecessor is not None and predecessor.failed_at is not None:
            self.spare_ready = self.built_at <= predecessor.failed_at

    def dispatch(self) -> None:
        """One more request goes to this executor (slot thread)."""
        self.dispatched += 1
        if self.dispatched == WARMUP_REQUESTS + 1:
            self.rss_warm = {pid: _rss_kib(pid) for pid in self.pids}

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
            self.rss_last[victim] = _rss_kib(victim)  # its life's end, for the RSS check
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
            end = self.rss_last[pid] if pid in self.rss_last else _rss_kib(pid)
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


# ------------------------------------------------------------------------------ one request

_DIGEST_WEIGHTS = np.arange(1, 252, dtype=np.int64)  # image_digest's weights: byte i counts (i % 251) + 1


def host_digest(t: torch.Tensor) -> int:
    """``int(image_digest(t))`` for a tensor on the host, without its temporaries.

    ``image_digest`` widens every byte to int64 and multiplies by a weight tensor as
    long: three 8-byte temporaries per byte of the image (24 MiB for a 1 MiB image), on
    each of the soak's engine threads.  glibc serves such sizes from the thread's arena
    once its mmap threshold has risen past them, and keeps them: that, not the library,
    was most of the driver's RSS growth (defect 15).  Here the bytes are summed per
    weight (column sums of a ``(-1, 251)`` view, in numpy's small buffers), then weighted:
    the same exact integer.
    """
    if t.device.type != "cpu":
        return int(image_digest(t))
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    whole = raw.size - raw.size % 251
    total = 0
    if whole:
        total = int(np.add.reduce(raw[:whole].reshape(-1, 251), axis=0, dtype=np.int64) @ _DIGEST_WEIGHTS)
    rest = raw[whole:]
    if rest.size:
        total += int(rest.astype(np.int64) @ _DIGEST_WEIGHTS[: rest.size])
    return total  # no wrap: under 2**63 for any image below 32 TiB


def _intact(out: DiffusionOutput, plan: Plan) -> bool:
    image = out.output["image"]
    return bool(
        out.request_id == plan.request_id
        and tuple(image.shape) == (plan.height, WIDTH)
        and host_digest(image) == int(out.output["digest"])
        and len(out.output["latents"]) == (plan.steps if plan.keep_trajectory else 0)
    )


def _consume(life: Life, out: DiffusionOutput, plan: Plan) -> str:
    intact = _intact(out, plan)
    life.ex.release_output(out)
    return RESULT if intact else CHANGED


def _request(plan: Plan, life: Life, output_timeout: float) -> str:
    """Run one request as its plan says; returns its outcome (raises what ended it otherwise)."""
    ex, fault = life.ex, plan.fault
    consumer = f"soak-consumer-{plan.index}" if fault == "consumer-gone" else None
    call = ex.submit_request(plan.request(), consumer=consumer)
    if fault == "kill":
        life.kill_one(random.Random(plan.index))
    if fault == "cancel-call":
        time.sleep(plan.delay)
        if call.cancel():
            return CANCELLED
    if consumer is not None:
        if plan.early:
            ex.release_consumer(consumer)
        try:
            oid = call.result(timeout=WAIT_S).async_output_id
        except OutputDropped:
            return CONSUMER_GONE  # gone before the call resolved
        ex.release_consumer(consumer)
        assert oid is not None
        try:
            ex.release_output(ex.wait_output_ready(oid).result(timeout=WAIT_S))
        except OutputError as exc:
            if isinstance(exc, OutputDropped) or type(exc) is OutputError:  # abandoned, or released already
                return CONSUMER_GONE
            raise
        raise AssertionError(f"{plan.request_id}: delivered after its consumer was released")  # untyped: fails
    oid = call.result(timeout=WAIT_S).async_output_id
    assert oid is not None
    if fault == "abort" and plan.early:
        ex.drop_output(oid).result(timeout=WAIT_S)
        return ABORTED
    if fault == "expire":
        time.sleep(output_timeout + 0.25)
    waiter = ex.wait_output_ready(oid)
    if fault == "cancel-wait":
        time.sleep(plan.delay)
        if waiter.cancel():
            return CANCELLED
    elif fault == "tight-wait":
        try:
            return _consume(life, waiter.result(timeout=plan.delay), plan)
        except TimeoutError as exc:
            if isinstance(exc, OmniAsyncError):  # OutputTimeout: the executor's deadline, an outcome
                raise
            if waiter.cancel():  # abandoned: the executor releases it on arrival
                return CANCELLED
    elif fault == "abort":
        time.sleep(plan.delay)
        ex.drop_output(oid).result(timeout=WAIT_S)
        err = waiter.exception(timeout=WAIT_S)
        if isinstance(err, OutputDropped):
            return ABORTED
        if err is not None:
            raise err
        return _consume(life, waiter.result(), plan)  # delivered before the drop
    return _consume(life, waiter.result(timeout=WAIT_S), plan)


def _engine_request(plan: Plan, life: Life, eng: EngineThread) -> str:
    """Run one request through the life's engine as its plan says (``ENGINE_FAULTS``)."""
    fault, rid = plan.fault, plan.request_id
    deadlines = None
    tight = max(plan.delay, 1e-4)  # a deadline must be > 0
    if fault == "tight-wait":
        deadlines = attrs.evolve(life.deadlines, compute_timeout=tight)
    elif fault == "expire":
        deadlines = attrs.evolve(life.deadlines, output_timeout=tight)
    call = eng.call(eng.generate(plan.request(), deadlines))
    if fault == "kill":
        life.kill_one(random.Random(plan.index))
    elif fault in ("cancel-call", "cancel-wait"):
        if fault == "cancel-wait":
            time.sleep(plan.delay)
        if call.cancel():
            return CANCELLED
    elif fault in ("abort", "consumer-gone"):
        if not plan.early:
            time.sleep(plan.delay)
        eng.call(eng.engine.abort(rid, wait=fault == "consumer-gone")).result(timeout=WAIT_S)
        if fault == "consumer-gone" and not eng.call(eng.gone(rid)).result(timeout=WAIT_S):
            raise AssertionError(f"{rid}: still in the engine after abort(wait=True)")  # untyped: fails
    try:
        result = call.result(timeout=WAIT_S)
    except RequestAborted:
        if fault in ("abort", "consumer-gone"):
            return ABORTED
        raise
    return RESULT if _intact_result(result, plan) else CHANGED


def _intact_result(result: GenerationResult, plan: Plan) -> bool:
    """The engine's result (an owned copy of the output): the bytes the worker computed."""
    out = result.output
    image = out["image"]
    return bool(
        result.request_id == plan.request_id
        and tuple(image.shape) == (plan.height, WIDTH)
        and host_digest(image) == int(out["digest"])
        and len(out["latents"]) == (plan.steps if plan.keep_trajectory else 0)
    )


def _task(plan: Plan, life: Life, acc: Accounting, output_timeout: float) -> None:
    """An engine thread's job: one request, exactly one outcome, whatever happens."""
    try:
        if life.engine is not None:
            outcome = _engine_request(plan, life, life.engine)
        else:
            outcome = _request(plan, life, output_timeout)
    except BaseException as exc:  # noqa: BLE001  # every ending is an outcome, the unexpected ones too
        outcome = classify(exc)
        if isinstance(exc, WorkerDied):
            life.mark_failed()
    acc.end(plan.index, outcome)


# ------------------------------------------------------------------------------ the table


@attrs.frozen
class Row:
    """One line of the table: a name, its value, and whether it passed (None: not a check)."""

    name: str
    value: str
    ok: bool | None = None


def build_rows(
    acc: Accounting,
    lives: Sequence[LifeReport],
    faults: Mapping[str, int],
    *,
    elapsed_s: float,
    rss_bound_mib: int,
    driver: DriverMemory | None = None,
    driver_rss_bound_mib: int = DRIVER_RSS_BOUND_MIB,
    executors: int = 1,
    start_failures: Sequence[str] = (),
    engine: bool = False,
) -> list[Row]:
    """The table the soak prints (and writes as JSON): outcomes, faults, then the checks.

    ``lives``: every executor's report, unused spares included (each checked like the
    others).  ``driver``: this process's memory over the run (None: no driver check, a
    unit test's table); its RssAnon growth after the warm-up is checked against
    ``driver_rss_bound_mib``.  ``start_failures``: executors that failed to start, in words.
    ``engine``: the requests went through engines (``--engine``): add each engine's checks.
    """
    rows = [Row("requests", str(acc.requests))]
    rows += [Row(f"  {outcome}", str(n)) for outcome, n in sorted(acc.outcomes.items())]
    rows += [Row(f"  fault injected: {fault}", str(n)) for fault, n in sorted(faults.items())]
    changed = acc.outcomes[CHANGED]
    untyped = sum(n for o, n in acc.outcomes.items() if o.startswith(UNTYPED))
    not_empty = sum(1 for life in lives if not life.registry_empty)
    incomplete = sum(1 for life in lives if life.leases_outstanding)
    files = sum(life.files_left for life in lives)
    growth = max((life.rss_growth_kib for life in lives), default=0)
    warm = [life.anon_growth_kib for life in lives if life.anon_growth_kib is not None]
    anon = max(warm, default=0)
    n = len(lives)
    killed = sum(1 for life in lives if life.killed)
    unused = sum(1 for life in lives if not life.used)
    replacements = [life for life in lives if life.spare_ready is not None]
    ready = sum(1 for life in replacements if life.spare_ready)
    waits = _restart_waits(lives)
    rows += [
        Row("requests unaccounted", str(acc.unaccounted), acc.unaccounted == 0),
        Row("requests recorded twice", str(acc.twice), acc.twice == 0),
        Row("results with changed bytes", str(changed), changed == 0),
        Row("untyped errors", str(untyped), untyped == 0),
        Row("registry empty", f"{n - not_empty} of {n} executors", not_empty == 0),
        Row("pool complete (no lease out)", f"{n - incomplete} of {n} executors", incomplete == 0),
        Row("segments left in /dev/shm", str(files), files == 0),
        Row(
            "worker RSS growth (RssAnon)",
            f"{anon / 1024:.1f} MiB, bound {rss_bound_mib} ({len(warm)} of {n})",
            anon < rss_bound_mib * 1024,
        ),
        Row("executors that failed to start", str(len(start_failures)), not start_failures),
    ]
    if driver is not None:
        rows.append(_driver_row(driver, driver_rss_bound_mib))
    if engine:
        engines = [life for life in lives if life.engine_accepted is not None]
        accepted = sum(life.engine_accepted or 0 for life in engines)
        counted = sum(life.engine_outcomes or 0 for life in engines)
        unequal = sum(1 for life in engines if life.engine_outcomes != life.engine_accepted)
        left = sum(life.engine_left or 0 for life in engines)
        rows += [
            Row(
                "engine: one outcome per request",
                f"{counted} of {accepted} ({len(engines) - unequal} of {len(engines)} engines)",
                unequal == 0 and len(engines) == len(lives),
            ),
            Row("engine: requests held at the end", str(left), left == 0),
        ]
    rows += [
        Row("worker RSS growth (VmRSS)", f"{growth / 1024:.1f} MiB"),
        Row(
            "driver VmRSS (start, 10%, last request, end)",
            " -> ".join(f"{k / 1024:.0f}" for k in driver.vm_rss_kib()) + " MiB" if driver is not None else "-",
        ),
        Row(
            "executors started",
            f"{n} on {executors} slot{'s' if executors != 1 else ''} ({killed} killed, {unused} spares unused)",
        ),
        Row("spares ready when a worker died", f"{ready} of {len(replacements)}"),
        Row(
            "worker death to next request (mean, max)",
            f"{sum(waits) / len(waits):.2f} s, {max(waits):.2f} s" if waits else "-",
        ),
        Row("elapsed", f"{elapsed_s:.1f} s"),
        Row("requests/s", f"{acc.ended / elapsed_s:.1f}" if elapsed_s > 0 else "-"),
    ]
    return rows


def _driver_row(driver: DriverMemory, bound_mib: int) -> Row:
    growth = driver.growth_kib()
    name = "driver RSS growth after warm-up (RssAnon)"
    if growth is None:  # interrupted before the warm-up ended: nothing to judge
        return Row(name, f"-, bound {bound_mib} MiB")
    per_1000 = driver.per_1000_kib()
    rate = "" if per_1000 is None else f", {per_1000 / 1024:.2f} MiB per 1000 requests"
    return Row(name, f"{growth / 1024:.1f} MiB{rate}, bound {bound_mib} MiB", growth < bound_mib * 1024)


def _restart_waits(lives: Sequence[LifeReport]) -> list[float]:
    """Seconds from each failed life's worker death to its replacement's first request (same slot)."""
    by_slot: dict[int, list[tuple[float, LifeReport]]] = {}
    for life in lives:
        if life.live_s is not None:
            by_slot.setdefault(life.slot, []).append((life.live_s, life))
    waits = []
    for slot_lives in by_slot.values():
        slot_lives.sort(key=lambda pair: pair[0])
        for (_, before), (live_s, _) in itertools.pairwise(slot_lives):
            if before.failed_s is not None:
                waits.append(live_s - before.failed_s)
    return waits


def render(rows: Sequence[Row]) -> Table:
    table = Table(title="omni-async soak")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_column("check")
    for row in rows:
        table.add_row(row.name, row.value, "" if row.ok is None else ("ok" if row.ok else "FAIL"))
    return table


# ------------------------------------------------------------------------------ the run


def run(args: argparse.Namespace) -> int:
    console = Console()
    # The executors log each killed worker: above the progress bar, not through it.
    handler = RichHandler(console=console, show_path=False, level=logging.WARNING)
    package_log = logging.getLogger("omni_async")
    package_log.addHandler(handler)
    try:
        return _run(args, console)
    except KeyboardInterrupt:  # every executor was checked and shut down on the way out
        console.print("soak interrupted: no table (the requests did not all run)")
        return 130
    finally:
        package_log.removeHandler(handler)


class _Soak:
    """The state the slots share: the plan sequence, the accounting, the lives' reports.

    Request ``i``'s plan is ``plan_request(seed, fault_rate, i)`` whichever slot draws it.
    Each slot (``--executors``) runs one executor life at a time from its own
    ``--concurrency`` engine threads, with the next executor for the slot already being
    built in the background (the warm spare, while a planned kill is still to be handed
    out): when a worker dies the slot goes on with the spare at once, starts building the
    next one, and hands the dead life to a retiring thread that lets its requests in
    flight end, checks it and shuts it down.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.acc = Accounting(args.requests)
        self.faults: Counter[str] = Counter()
        self.t0 = time.monotonic()
        self.driver_start = _rss_kib(os.getpid()) or (0, 0)
        self.driver_warm: tuple[int, int] | None = None
        self.driver_last: tuple[int, int] | None = None
        self.warm_index = args.requests // 10
        self._lock = threading.Lock()
        self._next = 0
        self._last_kill = last_kill(args.seed, args.fault_rate, args.requests)
        self._stopped = False
        self._serial = 0
        self.reports: list[LifeReport] = []
        self.start_failures: list[str] = []
        self.lives_live = 0
        executors = args.executors
        self._builders = ThreadPoolExecutor(executors, thread_name_prefix="soak-build")
        self._retirers = ThreadPoolExecutor(2 * executors, thread_name_prefix="soak-retire")
        self._retiring: list[Future[None]] = []

    # -------------------------------------------------------------- the plan sequence

    def take(self) -> Plan | None:
        """The next request's plan, started in the accounting (None: no more)."""
        with self._lock:
            if self._stopped or self._next >= self.args.requests:
                return None
            i = self._next
            self._next += 1
            plan = plan_request(self.args.seed, self.args.fault_rate, i)
            self.faults[plan.fault or "none"] += 1
        if i == self.warm_index:
            self.driver_warm = _rss_kib(os.getpid())
        if i == self.args.requests - 1:
            self.driver_last = _rss_kib(os.getpid())
        self.acc.start(i)
        return plan

    def kill_ahead(self) -> bool:
        """Whether a planned kill is still to be handed out (a spare may be needed)."""
        with self._lock:
            return not self._stopped and self._next <= self._last_kill

    def stop(self) -> None:
        """Hand out no more requests (Ctrl-C): the slots end what is in flight and retire."""
        with self._lock:
            self._stopped = True

    # -------------------------------------------------------------- executors

    def _build(self, slot: int) -> Life:
        with self._lock:
            self._serial += 1
            serial = self._serial
        return Life(self.args, slot=slot, serial=serial, t0=self.t0)

    def _spare(self, slot: int) -> Future[Life]:
        return self._builders.submit(self._build, slot)

    def _retire(self, life: Life, pending: set[Future[None]]) -> None:
        """Let the life's requests end, then check it and shut it down (retiring thread)."""
        for f in wait(pending).done:
            f.result()  # _task never raises; a bug in it must not pass silently
        report = life.end()
        with self._lock:
            self.reports.append(report)

    def _retire_spare(self, spare: Future[Life]) -> None:
        """A spare nobody needed: wait for it to be built, then check and shut it down too."""
        try:
            life = spare.result()
        except Exception as exc:  # noqa: BLE001  # reported: the table fails on it
            self._start_failed(exc)
            return
        self._retire(life, set())

    def _later(self, fn: Callable[..., None], *args: object) -> None:
        with self._lock:
            self._retiring.append(self._retirers.submit(fn, *args))

    def _start_failed(self, exc: BaseException) -> None:
        with self._lock:
            self.start_failures.append(f"{type(exc).__name__}: {exc}")

    # -------------------------------------------------------------- one slot

    def slot(self, slot: int) -> None:
        """One slot's driver thread: its lives one after the other, each fed from the shared sequence."""
        concurrency = self.args.concurrency
        # Room for the requests still in flight on a dead life beside the new life's.
        engines = ThreadPoolExecutor(2 * concurrency, thread_name_prefix=f"soak-engine-{slot}")
        spare: Future[Life] | None = None
        life: Life | None = None
        pending: set[Future[None]] = set()
        try:
            while True:
                if life is None or life.failed.is_set():
                    if life is not None:
                        self._later(self._retire, life, pending)
                        pending = set()
                    if spare is None:  # a death no plan asked for (or the first life): build now
                        spare = self._spare(slot)
                    try:
                        new = spare.result()
                    except Exception as exc:  # noqa: BLE001  # reported: the table fails on it
                        spare, life = None, None
                        self._start_failed(exc)
                        return  # the other slots take this one's share
                    # Build the next one while this one runs, unless no planned kill is left
                    # that could end it: then a spare would only be built to be shut down.
                    spare = self._spare(slot) if self.kill_ahead() else None
                    new.go_live(life)
                    life = new
                    with self._lock:
                        self.lives_live += 1
                while len(pending) >= concurrency:
                    done, rest = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        f.result()  # _task never raises; a bug in it must not pass silently
                    pending = set(rest)
                if life.failed.is_set():
                    continue
                plan = self.take()
                if plan is None:
                    return
                life.dispatch()
                pending.add(engines.submit(_task, plan, life, self.acc, self.args.output_timeout))
        finally:
            if life is not None:
                self._later(self._retire, life, pending)
            if spare is not None:
                self._later(self._retire_spare, spare)
            engines.shutdown(wait=True)

    def finish(self) -> None:
        """Wait for every retirement (every slot has returned); raise what a retirement raised."""
        self._builders.shutdown(wait=True)
        self._retirers.shutdown(wait=True)
        for f in self._retiring:
            f.result()


def _run(args: argparse.Namespace, console: Console) -> int:
    state = _Soak(args)
    acc = state.acc
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with ThreadPoolExecutor(args.executors, thread_name_prefix="soak-slot") as slots, Progress(
        *columns, console=console
    ) as progress:
        bar = progress.add_task("soak", total=args.requests)
        slot_futures = [slots.submit(state.slot, k) for k in range(args.executors)]
        running = set(slot_futures)
        try:
            while running:
                running = set(wait(running, timeout=0.25).not_done)
                progress.update(
                    bar,
                    completed=acc.ended,
                    description=(
                        f"{args.executors} executors, {state.lives_live} lives, {acc.outcomes[RESULT]} results"
                    ),
                )
        except BaseException:
            state.stop()  # Ctrl-C: end what is in flight, check and shut every executor down
            raise
        finally:
            wait(running)
            try:
                for f in slot_futures:
                    f.result()  # a slot raises only on a bug in the soak itself
            finally:
                state.finish()
    elapsed = time.monotonic() - state.t0
    driver = DriverMemory(
        start=state.driver_start,
        warm=state.driver_warm,
        last=state.driver_last,
        end=_rss_kib(os.getpid()),
        warm_index=state.warm_index,
        requests=args.requests,
    )
    lives = sorted(state.reports, key=lambda r: r.serial)
    rows = build_rows(
        acc,
        lives,
        {k: v for k, v in state.faults.items() if k != "none"},
        elapsed_s=elapsed,
        rss_bound_mib=args.rss_bound_mib,
        driver=driver,
        driver_rss_bound_mib=args.driver_rss_bound_mib,
        executors=args.executors,
        start_failures=state.start_failures,
        engine=args.engine,
    )
    ok = all(row.ok is not False for row in rows)
    console.print(render(rows))
    for life in lives:
        for problem in life.problems(args.rss_bound_mib):
            console.print(f"{life.name()}: {problem}")
    for failure in state.start_failures:
        console.print(f"an executor failed to start: {failure}")
    growth = driver.growth_kib()
    if growth is not None and growth >= args.driver_rss_bound_mib * 1024:
        console.print(
            f"the driver's RssAnon grew {growth / 1024:.1f} MiB after its warm-up (request {state.warm_index}), "
            f"bound {args.driver_rss_bound_mib} MiB (--driver-rss-bound-mib)"
        )
    console.print(
        f"soak {'passed' if ok else 'FAILED'}: {acc.requests} requests, {len(lives)} executors "
        f"on {args.executors} slot{'s' if args.executors != 1 else ''}"
        + (", through AsyncDiffusionEngine" if args.engine else "")
    )
    if args.json is not None:
        report = _as_json(args, rows, acc, state.faults, ok)
        report["lives"] = [_life_json(life, args.rss_bound_mib) for life in lives]
        report["start_failures"] = list(state.start_failures)
        report["driver"] = {
            **attrs.asdict(driver),
            "growth_kib": driver.growth_kib(),
            "per_1000_kib": driver.per_1000_kib(),
            "bound_mib": args.driver_rss_bound_mib,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if ok else 1


def _life_json(life: LifeReport, rss_bound_mib: int) -> dict[str, object]:
    return {**attrs.asdict(life), "problems": life.problems(rss_bound_mib)}


def _as_json(
    args: argparse.Namespace, rows: Sequence[Row], acc: Accounting, faults: Mapping[str, int], ok: bool
) -> dict[str, object]:
    argv = ["omni-async", *sys.argv[1:]] if sys.argv[1:2] == ["soak"] else ["omni-async", "soak"]
    return {
        "command": shlex.join(argv),
        "ok": ok,
        "rows": [{"name": r.name.strip(), "value": r.value, "check": None if r.ok is None else r.ok} for r in rows],
        "outcomes": dict(sorted(acc.outcomes.items())),
        "faults": dict(sorted(faults.items())),
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in sorted(vars(args).items())
            if k not in ("subparser", "check", "run")
        },
    }
