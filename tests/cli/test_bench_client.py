"""Issue 31: the bench's client bytes without fresh memory (``ClientBytes``) are the
seed's (``to_client_bytes``) bit for bit, and reuse their memory once dropped."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_async.cli.bench_client import ClientBytes
from omni_async.core.messages import DiffusionOutput
from omni_async.engine.owned import POOLED_FROM_BYTES, HostBuffers
from omni_async.models.synthetic import to_client_bytes


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int64]
)
def test_the_bytes_are_the_seeds_across_slices_and_dtypes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    # Values beyond -1..1 (clamped), the exact edges, and a size that ends mid-slice.
    x = torch.rand((3, 37, 29), generator=gen, dtype=torch.float64) * 3.2 - 1.6
    x.view(-1)[:4] = torch.tensor([-1.0, 0.0, 1.0, 1.0 / 127.5], dtype=torch.float64)
    t = (x * 100).to(dtype) if not dtype.is_floating_point else x.to(dtype)
    output = DiffusionOutput("r", {"image": t, "note": "not a tensor"})
    made = ClientBytes(chunk=1000)(output)  # 3 x 37 x 29 = 3219 elements: four slices
    assert set(made) == {"image"} and made["image"].dtype == np.uint8
    assert bytes(made["image"]) == to_client_bytes(output)["image"]


def test_large_bytes_reuse_their_memory_once_dropped_and_never_before() -> None:
    buffers = HostBuffers()
    make = ClientBytes(buffers)
    frames = torch.rand(2 * POOLED_FROM_BYTES) * 2 - 1  # float32: a pooled uint8 result
    kept = make(DiffusionOutput("a", {"frames": frames}))["frames"]
    first = bytes(kept)
    other = make(DiffusionOutput("b", {"frames": -frames}))["frames"]
    assert bytes(kept) == first and kept.ctypes.data != other.ctypes.data and buffers.fresh == 2
    del kept, other
    again = make(DiffusionOutput("c", {"frames": frames}))["frames"]
    assert buffers.reused == 1 and bytes(again) == first
