"""The engine's scheduler, sans-IO: FIFO, the bounded queue, running slots freed at
COMPUTE_DONE, the budget of held outputs (count and bytes), budget waits; and a
Hypothesis state machine holding it to a plain model."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from omni_async.core.errors import UsageError
from omni_async.engine.errors import EngineOverloaded
from omni_async.engine.scheduler import Scheduler, SchedulerPhase
from omni_async.transport.budget import OutputBudget


def test_fifo_and_running_slots_free_at_compute_done() -> None:
    s = Scheduler(max_waiting=10, max_running=2)
    for rid in "abcd":
        s.add(rid)
    assert s.schedule(0.0) == ["a", "b"]
    assert s.schedule(0.0) == []
    s.compute_done("a")  # a's output is still pending: its running slot is free all the same
    assert s.phase("a") is SchedulerPhase.HOLDING
    assert s.schedule(0.0) == ["c"]
    s.remove("b")  # b failed before COMPUTE_DONE
    assert s.schedule(0.0) == ["d"]
    assert (s.waiting, s.running, s.holding) == (0, 2, 1)


def test_a_full_queue_refuses_at_the_call() -> None:
    s = Scheduler(max_waiting=2, max_running=1)
    s.add("a")
    assert s.schedule(0.0) == ["a"]  # the one running slot taken: the queue's bound alone is left
    s.add("b")
    s.add("c")
    with pytest.raises(EngineOverloaded) as err:
        s.add("d")
    assert err.value.request_id == "d" and err.value.max_waiting == 2
    assert "max_waiting=2" in str(err.value)
    assert s.stats.rejected == 1 and "d" not in s
    with pytest.raises(UsageError, match="already in the engine"):
        s.add("a")


def test_free_running_slots_count_before_the_queue() -> None:
    """Defect (issue 29): an idle scheduler with max_running=2, max_waiting=1 refused the
    second of three requests added before a ``schedule``, though two fit the running
    slots and one the queue."""
    s = Scheduler(max_waiting=1, max_running=2)
    for rid in ("a", "b", "c"):
        s.add(rid)
    with pytest.raises(EngineOverloaded):
        s.add("d")
    assert s.schedule(0.0) == ["a", "b"] and s.waiting_ids() == ["c"]


def test_the_budget_bounds_the_free_slots_the_queue_counts() -> None:
    s = Scheduler(max_waiting=1, max_running=3, budget=OutputBudget(max_outputs=1))
    s.add("a")
    s.add("b")
    with pytest.raises(EngineOverloaded):
        s.add("c")  # one may run (the budget), one may wait
    assert s.free_slots == 1 and s.schedule(0.0) == ["a"] and s.free_slots == 0


def test_the_budget_of_held_outputs_bounds_running_plus_holding() -> None:
    s = Scheduler(max_waiting=10, max_running=2, budget=OutputBudget(max_outputs=3))
    for rid in "abcde":
        s.add(rid)
    assert s.schedule(1.0) == ["a", "b"]
    s.compute_done("a")
    s.compute_done("b")
    assert s.schedule(1.0) == ["c"]  # 3 in flight: a, b hold outputs, c runs
    assert s.stats.budget_waits == 1  # d could run (a slot is free) but the budget is full
    assert s.schedule(2.0) == []
    assert s.budget_wait_s(3.0) == pytest.approx(2.0)
    s.remove("a")  # a's output released
    assert s.schedule(4.0) == ["d"]
    assert s.stats.budget_waits == 1 and s.stats.budget_wait_s == pytest.approx(3.0)


def test_outputs_lent_to_callers_hold_the_budget_until_their_leases_end() -> None:
    """A ``sink="segment"`` output outlives its request: it counts as in flight (``lent``)."""
    s = Scheduler(max_waiting=10, max_running=2, budget=OutputBudget(max_outputs=2))
    for rid in "abc":
        s.add(rid)
    assert s.schedule(1.0) == ["a", "b"]
    for rid in "ab":
        s.compute_done(rid)
        s.remove(rid)  # finished, their outputs lent
    s.lent = 2
    assert s.in_flight == 2 and s.schedule(2.0) == [] and s.stats.budget_waits == 1
    s.lent = 1  # one lease released
    assert s.schedule(3.0) == ["c"]


def test_the_byte_budget_counts_twice_the_size_class_of_the_largest_output() -> None:
    budget = OutputBudget(max_outputs=64, max_bytes=8 << 20)
    assert budget.size_class(1) == 1 << 16
    assert budget.size_class((1 << 20) + 1) == 1 << 21
    assert budget.size_class(1 << 20) == 1 << 20
    s = Scheduler(max_waiting=10, max_running=8, budget=budget)
    assert s.in_flight_limit == 64  # no output seen yet
    s.observe_output(1 << 20)  # 1 MiB: class 1 MiB, counted as 2 MiB
    assert s.in_flight_limit == 4
    s.observe_output(1000)  # smaller ones do not loosen it
    assert s.in_flight_limit == 4
    s.observe_output(100 << 20)  # larger than the budget: one at a time
    assert s.in_flight_limit == 1


def test_arguments_are_checked() -> None:
    with pytest.raises(UsageError, match="max_running"):
        Scheduler(max_waiting=1, max_running=0)
    with pytest.raises(UsageError, match="max_held_bytes"):
        Scheduler(max_waiting=1, max_running=1, budget=OutputBudget(max_bytes=True))
    s = Scheduler(max_waiting=1, max_running=1)
    with pytest.raises(UsageError, match="not running"):
        s.compute_done("x")


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / schedule / compute_done / remove against a plain model: FIFO
    admission, the limits never exceeded, and every admitted id leaves exactly once."""

    @initialize(
        max_waiting=st.integers(1, 6),
        max_running=st.integers(1, 3),
        held=st.none() | st.integers(1, 4),
    )
    def setup(self, max_waiting: int, max_running: int, held: int | None) -> None:
        self.s = Scheduler(
            max_waiting=max_waiting,
            max_running=max_running,
            budget=None if held is None else OutputBudget(max_outputs=held),
        )
        self.max_waiting, self.max_running, self.held = max_waiting, max_running, held
        self.waiting: list[str] = []
        self.running: set[str] = set()
        self.holding: set[str] = set()
        self.next = 0
        self.now = 0.0
        self.admitted_order: list[str] = []
        self.added_order: list[str] = []

    @rule()
    def add(self) -> None:
        rid = f"r{self.next}"
        self.next += 1
        free = self.max_running - len(self.running)
        if self.held is not None:
            free = min(free, self.held - len(self.running) - len(self.holding))
        if len(self.waiting) >= self.max_waiting + max(0, free):
            with pytest.raises(EngineOverloaded):
                self.s.add(rid)
            return
        self.s.add(rid)
        self.waiting.append(rid)
        self.added_order.append(rid)

    @rule(dt=st.floats(0, 1))
    def schedule(self, dt: float) -> None:
        self.now += dt
        got = self.s.schedule(self.now)
        limit = self.held
        expect: list[str] = []
        while self.waiting and len(self.running) < self.max_running:
            if limit is not None and len(self.running) + len(self.holding) >= limit:
                break
            rid = self.waiting.pop(0)
            self.running.add(rid)
            expect.append(rid)
        assert got == expect
        self.admitted_order.extend(got)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def compute_done(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.s.compute_done(rid)
        self.running.discard(rid)
        self.holding.add(rid)

    @precondition(lambda self: bool(self.waiting or self.running or self.holding))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted({*self.waiting, *self.running, *self.holding})))
        phase = self.s.remove(rid)
        if rid in self.waiting:
            assert phase is SchedulerPhase.WAITING
            self.waiting.remove(rid)
        elif rid in self.running:
            assert phase is SchedulerPhase.RUNNING
            self.running.discard(rid)
        else:
            assert phase is SchedulerPhase.HOLDING
            self.holding.discard(rid)
        assert self.s.remove(rid) is None  # gone, once

    @invariant()
    def matches_the_model(self) -> None:
        if not hasattr(self, "s"):
            return
        assert self.s.waiting_ids() == self.waiting
        assert (self.s.running, self.s.holding) == (len(self.running), len(self.holding))
        assert self.s.running <= self.max_running
        if self.held is not None:
            assert self.s.in_flight <= self.held  # admission never exceeds the budget
        # FIFO: ids are admitted in the order they were added (skipping removed ones).
        positions = [self.added_order.index(r) for r in self.admitted_order]
        assert positions == sorted(positions)


