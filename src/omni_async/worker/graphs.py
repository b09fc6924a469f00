"""A module's forward replayed as CUDA graphs (``CudaGraphForward``).

A diffusion forward of many small kernels (PixArt-Sigma at 512x512: 28 layers, 20 steps)
is bound by the host thread that launches them: on the H200 the device would finish each
step's kernels in a fraction of the time the host takes to launch them.  A CUDA graph
launches a whole captured call with one host call.  ``CudaGraphForward`` wraps a
callable (a denoiser's ``forward``) and, per distinct input signature (the shapes, strides
and dtypes of its tensor arguments and the values of the others), captures it once and
then replays the capture: the same kernels on the same inputs, so the same numbers as the
eager call, with the host's launches gone.

Each call copies its tensor arguments into the capture's own input buffers, replays, and
returns a copy of the capture's outputs (the next replay overwrites them), all on the
caller's current stream.  A call runs eagerly instead, as it would unwrapped, where a graph
could give a wrong answer or cannot be made:

* an argument is a tensor on another device (a capture would read its host memory once, at
  capture, and replay that) or requires grad while grad is enabled;
* an argument is neither a tensor nor hashable (the signature could not tell calls apart);
* the stream is already capturing, or ``max_graphs`` signatures have had their capture
  (made or failed) already;
* the capture itself failed (the callable synchronizes with the host, say, as a
  ``.item()`` does), or the output holds an object that is neither a tensor nor a plain
  value (a container ``torch.utils._pytree`` does not know: its tensors could not be copied
  out, and the next replay would change them under the caller): that signature runs
  eagerly from then on, and the failure is logged once.

What a graph cannot see, and so must not change between calls of one signature: Python
state the callable reads (a cache hook's step counter, an attribute set between calls).
The wrapper is for one thread (a worker's forward); it is not re-entrant.  Other threads
may use the device while it captures (the capture is thread-local: a worker's packer
copies on), except to draw from CUDA's default generator, which a capture reserves
(torch raises "Offset increment outside graph capture" in that thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Generic, ParamSpec, TypeVar

import attrs
import torch
from torch.utils import _pytree as pytree

__all__ = ["CudaGraphForward", "GraphStats"]

log = logging.getLogger("omni_async.worker")

P = ParamSpec("P")
R = TypeVar("R")

#: A signature that runs eagerly (not captured, or its capture failed).
_EAGER = "eager"
#: What a captured call's output may hold: tensors (copied out after each replay) and values.
_COPYABLE = (torch.Tensor, type(None), bool, int, float, str, bytes)


@attrs.define
class GraphStats:
    """What a ``CudaGraphForward`` did: calls replayed, calls run eagerly, graphs captured,
    and captures that failed (those signatures run eagerly)."""

    replays: int = 0
    eager_calls: int = 0
    captures: int = 0
    failed_captures: int = 0


@attrs.define
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]  # per flat argument: its buffer, or None (not a tensor)
    output: object  # the captured call's output tree, its tensors in the graph's pool


def _collapsed(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """``t``'s shape and strides with each expanded dimension (stride 0) cut to size 1."""
    return [1 if st == 0 else n for n, st in zip(t.shape, t.stride(), strict=True)], [st or 1 for st in t.stride()]


def _buffer_like(x: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``x``'s shape and strides (an expanded dimension, stride 0, stays
    expanded), to copy ``x`` into before each replay: the captured kernels see the layout
    the eager call would have."""
    shape, strides = _collapsed(x)
    return torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device).expand(x.shape)


def _copy_in(buffer: torch.Tensor, x: torch.Tensor) -> None:
    """``x`` into ``buffer`` (same shape and strides): each expanded dimension's one element."""
    shape, strides = _collapsed(buffer)
    buffer.as_strided(shape, strides).copy_(x.as_strided(shape, x.stride(), x.storage_offset()))


