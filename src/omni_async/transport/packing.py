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

Lifetime of an unpacked output (consumer side) -- the rule:

* ``unpack_diffusion_output_shm(packed)`` returns tensors and arrays that VIEW the
  segment (zero copy).  **The segment goes back to the pool when the last of them is
  gone** -- the output's own leaves and anything derived from them (slices, ``.numpy()``,
  ``np.asarray``, memoryviews, DLPack, storages) -- and never before, so a view the
  caller keeps can never show the bytes of a later request.  Dropping everything
  releases it: no explicit call is needed, and the last ``del`` gives it back before it
  returns, on whatever thread runs it.
* ``release_unpacked_output(unpacked)`` (``MultiprocDiffusionExecutor.release_output``)
  says "done" explicitly: it takes the output's own views back (``unpacked.output``
  becomes a ``ReleasedOutput``, which raises ``LeaseAlreadyReleased`` on any use) and
  returns 1 with the segment back in the pool -- if no other view is alive.  If some are,
  it raises ``OutputStillViewed`` (the output id, how many, what to do: drop them or
  copy) and the segment goes back by itself when they are dropped: loud, never stale,
  never leaked.  ``release_packed_output(packed)`` on a payload whose views are alive
  in this process raises the same; after the views gave it back, ``LeaseAlreadyReleased``.
* ``copy=True`` returns owned copies and releases at once; ``bytes``/``bytearray``
  leaves are copies in either mode.  The executor's registry calls
  ``release_packed_output`` on every packed output it drops or abandons (never unpacked).
* The release runs in a finalizer (``weakref.finalize`` on one ndarray per segment that
  every view's memory hangs from): any thread, never raises, at most once, a no-op once
  the pool closed; inside a garbage collection it is handed to the ``omni-release``
  thread (``settle_releases`` waits for it).  Views outlive a closed pool readably: they
  keep the mapping.  Until released, the lease shows in ``SegmentPool.outstanding()``.

Unpacking and releasing work in any process that received the pool (segments attach by
name); views are tracked per process.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import gc
import logging
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Final, TypeAlias, assert_never

import attrs
import numpy as np
import torch

from omni_async.core.errors import UsageError
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    BatchDiffusionOutput,
    Chunk,
    ComputeDone,
    DiffusionOutput,
    OutputReady,
    RpcResult,
)
from omni_async.transport.errors import (
    LeaseAlreadyReleased,
    OutputStillViewed,
    PoolClosed,
    UnknownSegment,
    UnsupportedOutputType,
)
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
    "ReleasedOutput",
    "ShmArray",
    "ShmBytes",
    "ShmTensor",
    "StoredPayload",
    "carried_leases",
    "carried_stored_keys",
    "is_packed",
    "pack_diffusion_output_host",
    "pack_diffusion_output_shm",
    "packed_lease",
    "packed_nbytes",
    "release_packed_output",
    "release_unpacked_output",
    "settle_releases",
    "unpack_diffusion_output_host",
    "unpack_diffusion_output_shm",
]

log = logging.getLogger(__name__)

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


@attrs.frozen
class StoredPayload:
    """What ``DiffusionOutput.output`` holds on the object-store path: the skeleton, with
    ``Shm*`` leaves at offsets in ONE host buffer stored elsewhere under ``key`` (a Ray
    object, see ``pack_diffusion_output_host``); the buffer never travels in the message."""

    tree: Any
    key: str
    nbytes: int  # of the stored buffer
    inline_bytes: int

    def __repr__(self) -> str:
        return f"StoredPayload(key={self.key}, nbytes={self.nbytes}, inline_bytes={self.inline_bytes})"


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


def _ordered_streams(
    d2h_stream: CopyStream, ready_event: DeviceEvent | None
) -> Callable[[torch.device], torch.cuda.Stream]:
    """The stream to copy from ``dev`` on, ordered after the forward: a device-side wait on
    the stream that will copy, or a host synchronize (now) where no event exists (F1)."""

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
    return ordered_stream


