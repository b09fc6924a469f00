"""Absolute timestamps a worker puts in each output's ``metrics`` (for timelines).

The worker stamps every output it ships with when its forward ran and when it was
packed, as ``time.monotonic()`` values in these fields of ``DiffusionOutput.metrics``
(an ``OutputStats``, which reads as a mapping under the same keys):

* ``forward_started_at`` / ``forward_ended_at``: the model call on the worker's main
  thread (the whole call: one forward for every request of a batch);
* ``pack_started_at`` / ``pack_ended_at``: the device stage and the copy into shared
  memory -- on the packer thread (the asynchronous output path), or on the main thread
  (the synchronous one: step mode, ``execute_request(sync_output=True)``).

``time.monotonic()`` is CLOCK_MONOTONIC on Linux: one clock for every process of a host,
so these compare with the engine's own stamps (``RequestTimings``).  The engine reads
them into ``RequestTimings.forward_started_at`` etc.; a worker of another host (or an
output that was not stamped) gives None there.
"""

from __future__ import annotations

import attrs

from omni_async.core.messages import DiffusionOutput

__all__ = ["FORWARD_ENDED_AT", "FORWARD_STARTED_AT", "PACK_ENDED_AT", "PACK_STARTED_AT", "STAMPS", "stamped"]

FORWARD_STARTED_AT = "forward_started_at"
FORWARD_ENDED_AT = "forward_ended_at"
PACK_STARTED_AT = "pack_started_at"
PACK_ENDED_AT = "pack_ended_at"
#: Every key this module defines, in the order the steps happen.
STAMPS: tuple[str, ...] = (FORWARD_STARTED_AT, FORWARD_ENDED_AT, PACK_STARTED_AT, PACK_ENDED_AT)


def stamped(output: DiffusionOutput, **stamps: float) -> DiffusionOutput:
    """``output`` with ``stamps`` added to its metrics (its other fields as they are)."""
    return attrs.evolve(output, metrics=output.metrics.set(**stamps))
