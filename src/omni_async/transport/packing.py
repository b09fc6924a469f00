"""Packing a finished output for the trip to the consumer, and unpacking it there.

``pack_diffusion_output_shm`` walks the output (dicts and dict subclasses, lists, tuples,
namedtuples, attrs and dataclass instances; tensors, numpy arrays, bytes and small plain
values) and
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

This module is the transport's public face for packing; the work is split by concern:
``skeleton`` (the packed tree's types), ``pack_walk`` (what an output may hold, what each
leaf costs, where it goes), ``device_copy`` (stream ordering and the copies),
``unpack_walk`` (the tree back into the output's shape) and ``unpacking`` (unpack,
release and the lifetime of zero-copy views).  Every public name is importable here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import assert_never

import attrs
import numpy as np
import numpy.typing as npt
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
from omni_async.transport.device_copy import (
    Staging,
    copy_in,
    fill_staged,
    launch_staged,
    ordered_streams,
    record_done,
    stage_and_sync,
)
from omni_async.transport.pack_walk import Plan, walk
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.transport.shm import Lease, SegmentPool
from omni_async.transport.skeleton import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_MAX_INLINE_BYTES,
    InlineTensor,
    PackedMap,
    PackedObject,
    PackedPayload,
    PackedSeq,
    ShmArray,
    ShmBytes,
    ShmTensor,
    Skeleton,
    StoredPayload,
    is_packed,
    packed_lease,
)
from omni_async.transport.unpacking import (
    ReleasedOutput,
    release_packed_output,
    release_unpacked_output,
    settle_releases,
    unpack_diffusion_output_host,
    unpack_diffusion_output_shm,
    viewed_segment,
)

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_MAX_INLINE_BYTES",
    "InlineTensor",
    "PackInFlight",
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
    "leaf_nbytes",
    "pack_diffusion_output_host",
    "pack_diffusion_output_shm",
    "packed_lease",
    "packed_nbytes",
    "release_packed_output",
    "release_unpacked_output",
    "segment_nbytes",
    "start_pack_shm",
    "settle_releases",
    "unpack_diffusion_output_host",
    "unpack_diffusion_output_shm",
    "viewed_segment",
]


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
    return sum(leaf_nbytes(output.output))


def leaf_nbytes(tree: object) -> list[int]:
    """The bytes of every tensor, array and bytes leaf of ``tree`` (an output's structure),
    in the order the packer walks them; raises what the packer's walk raises."""
    sizes: list[int] = []
    walk(tree, lambda _, n: sizes.append(n), "output", 0)
    return sizes


def segment_nbytes(
    leaves: list[int] | tuple[int, ...],
    *,
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES,
) -> int:
    """The bytes of the segment ``pack_diffusion_output_shm`` leases for an output whose
    leaves (``leaf_nbytes``, in walk order) have these sizes: its own placement rule
    (inline while small, aligned offsets in the segment otherwise); 0 when every leaf
    travels inline (no segment)."""
    plan = Plan(inline_threshold, max_inline_bytes)
    for n in leaves:
        if not plan.inline_ok(n):
            plan.place(b"", n)
    return plan.size


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

    ``metrics.pack_s``: the host seconds of this call, which include waiting for
    ``ready_event`` (the synchronize waits for the forward's kernels too); a worker's
    packer replaces it with the time from the copy's start on the device
    (``omni_async.worker.stamps``).

    The same as ``start_pack_shm(...).finish()``.
    """
    return start_pack_shm(
        output,
        d2h_stream,
        pool=pool,
        inline_threshold=inline_threshold,
        max_inline_bytes=max_inline_bytes,
        ready_event=ready_event,
        lease_timeout=lease_timeout,
    ).finish()


@attrs.define(eq=False)
class PackInFlight:
    """A pack whose copies are queued (``start_pack_shm``): ``finish`` waits for them and
    returns the packed output; ``abandon`` waits for them and gives the segment back.
    Exactly one of the two, once.  Until then the lease is this process's (a worker that
    dies here has it reclaimed: ``SegmentPool.reclaim_owner``), and ``output`` keeps the
    device tensors referenced, so their memory is not reused mid-copy."""

    output: DiffusionOutput
    plan: Plan
    tree: Skeleton
    lease: Lease | None
    pool: SegmentPool | None
    pinned: bool
    done: list[torch.cuda.Event]
    staging: Staging
    started: float
    ended: bool = False

    def finish(self) -> DiffusionOutput:
        self._end()
        try:
            for e in self.done:
                e.synchronize()
            fill_staged(self.staging)
            if self.lease is not None:
                assert self.pool is not None
                self.pool.hand_off(self.lease)
        except BaseException:
            self._give_back()
            raise
        plan = self.plan
        payload = PackedPayload(self.tree, self.lease, plan.shm_bytes, plan.inline_bytes)
        metrics = attrs.evolve(
            self.output.metrics,
            pack_s=time.perf_counter() - self.started,
            pack_shm_bytes=float(plan.shm_bytes),
            pack_inline_bytes=float(plan.inline_bytes),
            pack_pinned=1.0 if self.pinned else 0.0,
        )
        return attrs.evolve(self.output, output=payload, metrics=metrics)

    def abandon(self) -> None:
        self._end()
        self._give_back()

    def _end(self) -> None:
        if self.ended:
            raise UsageError("a pack in flight is finished or abandoned once")
        self.ended = True

    def _give_back(self) -> None:
        for e in self.done:
            e.synchronize()  # no DMA may still target a segment we give back
        if self.lease is not None and self.pool is not None:
            self.pool.release(self.lease)


def start_pack_shm(
    output: DiffusionOutput,
    d2h_stream: CopyStream = None,
    *,
    pool: SegmentPool | None = None,
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES,
    ready_event: DeviceEvent | None = None,
    lease_timeout: float | None = None,
) -> PackInFlight:
    """``pack_diffusion_output_shm``'s first half: lease the segment and queue the copies
    (host leaves are copied now); returns without waiting for the device.  A packer
    that starts the next output's pack before it finishes this one keeps the copy
    engine busy across the two (``omni_async.worker.packer``).  Raises what
    ``pack_diffusion_output_shm`` raises, with nothing leased."""
    _check_unpacked(output, "pack_diffusion_output_shm")
    t0 = time.perf_counter()
    plan = Plan(inline_threshold, max_inline_bytes)
    tree = walk(output.output, plan.pack_leaf, "output", 0)

    ordered_stream = ordered_streams(d2h_stream, ready_event)
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
            streams = copy_in(seg, plan, ordered_stream)
        staging = launch_staged(plan, ordered_stream, streams)
        done = record_done(streams)
    except BaseException:
        if lease is not None and pool is not None:
            for s in streams:
                s.synchronize()  # no DMA may still target a segment we give back
            pool.release(lease)
        raise
    return PackInFlight(output, plan, tree, lease, pool, pinned, done, staging, t0)


def pack_diffusion_output_host(
    output: DiffusionOutput,
    d2h_stream: CopyStream = None,
    *,
    put: Callable[[npt.NDArray[np.uint8]], str],
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
    plan = Plan(inline_threshold, max_inline_bytes)
    tree = walk(output.output, plan.pack_leaf, "output", 0)
    ordered_stream = ordered_streams(d2h_stream, ready_event)
    if pin_memory is None:
        pin_memory = any(isinstance(src, torch.Tensor) and src.device.type == "cuda" for src, _, _ in plan.shm)
    buf = torch.empty((plan.size,), dtype=torch.uint8, pin_memory=pin_memory)
    streams = copy_in(buf, plan, ordered_stream) if plan.shm else []
    stage_and_sync(plan, ordered_stream, streams)
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