def _stage_and_sync(
    plan: _Plan, ordered_stream: Callable[[torch.device], torch.cuda.Stream], streams: list[torch.cuda.Stream]
) -> None:
    """Copy the small (inline) device tensors to host, then synchronize every stream once."""
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

    ordered_stream = _ordered_streams(d2h_stream, ready_event)
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
        _stage_and_sync(plan, ordered_stream, streams)
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
    metrics = attrs.evolve(
        output.metrics,
        pack_s=time.perf_counter() - t0,
        pack_shm_bytes=float(plan.shm_bytes),
        pack_inline_bytes=float(plan.inline_bytes),
        pack_pinned=1.0 if pinned else 0.0,
    )
    return attrs.evolve(output, output=payload, metrics=metrics)


def pack_diffusion_output_host(
    output: DiffusionOutput,
    d2h_stream: CopyStream = None,
    *,
    put: Callable[[np.ndarray[Any, Any]], str],
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES,
    ready_event: DeviceEvent | None = None,
    pin_memory: bool | None = None,
) -> DiffusionOutput:
    """Pack ``output`` as ``pack_diffusion_output_shm`` does, but into one fresh host buffer
    (a ``uint8`` ndarray) handed to ``put``, which stores it and returns its key (the Ray
    executor's object-store path: ``put`` is a ``ray.put`` kept in a table).  Small leaves
    travel inline as on the shared-memory path; the copies are ordered after
    ``ready_event`` on ``d2h_stream``, synchronized once.  The payload is a ``StoredPayload``
    (``unpack_diffusion_output_host``); nothing is stored when every leaf is inline.

    The buffer is pinned (page-locked, from torch's caching host allocator, so a size
    seen before costs no new registration) when a leaf is on a CUDA device, so the
    device-to-host copy runs at the link's speed; ``pin_memory`` overrides that.  It
    lives only until ``put`` returned: ``put`` must copy it (``ray.put`` does).
    """
    _check_unpacked(output, "pack_diffusion_output_host")
    t0 = time.perf_counter()
    plan = _Plan(inline_threshold, max_inline_bytes)
    tree = _walk(output.output, plan.pack_leaf, "output", 0)
    ordered_stream = _ordered_streams(d2h_stream, ready_event)
    if pin_memory is None:
        pin_memory = any(isinstance(src, torch.Tensor) and src.device.type == "cuda" for src, _, _ in plan.shm)
    buf = torch.empty((plan.size,), dtype=torch.uint8, pin_memory=pin_memory)
    streams = _copy_in(buf, plan, ordered_stream) if plan.shm else []
    _stage_and_sync(plan, ordered_stream, streams)
    key = put(buf.numpy()) if plan.shm else ""
    payload = StoredPayload(tree, key, plan.size if plan.shm else 0, plan.inline_bytes)
    metrics = attrs.evolve(
        output.metrics,
        pack_s=time.perf_counter() - t0,
        pack_stored_bytes=float(plan.shm_bytes),
        pack_inline_bytes=float(plan.inline_bytes),
    )
    return attrs.evolve(output, output=payload, metrics=metrics)


def carried_stored_keys(msg: AsyncDiffusionOutput) -> list[str]:
    """The keys of the stored buffers a result-channel message's outputs refer to (as
    ``carried_leases`` for segments)."""
    return [o.output.key for o in _carried_outputs(msg) if isinstance(o.output, StoredPayload) and o.output.key]