TestSchedulerMachine = SchedulerMachine.TestCase


# ---------------------------------------------------------------- batches (issue 19)


def test_groups_take_the_oldest_request_and_later_ones_of_its_key() -> None:
    s = Scheduler(max_waiting=16, max_running=8, max_batch_size=3, batch_wait_s=0.0)
    for rid, key in [("a0", "a"), ("b0", "b"), ("a1", "a"), ("n0", None), ("a2", "a"), ("a3", "a"), ("b1", "b")]:
        s.add(rid, key=key, now=0.0)
    assert s.schedule_batches(0.0) == [["a0", "a1", "a2"], ["b0", "b1"], ["n0"], ["a3"]]
    assert s.running == 7
    assert (s.stats.batches, s.stats.batched, s.stats.max_batch, s.stats.admitted) == (4, 2, 3, 7)


def test_members_count_against_max_running_and_the_in_flight_cap() -> None:
    s = Scheduler(max_waiting=16, max_running=4, max_in_flight=3, max_batch_size=4, batch_wait_s=0.0)
    for i in range(6):
        s.add(f"r{i}", key="k", now=0.0)
    assert s.schedule_batches(0.0) == [["r0", "r1", "r2"]]  # room for 3 members, not 4
    s.compute_done("r0")
    assert s.schedule_batches(0.0) == []  # r0 still holds its output: in flight
    s.remove("r0")
    assert s.schedule_batches(0.0) == [["r3"]]


def test_a_group_that_could_grow_waits_batch_wait_s_from_its_oldest_member() -> None:
    s = Scheduler(max_waiting=16, max_running=8, max_batch_size=4, batch_wait_s=0.5)
    s.add("a", key="k", now=10.0)
    s.add("x", key=None, now=10.1)  # behind the held group: waits too (first come, first served)
    assert s.schedule_batches(10.2) == []
    held: float | None = s.held_until
    assert held == 10.5
    s.add("b", key="k", now=10.3)
    assert s.schedule_batches(10.4) == []
    assert s.schedule_batches(10.5) == [["a", "b"], ["x"]]
    assert s.held_until is None
    for i in range(4):
        s.add(f"f{i}", key="k", now=20.0)
    assert s.schedule_batches(20.0) == [["f0", "f1", "f2", "f3"]]  # full: no wait


def test_batch_options_are_checked() -> None:
    with pytest.raises(UsageError, match="max_batch_size must be a positive int"):
        Scheduler(max_waiting=1, max_running=1, max_batch_size=0)
    with pytest.raises(UsageError, match="batch_wait_s must be a number of seconds >= 0"):
        Scheduler(max_waiting=1, max_running=1, batch_wait_s=float("nan"))
