"""The demo's figures and timelines as pure functions: percentiles, idle gaps between
forwards, speed-up, phases of a request, and the Chrome trace's events."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from omni_async.cli.figures import idle_gaps, percentile, speedup, summarize_mode, throughput
from omni_async.cli.timeline import Span, chrome_trace, forward_intervals, request_spans
from omni_async.engine.metrics import RequestTimings


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)  # numpy.percentile([1,2,3,4], 95)
    assert percentile([7.0], 95) == 7.0
    assert percentile(list(map(float, range(101))), 95) == 95.0


@pytest.mark.parametrize("q", [-1.0, 100.5, math.nan])
def test_percentile_refuses_q_outside_0_to_100(q: float) -> None:
    with pytest.raises(ValueError, match="q must be in 0..100"):
        percentile([1.0], q)


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_idle_gaps_between_forwards_in_any_order() -> None:
    # Forwards 0-1, 1.5-2, 2-3 (back to back), 4-5: gaps 0.5, 0, 1.
    forwards = [(4.0, 5.0), (0.0, 1.0), (2.0, 3.0), (1.5, 2.0)]
    assert idle_gaps(forwards) == [0.5, 0.0, 1.0]
    assert idle_gaps([]) == [] and idle_gaps([(1.0, 2.0)]) == []


def test_idle_gaps_count_overlapping_forwards_as_busy() -> None:
    # A long forward 0-10 covers 2-3 and 4-5 (a batch): the worker is never idle until 12.
    assert idle_gaps([(0.0, 10.0), (2.0, 3.0), (4.0, 5.0), (12.0, 13.0)]) == [0.0, 0.0, 2.0]


def test_idle_gaps_refuse_an_interval_that_ends_before_it_starts() -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        idle_gaps([(0.0, 1.0), (3.0, 2.0)])


def test_throughput_and_speedup() -> None:
    assert throughput(30, 10.0) == 3.0
    assert throughput(1, 0.0) == math.inf
    assert speedup(2.0, 3.0) == 1.5
    assert speedup(2.0, 1.0) == 0.5
    with pytest.raises(ValueError):
        speedup(0.0, 1.0)
    with pytest.raises(ValueError):
        throughput(1, -1.0)


def test_summarize_mode() -> None:
    s = summarize_mode("async", [1.0, 2.0, 3.0, 4.0], 8.0, [(0.0, 1.0), (1.5, 2.5), (3.5, 4.0)])
    assert (s.mode, s.requests, s.wall_s, s.throughput) == ("async", 4, 8.0, 0.5)
    assert s.p50_s == 2.5 and s.p95_s == pytest.approx(3.85)
    assert s.forward_total_s == 2.5
    assert s.idle_total_s == 1.5 and s.idle_mean_s == 0.75
    assert s.as_dict()["throughput"] == 0.5


def _timings(**stamps: float | None) -> RequestTimings:
    base = dict(enqueued_at=0.0, submitted_at=1.0, compute_done_at=3.1, output_ready_at=3.5, finished_at=4.0)
    base.update({k: v for k, v in stamps.items() if k in base and v is not None})
    durations = dict(queued=1.0, forward=2.1, pack=0.2, transfer_wait=0.4, postprocess=0.4, total=4.0)
    extra = {k: v for k, v in stamps.items() if k not in base}
    return RequestTimings(**durations, **base, **extra)  # type: ignore[arg-type]


def test_request_spans_use_the_workers_stamps() -> None:
    t = _timings(
        forward_started_at=1.2, forward_ended_at=3.0, pack_started_at=3.0, pack_ended_at=3.2, postprocess_started_at=3.6
    )
    spans = request_spans("req-1", t)
    assert [(s.phase, s.start, s.end) for s in spans] == [
        ("queued", 0.0, 1.2),
        ("forward", 1.2, 3.0),
        ("pack", 3.0, 3.2),
        ("wait", 3.2, 3.6),
        ("postprocess", 3.6, 4.0),
    ]
    assert {s.request_id for s in spans} == {"req-1"}


def test_request_spans_without_worker_stamps_fall_back_on_the_engines() -> None:
    spans = request_spans("r", _timings())
    assert [(s.phase, s.start, s.end) for s in spans] == [
        ("queued", 0.0, 1.0),
        ("forward", 1.0, 3.1),
        ("wait", 3.1, 3.5),
        ("postprocess", 3.5, 4.0),
    ]


def _spans(rid: str, f0: float) -> list[Span]:
    return [
        Span(rid, "queued", 0.0, f0),
        Span(rid, "forward", f0, f0 + 1.0),
        Span(rid, "pack", f0 + 1.0, f0 + 1.1),
        Span(rid, "postprocess", f0 + 1.2, f0 + 1.3),
    ]


def test_chrome_trace_has_a_process_per_mode_a_thread_per_request_and_the_idle_gaps() -> None:
    runs = {
        "sync": _spans("req-0", 10.0) + _spans("req-1", 11.5),
        "async": _spans("req-0", 20.0) + _spans("req-1", 21.0),
    }
    trace = json.loads(json.dumps(chrome_trace(runs, origin={"sync": 9.0, "async": 19.0})))
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 for e in complete)
    names = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert names == {"sync": 1, "async": 2}
    for pid in (1, 2):
        mine = [e for e in complete if e["pid"] == pid and e["tid"] != 0]
        assert {e["name"].split()[0] for e in mine} == {"req-0", "req-1"}
        assert {e["tid"] for e in mine if e["name"].startswith("req-1")} == {2}
        threads = {e["tid"]: e["args"]["name"] for e in events if e["pid"] == pid and e["name"] == "thread_name"}
        assert threads == {0: "worker", 1: "req-0", 2: "req-1"}
    # Microseconds from each run's origin.
    fwd = next(e for e in complete if e["pid"] == 1 and e["name"] == "req-0 forward")
    assert (fwd["ts"], fwd["dur"]) == (1_000_000.0, 1_000_000.0)
    # The worker's row: both forwards, and the 0.5 s gap between them in the sync run only.
    worker = [(e["name"], e["ts"], e["dur"]) for e in complete if e["tid"] == 0 and e["pid"] == 1]
    assert worker == [("forward req-0", 1e6, 1e6), ("idle", 2e6, 0.5e6), ("forward req-1", 2.5e6, 1e6)]
    assert not [e for e in complete if e["pid"] == 2 and e["name"] == "idle"]


def test_chrome_trace_origin_defaults_to_the_runs_first_stamp() -> None:
    trace = json.loads(json.dumps(chrome_trace({"only": _spans("a", 5.0)})))
    first = min(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X")
    assert first == 0.0


def test_forward_intervals() -> None:
    spans = _spans("b", 3.0) + _spans("a", 1.0)
    assert forward_intervals(spans) == [(1.0, 2.0), (3.0, 4.0)]


def test_the_warm_up_stops_once_forwards_take_a_steady_time() -> None:
    from omni_async.cli.demo import WARM_UP_MAX, steady

    assert not steady([]) and not steady([2.0]) and not steady([2.0, 0.3]) and not steady([2.0, 0.3, 0.32])
    assert not steady([2.0, 1.5, 1.0, 0.8])  # still getting faster
    assert steady([2.0, 0.3, 0.32, 0.31])  # the last three within 25 % of each other
    assert not steady([2.0, 0.3, 0.3, 0.5])  # a slow one: go on
    assert steady([1.0] * (WARM_UP_MAX - 1) + [5.0])  # bounded


def test_request_order_is_the_order_of_the_forwards() -> None:
    from omni_async.cli.timeline import request_order

    spans = _spans("late", 5.0) + _spans("early", 1.0) + [Span("never-ran", "queued", 0.0, 9.0)]
    assert request_order(spans) == ["early", "late", "never-ran"]
    trace = json.loads(json.dumps(chrome_trace({"m": spans})))
    threads = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"worker": 0, "early": 1, "late": 2, "never-ran": 3}


def test_the_runs_alternate_in_rounds_of_even_shares() -> None:
    """ABBA: whatever the machine does during the demo falls on both runs alike."""
    from omni_async.cli.demo import MODES, round_orders, round_shares

    assert round_orders(2) == [MODES, MODES[::-1]]
    assert round_orders(3) == [MODES, MODES[::-1], MODES]
    assert round_shares(48, 2) == [range(0, 24), range(24, 48)]
    assert round_shares(5, 2) == [range(0, 2), range(2, 5)]
    assert round_shares(1, 2) == [range(0, 1)]  # no empty round
    assert [i for share in round_shares(7, 3) for i in share] == list(range(7))


def test_a_runs_rounds_add_up_without_the_pause_between_them() -> None:
    from omni_async.cli.demo import _Run

    def part(t0: float, rid: str) -> _Run:
        r = _Run("sync", started=t0, finished=t0 + 3.0, latencies=[2.0], digests={rid: 1})
        r.spans = [Span(rid, "forward", t0 + 1.0, t0 + 2.0)]
        return r

    run = _Run("sync")
    run.add_round(part(10.0, "a"))
    run.add_round(part(100.0, "b"))  # 87 s later: another run's round came between
    # The second round's spans follow the first's on one time scale.
    assert [(s.start, s.end) for s in run.spans] == [(11.0, 12.0), (14.0, 15.0)]
    assert (run.started, run.finished) == (10.0, 16.0)
    s = run.summary()
    assert s.requests == 2 and s.wall_s == 6.0 and s.throughput == pytest.approx(2 / 6.0)
    assert s.forward_total_s == 2.0
    assert s.idle_total_s == 0.0  # one forward per round: no gap inside a round, none across
    assert run.forward_p50() == 1.0 and run.digests == {"a": 1, "b": 1}


def test_the_demos_cpu_worker_runs_torch_on_one_thread() -> None:
    """Both paths' forwards on one intra-op thread: with torch's default, the seed's
    worker spun in OpenMP barriers on a loaded machine and its forwards took 5-10x the
    library's worker's (demo.make_worker says why).  In a fresh interpreter: the setting
    is the process's."""
    code = (
        "import torch; before = torch.get_num_threads()\n"
        "from omni_async.cli.demo import make_worker\n"
        "m = make_worker(device='cpu', steps=1, hidden_size=32, depth=1, heads=2)\n"
        "print(before, torch.get_num_threads(), type(m).__name__, callable(make_worker.validate_request))\n"
    )
    env_threads = "2"  # a process that would use two threads otherwise, on any machine
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": env_threads},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "1", "DiTPipelineWorker", "True"]
