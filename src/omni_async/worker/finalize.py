"""A device stage's pointwise finalize as one fused kernel (``torch.compile``), eager where it cannot be.

A device stage that turns float pixels into uint8 in eager PyTorch makes one pass over
memory per operation (``mul``, ``add``, ``clamp``, ``to``: four passes, three of them
writing a float tensor as large as the input).  Fused by Inductor it is one pass that
reads the input once and writes the uint8 pixels once: on an H200 a 1.5 GB bf16 video
takes 0.56 ms instead of 8.26 ms (DESIGN.md, 4b).

``FusedPointwise(fn)`` wraps an elementwise ``fn(tensor) -> tensor`` (written in eager
PyTorch: it is the reference, and the fallback):

* **bit for bit the eager result.**  It is compiled with Inductor's
  ``emulate_precision_casts``: eager PyTorch rounds every bf16/fp16 intermediate back to
  its dtype, which a fused kernel skips unless told (a bf16 ``x * 127.5 + 127.5`` then
  differs by one in the last uint8 for some inputs), and the same option turns off
  contracting a multiply and an add into one FMA on the GPU (one rounding instead of two).
* **compiled once per device and dtype, not per shape.**  The input is flattened (``fn``
  is elementwise, so its shape does not matter) and compiled with dynamic sizes: every
  image and video size reuses one kernel.  Dynamo's cache on ``fn``'s code object holds
  one entry per (device, dtype), well under its recompile limit.
* **eager where compiling does not pay or cannot work**: on devices not in ``devices``
  (by default CUDA only: on the CPU the worker's packer thread is better spent copying),
  for tensors under ``min_numel`` elements or not contiguous, and wherever
  ``torch.compile`` is missing or fails: the first failure for a (device, dtype) is
  logged once with its reason, and that key stays eager.  A request never fails because
  compiling did.
* **warm-up outside the hot path**: ``warm_up(device)`` compiles for the dtypes given
  (a ``PostProcess.warmup`` hook runs it in the worker at start-up, before the first
  request); otherwise the first call for a key compiles (seconds).

``status(device, dtype)`` says which path a key takes, and why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["FusedPointwise"]

log = logging.getLogger(__name__)

Pointwise = Callable[[torch.Tensor], torch.Tensor]
_Key = tuple[str, torch.dtype]

# Below this many elements a launch costs more than the passes it saves.
DEFAULT_MIN_NUMEL = 1 << 16
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
# Round every low-precision intermediate as eager does, and no FMA contraction on the GPU.
_EAGER_BITS: Mapping[str, str | int | bool] = {"emulate_precision_casts": True}


class FusedPointwise:
    """``fn`` fused into one kernel per (device type, dtype); see the module docstring."""

    def __init__(
        self,
        fn: Pointwise,
        *,
        devices: Iterable[str] = ("cuda",),
        min_numel: int = DEFAULT_MIN_NUMEL,
        options: Mapping[str, str | int | bool] | None = None,
    ) -> None:
        """``options``: Inductor's, for ``torch.compile`` (default: emulate eager's casts)."""
        self.eager = fn
        self.devices = frozenset(devices)
        self.min_numel = min_numel
        self.options: dict[str, str | int | bool] = dict(options if options is not None else _EAGER_BITS)
        self._lock = threading.Lock()
        self._compiled: Pointwise | None = None
        # Per (device type, dtype): None compiled and checked, else why it runs eager.
        self._status: dict[_Key, str | None] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x)[0]

    def apply(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``fn(x)``, and whether the fused kernel computed it (False: eager)."""
        key = (x.device.type, x.dtype)
        if key[0] not in self.devices or x.numel() < self.min_numel or not x.is_contiguous():
            return self.eager(x), False
        status = self._status.get(key, "")
        if status is None:
            return self._run(x), True
        if status:
            return self.eager(x), False
        return self._first(x, key)

    def status(self, device: str | torch.device, dtype: torch.dtype) -> str:
        """``"fused"``, ``"not compiled yet"``, or ``"eager: <why>"`` for this device and dtype."""
        kind = torch.device(device).type
        if kind not in self.devices:
            return f"eager: compiling is off for {kind} (devices={sorted(self.devices)})"
        got = self._status.get((kind, dtype), "")
        if got is None:
            return "fused"
        return f"eager: {got}" if got else "not compiled yet"

    def warm_up(self, device: str | torch.device, dtypes: Iterable[torch.dtype] = FLOAT_DTYPES) -> None:
        """Compile for ``device`` and each of ``dtypes`` now (a no-op for a device that runs eager)."""
        dev = torch.device(device)
        if dev.type not in self.devices:
            return
        for dtype in dtypes:
            self(torch.zeros(self.min_numel, dtype=dtype, device=dev))

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        assert self._compiled is not None
        return self._compiled(x.reshape(-1)).view(x.shape)

    def _first(self, x: torch.Tensor, key: _Key) -> tuple[torch.Tensor, bool]:
        """The first call for ``key``: compile, check against eager on this input, or fall back."""
        with self._lock:  # one thread compiles; another that comes meanwhile waits for it
            status = self._status.get(key, "")
            if status is None:
                return self._run(x), True
            if status:
                return self.eager(x), False
            try:
                if self._compiled is None:
                    options: dict[str, str | int | bool | Callable[..., Any]] = dict(self.options)
                    self._compiled = torch.compile(self.eager, dynamic=True, options=options)
                out = self._run(x)
                want = self.eager(x)
                if out.dtype != want.dtype or not torch.equal(out, want):
                    raise ValueError("the compiled kernel's result differs from eager's on its first input")
            except Exception as exc:  # noqa: BLE001  # whatever compiling raises, the request must not fail
                reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                self._status[key] = reason[:300]
                log.warning(
                    "fused %s on %s %s: running eager instead (%s)",
                    getattr(self.eager, "__name__", "kernel"),
                    key[0],
                    key[1],
                    reason[:300],
                )
                return self.eager(x), False
            self._status[key] = None
            return out, True