class _BufferViews:
    """Leaf builder over a stored buffer: zero-copy views of it (counted in ``leaves``, as
    ``_ViewsOf`` does), or owned copies."""

    def __init__(self, buf: np.ndarray[Any, Any], copy: bool, leaves: list[weakref.ref[Any]] | None = None) -> None:
        self.buf = buf
        self.copy = copy
        self.leaves = leaves if leaves is not None else []

    def tensor(self, x: ShmTensor) -> torch.Tensor:
        part = self.buf[x.offset : x.offset + x.nbytes]
        if self.copy:
            part = part.copy()
        else:
            self.leaves.append(weakref.ref(part))
        with warnings.catch_warnings():
            # Ray hands the buffer read-only, and torch has no read-only tensors: the view
            # is writable, and a write reaches only this consumer's own stored copy.
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            return torch.from_numpy(part).view(x.dtype).view(x.shape)

    def array(self, x: ShmArray) -> np.ndarray[Any, Any]:
        a = self.buf[x.offset : x.offset + x.nbytes].view(x.dtype).reshape(x.shape)
        if self.copy:
            return a.copy()
        self.leaves.append(weakref.ref(a))
        return a  # read-only where the buffer is

    def raw(self, x: ShmBytes) -> bytes:
        return self.buf[x.offset : x.offset + x.nbytes].tobytes()


def unpack_diffusion_output_host(
    packed: DiffusionOutput,
    buf: np.ndarray[Any, Any] | None,
    *,
    copy: bool = False,
    on_gone: Callable[[], object] | None = None,
) -> DiffusionOutput:
    """Restore a ``StoredPayload`` output from its stored buffer (None when nothing was
    stored).  Zero copy unless ``copy``: tensors and arrays view ``buf`` (arrays read-only
    where it is, as Ray returns it), and keep it alive as long as they are.

    ``on_gone`` is called exactly once, on whatever thread drops the last view of
    ``buf`` (at once when this raises, or copies): the moment the buffer is no longer
    held (the object store's budget, ``RayDiffusionExecutor``).  It must not block or
    raise; it may run inside a garbage collection.
    """
    payload = packed.output
    try:
        if not isinstance(payload, StoredPayload):
            raise UsageError(f"output of {packed.request_id!r} is not packed for the object store")
        if payload.key and (buf is None or buf.dtype != np.uint8 or buf.shape != (payload.nbytes,)):
            got = None if buf is None else (buf.dtype, buf.shape)
            raise UsageError(f"output {_output_id(packed)!r}: its stored buffer is {got}, not {payload.nbytes} bytes")
    except BaseException:
        if on_gone is not None:
            on_gone()
        raise
    # The anchor: every view is a slice of it (numpy stops collapsing bases at an array
    # over a memoryview), so it dies with the last view, and its finalizer says so.
    anchor = np.frombuffer(memoryview(buf.data), np.uint8) if buf is not None else np.empty((0,), np.uint8)
    if on_gone is None:
        return attrs.evolve(packed, output=_unwalk(payload.tree, _BufferViews(anchor, copy)))
    views = _Views(None, _output_id(packed), None, anchor, name=f"stored buffer {payload.key}", on_gone=on_gone)
    weakref.finalize(anchor, _views_gone, views)
    src = _BufferViews(anchor, copy, views.leaves)
    del anchor  # from here the views hold it: copied, it is gone once the unpack returns
    out = attrs.evolve(packed, output=_unwalk(payload.tree, src))
    del src
    if not copy and views.leaves:
        _remember_unpacked(out, views)  # release_unpacked_output takes them back
    return out


