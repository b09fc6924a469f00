"""The transition tables: totality, terminal states, reachability, and ``transitions`` as an oracle.

As in h2's stream tests, Hypothesis draws every (state, event) pair and checks that the
table-driven ``Machine`` either moves as the table says or raises ``IllegalTransition``
naming the key, the state and the event, with the state unchanged.  An independent
``transitions.Machine`` built from the same table then has to agree with ``Machine`` on
every step of drawn event sequences.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import pytest
import transitions
from hypothesis import given
from hypothesis import strategies as st

from omni_async.core.engine_states import (
    ENDING_OF,
    ENGINE_INITIAL,
    ENGINE_TABLE,
    ENGINE_TERMINAL,
    OUTCOME_OF,
    STAGE_INITIAL,
    STAGE_TABLE,
    STAGE_TERMINAL,
    EngineEvent,
    EngineState,
    StageEvent,
    StageState,
    engine_machine,
    stage_machine,
)
from omni_async.core.errors import IllegalTransition
from omni_async.core.states import (
    AWAITING_COMPUTE_DONE,
    HOLDING,
    LIFECYCLE_INITIAL,
    LIFECYCLE_TABLE,
    LIFECYCLE_TERMINAL,
    REGISTRY_INITIAL,
    REQUEST_INITIAL,
    REQUEST_TABLE,
    REQUEST_TERMINAL,
    LifecycleEvent,
    LifecycleState,
    Machine,
    RequestEvent,
    RequestState,
    lifecycle_machine,
    reachable,
    request_machine,
)

S = RequestState
E = RequestEvent

TABLES: dict[str, tuple[Mapping[Any, Any], type[enum.Enum], type[enum.Enum], Any, frozenset[Any]]] = {
    "request": (REQUEST_TABLE, RequestState, RequestEvent, REQUEST_INITIAL, REQUEST_TERMINAL),
    "lifecycle": (LIFECYCLE_TABLE, LifecycleState, LifecycleEvent, LIFECYCLE_INITIAL, LIFECYCLE_TERMINAL),
    "engine": (ENGINE_TABLE, EngineState, EngineEvent, ENGINE_INITIAL, ENGINE_TERMINAL),
    "engine request": (STAGE_TABLE, StageState, StageEvent, STAGE_INITIAL, STAGE_TERMINAL),
}


def _machine_in(name: str, key: str, state: Any) -> Machine[Any, Any]:
    table, _, _, _, terminal = TABLES[name]
    return Machine(name, key, table, state, terminal)


# --------------------------------------------------------------------------- totality


@given(st.sampled_from(list(RequestState)), st.sampled_from(list(RequestEvent)), st.text(min_size=1, max_size=8))
def test_request_machine_moves_per_table_or_raises(state: RequestState, event: RequestEvent, key: str) -> None:
    _check_pair("request", key, state, event)


@given(st.sampled_from(list(LifecycleState)), st.sampled_from(list(LifecycleEvent)), st.text(min_size=1, max_size=8))
def test_lifecycle_machine_moves_per_table_or_raises(state: LifecycleState, event: LifecycleEvent, key: str) -> None:
    _check_pair("lifecycle", key, state, event)


@given(st.sampled_from(list(EngineState)), st.sampled_from(list(EngineEvent)), st.text(min_size=1, max_size=8))
def test_engine_machine_moves_per_table_or_raises(state: EngineState, event: EngineEvent, key: str) -> None:
    _check_pair("engine", key, state, event)


@given(st.sampled_from(list(StageState)), st.sampled_from(list(StageEvent)), st.text(min_size=1, max_size=8))
def test_engine_request_machine_moves_per_table_or_raises(state: StageState, event: StageEvent, key: str) -> None:
    _check_pair("engine request", key, state, event)


def _check_pair(name: str, key: str, state: Any, event: Any) -> None:
    table, state_type, _, _, _ = TABLES[name]
    m = _machine_in(name, key, state)
    expected = table.get((state, event))
    assert m.can(event) == (expected is not None)
    if expected is not None:
        assert m.fire(event) is expected
        assert m.state is expected
        assert isinstance(m.state, state_type)
    else:
        with pytest.raises(IllegalTransition) as info:
            m.fire(event)
        err = info.value
        names = (state.name, event.name)
        assert err.key == key and err.state is state and err.event is event and err.machine == name
        text = str(err)
        assert repr(key) in text and names[0] in text and names[1] in text
        assert m.state is state, "an illegal event must leave the state unchanged"


def test_every_pair_is_exercised() -> None:
    """The Hypothesis tests above draw from these; check the products are what we think."""
    assert len(RequestState) * len(RequestEvent) == 15 * 9
    assert len(LifecycleState) * len(LifecycleEvent) == 5 * 4
    for table, state_type, event_type, _, _ in TABLES.values():
        for (src, ev), dst in table.items():
            assert isinstance(src, state_type) and isinstance(ev, event_type) and isinstance(dst, state_type)


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", sorted(TABLES))
def test_terminal_states_have_no_outgoing_transitions(name: str) -> None:
    table, _, event_type, _, terminal = TABLES[name]
    assert terminal
    for state in terminal:
        assert [ev for ev in event_type if (state, ev) in table] == []
        assert _machine_in(name, "k", state).terminal


@pytest.mark.parametrize(
    ("name", "start"),
    [("request", REQUEST_INITIAL), ("request", REGISTRY_INITIAL), ("lifecycle", LIFECYCLE_INITIAL)],
)
def test_every_non_terminal_state_can_reach_a_terminal_one(name: str, start: Any) -> None:
    table, _, _, _, terminal = TABLES[name]
    for state in reachable(table, start):
        assert reachable(table, state) & terminal, f"{state} cannot reach a terminal state"


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_state_is_reachable_from_the_initial_state(name: str) -> None:
    table, state_type, _, initial, _ = TABLES[name]
    assert reachable(table, initial) == frozenset(state_type)


def test_registry_initial_reaches_every_registry_state() -> None:
    """From where the registry creates a record, every state it can hold is reachable."""
    # Only the worker's QUEUED lies before the registry's first record state.
    assert reachable(REQUEST_TABLE, REGISTRY_INITIAL) == frozenset(RequestState) - {S.QUEUED}
    # The registry's named subsets are made of reachable, non-terminal states.
    for subset in (HOLDING, AWAITING_COMPUTE_DONE):
        assert subset <= reachable(REQUEST_TABLE, REGISTRY_INITIAL) - REQUEST_TERMINAL


def test_drop_abandon_and_force_release_are_valid_in_every_non_terminal_state() -> None:
    """F10/F11/F16 by construction: nobody-wants-it events never raise."""
    for state in set(RequestState) - REQUEST_TERMINAL:
        for ev in (E.DROP, E.FORCE_RELEASE):
            assert (state, ev) in REQUEST_TABLE, (state, ev)
        if state is not S.QUEUED:  # a queued request has no waiter yet
            assert (state, E.ABANDON) in REQUEST_TABLE, state
    for lstate in set(LifecycleState) - LIFECYCLE_TERMINAL:
        assert (lstate, LifecycleEvent.STOPPED) in LIFECYCLE_TABLE
        assert (lstate, LifecycleEvent.CRASH) in LIFECYCLE_TABLE


def test_reachable_walks_the_table() -> None:
    class St(enum.Enum):
        A = 1
        B = 2
        C = 3
        D = 4

    class Ev(enum.Enum):
        X = 1

    table = {(St.A, Ev.X): St.B, (St.B, Ev.X): St.C, (St.D, Ev.X): St.A}
    assert reachable(table, St.A) == frozenset({St.A, St.B, St.C})
    assert reachable(table, St.C) == frozenset({St.C})


def test_constructors_and_names() -> None:
    m = request_machine("o1")
    assert m.state is REQUEST_INITIAL and m.key == "o1" and not m.terminal
    assert request_machine("o2", REGISTRY_INITIAL).state is S.COMPUTING
    lm = lifecycle_machine("omni-pump")
    assert lm.state is LifecycleState.STARTING
    assert str(S.READY) == repr(S.READY) == "READY"


def test_happy_path_through_the_request_machine() -> None:
    m = request_machine("o1")
    for ev, st_ in [
        (E.FORWARD, S.COMPUTING),
        (E.COMPUTE_DONE, S.COMPUTE_DONE),
        (E.PACK, S.PACKING),
        (E.OUTPUT_READY, S.READY),
        (E.DELIVER, S.DELIVERED),
    ]:
        assert m.fire(ev) is st_
    assert m.terminal


# --------------------------------------------------------------------------- transitions oracle


def build_oracle(
    table: Mapping[tuple[Any, Any], Any], states: type[enum.Enum], initial: Any
) -> tuple[transitions.Machine, Any]:
    """An independent ``transitions.Machine`` from the same table: one trigger per event."""

    class Model:
        state: str

    model = Model()
    machine = transitions.Machine(
        model=model,
        states=[s.name for s in states],
        transitions=[{"trigger": ev.name, "source": src.name, "dest": dst.name} for (src, ev), dst in table.items()],
        initial=initial.name,
        ignore_invalid_triggers=False,
        auto_transitions=False,
    )
    return machine, model


def _agree(name: str, start: Any, events: list[Any]) -> None:
    table, state_type, _, _, _ = TABLES[name]
    core = _machine_in(name, "oracle", start)
    _, model = build_oracle(table, state_type, start)
    for ev in events:
        before = core.state
        try:
            after = core.fire(ev)
        except IllegalTransition:
            after = None
            assert core.state is before
        try:
            model.trigger(ev.name)
            oracle_after: str | None = model.state
        except transitions.MachineError:
            oracle_after = None
            assert model.state == before.name
        assert (None if after is None else after.name) == oracle_after, (before, ev)
        assert core.state.name == model.state


@given(
    st.sampled_from([REQUEST_INITIAL, REGISTRY_INITIAL]),
    st.lists(st.sampled_from(list(RequestEvent)), max_size=25),
)
def test_transitions_oracle_agrees_on_request_sequences(start: RequestState, events: list[RequestEvent]) -> None:
    _agree("request", start, events)


@given(st.sampled_from(list(RequestState)), st.lists(st.sampled_from(list(RequestEvent)), max_size=10))
def test_transitions_oracle_agrees_from_any_request_state(start: RequestState, events: list[RequestEvent]) -> None:
    _agree("request", start, events)


@given(st.sampled_from(list(EngineState)), st.lists(st.sampled_from(list(EngineEvent)), max_size=12))
def test_transitions_oracle_agrees_on_engine_sequences(start: EngineState, events: list[EngineEvent]) -> None:
    _agree("engine", start, events)


@given(st.sampled_from(list(StageState)), st.lists(st.sampled_from(list(StageEvent)), max_size=14))
def test_transitions_oracle_agrees_on_engine_request_sequences(start: StageState, events: list[StageEvent]) -> None:
    _agree("engine request", start, events)


@given(st.lists(st.sampled_from(list(StageEvent)), max_size=20))
def test_an_engine_request_decides_its_end_once_and_keeps_it(events: list[StageEvent]) -> None:
    """Whatever happens to a request, the first end decided is its outcome: an *-ING state
    (or, from WAITING, its terminal state at once) that no later event changes but GONE,
    which takes it to that outcome's terminal state."""
    m = stage_machine("r")
    decided: StageState | None = None
    for ev in events:
        if not m.can(ev):
            continue
        before = m.state
        after = m.fire(ev)
        if decided is None and (after in OUTCOME_OF or after in STAGE_TERMINAL) and after is not StageState.FINISHED:
            decided = OUTCOME_OF.get(after, after)
        elif decided is not None:
            assert OUTCOME_OF.get(after, after) is decided, (before, ev, after)
        if after is StageState.FINISHED:
            assert decided is None and ev in (StageEvent.RESULT, StageEvent.GONE)
    if m.terminal and decided is not None:
        assert m.state is decided


