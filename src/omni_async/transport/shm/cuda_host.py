"""Registering shared memory with CUDA as pinned host memory, and the error it can leave.

A device-to-host copy into registered (page-locked) memory is a straight DMA; into
ordinary memory the driver stages it through a bounce buffer at a fraction of the
speed.  Registration is dear, so a mapping registers once (``mapping.SegmentMapping``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Protocol, SupportsInt

import torch

__all__ = ["clear_cuda_error", "host_register", "host_unregister"]


class _CudaRuntime(Protocol):
    """The calls used here of ``torch.cuda.cudart()`` (torch's binding of the CUDA runtime;
    each returns a ``cudaError`` enum value)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int, /) -> SupportsInt: ...  # noqa: N802 -- CUDA's name

    def cudaHostUnregister(self, ptr: int, /) -> SupportsInt: ...  # noqa: N802 -- CUDA's name


def _cudart() -> _CudaRuntime:
    fn: Callable[[], _CudaRuntime] = torch.cuda.cudart  # unannotated in torch
    return fn()


@functools.cache
def _cudart_lib() -> ctypes.CDLL | None:
    """The libcudart torch loaded, through ctypes; None if torch linked it statically."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
        return ctypes.CDLL(paths[0]) if paths else None
    except OSError:
        return None


def clear_cuda_error() -> None:
    """Clear the error a failed CUDA runtime call left pending in this thread.

    A failed ``cudaHostRegister`` is not only a return code: the runtime keeps the error
    as this thread's "last error", and torch's check after its next kernel launch
    reports it as that kernel's failure.  Measured on the H200 (``bench/probes/
    probe_register.py``): a second register of the same range returned 712, and the
    next ``torch.ones(...) * 2`` raised "part or all of the requested memory range is
    already mapped".  ``torch.cuda.cudart()`` has no ``cudaGetLastError``, so it is
    called through ctypes on the libcudart that torch loaded (found in
    ``/proc/self/maps``: the same library instance, so the same per-thread state).
    """
    lib = _cudart_lib()
    if lib is not None:
        lib.cudaGetLastError()
        return
    # torch linked cudart statically: let a zero-length kernel's launch check consume it.
    sleep: Callable[[int], object] = torch.cuda._sleep  # unannotated in torch
    try:
        sleep(0)
    except RuntimeError:
        pass


def host_register(ptr: int, size: int) -> int:
    """``cudaHostRegister(ptr, size, 0)``; returns the CUDA error code (0: pinned), the error cleared."""
    rc = int(_cudart().cudaHostRegister(ptr, size, 0))
    if rc != 0:
        clear_cuda_error()
    return rc


def host_unregister(ptr: int) -> None:
    """Undo ``host_register``; quiet when CUDA is already torn down (interpreter exit)."""
    try:
        if int(_cudart().cudaHostUnregister(ptr)) != 0:
            clear_cuda_error()
    except RuntimeError:
        pass
