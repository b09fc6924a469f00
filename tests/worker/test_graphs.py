"""``CudaGraphForward``: a callable replayed as CUDA graphs per input signature, the same
numbers as the eager call, and the eager call wherever a graph could be wrong or cannot be
made.  The graphs themselves run on the device only (``cuda``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
import torch

from omni_async.worker.graphs import CudaGraphForward


def test_refuses_a_device_that_is_not_cuda_and_empty_limits() -> None:
    with pytest.raises(ValueError, match="CUDA graphs run on a CUDA device, got 'cpu'"):
        CudaGraphForward(torch.relu, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees none here"):
            CudaGraphForward(torch.relu, device="cuda:0")
        return
    with pytest.raises(ValueError, match="max_graphs and warmup_calls must be >= 1"):
        CudaGraphForward(torch.relu, device="cuda:0", max_graphs=0)


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda", 0)


class _Block(torch.nn.Module):
    """A transformer-ish block: enough kernels (GEMMs, a norm, attention, GELU) that a
    different kernel choice under capture would show in the bits."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, scale: torch.Tensor, *, gate: float = 1.0) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attn = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        h = x + gate * self.out(attn) * scale[:, None, None]
        out: torch.Tensor = h + self.mlp(self.norm(h))
        return out


def _block(dev: torch.device, dtype: torch.dtype = torch.bfloat16) -> _Block:
    torch.manual_seed(0)
    return _Block(64).to(dev, dtype).eval()


@pytest.mark.cuda
def test_replays_equal_the_eager_call_bit_for_bit_and_outputs_are_the_callers() -> None:
    dev = _cuda()
    block = _block(dev)
    graphed = CudaGraphForward(block.forward, device=dev)
    held = []
    with torch.inference_mode():
        for i in range(4):
            x = torch.randn(2, 16, 64, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(i))
            scale = torch.full((2,), 0.5 + i, device=dev, dtype=torch.bfloat16)
            got = graphed(x, scale, gate=0.25)
            want = block(x, scale, gate=0.25)
            assert torch.equal(got, want), i
            held.append((got, want.clone()))
    assert graphed.stats.captures == 1 and graphed.stats.replays == 4 and graphed.stats.eager_calls == 0
    # Each result is the caller's own tensor: a later replay did not write over it.
    for got, want in held:
        assert torch.equal(got, want)


@pytest.mark.cuda
def test_each_signature_gets_a_graph_up_to_max_graphs_then_runs_eagerly() -> None:
    dev = _cuda()
    block = _block(dev)
    graphed = CudaGraphForward(block.forward, device=dev, max_graphs=2)
    with torch.inference_mode():
        for rows in (8, 16, 24, 8, 24):
            x = torch.randn(2, rows, 64, device=dev, dtype=torch.bfloat16)
            scale = torch.ones(2, device=dev, dtype=torch.bfloat16)
            assert torch.equal(graphed(x, scale), block(x, scale)), rows
        # A value that is not a tensor is part of the signature: a new gate, a new graph
        # (none left: eager).
        assert torch.equal(graphed(x, scale, gate=0.5), block(x, scale, gate=0.5))
    assert graphed.graphs() == 2
    assert graphed.stats.captures == 2
    assert graphed.stats.replays == 2 + 1  # 8, 16, then 8 again; 24 never got a graph
    assert graphed.stats.eager_calls == 3  # 24 twice, and the new gate


@pytest.mark.cuda
def test_host_tensors_unhashable_values_and_grad_run_eagerly() -> None:
    dev = _cuda()
    seen: list[str] = []

    def fn(x: torch.Tensor, extra: object) -> torch.Tensor:
        seen.append(type(extra).__name__)
        return x * 2 + (extra.to(x.device) if isinstance(extra, torch.Tensor) else 0)

    graphed = CudaGraphForward(fn, device=dev)
    x = torch.arange(4.0, device=dev)
    with torch.no_grad():
        # A host tensor: a capture would bake in the bytes it held at capture.
        for v in (1.0, 2.0):
            assert torch.equal(graphed(x, torch.full((4,), v)), x * 2 + v)
        assert torch.equal(graphed(x, {1, 2}), x * 2)  # a set: not hashable
    w = torch.ones(4, device=dev, requires_grad=True)
    with torch.enable_grad():
        out = graphed(w, None)
        out.sum().backward()  # type: ignore[no-untyped-call]  # eager: autograd saw the call
    assert w.grad is not None and torch.equal(w.grad, torch.full((4,), 2.0, device=dev))
    assert graphed.stats.captures == 0 and graphed.stats.eager_calls == 4


