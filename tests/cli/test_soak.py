"""``omni-async soak``: a short soak as a user runs it, and the accounting that judges it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from omni_async import cli
from omni_async.cli import soak
from omni_async.transport.shm.files import entries


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["rows"]}


@pytest.mark.slow
def test_a_short_soak_with_faults_accounts_for_every_request(tmp_path: Path) -> None:
    """300 requests, a tenth of them faulty (two worker kills among them with seed 1), in about
    20 s: exit status 0, and the table says every request ended in one outcome, every
    executor was left clean, and nothing is left in /dev/shm."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "omni_async.cli", "soak", "--requests", "300", "--fault-rate", "0.1", "--seed", "1"]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("requests unaccounted", "segments left in /dev/shm", "registry empty", "soak passed: 300 requests"):
        assert line in done.stdout, done.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["command"].startswith("omni-async soak --requests 300")
    rows = _rows(report)
    assert rows["requests unaccounted"]["value"] == "0" and rows["requests unaccounted"]["check"] is True
    assert rows["segments left in /dev/shm"]["value"] == "0"
    checks = {name: row["check"] for name, row in rows.items() if row["check"] is not None}
    assert len(checks) == 10 and all(checks.values()), checks
    assert rows["driver RSS growth after warm-up (RssAnon)"]["value"].endswith(", bound 64 MiB")
    driver = report["driver"]
    assert driver["warm_index"] == 30 and driver["requests"] == 300 and driver["bound_mib"] == 64
    assert driver["growth_kib"] is not None and driver["growth_kib"] < 64 << 10
    assert sum(report["outcomes"].values()) == 300
    assert report["outcomes"]["result"] > 200
    # A kill ends its executor; a second kill drawn before the soak noticed finds it ended.
    # With one slot every spare is used: one is built only while a planned kill lies ahead.
    executors = int(rows["executors started"]["value"].split()[0])
    assert 2 <= executors <= report["faults"]["kill"] + 1
    assert all(life["used"] for life in report["lives"])
    assert executors == 1 + sum(1 for life in report["lives"] if life["killed"])
    typed = {o for o in report["outcomes"] if o.startswith("typed error")}
    assert "typed error: WorkerDied" in typed and "typed error: RpcFailed (RuntimeError)" in typed


