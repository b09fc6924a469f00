"""Does a failed cudaHostRegister poison the thread's next kernel launch?  And does
``omni_async.transport.shm.cuda_host.clear_cuda_error`` stop that?  Run on a CUDA machine:

    PYTHONPATH=src python3 bench/probes/probe_register.py

Registers one host range twice (the second call fails with 712,
cudaErrorHostMemoryAlreadyRegistered), then launches a kernel; once as is, once after
clearing the pending error.  Prints what happened; results in bench/results/README.md.
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

from omni_async.transport.shm.cuda_host import clear_cuda_error


def kernel_after_failed_register(clear: bool) -> str:
    cr: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    mm = mmap.mmap(-1, 1 << 20)
    t = torch.frombuffer(memoryview(mm), dtype=torch.uint8)
    assert int(cr.cudaHostRegister(t.data_ptr(), 1 << 20, 0)) == 0
    rc = int(cr.cudaHostRegister(t.data_ptr(), 1 << 20, 0))
    if clear:
        clear_cuda_error()
    try:
        y = torch.ones(1000, device="cuda") * 2
        outcome = f"ok (sum {float(y.sum())})"
    except RuntimeError as exc:
        outcome = f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
    assert int(cr.cudaHostUnregister(t.data_ptr())) == 0
    return f"second register -> {rc}; kernel launch after it, clear={clear}: {outcome}"


if __name__ == "__main__":
    torch.ones(1, device="cuda")  # the context and the launch path warm
    print(kernel_after_failed_register(clear=False))
    print(kernel_after_failed_register(clear=True))
