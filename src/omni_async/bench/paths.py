"""The comparison paths that ``omni-async bench`` measures our output path against.

``WorkerOptions.output_path`` picks how a worker ships its outputs: ``"omni"`` (the
default) is ours, the runtime's own -- the packer copies each output on a side stream
straight into a pooled shared-memory segment registered once as pinned memory
(``omni_async.transport.packing``).  The two paths here reach the worker through the
runtime's extension point (``omni_async.worker.output_path``): each is an
``OutputPath``, registered there under its name as an import path, so that the runtime
never imports this package.

* ``SYNC`` (``output_path="sync"``): the seed's original synchronous path (DESIGN.md
  section 4, first row), ``pack_sync_fresh``.  On the worker's main thread, in step mode
  (the answer carries the output, so the next forward starts only after it): every
  tensor of the output is brought to the host with ``.cpu()`` (which waits for the
  forward on the default stream and copies into pageable memory), then written into a
  shared-memory segment created for it alone.
* ``REFERENCE`` (``output_path="reference"``): the reference implementation's
  asynchronous path (DESIGN.md section 4, second row), ``pack_reference_fresh``.  On the
  packer thread, in request mode: the side stream waits on the forward's event; per
  tensor, a bfloat16 tensor is upcast to float32 on the side stream (numpy, which the
  reference's segments went through, has no bfloat16), copied into a freshly allocated
  pinned host buffer (``torch.empty(..., pin_memory=True)``: torch's caching host
  allocator, as plain torch code gets it), and the side stream is synchronized -- once
  per tensor; then the host buffer is written into a shared-memory segment created for
  that tensor alone (a second host copy, into pages faulted in fresh).  On a CPU worker
  there is no stream, no event and no pinned memory: the upcast and the fresh host
  buffer remain.

Neither is slowed down on purpose: each does the work its original did, the way plain
torch does it, and nothing more.  Small tensors (up to ``inline_threshold`` bytes, as
ours) travel inside the message.

Fresh segments: named ``<pool prefix>fresh-<worker pid>-<n>``, so the executor's
shutdown (which unlinks by the pool's prefix) and the sweep of dead executors find
any that were never read.  The output travels as a ``FreshPayload`` naming its segments.
The consumer (``FreshPath.receive``, which the executor's store for an output path calls
for a claimed output or step mode's answer: ``receive_fresh_output``) reads each segment
into an owned tensor, as the seed's consumer did, and unlinks it; a dropped output's
segments are unlinked unread (``discard_fresh_output``).  A tensor the reference path
upcast is cast back to its dtype there (exact: every bfloat16 value is a float32 value),
so every path hands the engine the tensors the model produced, bit for bit (NaN payloads
aside on the reference path: the round trip through float32 canonicalises them).
"""

from __future__ import annotations

import itertools
import mmap
import os
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

import attrs
import numpy as np
import torch

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput
from omni_async.transport.platform import CopyStream, DeviceEvent, wait_device_event
from omni_async.transport.shm import SHM_DIR

__all__ = [
    "REFERENCE",
    "SYNC",
    "FreshPath",
    "FreshPayload",
    "FreshTensor",
    "discard_fresh_output",
    "is_fresh",
    "pack_reference_fresh",
    "pack_sync_fresh",
    "receive_fresh_output",
]


@attrs.frozen
class FreshTensor:
    """A tensor in a segment of its own: ``name`` under ``/dev/shm``, ``nbytes`` of ``dtype``
    in ``shape``; ``restore``: the model's dtype when the path shipped it upcast."""

    name: str
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    restore: torch.dtype | None = None


@attrs.frozen
class FreshPayload:
    """What ``DiffusionOutput.output`` holds on a baseline path between worker and consumer:
    the output's structure with ``FreshTensor`` leaves, and every segment it created."""

    tree: Any
    segments: tuple[str, ...]
    nbytes: int


def is_fresh(output: DiffusionOutput) -> bool:
    """Whether ``output`` travelled on a baseline path (its segments are fresh, not pooled)."""
    return isinstance(output.output, FreshPayload)