# -- unpack / release ----------------------------------------------------------------------
#
# Lifetime of a zero-copy unpack (see the module docstring for the rule):
#
# * One ``_Views`` per leased segment viewed in this process, in ``_LIVE`` (by lease)
#   while its views may be alive.  Its *anchor* is a fresh uint8 ndarray over the
#   segment's cached mapping (``seg.numpy()``, whose base is the mapping's tensor, so
#   numpy stops collapsing bases at the anchor): every tensor leaf is
#   ``torch.from_numpy(anchor[a:b])`` (its storage keeps that slice, hence the anchor,
#   alive) and every array leaf is a numpy view whose base IS the anchor.  Whatever the
#   caller derives -- slices, ``.numpy()``, ``np.asarray``, memoryviews, DLPack,
#   storages -- holds one of those, so the anchor dies exactly when the last view does.
# * ``weakref.finalize(anchor, _views_gone, views)`` then gives the lease back.  It runs
#   on whatever thread dropped the last view, inside a garbage collection, or at
#   interpreter exit; it never raises, releases at most once (``views.gone``), and a
#   closed or vanished pool means nothing is left to give back.  During a collection the
#   thread might be inside the pool's own (non-reentrant) lock, so there the release is
#   queued for the ``omni-release`` thread instead of taken on the spot.
# * The anchor also keeps the mapping's tensor, and so the mmap, alive: after the pool
#   closed (files unlinked, mapping dropped from the cache) live views stay readable.

_LOCK = threading.RLock()  # reentrant: a finalizer may run while this thread holds it
_LIVE: dict[Lease, _Views] = {}
_UNPACKED: dict[int, tuple[weakref.ref[DiffusionOutput], _Views]] = {}
_DEFERRED: queue.SimpleQueue[_Views | threading.Event] = queue.SimpleQueue()  # put() is reentrant
_RELEASER: list[threading.Thread] = []
_RELEASER_PID = [0]
_IN_GC = [0]  # > 0 while a garbage collection runs (gc.callbacks)


def _on_gc(phase: str, info: dict[str, int]) -> None:
    _IN_GC[0] += 1 if phase == "start" else -1 if _IN_GC[0] > 0 else 0


gc.callbacks.append(_on_gc)


