"""The client's bytes of an output in hand, as ``omni-async bench`` makes them (issue 31).

``models.synthetic.to_client_bytes`` (the seed's split of the work, kept as the
reference) allocates fresh memory for every pass: on a bf16 video a float32 copy, a
second float32 for the product, the uint8 result, then a ``bytes`` of it -- about 4.5 x
the output's bytes of fresh pages per request, each one faulted in on its first write
(``bench/results/host_path_profile.md``: 0.7 GB/s into a fresh ``bytes`` against 12 GB/s
into memory written before, on the 2-core CPU machine).

``ClientBytes`` makes the same bytes, bit for bit, with none of that: each tensor is
converted in slices of ``chunk`` elements (numpy, on the calling thread) through one
float32 scratch per thread (small enough to stay in cache) straight into a uint8 buffer
from ``HostBuffers``, reused once
the caller has dropped the bytes (never while anything made of them is alive).  A uint8
output (the device stage converted it) is one copy.  The result is a uint8 array per
tensor: a buffer, as ``bytes`` is (``memoryview``, a socket's ``send``, ``np.frombuffer``
take it), owned, so the output can be released at once.
"""

from __future__ import annotations

import threading
from typing import Any, Final

import numpy as np
import torch

from omni_async.core.messages import DiffusionOutput
from omni_async.engine.owned import HostBuffers

__all__ = ["CHUNK_ELEMENTS", "ClientBytes"]

#: Elements converted per slice: a 4 MB float32 scratch, in a core's L2/L3.
CHUNK_ELEMENTS: Final = 1 << 20


class ClientBytes:
    """``to_client_bytes`` into reused memory (see the module docstring); thread-safe (the
    bench's consumer threads call it at once: each has its own scratch)."""

    def __init__(self, buffers: HostBuffers | None = None, chunk: int = CHUNK_ELEMENTS) -> None:
        self.buffers = buffers if buffers is not None else HostBuffers()
        self.chunk = chunk
        self._local = threading.local()

    def __call__(self, output: DiffusionOutput) -> dict[str, np.ndarray[Any, np.dtype[np.uint8]]]:
        """What a client receives of each tensor of ``output``: owned uint8 pixels (a float
        tensor in -1..1 converted as ``to_uint8`` does; any other dtype its raw bytes)."""
        result: dict[str, np.ndarray[Any, np.dtype[np.uint8]]] = {}
        for key, value in output.output.items():
            if isinstance(value, torch.Tensor):
                result[key] = self._one(value)
        return result

    def _one(self, t: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
        src = t.detach().reshape(-1)  # a view when contiguous (an unpacked output is)
        if not t.is_floating_point():
            raw = src.view(torch.uint8).numpy()
            out = self.buffers.take(raw.nbytes)
            self.buffers.copy(out, raw)
            return out
        # numpy, one thread: torch's CPU thread pool stalls for tens of ms per parallel
        # region on a loaded machine (24 ms per slice on the 2-core one, against 2 ms).
        # bf16 has no numpy dtype: its bits are the upper half of the float32's.
        bf16 = t.dtype == torch.bfloat16
        flat = src.view(torch.int16).numpy().view(np.uint16) if bf16 else src.numpy()
        out = self.buffers.take(flat.size)
        scratch = self._scratch()
        for start in range(0, flat.size, self.chunk):
            part = flat[start : start + self.chunk]
            s = scratch[: part.size]
            # to_uint8's arithmetic in the same order and precision: upcast, x * 127.5 + 127.5,
            # clamp, truncate to uint8 (as .to(torch.uint8) does).
            if bf16:
                bits = s.view(np.uint32)
                np.copyto(bits, part)
                np.left_shift(bits, 16, out=bits)
            else:
                np.copyto(s, part, casting="same_kind")
            np.multiply(s, np.float32(127.5), out=s)
            np.add(s, np.float32(127.5), out=s)
            np.clip(s, np.float32(0), np.float32(255), out=s)
            np.copyto(out[start : start + part.size], s, casting="unsafe")
        return out

    def _scratch(self) -> np.ndarray[Any, np.dtype[np.float32]]:
        scratch: np.ndarray[Any, np.dtype[np.float32]] | None = getattr(self._local, "scratch", None)
        if scratch is None or scratch.size < self.chunk:
            scratch = np.empty(self.chunk, np.float32)
            self._local.scratch = scratch
        return scratch