@pytest.mark.cuda
def test_a_call_that_syncs_with_the_host_is_not_captured_and_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    dev = _cuda()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum().item())  # the host reads a device value: no graph can hold that

    graphed = CudaGraphForward(fn, device=dev, name="syncing")
    with caplog.at_level(logging.WARNING, logger="omni_async.worker"):
        for i in range(3):
            x = torch.full((8,), float(i + 1), device=dev)
            assert torch.equal(graphed(x), fn(x)), i
    assert graphed.stats.failed_captures == 1 and graphed.graphs() == 0 and graphed.stats.eager_calls == 3
    warnings = [r.getMessage() for r in caplog.records if "CudaGraphForward(syncing)" in r.getMessage()]
    assert len(warnings) == 1 and "run eagerly" in warnings[0]
    # The device is usable after the failed capture, graphs included.
    ok = CudaGraphForward(lambda t: t + 1, device=dev)
    t = torch.zeros(3, device=dev)
    assert torch.equal(ok(t), t + 1) and ok.stats.captures == 1


class _Box:
    """A container torch's pytree does not know."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@pytest.mark.cuda
def test_an_output_the_wrapper_cannot_copy_runs_eagerly() -> None:
    """Its tensor sits in the graph's memory: the next replay would change it under the caller."""
    dev = _cuda()
    graphed = CudaGraphForward(lambda t: _Box(t * 2), device=dev)
    first = graphed(torch.ones(4, device=dev))
    second = graphed(torch.full((4,), 5.0, device=dev))
    assert torch.equal(first.t, torch.full((4,), 2.0, device=dev)) and torch.equal(
        second.t, torch.full((4,), 10.0, device=dev)
    )
    assert graphed.graphs() == 0 and graphed.stats.failed_captures == 1 and graphed.stats.eager_calls == 2


@pytest.mark.cuda
def test_an_expanded_argument_keeps_its_layout_in_the_graph() -> None:
    """Pipelines pass ``t.expand(batch)`` (stride 0): the captured call sees that layout, as the eager one does."""
    dev = _cuda()
    strides: list[tuple[int, ...]] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        strides.append(t.stride())
        return t * 3 + 1

    graphed = CudaGraphForward(fn, device=dev)
    for v in (5.0, 7.0, 9.0):
        t = torch.tensor(v, device=dev)[None].expand(4)
        assert torch.equal(graphed(t), torch.full((4,), v * 3 + 1, device=dev))
    assert set(strides) == {(0,)} and graphed.stats.replays == 3


@pytest.mark.cuda
def test_other_threads_use_the_device_while_a_capture_runs() -> None:
    """A worker's packer copies on its own stream while the forward's thread captures
    (``capture_error_mode="thread_local"``): neither side fails."""
    dev = _cuda()
    block = _block(dev, torch.float32)
    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:
        stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
        host = torch.empty(1 << 20, pin_memory=True)
        try:
            with torch.cuda.stream(stream):
                src = torch.arange(1 << 20, device=dev, dtype=torch.float32)
                while not stop.is_set():
                    host.copy_(src * 2, non_blocking=True)  # no random draws: see the module docstring
                    stream.synchronize()
        except BaseException as exc:  # noqa: BLE001  # reported below
            errors.append(exc)

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        graphed: Callable[..., torch.Tensor] = CudaGraphForward(block.forward, device=dev, max_graphs=8)
        with torch.inference_mode():
            for rows in (4, 8, 12, 16, 20):
                x = torch.randn(2, rows, 64, device=dev)
                scale = torch.ones(2, device=dev)
                assert torch.equal(graphed(x, scale), block(x, scale)), rows
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
