"""Owned copies of an unpacked output: what the engine returns without a host stage.

An unpacked output's tensors view a shared-memory segment of the executor's budget;
a result that kept them would hold that budget for as long as the caller keeps the
result.  So without a host stage the engine copies every tensor, array and
bytearray out and releases the segment before the result reaches the caller.

Large tensors and arrays are copied into ``HostBuffers``: memory the engine reuses once
the caller has dropped every array and tensor made of it.  Fresh memory is what the
copy used to cost: each page of it faults in on first write (measured on the 2-core CPU
machine, 224 MB: 58 ms into fresh numpy memory, 345 ms into a fresh ``bytes``, 19 ms
into memory written before; ``bench/results/host_path_profile.md``).  Smaller ones go
through numpy's allocator (its huge pages fault far less than ``Tensor.clone()``: 64 MB
float32, 49 ms against 172 ms).  The tensor returned wraps the numpy copy
(``torch.from_numpy``): an ordinary CPU tensor that owns its memory.

The structures walked are the ones the packer carries: tensors, numpy arrays, bytes,
plain values, lists, tuples (named too), dicts (``OrderedDict``, ``defaultdict``),
instances of dict subclasses (diffusers' ``BaseOutput``), and attrs/dataclass instances
(rebuilt field by field, as unpacking builds them).
Anything else is ``copy.deepcopy``-ed.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

import attrs
import numpy as np
import torch

from omni_async.transport.pack_walk import attribute_names, dict_base

__all__ = [
    "DEFAULT_COPY_THREADS",
    "DEFAULT_IDLE_BYTES",
    "POOLED_FROM_BYTES",
    "Guarded",
    "HostBuffers",
    "guard_input",
    "owned_copy",
    "parallel_copy",
    "written",
]

T = TypeVar("T")

_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


#: Below this many bytes a copy takes fresh memory: the allocator's own free lists keep
#: it warm, and a loan's bookkeeping would cost more than the faults it saves.
POOLED_FROM_BYTES: Final = 1 << 20
#: Idle buffers ``HostBuffers`` keeps by default (the least recently returned go first).
DEFAULT_IDLE_BYTES: Final = 4 << 30
#: An idle buffer not taken again within this many seconds is dropped (a burst of large
#: outputs does not pin its memory for the process's life).
DEFAULT_IDLE_S: Final = 60.0
_HUGE_PAGE: Final = 2 << 20
#: A copy is split over the copy threads in parts of at least this many bytes.
PARALLEL_PART_BYTES: Final = 32 << 20
#: Threads a large copy is split over by default: half the cores, at most 8 (one core's
#: memcpy reaches 10-13 GB/s; a 16-core host's memory several times that), 1 on the
#: 2-core machine, where a second thread only competes with the worker.
DEFAULT_COPY_THREADS: Final = max(1, min(8, (os.cpu_count() or 1) // 2))

_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


def _copy_threads(n: int) -> ThreadPoolExecutor:
    """The process's copy threads (one pool for every engine: none is started per engine,
    none outlives the process's need; started on the first parallel copy)."""
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None or _copy_pool._max_workers < n:
            if _copy_pool is not None:
                _copy_pool.shutdown(wait=False)  # its threads leave once idle
            _copy_pool = ThreadPoolExecutor(n, thread_name_prefix="omni-host-copy")
        return _copy_pool


