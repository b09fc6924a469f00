"""``EngineConfig``: every field checked when the object is made, ``InvalidConfig``
(a ``UsageError``) naming the field; the engine's keyword form builds the same object."""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.executor_harness import RELAXED, make_toy
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.config import EngineConfig
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.sync import DiffusionEngine
from omni_async.executor.config import InvalidConfig
from omni_async.executor.inprocess import InProcessExecutor

# What each field is, for the property test: a positive count, an optional positive
# count, seconds (> 0, or >= 0 where 0 means something), a bool, a callable or None, a
# name or None.
COUNTS = ("max_waiting", "postprocess_workers", "max_batch_size", "video_bytes_in_flight")
OPTIONAL_COUNTS = ("max_running", "max_in_flight", "encode_workers")
SECONDS = {"close_timeout": False, "batch_wait_s": True, "output_ttl_s": False}  # field -> zero allowed
BOOLS = ("async_output",)
CALLABLES = ("tracer", "batch_key")
NAMES = ("pipeline",)
DIRS = ("output_dir",)


def test_the_property_test_covers_every_field() -> None:
    covered = {*COUNTS, *OPTIONAL_COUNTS, *SECONDS, *BOOLS, *CALLABLES, *NAMES, *DIRS}
    assert covered == set(attrs.fields_dict(EngineConfig))


def _refused(field: str, value: object) -> None:
    with pytest.raises(InvalidConfig) as err:
        EngineConfig(**{field: value})  # type: ignore[arg-type]  # wrong on purpose
    assert err.value.field == field and isinstance(err.value, UsageError)
    assert str(err.value).startswith(field)


NOT_A_NUMBER = st.sampled_from(["3", b"3", None, [], {}, object(), True, False, 1j])
BAD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf])


@given(field=st.sampled_from(COUNTS + OPTIONAL_COUNTS), value=st.integers(max_value=0) | BAD_FLOATS | st.floats(1, 9))
def test_a_count_refuses_zero_negative_and_non_ints(field: str, value: object) -> None:
    _refused(field, value)


@given(field=st.sampled_from(COUNTS + OPTIONAL_COUNTS), value=NOT_A_NUMBER.filter(lambda v: v is not None))
def test_a_count_refuses_other_types(field: str, value: object) -> None:
    _refused(field, value)


@given(field=st.sampled_from(COUNTS), value=st.integers(1, 1 << 20))
def test_a_count_takes_positive_ints(field: str, value: int) -> None:
    max_running = value if field == "max_batch_size" else None
    cfg = EngineConfig(**{field: value, "max_running": max_running})  # type: ignore[arg-type]
    assert getattr(cfg, field) == value


@given(field=st.sampled_from(OPTIONAL_COUNTS), value=st.none() | st.integers(1, 1 << 20))
def test_an_optional_count_takes_none_and_positive_ints(field: str, value: int | None) -> None:
    assert getattr(EngineConfig(**{field: value}), field) == value  # type: ignore[arg-type]


@given(field=st.sampled_from(sorted(SECONDS)), value=BAD_FLOATS | st.floats(max_value=-1e-9) | NOT_A_NUMBER)
def test_seconds_refuse_nan_inf_negative_and_non_numbers(field: str, value: object) -> None:
    _refused(field, value)


@given(value=st.sampled_from(["", 3, b"/tmp", ["/tmp"], True]))
def test_output_dir_takes_a_path_or_none(value: object) -> None:
    _refused("output_dir", value)
    assert EngineConfig(output_dir="/some/where").output_dir == "/some/where"
    assert EngineConfig().output_dir is None and EngineConfig().output_ttl_s == 600.0


def test_zero_seconds_only_where_zero_means_something() -> None:
    _refused("close_timeout", 0)
    _refused("close_timeout", 0.0)
    assert EngineConfig(batch_wait_s=0).batch_wait_s == 0.0


@given(field=st.sampled_from(sorted(SECONDS)), value=st.floats(1e-6, 1e6) | st.integers(1, 1000))
def test_seconds_take_finite_positive_numbers_as_floats(field: str, value: float) -> None:
    got = getattr(EngineConfig(**{field: value}), field)  # type: ignore[arg-type]
    assert got == value and type(got) is float


@given(value=st.sampled_from([0, 1, "yes", None, 1.0]))
def test_a_bool_takes_only_a_bool(value: object) -> None:
    _refused("async_output", value)


@given(field=st.sampled_from(CALLABLES), value=st.integers() | st.floats() | st.text(max_size=3) | st.just(b"x"))
def test_a_callable_field_refuses_what_cannot_be_called(field: str, value: object) -> None:
    _refused(field, value)


@given(value=st.integers() | st.floats() | st.just(b"x") | st.just(["tiny"]))
def test_pipeline_takes_a_name_or_none(value: object) -> None:
    _refused("pipeline", value)


def test_the_reported_cases_are_refused() -> None:
    """Issue 29: close_timeout=nan and tracer=5 were accepted."""
    _refused("close_timeout", math.nan)
    _refused("tracer", 5)


def test_max_running_below_max_batch_size_is_refused_naming_max_running() -> None:
    _refused_pair = pytest.raises(InvalidConfig, match="max_running")
    with _refused_pair as err:
        EngineConfig(max_running=2, max_batch_size=4)
    assert err.value.field == "max_running"
    assert EngineConfig(max_batch_size=4).running_slots == 8
    assert EngineConfig().running_slots == 3


@pytest.fixture
def ex() -> Iterator[InProcessExecutor]:
    executor = InProcessExecutor(make_toy, deadlines=RELAXED)
    try:
        yield executor
    finally:
        executor.shutdown()


def test_the_engine_takes_a_config_or_its_keywords_not_both(ex: InProcessExecutor) -> None:
    cfg = EngineConfig(max_running=2, close_timeout=5)
    assert AsyncDiffusionEngine(ex, config=cfg).config is cfg
    assert AsyncDiffusionEngine(ex, max_running=2, close_timeout=5).config == cfg
    assert AsyncDiffusionEngine.from_factory(lambda: ex, config=cfg).config is cfg
    with pytest.raises(InvalidConfig, match="not both") as err:
        AsyncDiffusionEngine(ex, config=cfg, max_running=3)
    assert err.value.field == "config"
    with pytest.raises(InvalidConfig) as err:
        AsyncDiffusionEngine(ex, max_runing=3)  # type: ignore[call-arg]  # misspelt on purpose
    assert err.value.field == "max_runing" and "max_running" in str(err.value)
    with pytest.raises(InvalidConfig) as err:
        AsyncDiffusionEngine(ex, close_timeout=math.nan)
    assert err.value.field == "close_timeout"
    with pytest.raises(InvalidConfig) as err:
        AsyncDiffusionEngine(ex, config=5)  # type: ignore[arg-type]
    assert err.value.field == "config"


def test_the_blocking_engine_takes_a_config(ex: InProcessExecutor) -> None:
    with pytest.raises(InvalidConfig) as err:
        DiffusionEngine(ex, tracer=5)  # type: ignore[arg-type]
    assert err.value.field == "tracer"
    with DiffusionEngine(ex, config=EngineConfig(max_running=1)) as engine:
        assert engine.engine.config.max_running == 1
        assert engine.generate(DiffusionRequest("r", {})).request_id == "r"