def _map_tree(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """``x`` with ``leaf`` applied to every leaf inside dicts, lists and tuples (what the
    seed's packer walked); every other value travels as it is (pickled)."""
    if isinstance(x, dict):
        return {k: _map_tree(v, leaf) for k, v in x.items()}
    if isinstance(x, list):
        return [_map_tree(v, leaf) for v in x]
    if isinstance(x, tuple) and not hasattr(type(x), "_fields"):
        return tuple(_map_tree(v, leaf) for v in x)
    return leaf(x)


_COUNTER = itertools.count()


def _write_fresh(name: str, host: torch.Tensor) -> None:
    """Create ``/dev/shm/<name>`` for ``host`` alone and copy its bytes in (page faults included)."""
    n = host.numel() * host.element_size()
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
    except BaseException:
        os.close(fd)
        os.unlink(os.path.join(SHM_DIR, name))
        raise
    os.close(fd)
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8)
        dst.copy_(host.contiguous().reshape(-1).view(torch.uint8))
        del dst  # the buffer export must end before the mapping closes
    finally:
        mm.close()


def _unlink(names: list[str] | tuple[str, ...]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


class _Shipper:
    """One output's trip: host tensors into fresh segments (or inline), and the accounting."""

    def __init__(self, prefix: str, inline_threshold: int) -> None:
        self.prefix = prefix
        self.inline_threshold = inline_threshold
        self.names: list[str] = []
        self.shm_bytes = 0
        self.inline_bytes = 0

    def ship(self, host: torch.Tensor, restore: torch.dtype | None) -> object:
        n = host.numel() * host.element_size()
        if n <= self.inline_threshold:
            self.inline_bytes += n
            small = host.clone()  # owns only its elements (never a big storage: F5)
            return small if restore is None else small.to(restore)
        name = f"{self.prefix}fresh-{os.getpid()}-{next(_COUNTER)}"
        self.names.append(name)  # before the write: a failed write still unlinks it
        _write_fresh(name, host)
        self.shm_bytes += n
        return FreshTensor(name, n, host.dtype, tuple(host.shape), restore)

    def payload(self, output: DiffusionOutput, tree: Any, t0: float, pinned: bool) -> DiffusionOutput:
        metrics = attrs.evolve(
            output.metrics,
            pack_s=time.perf_counter() - t0,
            pack_shm_bytes=float(self.shm_bytes),
            pack_inline_bytes=float(self.inline_bytes),
            pack_pinned=1.0 if pinned else 0.0,
            pack_segments=float(len(self.names)),
        )
        return attrs.evolve(output, output=FreshPayload(tree, tuple(self.names), self.shm_bytes), metrics=metrics)


def pack_sync_fresh(
    output: DiffusionOutput,
    stream: CopyStream,
    event: DeviceEvent | None,
    *,
    prefix: str,
    inline_threshold: int,
) -> DiffusionOutput:
    """The seed's synchronous path (module docstring): ``.cpu()`` per tensor on the calling
    thread, then a fresh segment per tensor.  ``stream`` and ``event`` are unused:
    ``.cpu()`` runs on the current stream, after the forward's kernels."""
    t0 = time.perf_counter()
    ship = _Shipper(prefix, inline_threshold)

    def leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return ship.ship(x.detach().cpu(), None)

    try:
        tree = _map_tree(output.output, leaf)
    except BaseException:
        _unlink(ship.names)
        raise
    return ship.payload(output, tree, t0, pinned=False)


def pack_reference_fresh(
    output: DiffusionOutput,
    stream: CopyStream,
    event: DeviceEvent | None,
    *,
    prefix: str,
    inline_threshold: int,
) -> DiffusionOutput:
    """The reference implementation's asynchronous path (module docstring): on ``stream``
    after ``event``, per tensor an upcast of bfloat16, a fresh pinned buffer, a copy and a
    synchronize; then a fresh segment per tensor and a second copy into it."""
    t0 = time.perf_counter()
    ship = _Shipper(prefix, inline_threshold)
    pinned = [False]
    waited: list[CopyStream] = []

    def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        restore = t.dtype if t.dtype == torch.bfloat16 else None
        if t.device.type != "cuda":
            if not waited:
                wait_device_event(event)
                waited.append(None)
            wide = t.float() if restore is not None else t
            host = torch.empty(wide.shape, dtype=wide.dtype)
            host.copy_(wide)
            return host, restore
        s = stream if stream is not None and stream.device == t.device else torch.cuda.current_stream(t.device)
        if s not in waited:
            wait_device_event(event, s)
            waited.append(s)
        with torch.cuda.device(t.device), torch.cuda.stream(s):
            wide = t.float() if restore is not None else t
            host = torch.empty(wide.shape, dtype=wide.dtype, pin_memory=True)
            host.copy_(wide, non_blocking=True)
        s.synchronize()  # per tensor, as the reference did
        pinned[0] = True
        return host, restore

    def leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        host, restore = to_host(x.detach())
        return ship.ship(host, restore)

    try:
        tree = _map_tree(output.output, leaf)
    except BaseException:
        _unlink(ship.names)
        raise
    return ship.payload(output, tree, t0, pinned=pinned[0])


def _read_fresh(x: FreshTensor) -> torch.Tensor:
    """An owned copy of a fresh segment's tensor (the segment is unlinked by the caller)."""
    fd = os.open(os.path.join(SHM_DIR, x.name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < x.nbytes:
            raise OSError(f"segment {x.name} holds {size} bytes, {x.nbytes} expected")
        mm = mmap.mmap(fd, x.nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        raw = np.frombuffer(mm, dtype=np.uint8, count=x.nbytes)
        owned = raw.copy()
        del raw  # the buffer export must end before the mapping closes
    finally:
        mm.close()
    t = torch.from_numpy(owned).view(x.dtype).view(x.shape)
    return t if x.restore is None else t.to(x.restore)


def receive_fresh_output(packed: DiffusionOutput) -> DiffusionOutput:
    """The consumer's side of a baseline path: every ``FreshTensor`` read into an owned
    tensor, and every segment of the output unlinked -- also when reading fails."""
    payload = packed.output
    if not isinstance(payload, FreshPayload):
        raise UsageError(f"output of {packed.request_id!r} did not travel on a baseline path")
    try:
        tree = _map_tree(payload.tree, lambda x: _read_fresh(x) if isinstance(x, FreshTensor) else x)
    finally:
        _unlink(payload.segments)
    return attrs.evolve(packed, output=tree)


def discard_fresh_output(packed: DiffusionOutput) -> int:
    """Unlink the segments of a baseline-path output nobody will read; returns how many it names."""
    payload = packed.output
    if not isinstance(payload, FreshPayload):
        return 0
    _unlink(payload.segments)
    return len(payload.segments)


class PackFresh(Protocol):
    """``pack_sync_fresh`` or ``pack_reference_fresh``: one output into fresh segments."""

    def __call__(
        self,
        output: DiffusionOutput,
        stream: CopyStream,
        event: DeviceEvent | None,
        *,
        prefix: str,
        inline_threshold: int,
    ) -> DiffusionOutput: ...


@attrs.frozen
class FreshPath:
    """A comparison path as the runtime's ``OutputPath``: ``packer`` packs each output
    into fresh segments; every output it made is read and unlinked here."""

    name: str
    step_mode: bool | None
    packer: PackFresh

    def pack(
        self,
        output: DiffusionOutput,
        stream: CopyStream,
        event: DeviceEvent | None,
        *,
        prefix: str,
        inline_threshold: int,
    ) -> DiffusionOutput:
        return self.packer(output, stream, event, prefix=prefix, inline_threshold=inline_threshold)

    def owns(self, packed: DiffusionOutput) -> bool:
        return is_fresh(packed)

    def receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        return receive_fresh_output(packed)

    def discard(self, packed: DiffusionOutput) -> int:
        return discard_fresh_output(packed)


# The objects ``WorkerOptions(output_path="sync")`` and ``"reference"`` resolve to
# (``omni_async.worker.output_path.REGISTERED_OUTPUT_PATHS``): the seed answered
# synchronously (step mode); the reference answered at COMPUTE_DONE and copied in the
# background (request mode).
SYNC: Final = FreshPath("sync", step_mode=True, packer=pack_sync_fresh)
REFERENCE: Final = FreshPath("reference", step_mode=False, packer=pack_reference_fresh)
