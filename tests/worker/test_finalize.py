"""Issue 20: the uint8 finalize as one fused kernel (``omni_async.worker.finalize``).

``bench-u8``'s device stage (``models.synthetic.to_uint8``) runs ``U8``: ``u8_eager``
fused by ``torch.compile`` on CUDA, eager elsewhere.  On the CPU the kernel is compiled
here on purpose (``devices=("cpu",)``: Inductor's C++ backend, gcc) to check that the
fused result is eager's, bit for bit, for every float dtype, over values that sit on
the rounding and truncation boundaries.  A compile that fails falls back to eager with
a logged reason, and the call still answers.  The CUDA tests (``-m cuda``) check the
same on the GPU, and that the stage is ordered after the forward's event.
"""

from __future__ import annotations

import logging

import pytest
import torch

from omni_async.core.messages import DiffusionOutput
from omni_async.models.synthetic import BENCH_U8, U8, to_uint8, u8_eager
from omni_async.worker.finalize import FLOAT_DTYPES, FusedPointwise
from omni_async.worker.postprocess import launch_device_stage

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def boundary_values(dtype: torch.dtype, n: int = 1 << 17) -> torch.Tensor:
    """Values in and around -1..1 whose eager uint8 lands on every boundary: each
    ``(k - 127.5) / 127.5`` for k in 0..255 and its neighbours a few units in the last
    place away, then random values beyond the clamp (-1.5..1.5)."""
    k = torch.arange(256, dtype=torch.float64)
    centre = ((k - 127.5) / 127.5).to(dtype)
    parts = [centre]
    step = centre
    for _ in range(4):
        up = torch.nextafter(step.float(), torch.tensor(2.0)).to(dtype)
        down = torch.nextafter(step.float(), torch.tensor(-2.0)).to(dtype)
        parts += [up, down]
        step = up
    gen = torch.Generator().manual_seed(20)
    rand = (torch.rand(n, generator=gen, dtype=torch.float32) * 3.0 - 1.5).to(dtype)
    return torch.cat([*parts, rand])


@pytest.mark.slow  # compiling with Inductor's C++ backend takes seconds the first time
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_the_fused_kernel_is_eager_bit_for_bit_on_cpu(dtype: torch.dtype) -> None:
    fused = FusedPointwise(u8_eager, devices=("cpu",))
    x = boundary_values(dtype)
    for shape in ((x.numel(),), (2, x.numel() // 2), (x.numel() // 64, 8, 8)):
        xs = x[: x.numel() // 64 * 64].reshape(shape) if len(shape) == 3 else x.reshape(shape)
        got, was_fused = fused.apply(xs)
        assert was_fused, fused.status("cpu", dtype)
        want = u8_eager(xs)
        assert got.dtype == torch.uint8 and got.shape == xs.shape
        assert torch.equal(got, want), (got.int() - want.int()).abs().max()
    # A size that is not a multiple of 16 takes the kernel's one-row form.
    odd = x[: x.numel() - 7]
    got, was_fused = fused.apply(odd)
    assert was_fused and torch.equal(got, u8_eager(odd))
    assert fused.status("cpu", dtype) == "fused"


@pytest.mark.slow  # importing torch.compile's machinery takes seconds
def test_a_compile_that_fails_runs_eager_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    # An Inductor option that does not exist: torch.compile refuses it, as it would a
    # missing compiler or backend.  The call still answers, eagerly.
    fused = FusedPointwise(u8_eager, devices=("cpu",), min_numel=16)
    fused.options = {"emulate_precision_casts": True, "no_such_inductor_option": 1}
    x = boundary_values(torch.float32, 256)
    with caplog.at_level(logging.WARNING, logger="omni_async.worker.finalize"):
        got, was_fused = fused.apply(x)
        again, again_fused = fused.apply(x)
    assert not was_fused and not again_fused
    assert torch.equal(got, u8_eager(x)) and torch.equal(again, got)
    status = fused.status("cpu", torch.float32)
    assert status.startswith("eager: ") and "no_such_inductor_option" in status, status
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "running eager instead" in warnings[0], warnings  # logged once per key


def test_what_does_not_pay_to_compile_runs_eager_without_compiling() -> None:
    fused = FusedPointwise(u8_eager, devices=("cpu",), min_numel=1 << 10)
    small = boundary_values(torch.float32, 16)[:100]
    strided = boundary_values(torch.float32).reshape(2, -1).t()
    for x in (small, strided):
        got, was_fused = fused.apply(x)
        assert not was_fused and torch.equal(got, u8_eager(x))
    assert fused.status("cpu", torch.float32) == "not compiled yet"
    # Off CUDA by default: the CPU worker's packer thread copies rather than compiles.
    assert U8.status("cpu", torch.bfloat16).startswith("eager: compiling is off for cpu")


def test_bench_u8_stage_says_which_path_ran_and_keeps_eager_semantics() -> None:
    x = boundary_values(torch.bfloat16).reshape(4, -1)
    out = to_uint8(DiffusionOutput("r", {"video": x, "n": 3}))
    assert torch.equal(out.output["video"], u8_eager(x)) and out.output["n"] == 3
    assert out.metrics["finalize_fused"] == 0.0  # CPU: eager
    assert BENCH_U8.warmup is not None
    BENCH_U8.warm_up(torch.device("cpu"))  # a no-op off CUDA
    assert U8.status("cpu", torch.bfloat16).startswith("eager")


# ------------------------------------------------------------------------------ CUDA


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_the_fused_kernel_is_eager_bit_for_bit_on_cuda(dtype: torch.dtype) -> None:
    U8.warm_up("cuda", [dtype])
    assert U8.status("cuda", dtype) == "fused"
    x = boundary_values(dtype).cuda()
    # A 1080p bf16 video's frame count is large: a few frames of it, and odd sizes.
    gen = torch.Generator(device="cuda").manual_seed(1)
    video = (torch.rand(9, 1080, 1920, 3, device="cuda", generator=gen) * 2.4 - 1.2).to(dtype)
    for t in (x, x[: x.numel() - 7], video, video[:, :1001, :777].contiguous()):
        got, was_fused = U8.apply(t)
        assert was_fused
        want = u8_eager(t)
        assert torch.equal(got, want), (got.int() - want.int()).abs().max()


@cuda
@pytest.mark.cuda
def test_the_fused_stage_waits_for_the_forwards_event() -> None:
    """The forward leaves a long kernel queued, then writes its output; the stage on the
    side stream, ordered after the forward's event, must see the written output."""
    U8.warm_up("cuda", [torch.bfloat16])
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
    x = torch.zeros(1 << 22, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    # ~0.1 s of GPU time queued on the forward's stream
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # unannotated in torch
    x.fill_(0.5)  # the forward's last write, behind the sleep
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
    event.record()
    out = launch_device_stage(to_uint8, DiffusionOutput("r", {"x": x}), side, event)
    side.synchronize()
    assert out.metrics["finalize_fused"] == 1.0
    assert bool((out.output["x"] == u8_eager(torch.full((1,), 0.5, dtype=torch.bfloat16)).cuda()).all())
