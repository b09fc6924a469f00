"""Device-side ordering and the copies of a pack: the bytes of every leaf into the segment.

The copies are ordered after the forward: a device-side wait on ``ready_event`` on the
stream that will copy, or a host synchronize where no event exists (F1); a CUDA leaf is
copied with ``non_blocking=True`` straight into the (pinned) segment, and each stream is
synchronized ONCE per output (``stage_and_sync``).  The packer runs on its own thread:
the current CUDA device is per thread, hence the explicit ``torch.cuda.device``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from omni_async.transport.pack_walk import Plan
from omni_async.transport.platform import CopyStream, DeviceEvent, wait_device_event

__all__ = [
    "Staging",
    "copy_in",
    "fill_staged",
    "launch_staged",
    "ordered_streams",
    "record_done",
    "stage_and_sync",
    "warm_copy_path",
]


def copy_in(
    seg: torch.Tensor, plan: Plan, stream_for: Callable[[torch.device], torch.cuda.Stream]
) -> list[torch.cuda.Stream]:
    """Copy every shared-memory leaf into the segment; returns the streams to synchronize."""
    streams: list[torch.cuda.Stream] = []
    for src, off, n in plan.shm:
        dst = seg[off : off + n]
        if isinstance(src, torch.Tensor):
            t = src.detach()
            if t.device.type == "cuda":
                s = stream_for(t.device)
                if s not in streams:
                    streams.append(s)
                with torch.cuda.device(t.device), torch.cuda.stream(s):
                    _copy_tensor(dst, t, non_blocking=True)
            else:
                _copy_tensor(dst, t, non_blocking=False)
        elif isinstance(src, np.ndarray):
            np.copyto(dst.numpy().view(src.dtype).reshape(src.shape), src, casting="no")
        else:
            data = src.cast("B") if isinstance(src, memoryview) else src
            dst.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return streams


def _copy_tensor(dst: torch.Tensor, t: torch.Tensor, *, non_blocking: bool) -> None:
    if t.numel() == 0:
        return
    if t.is_contiguous():
        # Raw bytes: bit-exact for every dtype (NaN payloads, bf16, fp8), no cast kernel.
        dst.copy_(t.reshape(-1).view(torch.uint8), non_blocking=non_blocking)
    else:
        dst.view(t.dtype).view(t.shape).copy_(t, non_blocking=non_blocking)


def ordered_streams(
    d2h_stream: CopyStream, ready_event: DeviceEvent | None
) -> Callable[[torch.device], torch.cuda.Stream]:
    """The stream to copy from ``dev`` on, ordered after the forward: a device-side wait on
    the stream that will copy, or a host synchronize (now) where no event exists (F1)."""

    def stream_for(dev: torch.device) -> torch.cuda.Stream:
        if d2h_stream is not None and d2h_stream.device == dev:
            return d2h_stream
        return torch.cuda.current_stream(dev)

    waited: list[torch.cuda.Stream] = []

    def ordered_stream(dev: torch.device) -> torch.cuda.Stream:
        s = stream_for(dev)
        if s not in waited:
            if isinstance(ready_event, torch.cuda.Event):
                wait_device_event(ready_event, s)
            waited.append(s)
        return s

    if ready_event is not None and not isinstance(ready_event, torch.cuda.Event):
        wait_device_event(ready_event)
    return ordered_stream


def stage_and_sync(
    plan: Plan, ordered_stream: Callable[[torch.device], torch.cuda.Stream], streams: list[torch.cuda.Stream]
) -> None:
    """Copy the small (inline) device tensors to host, then synchronize every stream once."""
    staging = launch_staged(plan, ordered_stream, streams)
    # One synchronize per stream per output, not per tensor.
    for s in streams:
        s.synchronize()
    fill_staged(staging)


Staging = list[tuple[torch.Tensor, bytearray]]


def launch_staged(
    plan: Plan, ordered_stream: Callable[[torch.device], torch.cuda.Stream], streams: list[torch.cuda.Stream]
) -> Staging:
    """Queue the copies of the small (inline) device tensors to pinned host buffers (a CPU
    tensor is copied now); adds their streams to ``streams``.  ``fill_staged`` writes the
    buffers into the message once those streams have finished."""
    staging: Staging = []
    for t, buf in plan.staged:
        s = ordered_stream(t.device) if t.device.type == "cuda" else None
        if s is not None:
            if s not in streams:
                streams.append(s)
            host = torch.empty((t.numel(),), dtype=t.dtype, pin_memory=True)
            with torch.cuda.device(t.device), torch.cuda.stream(s):
                host.copy_(t.reshape(-1), non_blocking=True)
        else:
            host = t.reshape(-1).to("cpu")
        staging.append((host, buf))
    return staging


def fill_staged(staging: Staging) -> None:
    """The staged bytes into their message buffers (their copies have finished)."""
    for host, buf in staging:
        buf[:] = host.view(torch.uint8).numpy().tobytes()


def record_done(streams: list[torch.cuda.Stream]) -> list[torch.cuda.Event]:
    """An event on each stream after the copies queued so far: waiting for them waits for
    this output's copies alone, not for a later output's queued behind them."""
    events = []
    for s in streams:
        e = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
        e.record(s)
        events.append(e)
    return events


def warm_copy_path(stream: torch.cuda.Stream) -> None:
    """Run the copy path once on ``stream`` with a few bytes: torch's pinned host allocator
    (the staging of small device tensors), the device-to-host copy and the stream's
    synchronize are initialised here -- the packer calls it while starting, on its own
    thread -- instead of in the first request's pack."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        src = torch.zeros(4096, dtype=torch.uint8, device=stream.device)
        host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
        host.copy_(src, non_blocking=True)
    stream.synchronize()
