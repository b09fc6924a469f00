"""The times a worker puts in each output's ``metrics``: true to the device.

Every output a worker ships carries, as ``time.monotonic()`` values in these fields of
``DiffusionOutput.metrics`` (an ``OutputStats``, which reads as a mapping under the same
keys):

* ``forward_started_at`` / ``forward_ended_at``: the forward on the device, from when
  the device began it (a mark recorded on the compute stream right before the model
  call) to when it finished the kernels the forward queued (a mark recorded right after
  the call returned).  A real pipeline returns on the host before its kernels end; its
  forward still runs on the device until ``forward_ended_at`` -- its *tail*.  The whole
  call: one forward for every request of a batch.
* ``forward_returned_at``: when the model call returned on the host (the worker sends
  COMPUTE_DONE right after it); ``forward_ended_at - forward_returned_at`` is the tail.
* ``pack_started_at`` / ``pack_ended_at``: the copy into shared memory (with a JPEG
  encode on the device, where the request asked for one), from when the copy could start
  on the device (a mark on the copy's stream, after it waited for the forward's event
  and the device stage: never the forward's tail nor the stage, whose device time is
  ``device_postprocess_s``, and which the packer runs one output ahead) to when the packed
  output was ready on the host (its stream synchronized, so the copy's end).  On the
  packer thread (the asynchronous output path), or on the main thread (the synchronous
  one: step mode, ``execute_request(sync_output=True)``, the ``"sync"`` baseline): the
  same definitions on both, so they compare.
* ``pack_s``: ``pack_ended_at - pack_started_at``, the copy and the packing alone (on
  an output whose pack function said it packed: it set its own ``pack_s``, the time of
  its call, which the worker replaces; a pack that copies nothing, the in-process
  executor's, leaves it None).

On CUDA the marks are timing events, read on the packer thread once its copy has
synchronized (``omni_async.transport.clock``: the device's times converted to the host's
monotonic clock; the main thread only records them, it never waits).  On a CPU the
marks are the host's clock at the same points (CPU kernels end when the call returns).
A mark the device had not reached when the output was stamped (an output with no device
tensor, whose pack synchronized nothing) reads as its host time.

``time.monotonic()`` is CLOCK_MONOTONIC on Linux: one clock for every process of a host,
so these compare with the engine's own stamps (``RequestTimings``).  The engine reads
them into ``RequestTimings.forward_started_at`` etc.; a worker of another host (or an
output that was not stamped) gives None there.  The device's idle time between two
forwards is the gap between one's ``forward_ended_at`` and the next one's
``forward_started_at`` (``omni_async.cli.figures.idle_gaps``).
"""

from __future__ import annotations

import attrs

from omni_async.core.messages import DiffusionOutput
from omni_async.transport.clock import ClockMark, DeviceClock

__all__ = [
    "FORWARD_ENDED_AT",
    "FORWARD_RETURNED_AT",
    "FORWARD_STARTED_AT",
    "PACK_ENDED_AT",
    "PACK_STARTED_AT",
    "STAMPS",
    "ForwardMarks",
    "stamped",
    "timed",
]

FORWARD_STARTED_AT = "forward_started_at"
FORWARD_ENDED_AT = "forward_ended_at"
FORWARD_RETURNED_AT = "forward_returned_at"
PACK_STARTED_AT = "pack_started_at"
PACK_ENDED_AT = "pack_ended_at"
#: Every key this module defines, in the order the steps happen.
STAMPS: tuple[str, ...] = (FORWARD_STARTED_AT, FORWARD_RETURNED_AT, FORWARD_ENDED_AT, PACK_STARTED_AT, PACK_ENDED_AT)


@attrs.frozen(eq=False)
class ForwardMarks:
    """A forward's marks (``DeviceClock.mark``): ``started`` right before the model call,
    ``ended`` right after it returned (its ``host_at``: the host's return)."""

    started: ClockMark
    ended: ClockMark


def stamped(output: DiffusionOutput, **stamps: float) -> DiffusionOutput:
    """``output`` with ``stamps`` added to its metrics (its other fields as they are)."""
    return attrs.evolve(output, metrics=output.metrics.set(**stamps))


def timed(
    output: DiffusionOutput,
    clock: DeviceClock,
    forward: ForwardMarks | None,
    copy: ClockMark,
    pack_ended_at: float,
) -> DiffusionOutput:
    """``output`` stamped (module docstring): the forward's marks (None: a streamed chunk,
    which has no forward of its own), the copy's start mark and the host time the packed
    output was ready; ``pack_s`` their difference (where the pack set one).

    Read after the pack synchronized its stream (never waits, ``DeviceClock.time_of``);
    each time is kept in the order the steps happen (a mark not reached yet reads as its
    host time, which may precede an earlier step's device time)."""
    stamps: dict[str, float] = {}
    pack_started = clock.time_of(copy)
    if forward is not None:
        started = clock.time_of(forward.started)
        returned = forward.ended.host_at
        ended = max(clock.time_of(forward.ended), started, returned)
        pack_started = max(pack_started, ended)
        stamps.update({FORWARD_STARTED_AT: started, FORWARD_RETURNED_AT: returned, FORWARD_ENDED_AT: ended})
    pack_ended = max(pack_ended_at, pack_started)
    stamps.update({PACK_STARTED_AT: pack_started, PACK_ENDED_AT: pack_ended})
    if output.metrics.pack_s is not None:
        stamps["pack_s"] = pack_ended - pack_started
    return stamped(output, **stamps)