def parallel_copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], threads: int = DEFAULT_COPY_THREADS) -> None:
    """``np.copyto(dst, src)`` of two C-contiguous arrays of one size, split over up to
    ``threads`` threads (numpy releases the GIL while it copies) for large copies."""
    n = src.nbytes
    parts = min(threads, n // PARALLEL_PART_BYTES)
    if parts <= 1:
        np.copyto(dst, src, casting="no")
        return
    d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    step = -(-n // parts)
    step += -step % 4096  # page-aligned parts: no two threads write one page
    futures = [_copy_threads(threads).submit(np.copyto, d[i : i + step], s[i : i + step]) for i in range(0, n, step)]
    for f in futures:
        f.result()


class _Loan:
    """What every array and tensor made of one lent buffer holds (their ``base`` chain
    ends here: ``np.asarray`` of an object with ``__array_interface__`` keeps the object).
    When the last of them is gone this object is, and its finalizer gives the buffer back:
    so a buffer is reused only once nothing made of it can be reached."""

    __slots__ = ("__array_interface__", "__weakref__", "raw")

    def __init__(self, raw: np.ndarray[Any, np.dtype[np.uint8]], nbytes: int) -> None:
        self.raw = raw
        self.__array_interface__ = {
            "data": (raw.ctypes.data, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


class HostBuffers:
    """Owned host memory for copies out of shared memory, reused once provably unreferenced.

    ``take(n)`` returns a writable uint8 array of ``n`` bytes.  Large ones (from
    ``POOLED_FROM_BYTES``) are lent out of buffers kept here: the buffer comes back only
    when every array and tensor made of the loan has been freed (a finalizer on the
    object they all hold, ``_Loan``), so a result a caller keeps never changes under
    them; a later ``take`` reuses it, its pages already faulted in.  A buffer is reused
    for a request at most a quarter (or a 2 MB huge page) smaller than it (outputs of one
    shape repeat); idle buffers past ``max_idle_bytes``, or idle longer than ``idle_s``,
    are dropped.  A raw pointer taken out of an array (``ctypes``) is not a reference:
    the pointer's holder must keep the array too.  Thread-safe:
    a finalizer may run on any thread, in a garbage collection inside ``take`` too, so
    it only appends to a deque that ``take`` drains."""

    def __init__(
        self,
        max_idle_bytes: int = DEFAULT_IDLE_BYTES,
        idle_s: float = DEFAULT_IDLE_S,
        copy_threads: int = DEFAULT_COPY_THREADS,
    ) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.idle_s = idle_s
        #: Threads ``copy`` splits a large copy over (``parallel_copy``).
        self.copy_threads = copy_threads
        self._lock = threading.Lock()
        self._idle: list[tuple[float, np.ndarray[Any, np.dtype[np.uint8]]]] = []  # (returned at, buffer)
        self._returned: collections.deque[np.ndarray[Any, np.dtype[np.uint8]]] = collections.deque()
        #: Loans served from an idle buffer, and from a fresh one (metrics, tests).
        self.reused = 0
        self.fresh = 0

    def take(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A uint8 array of ``nbytes`` that owns its memory for as long as anything made of it lives."""
        if nbytes < POOLED_FROM_BYTES:
            return np.empty(nbytes, np.uint8)
        now = time.monotonic()
        with self._lock:
            self._drain(now)
            best = -1
            for i, (_, raw) in enumerate(self._idle):
                size = raw.nbytes
                if nbytes <= size <= nbytes + max(nbytes // 4, _HUGE_PAGE) and (
                    best < 0 or size < self._idle[best][1].nbytes
                ):
                    best = i
            if best >= 0:
                raw = self._idle.pop(best)[1]
                self.reused += 1
            else:
                self.fresh += 1
                raw = np.empty(-(-nbytes // _HUGE_PAGE) * _HUGE_PAGE, np.uint8)
        loan = _Loan(raw, nbytes)
        weakref.finalize(loan, self._returned.append, raw)
        return np.asarray(loan)

    def copy(self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        """``src`` into ``dst`` (C-contiguous, one size), over ``copy_threads`` threads when large."""
        parallel_copy(dst, src, self.copy_threads)

    def idle_bytes(self) -> int:
        """Bytes held idle now (buffers given back and not yet taken again)."""
        with self._lock:
            self._drain(time.monotonic())
            return sum(raw.nbytes for _, raw in self._idle)

    def _drain(self, now: float) -> None:
        while self._returned:
            self._idle.append((now, self._returned.popleft()))
        self._idle = [(at, raw) for at, raw in self._idle if now - at <= self.idle_s]
        total = sum(raw.nbytes for _, raw in self._idle)
        while total > self.max_idle_bytes:
            total -= self._idle.pop(0)[1].nbytes


def owned_copy(value: T, buffers: HostBuffers | None = None) -> T:
    """``value`` with every tensor, array and bytearray copied into memory it owns (large
    ones into ``buffers``, reused once the caller has dropped them; None: fresh memory)."""
    return _walk(value, buffers)  # type: ignore[no-any-return]  # same structure, same types


def _fresh(nbytes: int, buffers: HostBuffers | None) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.empty(nbytes, np.uint8) if buffers is None else buffers.take(nbytes)


def _tensor(t: torch.Tensor, buffers: HostBuffers | None) -> torch.Tensor:
    if t.device.type != "cpu" or t.numel() == 0 or t.is_quantized or t.layout is not torch.strided:
        return t.detach().clone()
    src = t.detach()
    if not src.is_contiguous():
        src = src.contiguous()  # already a fresh copy: nothing else views it
        return src
    try:
        raw = src.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return src.clone()
    dst = _fresh(raw.nbytes, buffers)
    if buffers is None:
        np.copyto(dst, raw)
    else:
        buffers.copy(dst, raw)
    return torch.from_numpy(dst).view(t.dtype).view(t.shape)


def _array(x: np.ndarray[Any, Any], buffers: HostBuffers | None) -> np.ndarray[Any, Any]:
    if buffers is None or x.dtype.hasobject or not x.flags.c_contiguous or x.nbytes < POOLED_FROM_BYTES:
        return np.array(x, copy=True)
    dst: np.ndarray[Any, Any] = buffers.take(x.nbytes).view(x.dtype).reshape(x.shape)
    buffers.copy(dst, x)
    return dst


def _walk(x: Any, buffers: HostBuffers | None) -> Any:
    if isinstance(x, _IMMUTABLE):
        return x
    if isinstance(x, torch.Tensor):
        return _tensor(x, buffers)
    if isinstance(x, np.ndarray):
        return _array(x, buffers)
    if isinstance(x, bytearray):
        return bytearray(x)
    if isinstance(x, list):
        return [_walk(v, buffers) for v in x]
    if isinstance(x, tuple):
        items = [_walk(v, buffers) for v in x]
        if type(x) is tuple:
            return tuple(items)
        if hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*items)
        return copy.deepcopy(x)
    if type(x) is collections.defaultdict:
        return collections.defaultdict(x.default_factory, ((k, _walk(v, buffers)) for k, v in x.items()))
    if type(x) in (dict, collections.OrderedDict):
        return type(x)((k, _walk(v, buffers)) for k, v in x.items())
    if isinstance(x, dict):
        return _dict_object(x, buffers)
    if attrs.has(type(x)) or (dataclasses.is_dataclass(x) and not isinstance(x, type)):
        names = (
            [f.name for f in attrs.fields(type(x))] if attrs.has(type(x)) else [f.name for f in dataclasses.fields(x)]
        )
        obj: Any = object.__new__(type(x))
        for name in names:
            object.__setattr__(obj, name, _walk(getattr(x, name), buffers))
        return obj
    return copy.deepcopy(x)


_UNSET = object()


def _dict_object(x: Any, buffers: HostBuffers | None) -> Any:
    """An instance of a dict subclass (diffusers' ``BaseOutput``: a dataclass over an
    ``OrderedDict``), rebuilt as unpacking rebuilds it (``transport.unpack_walk``, with the
    transport's ``dict_base`` and ``attribute_names``): the builtin base makes the instance,
    no ``__init__`` runs (``object.__new__`` refuses these classes), dict's own
    ``__setitem__`` puts the copied items back, and each attribute takes its item's copy
    when it was that very item (BaseOutput mirrors its fields into items), a copy of its
    own otherwise."""
    base = dict_base(type(x))
    if base is None:  # made by another builtin: the packer refuses it too
        return copy.deepcopy(x)
    obj: Any = base.__new__(type(x))
    copies: dict[int, Any] = {}
    for k, v in dict.items(x):  # dict's own view: BaseOutput overrides items() and __getitem__
        copies[id(v)] = c = _walk(v, buffers)
        base.__setitem__(obj, k, c)
    if isinstance(x, collections.defaultdict):
        obj.default_factory = x.default_factory
    for name in attribute_names(x):
        v = getattr(x, name, _UNSET)
        if v is not _UNSET:
            object.__setattr__(obj, name, copies[id(v)] if id(v) in copies else _walk(v, buffers))
    return obj


#: What ``guard_input`` found: each tensor, where it is in the output, its version.
Guarded = list[tuple[str, torch.Tensor, int]]


def guard_input(value: object) -> Guarded:
    """What a host stage declared read-only (``PostProcess(host_reads_only=True)``) is
    handed: numpy arrays of ``value`` are made read-only (a write raises ``ValueError``
    in the stage), and every tensor is listed with its version counter, which every
    in-place torch op bumps (on the tensor or any view of it: ``t.float()`` of a float32
    tensor is ``t`` itself).  ``written`` reads them again after the stage.  The list
    holds views of the segment: drop it before the release."""
    found: Guarded = []
    _guard(value, "output", 0, found)
    return found


def _guard(x: Any, where: str, depth: int, found: Guarded) -> None:
    # A plain function, not a closure over ``found``: a recursive closure is a reference
    # cycle, which would keep the segment's views alive until the garbage collector ran
    # (and the release would find them: OutputStillViewed).
    if depth > 64 or isinstance(x, _IMMUTABLE):
        return
    if isinstance(x, torch.Tensor):
        found.append((where, x, x._version))
    elif isinstance(x, np.ndarray):
        x.flags.writeable = False
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _guard(v, f"{where}[{i}]", depth + 1, found)
    elif isinstance(x, dict):
        for k, v in x.items():
            _guard(v, f"{where}[{k!r}]", depth + 1, found)
    elif attrs.has(type(x)) or (dataclasses.is_dataclass(x) and not isinstance(x, type)):
        names = (
            [f.name for f in attrs.fields(type(x))] if attrs.has(type(x)) else [f.name for f in dataclasses.fields(x)]
        )
        for name in names:
            _guard(getattr(x, name, None), f"{where}.{name}", depth + 1, found)


def written(guarded: Guarded) -> list[str]:
    """The tensors of ``guard_input`` that were written in place since (by where they are)."""
    return [where for where, t, version in guarded if t._version != version]
