"""Per-platform device events: how the packer knows the forward has finished writing.

The worker's main thread calls ``record_device_event`` right after the forward (before
COMPUTE_DONE); the packer thread calls ``wait_device_event`` before its copies read the
output.  Three outcomes, and no fourth:

* CUDA: a real ``torch.cuda.Event`` recorded on the producing (current) stream.
  Recording only enqueues a marker: the host never synchronizes here (F14).  The
  packer makes its side stream wait on the event, so the copy is ordered after the
  forward's last kernel on the device, without the host waiting either.
* CPU (and ``meta``): ``None``.  CPU kernels have finished when the forward returns.
* Any other accelerator: its own event type when torch has one for it, otherwise a
  ``DeviceSync`` marker that makes the packer synchronize the producing stream (or
  the whole device) before copying.  Returning ``None`` there would be the reference
  implementation's bug (F1): the copy would race the forward.  If the marker cannot
  be honoured either, ``wait_device_event`` raises ``DeviceSyncUnavailable``.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import attrs
import torch

from omni_async.transport.errors import DeviceSyncUnavailable

__all__ = [
    "CopyStream",
    "DeviceEvent",
    "DeviceSync",
    "StreamLike",
    "default_device",
    "record_device_event",
    "record_stream_event",
    "wait_device_event",
]

# Device types whose kernels complete synchronously on the host thread.
_HOST_SYNCHRONOUS = frozenset({"cpu", "meta"})


@attrs.frozen
class DeviceSync:
    """Marker: this device could not record an event; synchronize before reading its output.

    ``stream`` is the producing stream when torch could name it at record time; then only
    that stream is synchronized, otherwise the whole device.
    """

    device: torch.device
    # Whatever the backend's ``current_stream`` returned at record time: the backend is
    # looked up by name at run time, so its stream type is only known then.
    stream: Any = None


@attrs.frozen
class GenericEvent:
    """An event of a non-CUDA accelerator (``torch.Event`` or ``torch.<backend>.Event``)."""

    device: torch.device
    event: Any  # torch.<backend>.Event, found by name at run time: no static type


DeviceEvent: TypeAlias = "torch.cuda.Event | GenericEvent | DeviceSync"

# A stream a device event can be waited on from: any torch stream (``torch.cuda.Stream``
# and the other backends' streams derive from ``torch.Stream``), or None (see
# ``wait_device_event``: the calling thread's current stream, or a host-side wait).
StreamLike: TypeAlias = "torch.Stream | None"

# The packer's side stream for the device->host copies: a CUDA stream when the worker
# computes on a CUDA device, None elsewhere (each device's current stream is used, and
# host tensors are copied on the host).
CopyStream: TypeAlias = "torch.cuda.Stream | None"


def default_device() -> torch.device:
    """The device a worker computes on when the caller does not say: CUDA if present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def record_device_event(device: torch.device | None = None, *, force_sync: bool = False) -> DeviceEvent | None:
    """Mark the point after the forward on ``device``'s current stream; never blocks the host.

    ``force_sync=True`` returns a ``DeviceSync`` even where an event is possible (tests
    and platforms whose events are known to be unreliable).
    """
    dev = default_device() if device is None else torch.device(device)
    if dev.type in _HOST_SYNCHRONOUS:
        return None
    if dev.type == "cuda":
        if force_sync:
            return DeviceSync(dev, torch.cuda.current_stream(dev))
        # Timing off: a plain event is cheaper to record and to wait on.
        ev = torch.cuda.Event(enable_timing=False, blocking=False)  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
        ev.record(torch.cuda.current_stream(dev))
        return ev
    stream = _current_stream(dev)
    if not force_sync:
        ev_obj = _make_event(dev)
        if ev_obj is not None:
            try:
                if stream is not None:
                    ev_obj.record(stream)
                else:
                    ev_obj.record()
                return GenericEvent(dev, ev_obj)
            except Exception:  # noqa: BLE001  # backends fail in many ways (AssertionError when not compiled in)
                pass  # this backend's event cannot record: synchronize instead (F1)
    return DeviceSync(dev, stream)


def record_stream_event(stream: CopyStream) -> DeviceEvent | None:
    """Mark the point after what ``stream`` has queued so far (another stream waits for it
    with ``wait_device_event``); None for no stream: the host's calls have finished."""
    if stream is None:
        return None
    ev = torch.cuda.Event(enable_timing=False, blocking=False)  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
    ev.record(stream)
    return ev


def wait_device_event(ev: DeviceEvent | None, stream: StreamLike = None) -> None:
    """Order the packer's copies after the event.

    CUDA event: ``stream.wait_event(ev)`` (a device-side wait; the host goes on), or the
    current stream of the calling thread when ``stream`` is None.  ``DeviceSync``: a
    host-side synchronize of the producing stream or device.  ``None``: nothing to wait for.
    """
    if ev is None:
        return
    if isinstance(ev, torch.cuda.Event):
        target = stream if stream is not None else torch.cuda.current_stream()
        target.wait_event(ev)
        return
    if isinstance(ev, GenericEvent):
        if stream is not None and hasattr(stream, "wait_event"):
            stream.wait_event(ev.event)
        else:
            ev.event.synchronize()
        return
    if isinstance(ev, DeviceSync):
        _synchronize(ev)
        return
    raise TypeError(f"not a device event: {type(ev).__qualname__}")


def _backend(dev: torch.device) -> Any:
    return getattr(torch, dev.type, None)


def _current_stream(dev: torch.device) -> Any:
    acc = getattr(torch, "accelerator", None)
    try:
        if acc is not None and acc.is_available() and acc.current_accelerator().type == dev.type:
            return acc.current_stream(dev)
    except Exception:  # noqa: BLE001
        pass
    mod = _backend(dev)
    fn = getattr(mod, "current_stream", None)
    if fn is not None:
        try:
            return fn()
        except Exception:  # noqa: BLE001
            return None
    return None


def _make_event(dev: torch.device) -> Any:
    mod = _backend(dev)
    cls = getattr(mod, "Event", None)
    if cls is not None:
        try:
            return cls()
        except Exception:  # noqa: BLE001  # e.g. AssertionError "Torch not compiled with XPU enabled"
            pass
    generic = getattr(torch, "Event", None)
    if generic is not None:
        try:
            return generic(device=dev)
        except Exception:  # noqa: BLE001
            pass
    return None


def _synchronize(ev: DeviceSync) -> None:
    if ev.stream is not None and hasattr(ev.stream, "synchronize"):
        ev.stream.synchronize()
        return
    mod = _backend(ev.device)
    fn = getattr(mod, "synchronize", None)
    if fn is not None:
        fn()
        return
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        try:
            if acc.is_available() and acc.current_accelerator().type == ev.device.type:
                acc.synchronize(ev.device)
                return
        except (RuntimeError, AttributeError, TypeError):
            pass
    raise DeviceSyncUnavailable(
        f"device {ev.device} recorded no event and cannot be synchronized; "
        "refusing to copy its output unordered (it would race the forward)"
    )
