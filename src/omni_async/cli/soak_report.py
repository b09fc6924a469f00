"""The soak's report: the table of checks (``build_rows``, ``render``) and the JSON
report (``as_json``, ``life_json``)."""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
from rich.table import Table

from omni_async.cli.parsers import DRIVER_RSS_BOUND_MIB
from omni_async.cli.soak_lives import DriverMemory, LifeReport
from omni_async.cli.soak_plans import CHANGED, UNTYPED, Accounting

__all__ = ["Row", "as_json", "build_rows", "life_json", "render"]


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
            " -> ".join(f"{k / 1024:.0f}" for k in driver.vmrss_kib()) + " MiB" if driver is not None else "-",
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


def life_json(life: LifeReport, rss_bound_mib: int) -> dict[str, object]:
    return {**attrs.asdict(life), "problems": life.problems(rss_bound_mib)}


def as_json(
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
