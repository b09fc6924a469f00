"""Device events: a real event, nothing on CPU, and never a silent no-op elsewhere (F1)."""

from __future__ import annotations

import pytest
import torch

from omni_async.transport.errors import DeviceSyncUnavailable
from omni_async.transport.platform import DeviceSync, default_device, record_device_event, wait_device_event


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("cpu")])
def test_host_synchronous_devices_need_no_event(device: str | torch.device) -> None:
    ev = record_device_event(torch.device(device))
    assert ev is None
    wait_device_event(ev)  # nothing to wait for
    assert record_device_event(torch.device(device), force_sync=True) is None


def test_default_device_follows_the_machine() -> None:
    dev = default_device()
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        assert record_device_event() is None


@pytest.mark.parametrize("kind", ["privateuseone", "hpu", "xla"])
def test_an_accelerator_without_events_gets_a_sync_marker_not_nothing(kind: str) -> None:
    ev = record_device_event(torch.device(kind))
    assert isinstance(ev, DeviceSync) and ev.device.type == kind
    # This build cannot synchronize that device either: refuse, never copy unordered.
    with pytest.raises(DeviceSyncUnavailable):
        wait_device_event(ev)


def test_not_an_event_is_rejected() -> None:
    with pytest.raises(TypeError):
        wait_device_event(object())  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_records_a_real_event_without_blocking() -> None:
    ev = record_device_event(torch.device("cuda"))
    assert isinstance(ev, torch.cuda.Event)
    forced = record_device_event(torch.device("cuda"), force_sync=True)
    assert isinstance(forced, DeviceSync)
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
    wait_device_event(ev, s)
    wait_device_event(forced)
    s.synchronize()
