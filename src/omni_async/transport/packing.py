"""Packing a finished output for the trip to the consumer, and unpacking it there.

``pack_diffusion_output_shm`` walks the output (dicts, lists, tuples, namedtuples, attrs
and dataclass instances; tensors, numpy arrays, bytes and small plain values) and
returns a ``DiffusionOutput`` whose ``output`` is a ``PackedPayload``: a small, picklable
skeleton of the same shape.  Each tensor, array or bytes leaf goes one of two ways:

* **inline**: at most ``inline_threshold`` bytes, while the output's inline total stays
  under ``max_inline_bytes``: its raw bytes travel inside the message;
* **shared memory**: everything else, copied into ONE segment leased from the pool for
  the whole output, at aligned offsets.

Sizing is by the bytes actually sent, ``numel * element_size`` of the leaf itself, never
its storage: a 2-element view of a 100 MB tensor costs 8 bytes, not 100 MB (F5);
``packed_nbytes`` gives that size without packing (the worker's back-pressure).  Bytes
are copied raw (a contiguous tensor through its ``uint8`` view; a strided one with a
same-dtype ``copy_``), so every dtype -- bf16 and fp8 included -- round-trips
bit-exactly with no upcast.

On CUDA, with ``d2h_stream``: the stream first waits on ``ready_event`` (recorded by the
worker's main thread after the forward, see ``platform``), then every device tensor is
copied with ``non_blocking=True`` straight into the segment, which is registered as
pinned memory once per process -- so the DMA lands in shared memory at PCIe speed with
no staging buffer -- and the stream is synchronized ONCE per output before returning.
The output's tensors stay referenced by ``output`` until that synchronize, so the
caching allocator cannot hand their memory to the next forward mid-copy (no
``record_stream`` needed).  The packer runs on its own thread: the current CUDA device
is per thread, hence the explicit ``torch.cuda.device`` around the copies.

Release API (consumer side): ``unpack_diffusion_output_shm(packed)`` returns tensors
that VIEW the segment (zero copy); they stay valid until the consumer releases the
segment exactly once, through either handle: ``release_packed_output(packed)`` or
``release_unpacked_output(unpacked)`` (a second release, through either, raises
``LeaseAlreadyReleased``).  ``unpack_diffusion_output_shm(packed, copy=True)`` returns
owned copies and releases at once.  The executor's registry calls
``release_packed_output`` on every packed output it drops or abandons.  Unpacking and
releasing work in any process that received the pool (segments attach by name).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final, TypeAlias

import attrs
import numpy as np
import torch

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput
from omni_async.transport.errors import UnsupportedOutputType
from omni_async.transport.platform import CopyStream, DeviceEvent, wait_device_event
from omni_async.transport.shm import Lease, SegmentPool, attach_view

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_MAX_INLINE_BYTES",
    "InlineTensor",
    "PackedMap",
    "PackedObject",
    "PackedPayload",
    "PackedSeq",
    "ShmArray",
    "ShmBytes",
    "ShmTensor",
    "is_packed",
    "pack_diffusion_output_shm",
    "packed_lease",
    "packed_nbytes",
    "release_packed_output",
    "release_unpacked_output",
    "unpack_diffusion_output_shm",
]

DEFAULT_INLINE_THRESHOLD: Final = 64 << 10
DEFAULT_MAX_INLINE_BYTES: Final = 1 << 20
# Offsets within a segment: a multiple of every element size and of the DMA engines'
# preferred alignment.
_ALIGN: Final = 512
_MAX_DEPTH: Final = 64

# -- the packed skeleton ----------------------------------------------------------------


@attrs.frozen
class ShmTensor:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@attrs.frozen
class ShmArray:
    offset: int
    nbytes: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]


@attrs.frozen
class ShmBytes:
    offset: int
    nbytes: int
    mutable: bool  # bytearray rather than bytes


@attrs.frozen
class InlineTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    # bytearray while a device->host copy fills it (before the stream sync), then never touched.
    data: bytes | bytearray


@attrs.frozen
class PackedSeq:
    cls: type
    items: tuple[Any, ...]


@attrs.frozen
class PackedMap:
    cls: type
    items: tuple[tuple[Any, Any], ...]
    default_factory: Callable[[], Any] | None = None


@attrs.frozen
class PackedObject:
    cls: type
    fields: tuple[tuple[str, Any], ...]


@attrs.frozen
class PackedPayload:
    """What ``DiffusionOutput.output`` holds between packing and unpacking."""

    tree: Any
    lease: Lease | None
    shm_bytes: int
    inline_bytes: int

    def __repr__(self) -> str:
        seg = self.lease.name if self.lease is not None else None
        return f"PackedPayload(segment={seg}, shm_bytes={self.shm_bytes}, inline_bytes={self.inline_bytes})"


_PLAIN: Final[tuple[type, ...]] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.Size,
    np.generic,
    np.dtype,
    slice,
    range,
    type(Ellipsis),
)


def _is_plain(x: object) -> bool:
    if isinstance(x, _PLAIN):
        return True
    if isinstance(x, (frozenset, set)):
        return all(_is_plain(v) for v in x)
    return False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# -- pack --------------------------------------------------------------------------------

# A tensor, array or bytes-like value: where a walk stops, and what the packer copies.
_Leaf: TypeAlias = "torch.Tensor | np.ndarray[Any, Any] | bytes | bytearray | memoryview"
# What a walk does at each leaf, given the bytes the packer copies for it; returns the
# leaf's place in the skeleton.
_OnLeaf: TypeAlias = Callable[[_Leaf, int], object]


@attrs.define
class _Plan:
    inline_threshold: int
    max_inline_bytes: int
    inline_bytes: int = 0
    shm_bytes: int = 0
    size: int = 0  # segment bytes used: the end of the last item
    # (source, offset, nbytes) for shared-memory leaves
    shm: list[tuple[_Leaf, int, int]] = attrs.field(factory=list)
    # (device tensor, bytearray it fills) for small device tensors
    staged: list[tuple[torch.Tensor, bytearray]] = attrs.field(factory=list)

    def inline_ok(self, n: int) -> bool:
        if n <= self.inline_threshold and self.inline_bytes + n <= self.max_inline_bytes:
            self.inline_bytes += n
            return True
        return False

    def place(self, src: _Leaf, n: int) -> int:
        off = _align(self.size)
        self.size = off + n
        self.shm_bytes += n
        self.shm.append((src, off, n))
        return off

    def pack_leaf(self, x: _Leaf, n: int) -> object:
        """A leaf's place in the skeleton: inline, or an offset in the segment."""
        if isinstance(x, torch.Tensor):
            return _pack_tensor(x.detach(), n, self)
        if isinstance(x, np.ndarray):
            return _pack_array(x, n, self)
        if self.inline_ok(n):
            data = x.cast("B") if isinstance(x, memoryview) else x
            return bytearray(data) if isinstance(x, bytearray) else bytes(data)
        return ShmBytes(self.place(x, n), n, isinstance(x, bytearray))


