"""Issue 29: the uint8 finalize of ``"bench-u8"`` against absolute values, not only against
its reference function.

An image in [-1, 1] becomes uint8 as ``x * 127.5 + 127.5``, clamped to 0..255 and cast;
the cast truncates, so 0 is 127 (``u8_eager``'s docstring).  Each way the library
converts -- the reference (``u8_eager``), the fused kernel (``U8``, compiled on the CPU
here on purpose, on CUDA with ``-m cuda``), the device stage (``to_uint8``) and the host
conversion (``to_client_bytes``) -- maps -3, -1.5, -1, 0, 1, 1.5, 3 in float32, bfloat16
and float16 to 0, 0, 0, 127, 255, 255, 255.  A test that only compares a kernel with the
reference passes when both are wrong the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from omni_async.core.messages import DiffusionOutput
from omni_async.models.synthetic import U8, to_client_bytes, to_uint8, u8_eager
from omni_async.worker.finalize import FLOAT_DTYPES, FusedPointwise

VALUES = (-3.0, -1.5, -1.0, 0.0, 1.0, 1.5, 3.0)
EXPECTED = (0, 0, 0, 127, 255, 255, 255)
# Enough copies for the fused kernel's path (it runs eager under min_numel elements).
COPIES = (U8.min_numel + len(VALUES) - 1) // len(VALUES)

Convert = Callable[[torch.Tensor], torch.Tensor]


def values(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    x = torch.tensor(VALUES, dtype=dtype, device=device)
    assert x.tolist() == list(VALUES)  # each value is exact in every float dtype
    return x.repeat(COPIES)


def assert_absolute(got: torch.Tensor) -> None:
    assert got.dtype == torch.uint8
    table = got.cpu().reshape(COPIES, len(VALUES))
    assert bool((table == table[0]).all())
    assert tuple(table[0].tolist()) == EXPECTED, dict(zip(VALUES, table[0].tolist(), strict=True))


def via_stage(x: torch.Tensor) -> torch.Tensor:
    out = to_uint8(DiffusionOutput("r", {"image": x}))
    image = out.output["image"]
    assert isinstance(image, torch.Tensor)
    return image


def via_host(x: torch.Tensor) -> torch.Tensor:
    data = to_client_bytes(DiffusionOutput("r", {"image": x}))["image"]
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "convert", [u8_eager, via_stage, via_host], ids=["reference", "device-stage", "host-conversion"]
)
def test_each_conversion_maps_the_absolute_values(convert: Convert, dtype: torch.dtype) -> None:
    assert_absolute(convert(values(dtype)))


@pytest.mark.slow  # Inductor's C++ backend compiles for seconds
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_the_fused_kernel_maps_the_absolute_values_on_cpu(dtype: torch.dtype) -> None:
    fused = FusedPointwise(u8_eager, devices=("cpu",))
    got, was_fused = fused.apply(values(dtype))
    assert was_fused, fused.status("cpu", dtype)
    assert_absolute(got)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_the_fused_kernel_and_the_stage_map_the_absolute_values_on_cuda(dtype: torch.dtype) -> None:
    x = values(dtype, "cuda")
    got, was_fused = U8.apply(x)
    assert was_fused, U8.status("cuda", dtype)
    assert_absolute(got)
    assert_absolute(u8_eager(x))
    staged = to_uint8(DiffusionOutput("r", {"image": x}))
    assert staged.metrics["finalize_fused"] == 1.0
    assert_absolute(staged.output["image"])