class ReleasedOutput:
    """What ``DiffusionOutput.output`` holds once ``release_unpacked_output`` took it back.

    Any use but ``repr`` raises ``LeaseAlreadyReleased``: reading a released output
    through the output object fails loudly instead of showing another request's bytes.
    """

    __slots__ = ("output_id", "segment")

    def __init__(self, output_id: str, segment: str) -> None:
        self.output_id = output_id
        self.segment = segment

    def _released(self) -> LeaseAlreadyReleased:
        return LeaseAlreadyReleased(
            self.segment,
            f"output {self.output_id!r} was released (release_output); copy what you keep before releasing",
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._released()

    def __getitem__(self, key: object) -> Any:
        raise self._released()

    def __iter__(self) -> Any:
        raise self._released()

    def __len__(self) -> int:
        raise self._released()

    def __repr__(self) -> str:
        return f"<released output {self.output_id!r} (segment {self.segment})>"


class _Views:
    """This process's zero-copy views of one leased segment (see the comment above), or of
    one stored buffer (``unpack_diffusion_output_host``: no lease, no pool; ``on_gone``
    says it is no longer held)."""

    __slots__ = ("anchor", "gone", "lease", "leaves", "name", "on_gone", "output_id", "pool")

    def __init__(
        self,
        lease: Lease | None,
        output_id: str,
        pool: SegmentPool | None,
        anchor: np.ndarray[Any, Any],
        *,
        name: str = "",
        on_gone: Callable[[], object] | None = None,
    ) -> None:
        self.lease = lease
        self.name = lease.name if lease is not None else name  # the segment's, or the stored buffer's key
        self.on_gone = on_gone
        self.output_id = output_id
        self.pool: weakref.ref[SegmentPool] | None = None if pool is None else weakref.ref(pool)
        self.anchor: weakref.ref[np.ndarray[Any, Any]] = weakref.ref(anchor)
        # One weak reference per tensor/array leaf handed out: for counting, never for lifetime.
        self.leaves: list[weakref.ref[Any]] = []
        self.gone = False  # the last view is gone (or the unpack failed): released or being released

    def alive(self) -> int:
        n = sum(1 for r in self.leaves if r() is not None)
        # A view derived from an array leaf points at the anchor, not at the leaf.
        return n if n or self.anchor() is None else 1


def _log(level: int, msg: str, *args: object, exc_info: bool = False) -> None:
    try:  # at interpreter exit logging may be half torn down: never let that escape
        log.log(level, msg, *args, exc_info=exc_info)
    except Exception:  # noqa: BLE001, S110 -- logging itself failed: nothing left to tell
        pass


def _give_back(views: _Views) -> None:
    """Release ``views``' lease to its pool, once; never raises (a finalizer's work)."""
    try:
        pool = None if views.pool is None else views.pool()
        if pool is not None and views.lease is not None and not pool.closed:
            pool.release(views.lease)
    except (PoolClosed, UnknownSegment):
        pass  # closed meanwhile: its owner unlinked every segment, nothing to give back
    except LeaseAlreadyReleased:
        _log(logging.ERROR, "segment %s of output %r was released behind its views' back", views.name, views.output_id)
    except Exception:  # noqa: BLE001 -- a finalizer must never raise; logged
        _log(logging.ERROR, "releasing segment %s of output %r failed", views.name, views.output_id, exc_info=True)
    finally:
        with _LOCK:
            if views.lease is not None and _LIVE.get(views.lease) is views:
                del _LIVE[views.lease]


def _views_gone(views: _Views) -> None:
    """The finalizer of a ``_Views``' anchor: its last view is gone.

    Called at most once (``weakref.finalize``; the one other caller detaches it first),
    and takes no lock of ours: during a collection this thread may hold any of them.
    """
    try:
        views.gone = True
        if views.on_gone is not None:
            views.on_gone()  # a stored buffer's: non-blocking, reentrant (its contract)
        elif _IN_GC[0]:
            _DEFERRED.put(views)  # maybe inside the pool's lock on this thread: not here
        else:
            _give_back(views)
    except Exception:  # noqa: BLE001, S110 -- a finalizer must never raise
        pass


def _releaser() -> None:
    while True:
        item = _DEFERRED.get()
        if isinstance(item, threading.Event):
            item.set()
        else:
            _give_back(item)


def _ensure_releaser() -> None:
    # Started once per process, from an unpack (never from a finalizer); its loop never
    # ends, so only a fork (a process without it) needs a new one.
    if _RELEASER_PID[0] == os.getpid():
        return
    with _LOCK:
        if _RELEASER_PID[0] != os.getpid():
            t = threading.Thread(target=_releaser, name="omni-release", daemon=True)
            t.start()
            _RELEASER[:] = [t]
            _RELEASER_PID[0] = os.getpid()


def settle_releases(timeout: float = 5.0) -> bool:
    """Wait until every release a garbage collection deferred has been carried out.

    Releases normally happen on the thread that drops the last view, before ``del``
    returns; only views freed by the cyclic garbage collector are released on the
    ``omni-release`` thread.  Returns False if that did not finish within ``timeout``.
    """
    if _RELEASER_PID[0] != os.getpid():
        return True  # nothing was ever deferred in this process
    done = threading.Event()
    _DEFERRED.put(done)
    return done.wait(timeout)


def is_packed(output: DiffusionOutput) -> bool:
    return isinstance(output.output, PackedPayload)


def packed_lease(output: DiffusionOutput) -> Lease | None:
    payload = output.output
    return payload.lease if isinstance(payload, PackedPayload) else None


def carried_leases(msg: AsyncDiffusionOutput) -> list[Lease]:
    """The segment leases a result-channel message carries.

    An OUTPUT_READY's packed output, and the packed output(s) of a step-mode
    RPC_RESULT (packed on the worker's main thread: one output or a batch).  The
    executor marks each received (``SegmentPool.receive``) as it reads the message.
    """
    return [lease for lease in map(packed_lease, _carried_outputs(msg)) if lease is not None]


def _carried_outputs(msg: AsyncDiffusionOutput) -> list[DiffusionOutput]:
    """The packed outputs a result-channel message carries: its OUTPUT_READY's output, or
    a step-mode RPC_RESULT's output or batch."""
    match msg:
        case OutputReady():
            items: tuple[object, ...] = (msg.output,)
        case RpcResult():
            items = (msg.result,)
        case ComputeDone() | Chunk():
            items = ()
        case _:
            assert_never(msg)
    found: list[DiffusionOutput] = []
    for item in items:
        if isinstance(item, DiffusionOutput):
            found.append(item)
        elif isinstance(item, BatchDiffusionOutput):
            found += item.outputs
    return found


def _output_id(output: DiffusionOutput) -> str:
    return output.async_output_id or output.request_id


class _Copies:
    """Leaf builder for ``copy=True``: owned copies out of the segment."""

    def __init__(self, seg: torch.Tensor | None) -> None:
        self.seg = seg

    def tensor(self, x: ShmTensor) -> torch.Tensor:
        assert self.seg is not None
        return self.seg[x.offset : x.offset + x.nbytes].view(x.dtype).view(x.shape).clone()

    def array(self, x: ShmArray) -> np.ndarray[Any, Any]:
        assert self.seg is not None
        return self.seg[x.offset : x.offset + x.nbytes].numpy().view(x.dtype).reshape(x.shape).copy()

    def raw(self, x: ShmBytes) -> bytes:
        assert self.seg is not None
        return self.seg[x.offset : x.offset + x.nbytes].numpy().tobytes()


class _ViewsOf:
    """Leaf builder for zero copy: views whose lifetime holds the anchor (see above)."""

    def __init__(self, anchor: np.ndarray[Any, Any], leaves: list[weakref.ref[Any]]) -> None:
        self.anchor = anchor
        self.leaves = leaves

    def tensor(self, x: ShmTensor) -> torch.Tensor:
        part = self.anchor[x.offset : x.offset + x.nbytes]
        self.leaves.append(weakref.ref(part))  # alive exactly while the tensor's storage is
        return torch.from_numpy(part).view(x.dtype).view(x.shape)

    def array(self, x: ShmArray) -> np.ndarray[Any, Any]:
        a = self.anchor[x.offset : x.offset + x.nbytes].view(x.dtype).reshape(x.shape)
        self.leaves.append(weakref.ref(a))
        return a

    def raw(self, x: ShmBytes) -> bytes:
        return self.anchor[x.offset : x.offset + x.nbytes].tobytes()


def _unwalk(x: Any, src: _Copies | _ViewsOf | _BufferViews) -> Any:
    if isinstance(x, ShmTensor):
        return src.tensor(x) if x.nbytes else torch.empty(x.shape, dtype=x.dtype)
    if isinstance(x, InlineTensor):
        if not x.data:
            return torch.empty(x.shape, dtype=x.dtype)
        return torch.frombuffer(bytearray(x.data), dtype=torch.uint8).view(x.dtype).view(x.shape)
    if isinstance(x, ShmArray):
        return src.array(x)
    if isinstance(x, ShmBytes):
        raw = src.raw(x)
        return bytearray(raw) if x.mutable else raw
    if isinstance(x, PackedSeq):
        items = [_unwalk(v, src) for v in x.items]
        if x.cls is list:
            return items
        if x.cls is tuple:
            return tuple(items)
        return x.cls(*items)  # namedtuple
    if isinstance(x, PackedMap):
        pairs = [(k, _unwalk(v, src)) for k, v in x.items]
        if x.cls is collections.defaultdict:
            return collections.defaultdict(x.default_factory, pairs)
        return x.cls(pairs)
    if isinstance(x, PackedObject):
        # As pickle does: no __init__, no validators or converters run a second time.
        obj: Any = object.__new__(x.cls)
        for name, v in x.fields:
            object.__setattr__(obj, name, _unwalk(v, src))
        return obj
    return x


def unpack_diffusion_output_shm(
    packed: DiffusionOutput, *, copy: bool = False, pool: SegmentPool | None = None
) -> DiffusionOutput:
    """Restore a packed output.

    ``copy=False`` (zero copy): tensors and arrays view the shared segment, which goes
    back to the pool when the last of them is gone (or at ``release_unpacked_output``
    if none is left then); see the module docstring.  ``copy=True``: owned copies, and
    the segment goes back before returning (unless views of it from an earlier zero-copy
    unpack are alive in this process: then when they go).  ``bytes``/``bytearray``
    leaves are copies either way.  Works in any process that received the pool: the
    segment is attached by name (cached per process); ``pool`` defaults to the one
    with the lease's prefix.  A second zero-copy unpack of a payload whose views are
    still alive here shares them; one whose segment already went back raises
    ``LeaseAlreadyReleased``.  If unpacking fails past those checks, the segment is
    given back before the error propagates.
    """
    payload = packed.output
    if not isinstance(payload, PackedPayload):
        raise UsageError(f"output of {packed.request_id!r} is not packed")
    lease = payload.lease
    if lease is None:
        return attrs.evolve(packed, output=_unwalk(payload.tree, _Copies(None)))
    if pool is None:
        pool = SegmentPool.for_prefix(lease.prefix)
    if copy:
        with _LOCK:
            viewed = lease in _LIVE  # then the live views hold it; it goes when they do
        if not viewed and not pool.is_leased(lease):
            raise LeaseAlreadyReleased(lease.name, f"output {_output_id(packed)!r} cannot be unpacked any more")
        try:
            tree = _unwalk(payload.tree, _Copies(attach_view(lease.name, lease.size)))
        finally:
            if not viewed:
                pool.release(lease)
        return attrs.evolve(packed, output=tree)
    return _unpack_views(packed, payload, lease, pool)


def _shared_views(lease: Lease, oid: str) -> tuple[_Views, np.ndarray[Any, Any]] | None:
    """Under ``_LOCK``: the live views of ``lease`` in this process and their anchor, if any."""
    views = _LIVE.get(lease)
    if views is None:
        return None
    anchor = views.anchor()
    if views.gone or anchor is None:
        raise LeaseAlreadyReleased(lease.name, f"the views of output {oid!r} were all dropped, which gave it back")
    return views, anchor


def _unpack_views(packed: DiffusionOutput, payload: PackedPayload, lease: Lease, pool: SegmentPool) -> DiffusionOutput:
    # _LOCK is only ever held for dict and flag work, never across a wait (no pool lock,
    # no mapping lock): so no finalizer, wherever it runs, can deadlock on it.
    oid = _output_id(packed)
    _ensure_releaser()
    fin: weakref.finalize[Any, Any] | None = None
    with _LOCK:
        shared = _shared_views(lease, oid)
    if shared is None:
        if not pool.is_leased(lease):
            if pool.closed:
                raise PoolClosed(f"segment pool {pool.prefix} is closed (output {oid!r})")
            raise LeaseAlreadyReleased(lease.name, f"output {oid!r} cannot be unpacked any more")
        try:
            fresh = attach_view(lease.name, lease.size).numpy()
        except BaseException:
            pool.release(lease)
            raise
        with _LOCK:
            shared = _shared_views(lease, oid)  # another thread may have won the race
            if shared is None:
                views = _Views(lease, oid, pool, fresh)
                fin = weakref.finalize(fresh, _views_gone, views)
                _LIVE[lease] = views
                shared = views, fresh
        del fresh
    views, anchor = shared
    del shared
    try:
        tree = _unwalk(payload.tree, _ViewsOf(anchor, views.leaves))
    except BaseException:
        if fin is not None and fin.detach() is not None:
            # The partial views are unreachable but through this traceback, which may
            # live long (a failed future keeps it): give the segment back now.
            views.gone = True
            _give_back(views)
        raise
    del anchor
    out = attrs.evolve(packed, output=tree)
    _remember_unpacked(out, views)
    return out


# The unpacked output cannot carry its views' state (DiffusionOutput is the public
# message type), so this process remembers which ``_Views`` each live unpacked output
# belongs to.  The entry goes when the output object does; the views and the lease do
# not (views may outlive the object): an unreleased lease stays in ``outstanding()``.


def _remember_unpacked(out: DiffusionOutput, views: _Views) -> None:
    key = id(out)

    def forget(ref: weakref.ref[DiffusionOutput]) -> None:
        # No lock (it may run in a collection, on a thread holding any lock); safe: the
        # object's id cannot be reused before its weakref callbacks have run.
        entry = _UNPACKED.get(key)
        if entry is not None and entry[0] is ref:
            _UNPACKED.pop(key, None)

    with _LOCK:
        _UNPACKED[key] = (weakref.ref(out, forget), views)


def _still_viewed(views: _Views) -> bool:
    with _LOCK:
        if views.gone:
            return False
    # What holds the views may be a reference cycle that is already garbage: collect
    # once before calling them alive (only on this path, which is about to fail).
    gc.collect()
    with _LOCK:
        return not views.gone


def release_unpacked_output(output: DiffusionOutput, *, pool: SegmentPool | None = None) -> int:
    """The consumer is done with what ``unpack_diffusion_output_shm`` returned (zero copy).

    Takes the output's own views back (``output.output`` becomes a ``ReleasedOutput``,
    which raises ``LeaseAlreadyReleased`` on any use) and returns 1 with the segment back
    in the pool -- if no other view of it is alive.  If some are (a tensor the caller
    kept, a slice of one, a numpy array over one...), raises ``OutputStillViewed``
    naming the output and how many are alive; the segment then goes back by itself when
    they are dropped.  0 for an output that views no segment (copied, inline-only, never
    unpacked here).  A second release raises ``LeaseAlreadyReleased``.  ``pool`` is not
    needed (the views know theirs); accepted for symmetry with ``release_packed_output``.
    """
    with _LOCK:
        entry = _UNPACKED.get(id(output))
        if entry is not None and entry[0]() is output:
            del _UNPACKED[id(output)]
        else:
            entry = None
    if entry is None:
        if isinstance(output.output, ReleasedOutput):
            raise output.output._released()
        return 0
    views = entry[1]
    # Dropping the output's own references may drop the last view: the finalizer then
    # releases, on this thread, before setattr returns.
    object.__setattr__(output, "output", ReleasedOutput(_output_id(output), views.name))
    if _still_viewed(views):
        raise OutputStillViewed(_output_id(output), views.alive(), views.name)
    if _DEFERRED.qsize():
        settle_releases()  # the collection above deferred it: it is done when we return
    return 1


def release_packed_output(output: DiffusionOutput, *, pool: SegmentPool | None = None) -> int:
    """Return a packed output's segment to its pool; how many segments were released (0 or 1).

    0 when the output holds no segment (not packed, or everything inline).  Raises
    ``LeaseAlreadyReleased`` on a second release (also when its zero-copy views already
    gave it back), ``OutputStillViewed`` while zero-copy views of it are alive in this
    process (they hold it; see ``release_unpacked_output``), ``PoolClosed`` after the
    pool closed.  The pool is found by the lease's prefix among this process's pools
    unless given.
    """
    lease = packed_lease(output)
    if lease is None:
        return 0
    with _LOCK:
        views = _LIVE.get(lease)
    if views is not None:
        if _still_viewed(views):
            raise OutputStillViewed(views.output_id, views.alive(), lease.name)
        raise LeaseAlreadyReleased(lease.name, f"the views of output {views.output_id!r} were dropped, which gave it back")
    (pool or SegmentPool.for_prefix(lease.prefix)).release(lease)
    return 1