def _pack_tensor(t: torch.Tensor, n: int, plan: _Plan) -> object:
    shape = tuple(t.shape)
    if plan.inline_ok(n):
        if n == 0:
            return InlineTensor(t.dtype, shape, b"")
        if t.device.type == "cpu":
            # contiguous() copies only the view's own elements (F5), never the storage.
            return InlineTensor(t.dtype, shape, t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        buf = bytearray(n)
        plan.staged.append((t, buf))
        return InlineTensor(t.dtype, shape, buf)
    return ShmTensor(plan.place(t, n), n, t.dtype, shape)


def _pack_array(a: np.ndarray[Any, Any], n: int, plan: _Plan) -> object:
    if plan.inline_ok(n):
        return a.copy()
    return ShmArray(plan.place(a, n), n, a.dtype, tuple(a.shape))


def _walk(x: Any, on_leaf: _OnLeaf, path: str, depth: int) -> Any:
    """Walk ``x`` as the packer does: ``on_leaf`` at every leaf, the skeleton around it.

    The one definition of what an output may hold and of the bytes each leaf costs:
    packing and sizing (``packed_nbytes``) both walk with it.
    """
    if depth > _MAX_DEPTH:
        raise UsageError(f"output nested deeper than {_MAX_DEPTH} levels at {path} (a cycle?)")
    d = depth + 1
    if isinstance(x, torch.Tensor):
        if x.layout is not torch.strided or x.is_quantized or x.is_nested or x.device.type == "meta":
            raise UnsupportedOutputType(path, type(x))
        return on_leaf(x, _nbytes(x))
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise UnsupportedOutputType(path, type(x))
        return on_leaf(x, int(x.nbytes))  # the view's own bytes (size * itemsize), never its base's
    if isinstance(x, (bytes, bytearray, memoryview)):
        return on_leaf(x, len(x.cast("B") if isinstance(x, memoryview) else x))
    if _is_plain(x):
        return x
    cls = type(x)
    if cls is dict or cls is collections.OrderedDict or cls is collections.defaultdict:
        items = []
        for k, v in x.items():
            if not _is_plain(k):
                raise UnsupportedOutputType(f"{path} key {k!r}", type(k))
            items.append((k, _walk(v, on_leaf, f"{path}[{k!r}]", d)))
        factory = x.default_factory if isinstance(x, collections.defaultdict) else None
        return PackedMap(cls, tuple(items), factory)
    if cls is list or cls is tuple or (isinstance(x, tuple) and hasattr(cls, "_fields")):
        return PackedSeq(cls, tuple(_walk(v, on_leaf, f"{path}[{i}]", d) for i, v in enumerate(x)))
    if attrs.has(cls):
        names = [f.name for f in attrs.fields(cls)]
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in dataclasses.fields(x)]
    else:
        raise UnsupportedOutputType(path, cls)
    return PackedObject(cls, tuple((name, _walk(getattr(x, name), on_leaf, f"{path}.{name}", d)) for name in names))


