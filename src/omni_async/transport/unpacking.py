"""Unpacking and releasing: a packed output back on the consumer's side, and its
segment back in the pool exactly when nothing views it any more.

The rule is in ``packing``'s docstring; the mechanism (one ``_Views`` per viewed
segment, its anchor, the finalizer, the ``omni-release`` thread) in the comment below.
``unpack_diffusion_output_host`` is the object-store path's unpack (a stored buffer
instead of a segment: the same views, an ``on_gone`` callback instead of a pool).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import NoReturn, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
import torch

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput
from omni_async.transport.errors import (
    LeaseAlreadyReleased,
    OutputStillViewed,
    PoolClosed,
    UnknownSegment,
)
from omni_async.transport.shm import Lease, SegmentPool, attach_view
from omni_async.transport.skeleton import Leaf, PackedPayload, StoredPayload, output_id, packed_lease
from omni_async.transport.unpack_walk import BufferViews, Copies, ViewsOf, unwalk

__all__ = [
    "ReleasedOutput",
    "release_packed_output",
    "release_unpacked_output",
    "segment_span",
    "settle_releases",
    "unpack_diffusion_output_host",
    "unpack_diffusion_output_shm",
    "viewed_segment",
]

log = logging.getLogger(__name__)

# A segment's (or stored buffer's) bytes: the anchor every view is a slice of.
_Bytes: TypeAlias = npt.NDArray[np.uint8]

# Lifetime of a zero-copy unpack (see ``packing``'s docstring for the rule):
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

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._released()

    def __getitem__(self, key: object) -> NoReturn:
        raise self._released()

    def __iter__(self) -> NoReturn:
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
        anchor: _Bytes,
        *,
        name: str = "",
        on_gone: Callable[[], object] | None = None,
    ) -> None:
        self.lease = lease
        self.name = lease.name if lease is not None else name  # the segment's, or the stored buffer's key
        self.on_gone = on_gone
        self.output_id = output_id
        self.pool: weakref.ref[SegmentPool] | None = None if pool is None else weakref.ref(pool)
        self.anchor: weakref.ref[_Bytes] = weakref.ref(anchor)
        # One weak reference per tensor/array leaf handed out: for counting, never for lifetime.
        self.leaves: list[weakref.ref[Leaf]] = []
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
        return attrs.evolve(packed, output=unwalk(payload.tree, Copies(None)))
    if pool is None:
        pool = SegmentPool.for_prefix(lease.prefix)
    if copy:
        with _LOCK:
            viewed = lease in _LIVE  # then the live views hold it; it goes when they do
        if not viewed and not pool.is_leased(lease):
            raise LeaseAlreadyReleased(lease.name, f"output {output_id(packed)!r} cannot be unpacked any more")
        try:
            tree = unwalk(payload.tree, Copies(attach_view(lease.name, lease.size)))
        finally:
            if not viewed:
                pool.release(lease)
        return attrs.evolve(packed, output=tree)
    return _unpack_views(packed, payload, lease, pool)


def _shared_views(lease: Lease, oid: str) -> tuple[_Views, _Bytes] | None:
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
    oid = output_id(packed)
    _ensure_releaser()
    fin: weakref.finalize[[_Views], _Bytes] | None = None
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
        tree = unwalk(payload.tree, ViewsOf(anchor, views.leaves))
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


def viewed_segment(output: DiffusionOutput) -> tuple[str, int, int] | None:
    """The segment ``output``'s zero-copy views are slices of, as ``(name, size, address)``:
    its POSIX shared-memory name (another process on the host attaches it by that name),
    its size, and where it is mapped in this process (a leaf's offset in the segment is
    its data pointer minus ``address``).  None: the output views no segment (copied,
    inline only, released, or not unpacked here)."""
    with _LOCK:
        entry = _UNPACKED.get(id(output))
        if entry is None or entry[0]() is not output:
            return None
        views = entry[1]
        anchor = views.anchor()
        if views.gone or anchor is None or views.lease is None:
            return None
        return views.lease.name, views.lease.size, int(anchor.ctypes.data)


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
    object.__setattr__(output, "output", ReleasedOutput(output_id(output), views.name))
    if _still_viewed(views):
        raise OutputStillViewed(output_id(output), views.alive(), views.name)
    if _DEFERRED.qsize():
        settle_releases()  # the collection above deferred it: it is done when we return
    return 1


def segment_span(output: DiffusionOutput, leaf: object) -> tuple[str, int, int] | None:
    """Where ``leaf`` (a tensor or array of ``output``, as ``unpack_diffusion_output_shm``
    made it, zero copy) lies in its segment: ``(segment name, segment size, byte
    offset)``, for another process of this host to map and read by name while the
    output is held (not released).  None where it is not a contiguous view of a segment
    of ``output``'s (copied, inline, stored buffer, a strided slice): the caller copies."""
    with _LOCK:
        entry = _UNPACKED.get(id(output))
        if entry is None or entry[0]() is not output or entry[1].lease is None or entry[1].gone:
            return None
        views = entry[1]
        anchor = views.anchor()
    lease = views.lease
    if anchor is None or lease is None:
        return None
    base = anchor.__array_interface__["data"][0]
    if isinstance(leaf, np.ndarray):
        if not leaf.flags.c_contiguous:
            return None
        start, nbytes = int(leaf.__array_interface__["data"][0]), int(leaf.nbytes)
    else:
        if not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu" or not leaf.is_contiguous():
            return None
        start, nbytes = int(leaf.data_ptr()), leaf.numel() * leaf.element_size()
    offset = start - int(base)
    if offset < 0 or offset + nbytes > min(int(anchor.nbytes), lease.size):
        return None
    return lease.name, lease.size, offset


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
        raise LeaseAlreadyReleased(
            lease.name, f"the views of output {views.output_id!r} were dropped, which gave it back"
        )
    (pool or SegmentPool.for_prefix(lease.prefix)).release(lease)
    return 1


def unpack_diffusion_output_host(
    packed: DiffusionOutput,
    buf: _Bytes | None,
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
            raise UsageError(f"output {output_id(packed)!r}: its stored buffer is {got}, not {payload.nbytes} bytes")
    except BaseException:
        if on_gone is not None:
            on_gone()
        raise
    # The anchor: every view is a slice of it (numpy stops collapsing bases at an array
    # over a memoryview), so it dies with the last view, and its finalizer says so.
    anchor = np.frombuffer(memoryview(buf.data), np.uint8) if buf is not None else np.empty((0,), np.uint8)
    if on_gone is None:
        return attrs.evolve(packed, output=unwalk(payload.tree, BufferViews(anchor, copy)))
    views = _Views(None, output_id(packed), None, anchor, name=f"stored buffer {payload.key}", on_gone=on_gone)
    weakref.finalize(anchor, _views_gone, views)
    src = BufferViews(anchor, copy, views.leaves)
    del anchor  # from here the views hold it: copied, it is gone once the unpack returns
    out = attrs.evolve(packed, output=unwalk(payload.tree, src))
    del src
    if not copy and views.leaves:
        _remember_unpacked(out, views)  # release_unpacked_output takes them back
    return out