def test_an_end_is_decided_from_every_stage_at_work() -> None:
    at_work = {
        StageState.SUBMITTED,
        StageState.COMPUTING,
        StageState.COMPUTED,
        StageState.POSTPROCESSING,
        StageState.RESOLVED,
    }
    for stage in at_work:
        for event, ending in ENDING_OF.items():
            assert STAGE_TABLE[(stage, event)] is ending
    for event in ENDING_OF:
        assert STAGE_TABLE[(StageState.WAITING, event)] is OUTCOME_OF[ENDING_OF[event]]


def test_a_close_during_start_can_never_reach_running() -> None:
    """Defect 2 by construction: the table has no way from CLOSING to RUNNING."""
    m = engine_machine("e")
    m.fire(EngineEvent.START)
    m.fire(EngineEvent.CLOSE)
    with pytest.raises(IllegalTransition, match="STARTED is illegal in state CLOSING"):
        m.fire(EngineEvent.STARTED)
    assert m.state is EngineState.CLOSING
    assert EngineState.RUNNING not in reachable(ENGINE_TABLE, EngineState.CLOSING)


@given(st.sampled_from(list(LifecycleState)), st.lists(st.sampled_from(list(LifecycleEvent)), max_size=12))
def test_transitions_oracle_agrees_on_lifecycle_sequences(start: LifecycleState, events: list[LifecycleEvent]) -> None:
    _agree("lifecycle", start, events)


def test_oracle_rejects_what_the_table_lacks() -> None:
    _, model = build_oracle(REQUEST_TABLE, RequestState, S.READY)
    with pytest.raises(transitions.MachineError):
        model.trigger("PACK")
    assert model.state == "READY"