def _copy_in(
    seg: torch.Tensor, plan: _Plan, stream_for: Callable[[torch.device], torch.cuda.Stream]
) -> list[torch.cuda.Stream]:
    """Copy every shared-memory leaf into the segment; returns the streams to synchronize."""
    streams: list[torch.cuda.Stream] = []
    for src, off, n in plan.shm:
        dst = seg[off : off + n]
        if isinstance(src, torch.Tensor):
            t = src.detach()
            if t.device.type == "cuda":
                s = stream_for(t.device)
                if s not in streams:
                    streams.append(s)
                with torch.cuda.device(t.device), torch.cuda.stream(s):
                    _copy_tensor(dst, t, non_blocking=True)
            else:
                _copy_tensor(dst, t, non_blocking=False)
        elif isinstance(src, np.ndarray):
            np.copyto(dst.numpy().view(src.dtype).reshape(src.shape), src, casting="no")
        else:
            data = src.cast("B") if isinstance(src, memoryview) else src
            dst.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return streams


def _copy_tensor(dst: torch.Tensor, t: torch.Tensor, *, non_blocking: bool) -> None:
    if t.numel() == 0:
        return
    if t.is_contiguous():
        # Raw bytes: bit-exact for every dtype (NaN payloads, bf16, fp8), no cast kernel.
        dst.copy_(t.reshape(-1).view(torch.uint8), non_blocking=non_blocking)
    else:
        dst.view(t.dtype).view(t.shape).copy_(t, non_blocking=non_blocking)


def _check_unpacked(output: DiffusionOutput, fn: str) -> None:
    if not isinstance(output, DiffusionOutput):
        raise UsageError(f"{fn} takes a DiffusionOutput, got {type(output).__qualname__}")
    if isinstance(output.output, PackedPayload):
        raise UsageError(f"output of {output.request_id!r} is already packed")


def packed_nbytes(output: DiffusionOutput) -> int:
    """The bytes ``pack_diffusion_output_shm`` copies for ``output``; copies nothing.

    The sum, over the output's tensor, array and bytes leaves, of their own bytes
    (``numel * element_size``, never their storage's: F5), whether they travel inline or
    in shared memory: the packed output's ``shm_bytes + inline_bytes``.  Plain values
    (numpy scalars too) travel in the skeleton and count nothing.  It walks the output
    as the packer does, so it raises what the packer's walk raises
    (``UnsupportedOutputType``, ``UsageError``) for an output the packer would refuse.
    """
    _check_unpacked(output, "packed_nbytes")
    sizes: list[int] = []
    _walk(output.output, lambda _, n: sizes.append(n), "output", 0)
    return sum(sizes)


