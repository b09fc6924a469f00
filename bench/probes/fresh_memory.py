"""Copying 224 MB into fresh memory (``bytes``, torch, numpy, numpy pre-faulted with
``MADV_POPULATE_WRITE``) against memory written before (issue 31;
``bench/results/host_path_profile.md``).

    python3 bench/probes/fresh_memory.py
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

N = 224 << 20  # the uint8 pixels of the 448 MB bf16 video
MADV_POPULATE_WRITE = 23  # Linux 5.14+


def median_ms(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return 1e3 * statistics.median(times)


def main() -> None:
    src = np.random.default_rng(0).integers(0, 255, N, dtype=np.uint8)
    reuse = np.empty(N, np.uint8)
    reuse[:] = 1
    libc = ctypes.CDLL(None)

    def prefaulted() -> np.ndarray[Any, np.dtype[np.uint8]]:
        a = np.empty(N, np.uint8)
        start = a.ctypes.data & ~4095
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(N + a.ctypes.data - start), MADV_POPULATE_WRITE)
        np.copyto(a, src)
        return a

    cases: dict[str, Callable[[], object]] = {
        "fresh numpy (np.copy)": src.copy,
        "fresh bytes (tobytes)": src.tobytes,
        "memory written before (np.copyto)": lambda: np.copyto(reuse, src),
        "fresh numpy + MADV_POPULATE_WRITE": prefaulted,
        "fresh tensor (torch clone)": lambda: torch.from_numpy(src).clone(),
    }
    for name, fn in cases.items():
        ms = median_ms(fn)
        print(f"{name:36} {ms:7.1f} ms  {N / ms / 1e6:5.2f} GB/s")


if __name__ == "__main__":
    main()