class CudaGraphForward(Generic[P, R]):
    """``fn`` replayed as a CUDA graph per input signature (see the module docstring).

    ``device``: the CUDA device the graphs run on (tensors elsewhere run eagerly);
    ``max_graphs``: at most this many signatures are captured (each holds the memory of one
    call's intermediates); ``warmup_calls``: eager calls on a side stream before a capture,
    as CUDA's libraries need to set up their workspaces outside one; ``name``: what the log
    calls it.
    """

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        device: torch.device | str,
        max_graphs: int = 8,
        warmup_calls: int = 2,
        name: str = "forward",
    ) -> None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaGraphForward({name}): CUDA graphs run on a CUDA device, got {str(dev)!r}")
        if not torch.cuda.is_available():
            raise ValueError(f"CudaGraphForward({name}): CUDA graphs need a CUDA device, and torch sees none here")
        if max_graphs < 1 or warmup_calls < 1:
            raise ValueError(f"CudaGraphForward({name}): max_graphs and warmup_calls must be >= 1")
        self.fn = fn
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        self.max_graphs = max_graphs
        self.warmup_calls = warmup_calls
        self.name = name
        self.stats = GraphStats()
        self._graphs: dict[Hashable, _Graph | str] = {}

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = self._signature(leaves, spec)
        entry = None if key is None else self._graphs.get(key)
        if entry is None and key is not None and len(self._graphs) < self.max_graphs:
            entry = self._capture(key, leaves, spec)
        if not isinstance(entry, _Graph):
            self.stats.eager_calls += 1
            return self.fn(*args, **kwargs)
        for buffer, x in zip(entry.inputs, leaves, strict=True):
            if buffer is not None:
                assert isinstance(x, torch.Tensor)
                _copy_in(buffer, x)
        entry.graph.replay()
        self.stats.replays += 1
        out: R = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.output)
        return out

    def _eager(self, key: Hashable, why: str) -> str:
        self._graphs[key] = _EAGER
        self.stats.failed_captures += 1
        log.warning("CudaGraphForward(%s): %s; calls of this signature run eagerly, as without graphs", self.name, why)
        return _EAGER

    def graphs(self) -> int:
        """How many signatures are captured (and replay)."""
        return sum(isinstance(g, _Graph) for g in self._graphs.values())

    def _signature(self, leaves: list[object], spec: pytree.TreeSpec) -> Hashable | None:
        """The call's key, or None where the call must run eagerly."""
        if torch.cuda.is_current_stream_capturing():
            return None
        grad = torch.is_grad_enabled()
        parts: list[Hashable] = [str(spec)]
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if x.device != self.device or (grad and x.requires_grad):
                    return None
                parts.append((tuple(x.shape), x.stride(), x.dtype))
            else:
                try:
                    hash(x)
                except TypeError:
                    return None
                parts.append(("value", type(x).__qualname__, x))
        parts.append(grad)
        return tuple(parts)

    def _capture(self, key: Hashable, leaves: list[object], spec: pytree.TreeSpec) -> _Graph | str:
        inputs = [_buffer_like(x) if isinstance(x, torch.Tensor) else None for x in leaves]
        for buffer, x in zip(inputs, leaves, strict=True):
            if buffer is not None:
                assert isinstance(x, torch.Tensor)
                _copy_in(buffer, x)
        static = [b if b is not None else x for b, x in zip(inputs, leaves, strict=True)]
        args, kwargs = pytree.tree_unflatten(static, spec)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                for _ in range(self.warmup_calls):
                    self.fn(*args, **kwargs)
            current.wait_stream(side)
            # thread_local: the worker's other threads (the packer's copies) may go on using
            # CUDA while this thread captures.
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                output = self.fn(*args, **kwargs)
            current.wait_stream(side)
        except Exception as exc:  # noqa: BLE001  # any failure to capture: run this signature eagerly
            current.wait_stream(side)
            return self._eager(key, f"could not capture a call ({type(exc).__name__}: {exc})")
        opaque = [type(x).__qualname__ for x in pytree.tree_leaves(output) if not isinstance(x, _COPYABLE)]
        if opaque:
            # A replay overwrites the captured outputs; one the wrapper cannot copy would change under its caller.
            return self._eager(key, f"its output holds {sorted(set(opaque))}, which a replay would overwrite")
        entry = _Graph(graph, inputs, output)
        self._graphs[key] = entry
        self.stats.captures += 1
        return entry