def pack_diffusion_output_shm(
    output: DiffusionOutput,
    d2h_stream: CopyStream = None,
    *,
    pool: SegmentPool | None = None,
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES,
    ready_event: DeviceEvent | None = None,
    lease_timeout: float | None = None,
) -> DiffusionOutput:
    """Pack ``output`` for the result channel (see the module docstring).

    ``d2h_stream``: a ``torch.cuda.Stream`` for the device->host copies (the packer's
    side stream); None uses each device's current stream.  ``ready_event``: from
    ``record_device_event`` after the forward; the copies are ordered after it.
    ``pool``: where shared-memory leaves go; None takes the process's one pool.
    Raises ``UnsupportedOutputType``, ``SegmentTooLarge``, ``PoolExhausted``.
    """
    _check_unpacked(output, "pack_diffusion_output_shm")
    t0 = time.perf_counter()
    plan = _Plan(inline_threshold, max_inline_bytes)
    tree = _walk(output.output, plan.pack_leaf, "output", 0)

    # Order every read of the output after the forward: a device-side wait on the
    # stream that will copy, or a host synchronize where no event exists (F1).
    def stream_for(dev: torch.device) -> torch.cuda.Stream:
        if d2h_stream is not None and d2h_stream.device == dev:
            return d2h_stream
        return torch.cuda.current_stream(dev)

    waited: list[torch.cuda.Stream] = []

    def ordered_stream(dev: torch.device) -> torch.cuda.Stream:
        s = stream_for(dev)
        if s not in waited:
            if isinstance(ready_event, torch.cuda.Event):
                wait_device_event(ready_event, s)
            waited.append(s)
        return s

    if ready_event is not None and not isinstance(ready_event, torch.cuda.Event):
        wait_device_event(ready_event)

    lease: Lease | None = None
    pinned = True
    streams: list[torch.cuda.Stream] = []
    if plan.shm:
        if pool is None:
            pool = SegmentPool.current()
        lease = pool.lease(plan.size, timeout=lease_timeout)
    try:
        if lease is not None:
            assert pool is not None
            on_cuda = any(isinstance(s, torch.Tensor) and s.device.type == "cuda" for s, _, _ in plan.shm)
            if on_cuda:
                seg, pinned = pool.pinned_view(lease)
            else:
                seg = pool.view(lease)
            streams = _copy_in(seg, plan, ordered_stream)
        staging: list[tuple[torch.Tensor, bytearray]] = []
        for t, buf in plan.staged:
            s = ordered_stream(t.device) if t.device.type == "cuda" else None
            if s is not None:
                if s not in streams:
                    streams.append(s)
                host = torch.empty((t.numel(),), dtype=t.dtype, pin_memory=True)
                with torch.cuda.device(t.device), torch.cuda.stream(s):
                    host.copy_(t.reshape(-1), non_blocking=True)
            else:
                host = t.reshape(-1).to("cpu")
            staging.append((host, buf))
        # One synchronize per stream per output, not per tensor.
        for s in streams:
            s.synchronize()
        for host, buf in staging:
            buf[:] = host.view(torch.uint8).numpy().tobytes()
        if lease is not None:
            assert pool is not None
            pool.hand_off(lease)
    except BaseException:
        if lease is not None and pool is not None:
            for s in streams:
                s.synchronize()  # no DMA may still target a segment we give back
            pool.release(lease)
        raise
    payload = PackedPayload(tree, lease, plan.shm_bytes, plan.inline_bytes)
    metrics = dict(output.metrics)
    metrics.update(
        pack_s=time.perf_counter() - t0,
        pack_shm_bytes=float(plan.shm_bytes),
        pack_inline_bytes=float(plan.inline_bytes),
        pack_pinned=1.0 if pinned else 0.0,
    )
    return attrs.evolve(output, output=payload, metrics=metrics)


# -- unpack / release ----------------------------------------------------------------------


def is_packed(output: DiffusionOutput) -> bool:
    return isinstance(output.output, PackedPayload)


def packed_lease(output: DiffusionOutput) -> Lease | None:
    payload = output.output
    return payload.lease if isinstance(payload, PackedPayload) else None


