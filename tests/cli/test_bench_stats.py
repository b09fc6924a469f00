"""The arithmetic of ``omni-async bench`` (``omni_async.cli.bench_stats``), on numbers worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_async.cli.bench import SIZES, TINY_SIZES, build_cases
from omni_async.cli.bench_stats import (
    efficiency,
    ideal_rate,
    idle_fraction,
    idle_gaps,
    median,
    percentile,
    steady_rate,
)


def test_percentile_interpolates_between_order_statistics() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 9.0], 0) == 1.0 and percentile([1.0, 9.0], 100) == 9.0
    assert median([5.0, 1.0, 3.0]) == 3.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="0 to 100"):
        percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_agrees_with_numpy_and_is_monotone(xs: list[float], q: float) -> None:
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)
    assert percentile(xs, 50) <= percentile(xs, 95) + 1e-9


def test_steady_rate_counts_the_completions_after_the_warm_up() -> None:
    # Warm-up done at t=1.0; then 4 completions by t=3.0: 2 per second.
    assert steady_rate([0.5, 1.0, 1.5, 2.0, 2.5, 3.0], skip=2) == pytest.approx(2.0)
    assert steady_rate([3.0, 1.0, 2.0], skip=1) == pytest.approx(1.0)  # any order
    with pytest.raises(ValueError, match="skip"):
        steady_rate([1.0, 2.0], skip=0)
    with pytest.raises(ValueError, match="skip"):
        steady_rate([1.0, 2.0], skip=2)


def test_idle_gaps_are_the_time_between_forwards_and_zero_when_they_overlap() -> None:
    # Forwards 0-10, 12-20, 19-25 (overlaps), 30-31, given out of order.
    forwards = [(12.0, 20.0), (0.0, 10.0), (30.0, 31.0), (19.0, 25.0)]
    assert idle_gaps(forwards) == [2.0, 0.0, 5.0]
    assert idle_fraction(forwards) == pytest.approx(7.0 / 31.0)
    # A forward nested inside a longer one idles nothing after it.
    assert idle_gaps([(0.0, 10.0), (2.0, 3.0), (11.0, 12.0)]) == [0.0, 1.0]
    assert idle_gaps([(0.0, 1.0)]) == [] and idle_fraction([(0.0, 1.0)]) == 0.0
    with pytest.raises(ValueError, match="ends before"):
        idle_gaps([(2.0, 1.0)])


def test_the_ideal_rate_is_bound_by_the_forward_or_by_the_copy() -> None:
    # 448 MB at 55 GB/s is 8.1 ms: a 50 ms forward bounds it; a 5 ms one does not.
    assert ideal_rate(0.050, 448e6, 55e9) == pytest.approx(20.0)
    assert ideal_rate(0.005, 448e6, 55e9) == pytest.approx(55e9 / 448e6)
    assert ideal_rate(0.0, 1e6, 1e9) == pytest.approx(1000.0)
    assert efficiency(18.4, 20.0) == pytest.approx(0.92)
    for bad in ((-1.0, 1.0, 1.0), (0.1, -1.0, 1.0), (0.1, 1.0, 0.0), (0.0, 0.0, 1.0)):
        with pytest.raises(ValueError):
            ideal_rate(*bad)
    with pytest.raises(ValueError, match="ideal"):
        efficiency(1.0, 0.0)
    assert math.isclose(efficiency(30.0, 20.0), 1.5)


def test_the_sweep_is_sizes_by_forwards_by_concurrency_plus_the_copy_bound_cases() -> None:
    cases = build_cases(dict(SIZES), [30.0, 300.0], [1, 2, 4], copy_bound=True)
    assert len(cases) == 4 * 2 * 3 + 3
    assert {c.forward_label for c in cases} == {"few-step 30ms", "long 300ms", "copy-bound"}
    bound = [c for c in cases if c.forward_label == "copy-bound"]
    assert {c.size for c in bound} == {"video-121x1080p-bf16"} and [c.concurrency for c in bound] == [1, 2, 4]
    assert bound[0].nbytes == 121 * 3 * 1080 * 1920 * 2 and bound[0].forward_ms == 0.0
    assert cases[0].nbytes == 3 * 1024 * 1024 * 4
    tiny = build_cases(dict(TINY_SIZES), [20.0], [1], copy_bound=False)
    assert [c.forward_label for c in tiny] == ["20ms", "20ms"]
