"""Protocol traces: what the implementation did, in the spec's vocabulary.

Tracing is off by default: every traced component takes ``tracer: Tracer | None``
and records through ``emit``, which skips the call when it is None, so the cost when
off is one function call.

A trace is a sequence of ``TraceEvent``: an action name plus flat fields
(strings, ints, bools, None).  Components record at the points where the system
is in a consistent state (the pump after it dequeued a message, the registry
after a state change), never in the middle of one.

Actions recorded by the executor side (the fields each carries):

* ``PumpRecv``: kind, rank, rpc_id, ids (comma-separated), output_id, ok (ids: a
  COMPUTE_DONE's, or those a failed RPC_RESULT names: ``compute_failed``)
* ``Create``: output_id (a record is created in REGISTRY_INITIAL)
* ``Fire``: output_id, event, src, dst (one request-machine transition)
* ``Remove``: output_id, state (the record reached a terminal state)
* ``WaiterAdd``: output_id
* ``WaiterResolve``: output_id, outcome (output | failure | dropped | timeout | orphaned | shutdown | worker_died
  | cancelled)
* ``PayloadDeliver`` / ``PayloadRelease``: output_id
* ``ProtocolError``: output_id, reason
* ``Late``: output_id, kind (cd | out), expected (a message of an id that already
  finished, swallowed by the registry's memory of finished ids: expected, or a
  protocol error, which a ``ProtocolError`` event follows)
* ``RpcSubmit``: rpc_id, method, ranks (comma-separated), reply_rank, consumer (or None)
* ``RpcAnswer``: rpc_id, rank, ok
* ``RpcResolve``: rpc_id, outcome (ok | failed | cancelled | timeout | consumer_gone | shutdown | worker_died)
* ``DispatchDrop``: output_id, rpc_id, reason (orphan | rejected | failed | cancelled | timeout):
  the dispatcher is about to drop an id its call announced (a ``Drop`` follows)
* ``Shutdown``: the registry closed (inside a ``FailAll`` with close)

Call boundaries: the first event of a registry call, so that the checker knows
which call every later state change belongs to (a DROP only inside a drop, an
ABANDON only inside a cancel, an expiry, a consumer's release or a claim race, a
FORCE_RELEASE only inside a fail_all):

* ``Drop``: output_id (``OutputRegistry.drop``, also for an unknown id)
* ``Cancel``: output_id (``OutputRegistry.cancel``, also when it finds nothing to do)
* ``ReleaseConsumer``: consumer (``OutputRegistry.release_consumer``)
* ``Expire``: count (``OutputRegistry.expire``, only when at least one deadline passed: a
  record whose COMPUTE_DONE arrived is abandoned, one still waiting for it is force-released)
* ``FailAll``: outcome, close (``OutputRegistry.fail_all``: worker death, shutdown)

A ``PumpRecv`` opens the handling of a message, a ``WaiterAdd`` a ``wait``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import attrs

FieldValue = str | int | bool | None


@attrs.frozen
class TraceEvent:
    action: str
    fields: Mapping[str, FieldValue]


class Tracer(Protocol):
    def __call__(self, action: str, fields: Mapping[str, FieldValue]) -> None: ...


def emit(tracer: Tracer | None, action: str, /, **fields: FieldValue) -> None:
    """Record ``action`` with ``fields`` on ``tracer``; nothing when tracing is off (None)."""
    if tracer is not None:
        tracer(action, fields)
