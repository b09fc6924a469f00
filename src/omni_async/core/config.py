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

Per call: ``submit_request``/``submit_batch``/``execute_request``/``execute_batch``
take ``deadlines=``; its ``compute_timeout`` and ``output_timeout`` replace the
executor's for that call (``rpc_timeout`` and ``cancel_grace`` are the executor's).

Environment variables (seconds; ``none`` or ``0`` disables a deadline):
``OMNI_ASYNC_COMPUTE_TIMEOUT``, ``OMNI_ASYNC_OUTPUT_TIMEOUT``, ``OMNI_ASYNC_RPC_TIMEOUT``,
``OMNI_ASYNC_CANCEL_GRACE``.
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


@attrs.frozen
class Deadlines:
    compute_timeout: float | None = 600.0
    output_timeout: float | None = 300.0
    # Every other RPC (path 2): from broadcast to every rank's RPC_RESULT.
    rpc_timeout: float | None = 300.0
    # How long a worker may go on after its compute deadline cancelled its forward
    # before check_health reports it stuck (WorkerStuck); None: never.
    cancel_grace: float | None = 30.0

    def __attrs_post_init__(self) -> None:
        for name in ("compute_timeout", "output_timeout", "rpc_timeout", "cancel_grace"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UsageError(f"{name} must be a number of seconds > 0, or None; got {value!r}")

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
    if value != value or value < 0:  # NaN or negative
        raise UsageError(f"{var}={raw!r} must be a non-negative number of seconds")
    return None if value == 0 else value
