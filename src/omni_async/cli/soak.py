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
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import attrs
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from omni_async.cli.parsers import DRIVER_RSS_BOUND_MIB as DRIVER_RSS_BOUND_MIB
from omni_async.cli.parsers import WARMUP_REQUESTS as WARMUP_REQUESTS
from omni_async.cli.parsers import add_soak as add_parser
from omni_async.cli.soak_lives import DriverMemory, Life, LifeReport, rss_kib
from omni_async.cli.soak_plans import (
    CANCELLED,
    ENGINE_FAULTS,
    FAULTS,
    RESULT,
    WIDTH,
    Accounting,
    Plan,
    classify,
    plan_request,
)
from omni_async.cli.soak_report import Row, as_json, build_rows, life_json, render
from omni_async.cli.soak_requests import engine_request, executor_request, host_digest
from omni_async.core.errors import WorkerDied

# Parts of the soak, by concern: ``soak_plans`` (the plans, the accounting),
# ``soak_lives`` (executor lives, the driver's memory), ``soak_requests`` (one request),
# ``soak_report`` (the table, the JSON); this module runs it.  The names the soak's
# users and tests reach through ``omni_async.cli.soak`` stay importable here.
__all__ = [
    "CANCELLED",
    "DRIVER_RSS_BOUND_MIB",
    "ENGINE_FAULTS",
    "FAULTS",
    "RESULT",
    "WARMUP_REQUESTS",
    "WIDTH",
    "Accounting",
    "DriverMemory",
    "Life",
    "LifeReport",
    "Plan",
    "Row",
    "add_parser",
    "build_rows",
    "host_digest",
    "plan_request",
    "run",
]


def last_kill(seed: int, fault_rate: float, requests: int) -> int:
    """The index of the last request whose plan is a kill (-1: none); reads the plans
    backwards, so it costs about ``1 / P(kill)`` plans, not ``requests``."""
    if fault_rate == 0.0:
        return -1
    for index in range(requests - 1, -1, -1):
        if plan_request(seed, fault_rate, index).fault == "kill":
            return index
    return -1


def _task(plan: Plan, life: Life, acc: Accounting, output_timeout: float) -> None:
    """An engine thread's job: one request, exactly one outcome, whatever happens."""
    try:
        if life.engine is not None:
            outcome = engine_request(plan, life, life.engine)
        else:
            outcome = executor_request(plan, life, output_timeout)
    except BaseException as exc:  # noqa: BLE001  # every ending is an outcome, the unexpected ones too
        outcome = classify(exc)
        if isinstance(exc, WorkerDied):
            life.mark_failed()
    acc.end(plan.index, outcome)


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
        self.driver_start = rss_kib(os.getpid()) or (0, 0)
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
            self.driver_warm = rss_kib(os.getpid())
        if i == self.args.requests - 1:
            self.driver_last = rss_kib(os.getpid())
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
    with (
        ThreadPoolExecutor(args.executors, thread_name_prefix="soak-slot") as slots,
        Progress(*columns, console=console) as progress,
    ):
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
        end=rss_kib(os.getpid()),
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
        report = as_json(args, rows, acc, state.faults, ok)
        report["lives"] = [life_json(life, args.rss_bound_mib) for life in lives]
        report["start_failures"] = list(state.start_failures)
        report["driver"] = {
            **attrs.asdict(driver),
            "growth_kib": driver.growth_kib(),
            "per_1000_kib": driver.per_1000_kib(),
            "bound_mib": args.driver_rss_bound_mib,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if ok else 1