@pytest.mark.slow
def test_a_short_soak_through_the_engine_passes_every_check_and_the_engines_own(tmp_path: Path) -> None:
    """--engine: 150 requests, a fifth of them faulty with seed 1 (two worker kills among
    them), through an AsyncDiffusionEngine over each executor, in about 10 s: every check
    passes, the engines' own included (each accepted request ended in one of its outcomes,
    none held at the end), and aborts and cancelled generate tasks did happen."""
    out = tmp_path / "engine.json"
    argv = ["soak", "--engine", "--requests", "150", "--fault-rate", "0.2", "--seed", "1", "--json", str(out)]
    done = subprocess.run([sys.executable, "-m", "omni_async.cli", *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "soak passed: 150 requests" in done.stdout and "through AsyncDiffusionEngine" in done.stdout, done.stdout
    report = json.loads(out.read_text())
    rows = _rows(report)
    checks = {name: row["check"] for name, row in rows.items() if row["check"] is not None}
    assert len(checks) == 12 and all(checks.values()), checks
    assert rows["engine: requests held at the end"]["value"] == "0"
    lives = report["lives"]
    assert rows["engine: one outcome per request"]["value"].endswith(f"({len(lives)} of {len(lives)} engines)")
    assert sum(life["engine_accepted"] for life in lives) == sum(life["engine_outcomes"] for life in lives) > 100
    assert sum(report["outcomes"].values()) == 150 and report["outcomes"]["result"] > 90
    assert report["faults"]["kill"] >= 1 and any(life["killed"] for life in lives)
    assert "typed error: WorkerDied" in report["outcomes"]
    assert report["outcomes"]["aborted"] > 0 and report["outcomes"]["cancelled"] > 0
    for life in lives:
        _gone(life)


def _gone(life: dict[str, Any]) -> None:
    """The executor of this life left nothing: no name under /dev/shm, no worker process."""
    assert life["prefix"] and not entries(life["prefix"]), life
    for pid in life["pids"]:
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} of {life['prefix']} still runs"


@pytest.mark.slow
def test_two_executors_side_by_side_a_kill_served_by_the_spare_and_an_unused_spare_shut_down(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--executors 2 over the seed's own plans (faults at a rate of 0.1), except one kill,
    at request 80, and no other kill or expired claim (they only add time).  The first
    requests wait until the two spares have been built (so that the test does not depend on
    how fast this machine starts executors).  Then: every check passes; the killed slot
    goes on with its spare, whose construction ended before the worker died (a soak that
    builds the replacement after the death fails here); and the other slot's spare, never
    used, was checked and shut down like the lives: registry empty, no lease out, nothing
    in /dev/shm, workers gone."""
    real_plan = soak.plan_request

    def one_kill(seed: int, fault_rate: float, index: int) -> soak.Plan:
        plan = real_plan(seed, fault_rate, index)
        if index == 80:
            return attrs.evolve(plan, fault="kill")
        return attrs.evolve(plan, fault=None) if plan.fault in ("kill", "expire") else plan

    built: list[soak.Life] = []
    real_init, real_dispatch = soak.Life.__init__, soak.Life.dispatch

    def init(self: soak.Life, args: argparse.Namespace, **kw: Any) -> None:
        real_init(self, args, **kw)
        built.append(self)

    def dispatch_once_spares_built(self: soak.Life) -> None:
        if self.serial <= 2 and self.dispatched == 0:  # the first request of each slot
            deadline = time.monotonic() + 60.0  # a spare takes seconds; without one, go on and fail below
            while len(built) < 4 and time.monotonic() < deadline:  # two lives, two spares
                time.sleep(0.01)
        real_dispatch(self)

    monkeypatch.setattr(soak, "plan_request", one_kill)
    monkeypatch.setattr(soak.Life, "__init__", init)
    monkeypatch.setattr(soak.Life, "dispatch", dispatch_once_spares_built)
    out = tmp_path / "two.json"
    argv = ["soak", "--requests", "160", "--fault-rate", "0.1", "--seed", "3", "--executors", "2"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = _rows(report)
    assert report["ok"] is True and sum(report["outcomes"].values()) == 160
    assert all(row["check"] for row in report["rows"] if row["check"] is not None)
    assert report["faults"]["kill"] == 1 and len(report["faults"]) > 3
    assert rows["executors started"]["value"] == "4 on 2 slots (1 killed, 1 spares unused)"
    lives = report["lives"]  # by the order their construction began
    assert sum(life["requests"] for life in lives) == 160
    (dead,) = [life for life in lives if life["killed"]]
    (spare,) = [life for life in lives if not life["used"]]
    (replacement,) = [life for life in lives if life["serial"] > 2 and life["used"]]
    assert replacement["slot"] == dead["slot"] != spare["slot"] and dead["requests"] >= 1
    assert replacement["built_s"] <= dead["failed_s"] <= replacement["live_s"], "replacement built after the death"
    assert replacement["spare_ready"] is True and rows["spares ready when a worker died"]["value"] == "1 of 1"
    assert spare["requests"] == 0 and spare["live_s"] is None and spare["anon_growth_kib"] is None
    assert spare["registry_empty"] and spare["leases_outstanding"] == 0 and spare["files_left"] == 0
    for life in lives:
        _gone(life)


def _lost(requests: int, lost: int) -> soak.Accounting:
    acc = soak.Accounting(requests)
    for i in range(requests):
        acc.start(i)
        if i != lost:
            acc.end(i, soak.RESULT)
    return acc


def _checks(acc: soak.Accounting) -> dict[str, bool | None]:
    rows = soak.build_rows(acc, [], {}, elapsed_s=1.0, rss_bound_mib=64)
    return {row.name: row.ok for row in rows}


def test_the_accounting_catches_a_request_that_vanishes() -> None:
    acc = _lost(5, lost=3)
    assert acc.unaccounted == 1 and acc.ended == 4
    assert _checks(acc)["requests unaccounted"] is False
    assert _checks(_lost(5, lost=-1))["requests unaccounted"] is True


def test_the_accounting_catches_a_request_recorded_twice() -> None:
    acc = _lost(3, lost=-1)
    acc.end(1, soak.CANCELLED)  # a second outcome for one request
    assert acc.twice == 1 and acc.outcomes == {soak.RESULT: 3}
    assert _checks(acc)["requests recorded twice"] is False


def test_the_engine_rows_catch_an_outcome_missing_and_a_request_held() -> None:
    acc = _lost(4, lost=-1)

    def engine_checks(accepted: int, outcomes: int, left: int) -> dict[str, bool | None]:
        life = soak.LifeReport(
            killed=False,
            registry_empty=True,
            leases_outstanding=0,
            files_left=0,
            rss_growth_kib=0,
            anon_growth_kib=None,
            engine_accepted=accepted,
            engine_outcomes=outcomes,
            engine_left=left,
        )
        rows = soak.build_rows(acc, [life], {}, elapsed_s=1.0, rss_bound_mib=64, engine=True)
        assert life.problems(64) == [] or not all(row.ok for row in rows if row.ok is not None)
        return {row.name: row.ok for row in rows}

    ok = engine_checks(4, 4, 0)
    assert ok["engine: one outcome per request"] is True and ok["engine: requests held at the end"] is True
    assert engine_checks(4, 3, 0)["engine: one outcome per request"] is False
    assert engine_checks(4, 4, 1)["engine: requests held at the end"] is False
    assert "engine: one outcome per request" not in _checks(acc)  # without --engine: no such row


def _driver(warm_anon: int, last_anon: int, end_anon: int | None) -> soak.DriverMemory:
    return soak.DriverMemory(
        start=(200_000, 150_000),
        warm=(250_000, warm_anon),
        last=(260_000, last_anon),
        end=None if end_anon is None else (240_000, end_anon),
        warm_index=1000,
        requests=10_000,
    )


def test_the_driver_row_checks_the_rssanon_growth_after_the_warm_up_against_its_bound() -> None:
    """Defect 15: the driver's growth is a check.  RssAnon from the warm-up (a tenth of
    the requests) to the larger of the last request's and the end's, under the bound."""
    acc = _lost(3, lost=-1)

    def driver_row(driver: soak.DriverMemory, bound: int = 64) -> soak.Row:
        rows = soak.build_rows(acc, [], {}, elapsed_s=1.0, rss_bound_mib=64, driver=driver, driver_rss_bound_mib=bound)
        (row,) = [r for r in rows if r.name == "driver RSS growth after warm-up (RssAnon)"]
        return row

    ok = driver_row(_driver(170_000, 180_000, 175_000))
    assert ok.ok is True and ok.value == "9.8 MiB, 1.09 MiB per 1000 requests, bound 64 MiB"
    assert driver_row(_driver(170_000, 170_000, 170_000 + (64 << 10))).ok is False, "the end counts too"
    assert driver_row(_driver(170_000, 170_000 + (64 << 10), None)).ok is False
    assert driver_row(_driver(170_000, 180_000, 175_000), bound=8).ok is False
    unfinished = attrs.evolve(_driver(0, 0, None), warm=None, last=None)
    assert driver_row(unfinished).ok is None, "interrupted before the warm-up ended: nothing judged"
    assert "driver RSS growth after warm-up (RssAnon)" not in {
        r.name for r in soak.build_rows(acc, [], {}, elapsed_s=1.0, rss_bound_mib=64)
    }


@pytest.mark.slow
def test_a_soak_whose_driver_keeps_memory_per_request_fails_its_driver_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The real run, with a driver that keeps 256 KiB per finished request (40 requests:
    about 9 MiB after the warm-up) and --driver-rss-bound-mib 4: exit status 1, the
    driver's row fails, the other checks pass, and the summary says why."""
    real = soak._task
    kept: list[bytes] = []

    def keeps_memory(plan: soak.Plan, life: soak.Life, acc: soak.Accounting, output_timeout: float) -> None:
        real(plan, life, acc, output_timeout)
        kept.append(os.urandom(256 << 10))  # touched pages: RssAnon

    monkeypatch.setattr(soak, "_task", keeps_memory)
    out = tmp_path / "leak.json"
    argv = ["soak", "--requests", "40", "--fault-rate", "0", "--driver-rss-bound-mib", "4", "--json", str(out)]
    assert cli.main([*argv]) == 1
    text = capsys.readouterr().out
    assert "soak FAILED" in text and "the driver's RssAnon grew" in text and "--driver-rss-bound-mib" in text
    report = json.loads(out.read_text())
    rows = _rows(report)
    row = rows["driver RSS growth after warm-up (RssAnon)"]
    assert row["check"] is False and row["value"].endswith("bound 4 MiB"), row
    assert report["driver"]["growth_kib"] >= 4 << 10 and report["driver"]["bound_mib"] == 4
    assert all(r["check"] for name, r in rows.items() if r["check"] is not None and name != row["name"])


@pytest.mark.slow
def test_a_soak_that_loses_a_request_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The real run, with one request whose ending is never recorded: exit status 1."""
    real = soak._task

    def loses_request_3(plan: soak.Plan, life: soak.Life, acc: soak.Accounting, output_timeout: float) -> None:
        if plan.index == 3:
            return  # ran nowhere, recorded nowhere: the request vanished
        real(plan, life, acc, output_timeout)

    monkeypatch.setattr(soak, "_task", loses_request_3)
    out = tmp_path / "lost.json"
    assert cli.main(["soak", "--requests", "8", "--fault-rate", "0", "--json", str(out)]) == 1
    assert "soak FAILED" in capsys.readouterr().out
    rows = _rows(json.loads(out.read_text()))
    assert rows["requests unaccounted"] == {"name": "requests unaccounted", "value": "1", "check": False}
    assert rows["segments left in /dev/shm"]["check"] is True  # only the accounting failed


def test_plans_are_a_function_of_seed_and_index() -> None:
    a = [soak.plan_request(7, 0.3, i) for i in range(2000)]
    assert a == [soak.plan_request(7, 0.3, i) for i in range(2000)]
    assert a != [soak.plan_request(8, 0.3, i) for i in range(2000)]
    faulty = [p for p in a if p.fault is not None]
    assert 0.25 < len(faulty) / len(a) < 0.35
    assert {p.fault for p in faulty} == set(soak.FAULTS)
    assert {p.height * soak.WIDTH * 4 <= 64 << 10 for p in a} == {True, False}  # inline and shared memory
    assert not any(p.fault for p in (soak.plan_request(7, 0.0, i) for i in range(500)))


BAD = [
    (["--fault-rate", "1.5"], "--fault-rate"),
    (["--fault-rate", "nan"], "--fault-rate"),
    (["--seed", "-1"], "--seed"),
    (["--concurrency", "0"], "--concurrency"),
    (["--executors", "0"], "--executors"),
    (["--requests", "0"], "--requests"),
    (["--output-timeout", "0"], "--output-timeout"),
    (["--json", "/no/such/dir/x.json"], "--json"),
]


@pytest.mark.parametrize(("argv", "option"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_one_error_line_before_anything_starts(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_run(args: argparse.Namespace) -> int:
        raise AssertionError(f"the soak started with {args}")

    monkeypatch.setattr(soak, "run", must_not_run)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["soak", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"omni-async soak: error: argument {option}: "), err


def test_the_help_says_what_happens_after_a_kill() -> None:
    soak_parser: argparse.ArgumentParser = cli.build_parser().parse_args(["soak"]).subparser
    text = " ".join(soak_parser.format_help().split())
    assert "WorkerDied is final" in text and "starts a new one" in text and "warm spare" in text
    assert "--rss-bound-mib" in text and "RssAnon" in text
    assert "--driver-rss-bound-mib" in text and f"(default: {soak.DRIVER_RSS_BOUND_MIB})" in text


def test_the_soaks_digest_is_image_digest_without_its_temporaries() -> None:
    """The soak checks every result's bytes on its engine threads; with image_digest's
    int64 temporaries (three of 8 MiB for a 1 MiB image) glibc kept that much in each
    thread's arena and the driver's RSS grew by hundreds of MiB (defect 15).  host_digest
    is the same integer, and allocates no tensor and a few KiB of numpy buffers."""
    import tracemalloc

    import torch
    from torch.profiler import ProfilerActivity, profile

    from omni_async.models.tiny import image_digest

    gen = torch.Generator().manual_seed(0)
    for n in (0, 1, 250, 251, 252, 64 * 8, 64 * 4096 + 3):
        t = torch.randn(n, generator=gen) * 100
        assert soak.host_digest(t) == int(image_digest(t)), n
    image = torch.randn(4096, soak.WIDTH, generator=gen)  # 1 MiB, the soak's largest
    assert soak.host_digest(image.to(torch.uint8)) == int(image_digest(image.to(torch.uint8)))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        soak.host_digest(image)
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert largest < 1 << 20, f"a tensor of {largest} bytes allocated to check a 1 MiB image"
    tracemalloc.start()
    try:
        soak.host_digest(image)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10, f"{peak} bytes traced for a 1 MiB image"
