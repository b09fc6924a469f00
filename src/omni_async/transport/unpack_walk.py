"""The unpack walk: a packed skeleton back into the output's own shape.

``unwalk`` rebuilds every container and takes each leaf from a *leaf builder*:
``Copies`` (owned copies out of the segment), ``ViewsOf`` (zero-copy views of a leased
segment, each counted in ``leaves``: see ``unpacking`` for their lifetime) or
``BufferViews`` (views or copies of a stored host buffer, the object-store path).
"""

from __future__ import annotations

import collections
import warnings
import weakref

import torch

from omni_async.transport.skeleton import (
    Array,
    InlineTensor,
    Leaf,
    PackedDictObject,
    PackedMap,
    PackedObject,
    PackedSeq,
    ShmArray,
    ShmBytes,
    ShmTensor,
    Skeleton,
)

__all__ = ["BufferViews", "Copies", "ViewsOf", "unwalk"]


class Copies:
    """Leaf builder for ``copy=True``: owned copies out of the segment."""

    def __init__(self, seg: torch.Tensor | None) -> None:
        self.seg = seg

    def tensor(self, x: ShmTensor) -> torch.Tensor:
        assert self.seg is not None
        return self.seg[x.offset : x.offset + x.nbytes].view(x.dtype).view(x.shape).clone()

    def array(self, x: ShmArray) -> Array:
        assert self.seg is not None
        return self.seg[x.offset : x.offset + x.nbytes].numpy().view(x.dtype).reshape(x.shape).copy()

    def raw(self, x: ShmBytes) -> bytes:
        assert self.seg is not None
        return self.seg[x.offset : x.offset + x.nbytes].numpy().tobytes()


class ViewsOf:
    """Leaf builder for zero copy: views whose lifetime holds the anchor (see above)."""

    def __init__(self, anchor: Array, leaves: list[weakref.ref[Leaf]]) -> None:
        self.anchor = anchor
        self.leaves = leaves

    def tensor(self, x: ShmTensor) -> torch.Tensor:
        part = self.anchor[x.offset : x.offset + x.nbytes]
        self.leaves.append(weakref.ref(part))  # alive exactly while the tensor's storage is
        return torch.from_numpy(part).view(x.dtype).view(x.shape)

    def array(self, x: ShmArray) -> Array:
        a = self.anchor[x.offset : x.offset + x.nbytes].view(x.dtype).reshape(x.shape)
        self.leaves.append(weakref.ref(a))
        return a

    def raw(self, x: ShmBytes) -> bytes:
        return self.anchor[x.offset : x.offset + x.nbytes].tobytes()


class BufferViews:
    """Leaf builder over a stored buffer: zero-copy views of it (counted in ``leaves``, as
    ``ViewsOf`` does), or owned copies."""

    def __init__(self, buf: Array, copy: bool, leaves: list[weakref.ref[Leaf]] | None = None) -> None:
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

    def array(self, x: ShmArray) -> Array:
        a = self.buf[x.offset : x.offset + x.nbytes].view(x.dtype).reshape(x.shape)
        if self.copy:
            return a.copy()
        self.leaves.append(weakref.ref(a))
        return a  # read-only where the buffer is

    def raw(self, x: ShmBytes) -> bytes:
        return self.buf[x.offset : x.offset + x.nbytes].tobytes()


def unwalk(x: Skeleton, src: Copies | ViewsOf | BufferViews) -> object:
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
        items = [unwalk(v, src) for v in x.items]
        if x.cls is list:
            return items
        if x.cls is tuple:
            return tuple(items)
        return x.cls(*items)  # namedtuple
    if isinstance(x, PackedMap):
        pairs = [(k, unwalk(v, src)) for k, v in x.items]
        if x.cls is collections.defaultdict:
            return collections.defaultdict(x.default_factory, pairs)
        return x.cls(pairs)
    if isinstance(x, PackedObject):
        # As pickle does: no __init__, no validators or converters run a second time.
        obj: object = object.__new__(x.cls)
        for name, v in x.fields:
            object.__setattr__(obj, name, unwalk(v, src))
        return obj
    if isinstance(x, PackedDictObject):
        return _rebuild_dict_object(x, src)
    return x


def _rebuild_dict_object(x: PackedDictObject, src: Copies | ViewsOf | BufferViews) -> object:
    # As pickle does (copyreg.__newobj__): the builtin base makes the instance, no
    # __init__ runs; the base's own __setitem__, not an override (BaseOutput refuses
    # update() and mirrors __setitem__ into attributes: harmless here, but not ours to call).
    base = x.base
    obj: dict[object, object] = base.__new__(x.cls)
    for k, v in x.items:
        base.__setitem__(obj, k, unwalk(v, src))
    if x.default_factory is not None:
        object.__setattr__(obj, "default_factory", x.default_factory)
    for name, v in x.fields:
        object.__setattr__(obj, name, unwalk(v, src))
    for name in x.aliases:
        object.__setattr__(obj, name, base.__getitem__(obj, name))
    return obj