def _unwalk(x: Any, seg: torch.Tensor | None, copy: bool) -> Any:
    if isinstance(x, ShmTensor):
        assert seg is not None
        v = seg[x.offset : x.offset + x.nbytes]
        t = v.view(x.dtype).view(x.shape) if x.nbytes else torch.empty(x.shape, dtype=x.dtype)
        return t.clone() if copy else t
    if isinstance(x, InlineTensor):
        if not x.data:
            return torch.empty(x.shape, dtype=x.dtype)
        return torch.frombuffer(bytearray(x.data), dtype=torch.uint8).view(x.dtype).view(x.shape)
    if isinstance(x, ShmArray):
        assert seg is not None
        a = seg[x.offset : x.offset + x.nbytes].numpy().view(x.dtype).reshape(x.shape)
        return a.copy() if copy else a
    if isinstance(x, ShmBytes):
        assert seg is not None
        raw = seg[x.offset : x.offset + x.nbytes].numpy().tobytes()
        return bytearray(raw) if x.mutable else raw
    if isinstance(x, PackedSeq):
        items = [_unwalk(v, seg, copy) for v in x.items]
        if x.cls is list:
            return items
        if x.cls is tuple:
            return tuple(items)
        return x.cls(*items)  # namedtuple
    if isinstance(x, PackedMap):
        pairs = [(k, _unwalk(v, seg, copy)) for k, v in x.items]
        if x.cls is collections.defaultdict:
            return collections.defaultdict(x.default_factory, pairs)
        return x.cls(pairs)
    if isinstance(x, PackedObject):
        # As pickle does: no __init__, no validators or converters run a second time.
        obj: Any = object.__new__(x.cls)
        for name, v in x.fields:
            object.__setattr__(obj, name, _unwalk(v, seg, copy))
        return obj
    return x


def unpack_diffusion_output_shm(packed: DiffusionOutput, *, copy: bool = False) -> DiffusionOutput:
    """Restore a packed output.

    ``copy=False`` (zero copy): tensors and arrays view the shared segment; valid until
    ``release_packed_output(packed)``, which the caller must call exactly once.
    ``copy=True``: owned copies, and the segment is released before returning.
    Works in any process: the segment is attached by name (cached per process).
    """
    payload = packed.output
    if not isinstance(payload, PackedPayload):
        raise UsageError(f"output of {packed.request_id!r} is not packed")
    seg = attach_view(payload.lease.name, payload.lease.size) if payload.lease is not None else None
    tree = _unwalk(payload.tree, seg, copy)
    if copy and payload.lease is not None:
        release_packed_output(packed)
    out = attrs.evolve(packed, output=tree)
    if not copy and payload.lease is not None:
        _remember_unpacked(out, payload.lease)
    return out


# The unpacked output cannot carry its lease (DiffusionOutput is the public message
# type), so this process remembers which lease each live unpacked output views.  The
# entry goes when the object does; the lease does not (views may outlive the object),
# so an unreleased lease stays visible in ``SegmentPool.outstanding()``.
_UNPACKED_LOCK = threading.Lock()
_UNPACKED: dict[int, tuple[weakref.ref[DiffusionOutput], Lease]] = {}


def _forget(key: int) -> None:
    with _UNPACKED_LOCK:
        _UNPACKED.pop(key, None)


def _remember_unpacked(out: DiffusionOutput, lease: Lease) -> None:
    key = id(out)
    with _UNPACKED_LOCK:
        _UNPACKED[key] = (weakref.ref(out), lease)
    weakref.finalize(out, _forget, key)


def release_unpacked_output(output: DiffusionOutput, *, pool: SegmentPool | None = None) -> int:
    """Like ``release_packed_output``, given what ``unpack_diffusion_output_shm`` returned.

    0 for an output that views no segment (copied, inline-only, or never unpacked here).
    """
    with _UNPACKED_LOCK:
        entry = _UNPACKED.get(id(output))
    if entry is None or entry[0]() is not output:
        return 0
    lease = entry[1]
    (pool or SegmentPool.for_prefix(lease.prefix)).release(lease)
    return 1


def release_packed_output(output: DiffusionOutput, *, pool: SegmentPool | None = None) -> int:
    """Return a packed output's segment to its pool; how many segments were released (0 or 1).

    0 when the output holds no segment (not packed, or everything inline).  Raises
    ``LeaseAlreadyReleased`` on a second release, ``PoolClosed`` after the pool closed.
    The pool is found by the lease's prefix among this process's pools unless given.
    """
    lease = packed_lease(output)
    if lease is None:
        return 0
    (pool or SegmentPool.for_prefix(lease.prefix)).release(lease)
    return 1
