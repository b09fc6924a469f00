"""Deadlines (F4): from the constructor and from the environment; invalid values are usage errors."""

from __future__ import annotations

import math

import pytest

from omni_async.core.config import (
    ENV_COMPUTE_TIMEOUT,
    ENV_OUTPUT_TIMEOUT,
    ENV_RPC_TIMEOUT,
    MAX_SECONDS,
    Deadlines,
    InvalidConfig,
)
from omni_async.core.errors import UsageError

ALL_VARS = (ENV_COMPUTE_TIMEOUT, ENV_OUTPUT_TIMEOUT, ENV_RPC_TIMEOUT)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ALL_VARS:
        monkeypatch.delenv(var, raising=False)


def test_env_var_names() -> None:
    assert ALL_VARS == ("OMNI_ASYNC_COMPUTE_TIMEOUT", "OMNI_ASYNC_OUTPUT_TIMEOUT", "OMNI_ASYNC_RPC_TIMEOUT")


def test_defaults_are_separate_and_finite() -> None:
    d = Deadlines()
    assert d.compute_timeout is not None and d.output_timeout is not None and d.rpc_timeout is not None
    assert d.compute_timeout > 0 and d.output_timeout > 0 and d.rpc_timeout > 0
    assert Deadlines.from_env({}) == d
    assert Deadlines.from_env() == d  # the real environment, cleaned by the fixture


def test_constructor_values() -> None:
    d = Deadlines(compute_timeout=1.5, output_timeout=None, rpc_timeout=7)
    assert (d.compute_timeout, d.output_timeout, d.rpc_timeout) == (1.5, None, 7)


@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.001, math.nan])
@pytest.mark.parametrize("field", ["compute_timeout", "output_timeout", "rpc_timeout"])
def test_constructor_rejects_non_positive(field: str, bad: float) -> None:
    with pytest.raises(UsageError, match=field):
        Deadlines(**{field: bad})


@pytest.mark.parametrize(
    ("var", "field"),
    [
        (ENV_COMPUTE_TIMEOUT, "compute_timeout"),
        (ENV_OUTPUT_TIMEOUT, "output_timeout"),
        (ENV_RPC_TIMEOUT, "rpc_timeout"),
    ],
)
def test_each_env_var_sets_its_own_deadline(var: str, field: str) -> None:
    d = Deadlines.from_env({var: "2.5"})
    assert getattr(d, field) == 2.5
    others = {"compute_timeout", "output_timeout", "rpc_timeout"} - {field}
    for other in others:
        assert getattr(d, other) == getattr(Deadlines(), other)


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_COMPUTE_TIMEOUT, "12")
    monkeypatch.setenv(ENV_OUTPUT_TIMEOUT, " 3.25 ")
    monkeypatch.setenv(ENV_RPC_TIMEOUT, "none")
    d = Deadlines.from_env()
    assert (d.compute_timeout, d.output_timeout, d.rpc_timeout) == (12.0, 3.25, None)


@pytest.mark.parametrize("raw", ["none", "None", "NONE", "0", "off", "OFF", "", "  "])
def test_env_disables_a_deadline(raw: str) -> None:
    assert Deadlines.from_env({ENV_OUTPUT_TIMEOUT: raw}).output_timeout is None


def test_explicit_arguments_override_the_environment() -> None:
    env = {ENV_COMPUTE_TIMEOUT: "5", ENV_OUTPUT_TIMEOUT: "6"}
    d = Deadlines.from_env(env, compute_timeout=1.0, output_timeout=None)
    assert (d.compute_timeout, d.output_timeout) == (1.0, None)


@pytest.mark.parametrize("raw", ["abc", "1s", "5 min", "-1", "-0.5", "nan", "1e", "--2"])
@pytest.mark.parametrize("var", ALL_VARS)
def test_invalid_env_values_raise_usage_error(var: str, raw: str) -> None:
    with pytest.raises(UsageError):
        Deadlines.from_env({var: raw})


def test_usage_error_names_the_variable() -> None:
    with pytest.raises(UsageError, match=ENV_COMPUTE_TIMEOUT):
        Deadlines.from_env({ENV_COMPUTE_TIMEOUT: "soon"})


def test_invalid_override_raises_usage_error() -> None:
    with pytest.raises(UsageError):
        Deadlines.from_env({}, rpc_timeout=-3)


def test_deadlines_are_frozen() -> None:
    import attrs

    d = Deadlines()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        d.compute_timeout = 1  # type: ignore[misc]


def test_env_zero_written_as_float_disables_a_deadline() -> None:
    assert Deadlines.from_env({ENV_OUTPUT_TIMEOUT: "0.0"}).output_timeout is None


def test_constructor_rejects_a_string_with_usage_error() -> None:
    with pytest.raises(UsageError):
        Deadlines(compute_timeout="5")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.inf, -math.inf, MAX_SECONDS * 1.5, 10**400, "5", [5], True])
@pytest.mark.parametrize("field", ["compute_timeout", "output_timeout", "rpc_timeout", "cancel_grace"])
def test_constructor_refuses_what_no_wait_can_take_naming_the_field(field: str, bad: object) -> None:
    """inf (or a finite value past every wait's limit) overflowed where it was used --
    ``timedelta`` in the process group's rendezvous, ``poll``: None is how a deadline is
    turned off."""
    with pytest.raises(InvalidConfig) as err:
        Deadlines(**{field: bad})  # type: ignore[arg-type]
    assert err.value.field == f"Deadlines.{field}" and isinstance(err.value, UsageError | ValueError)
    assert "None (no limit)" in str(err.value) and f"({type(bad).__name__})" in str(err.value)


def test_the_longest_deadline_is_accepted() -> None:
    assert Deadlines(compute_timeout=MAX_SECONDS, cancel_grace=MAX_SECONDS).compute_timeout == MAX_SECONDS


@pytest.mark.parametrize("raw", ["inf", "Infinity", "-inf", "1e7"])
def test_env_refuses_an_infinite_or_too_long_deadline_naming_the_variable(raw: str) -> None:
    with pytest.raises(UsageError, match=f"{ENV_RPC_TIMEOUT}={raw!r} must be a number of seconds from 0"):
        Deadlines.from_env({ENV_RPC_TIMEOUT: raw})
