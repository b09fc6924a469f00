"""Deadlines and limits, from the constructor or the environment (F4).

Two deadlines, measured from different events, because they bound different things:

* ``compute_timeout``: from broadcasting an execute RPC to every rank's answer
  (COMPUTE_DONE from the reply rank).  It bounds the forward.
* ``output_timeout``: from COMPUTE_DONE to the output's delivery to its waiter.
  It bounds packing plus the consumer's pick-up; a finished render is never
  thrown away because the forward was slow.

``compute_timeout`` also bounds a record that an output arriving *before* its
COMPUTE_DONE creates (early arrival): that COMPUTE_DONE answers a call that was
pending when the output arrived, so it is given up on once every such call's
compute deadline has passed (and no sooner than ``compute_timeout`` after the
arrival); the output is then released and counted as orphaned (``OutputOrphaned``,
``metrics()["orphaned_outputs"]``).  With ``compute_timeout`` off such a record
waits without a bound, like the call itself.

When an execute call's compute deadline expires, the executor also cancels its
forward on every rank (the model stops at its next cancellation check).  A rank that
still has not answered ``cancel_grace`` seconds later is reported stuck by
``check_health`` (``WorkerStuck``).

Per call: ``submit``/``submit_batch``/``execute_request``/``execute_batch``
take ``deadlines=``; its ``compute_timeout`` and ``output_timeout`` replace the
executor's for that call (``rpc_timeout`` and ``cancel_grace`` are the executor's).

Environment variables (seconds; ``none`` or ``0`` disables a deadline):
``OMNI_ASYNC_COMPUTE_TIMEOUT``, ``OMNI_ASYNC_OUTPUT_TIMEOUT``, ``OMNI_ASYNC_RPC_TIMEOUT``,
``OMNI_ASYNC_CANCEL_GRACE``.

Every setting of every configuration class (these deadlines, ``WorkerOptions``, the
executors' ``ExecutorConfig``) is checked when it is made, by the ``check_*`` functions
below: a value that cannot work raises ``InvalidConfig`` naming the field, what was given
and what is expected -- never an ``AttributeError`` or ``OverflowError`` later, in a
thread or a worker process.  A duration is finite and at most ``MAX_SECONDS``: None is
how a deadline is turned off, and an infinite or huge one overflowed the waits it reached
(``timedelta``, ``poll``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from omni_async.core.errors import UsageError

ENV_COMPUTE_TIMEOUT = "OMNI_ASYNC_COMPUTE_TIMEOUT"
ENV_OUTPUT_TIMEOUT = "OMNI_ASYNC_OUTPUT_TIMEOUT"
ENV_RPC_TIMEOUT = "OMNI_ASYNC_RPC_TIMEOUT"
ENV_CANCEL_GRACE = "OMNI_ASYNC_CANCEL_GRACE"

# The longest duration a setting takes (about 11.6 days).  Below poll()'s limit of 2**31
# milliseconds (24.8 days), the tightest of the waits a deadline reaches.
MAX_SECONDS = 1_000_000.0


class InvalidConfig(UsageError, ValueError):
    """A setting that cannot work; ``field`` names it (and starts the message)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


def given(value: object) -> str:
    """``value`` as an error message shows it: its repr (cut short) and its type."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001  # a repr that fails (an int of 5,000 digits) must not hide the field
        text = f"<{type(value).__name__} object>"
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def check_seconds(field: str, value: object, *, optional: bool = False, zero: bool = False) -> None:
    """A duration: an int or float, finite, > 0 (>= 0 with ``zero``), at most
    ``MAX_SECONDS``; None too when ``optional``."""
    if value is None and optional:
        return
    # Comparisons, not math.isfinite: NaN and inf fail them, and an int past float's range
    # (10**400) cannot overflow them.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (value >= 0 if zero else value > 0) and value <= MAX_SECONDS:
            return
    low = ">= 0" if zero else "> 0"
    off = " or None (no limit)" if optional else ""
    raise InvalidConfig(
        field, f"must be a finite number of seconds {low} and at most {MAX_SECONDS:,.0f}{off}, got {given(value)}"
    )


def check_int(field: str, value: object, low: int, *, optional: bool = False) -> None:
    """An int (not a bool) >= ``low``; None too when ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive int" if low == 1 else f"an int >= {low}"
        raise InvalidConfig(field, f"must be {what}{' or None' if optional else ''}, got {given(value)}")


def check_bool(field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidConfig(field, f"must be a bool (True or False), got {given(value)}")


def check_instance(field: str, value: object, kind: type, *, optional: bool = False, hint: str = "") -> None:
    """An instance of ``kind``; None too when ``optional``.  ``hint``: how to make one."""
    if value is None and optional:
        return
    if not isinstance(value, kind):
        what = f"a {kind.__name__}{' or None' if optional else ''}{f' ({hint})' if hint else ''}"
        raise InvalidConfig(field, f"must be {what}, got {given(value)}")


def check_callable(field: str, value: object, what: str, *, optional: bool = False) -> None:
    """A callable (``what`` says which); None too when ``optional``."""
    if value is None and optional:
        return
    if not callable(value):
        raise InvalidConfig(field, f"must be {what}{' or None' if optional else ''}, got {given(value)}")


def check_choice(field: str, value: object, choices: tuple[object, ...], *, optional: bool = False) -> None:
    """One of ``choices`` (compared by type and value: ``True`` is not ``1``); None too when ``optional``."""
    if value is None and optional:
        return
    if not any(type(value) is type(c) and value == c for c in choices):
        shown = ", ".join(map(repr, choices))
        raise InvalidConfig(field, f"must be one of {shown}{' or None' if optional else ''}, got {given(value)}")


@attrs.frozen
class Deadlines:
    """The executor's deadlines in seconds (module docstring); each None (off) or a
    finite number > 0, at most ``MAX_SECONDS`` (``InvalidConfig`` naming the field)."""

    compute_timeout: float | None = 600.0
    output_timeout: float | None = 300.0
    # Every other RPC (path 2): from broadcast to every rank's RPC_RESULT.
    rpc_timeout: float | None = 300.0
    # How long a worker may go on after its compute deadline cancelled its forward
    # before check_health reports it stuck (WorkerStuck); None: never.
    cancel_grace: float | None = 30.0

    def __attrs_post_init__(self) -> None:
        for name in ("compute_timeout", "output_timeout", "rpc_timeout", "cancel_grace"):
            check_seconds(f"Deadlines.{name}", getattr(self, name), optional=True)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: float | None) -> Deadlines:
        """Defaults, overridden by the environment, overridden by explicit arguments."""
        source = os.environ if env is None else env
        values: dict[str, float | None] = {}
        for name, var in (
            ("compute_timeout", ENV_COMPUTE_TIMEOUT),
            ("output_timeout", ENV_OUTPUT_TIMEOUT),
            ("rpc_timeout", ENV_RPC_TIMEOUT),
            ("cancel_grace", ENV_CANCEL_GRACE),
        ):
            raw = source.get(var)
            if raw is not None:
                values[name] = _parse_seconds(var, raw)
        values.update(overrides)
        return cls(**values)


def _parse_seconds(var: str, raw: str) -> float | None:
    text = raw.strip().lower()
    if text in ("", "none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{var}={raw!r} is not a number of seconds") from None
    if not 0 <= value <= MAX_SECONDS:  # NaN, inf, negative, or past the waits' limit
        raise UsageError(
            f"{var}={raw!r} must be a number of seconds from 0 (no deadline) to {MAX_SECONDS:,.0f}, or 'none'"
        )
    return None if value == 0 else value
