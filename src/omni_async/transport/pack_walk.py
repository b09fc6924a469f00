"""The pack walk: what an output may hold, what each leaf costs, and where it goes.

``walk`` is the one definition of an output's shape (dicts, lists, tuples, namedtuples,
attrs and dataclass instances; tensor, array and bytes leaves; plain values): packing
walks with ``Plan.pack_leaf`` (inline, or an offset in the segment), sizing
(``packed_nbytes``) with a counter.  The copies themselves are ``device_copy``'s.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Final, TypeAlias

import attrs
import numpy as np
import torch

from omni_async.core.errors import UsageError
from omni_async.transport.errors import UnsupportedOutputType
from omni_async.transport.skeleton import (
    MAX_DEPTH,
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
    align,
    is_plain,
    tensor_nbytes,
)

__all__ = ["OnLeaf", "Plan", "attribute_names", "dict_base", "walk"]

# The builtin dict types an instance of a dict subclass can be rebuilt on (their
# ``__new__`` takes no argument, their items are set one by one, as pickle does).
_DICT_BASES: Final[tuple[type[dict[object, object]], ...]] = (dict, collections.OrderedDict, collections.defaultdict)
_HEAPTYPE: Final = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python, not a builtin
_UNSET: Final = object()

# What a walk does at each leaf, given the bytes the packer copies for it; returns the
# leaf's place in the skeleton.
OnLeaf: TypeAlias = Callable[[Leaf, int], Skeleton]


@attrs.define
class Plan:
    inline_threshold: int
    max_inline_bytes: int
    inline_bytes: int = 0
    shm_bytes: int = 0
    size: int = 0  # segment bytes used: the end of the last item
    # (source, offset, nbytes) for shared-memory leaves
    shm: list[tuple[Leaf, int, int]] = attrs.field(factory=list)
    # (device tensor, bytearray it fills) for small device tensors
    staged: list[tuple[torch.Tensor, bytearray]] = attrs.field(factory=list)

    def inline_ok(self, n: int) -> bool:
        if n <= self.inline_threshold and self.inline_bytes + n <= self.max_inline_bytes:
            self.inline_bytes += n
            return True
        return False

    def place(self, src: Leaf, n: int) -> int:
        off = align(self.size)
        self.size = off + n
        self.shm_bytes += n
        self.shm.append((src, off, n))
        return off

    def pack_leaf(self, x: Leaf, n: int) -> Skeleton:
        """A leaf's place in the skeleton: inline, or an offset in the segment."""
        if isinstance(x, torch.Tensor):
            return _pack_tensor(x.detach(), n, self)
        if isinstance(x, np.ndarray):
            return _pack_array(x, n, self)
        if self.inline_ok(n):
            data = x.cast("B") if isinstance(x, memoryview) else x
            return bytearray(data) if isinstance(x, bytearray) else bytes(data)
        return ShmBytes(self.place(x, n), n, isinstance(x, bytearray))


def _pack_tensor(t: torch.Tensor, n: int, plan: Plan) -> Skeleton:
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


def _pack_array(a: Array, n: int, plan: Plan) -> Skeleton:
    if plan.inline_ok(n):
        return a.copy()
    return ShmArray(plan.place(a, n), n, a.dtype, tuple(a.shape))


def walk(x: object, on_leaf: OnLeaf, path: str, depth: int) -> Skeleton:
    """Walk ``x`` as the packer does: ``on_leaf`` at every leaf, the skeleton around it.

    The one definition of what an output may hold and of the bytes each leaf costs:
    packing and sizing (``packed_nbytes``) both walk with it.
    """
    if depth > MAX_DEPTH:
        raise UsageError(f"output nested deeper than {MAX_DEPTH} levels at {path} (a cycle?)")
    d = depth + 1
    if isinstance(x, torch.Tensor):
        if x.layout is not torch.strided or x.is_quantized or x.is_nested or x.device.type == "meta":
            raise UnsupportedOutputType(path, type(x))
        return on_leaf(x, tensor_nbytes(x))
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise UnsupportedOutputType(path, type(x))
        return on_leaf(x, int(x.nbytes))  # the view's own bytes (size * itemsize), never its base's
    if isinstance(x, (bytes, bytearray, memoryview)):
        return on_leaf(x, len(x.cast("B") if isinstance(x, memoryview) else x))
    if is_plain(x):
        return x
    cls = type(x)
    if isinstance(x, dict) and (cls is dict or cls is collections.OrderedDict or cls is collections.defaultdict):
        items: list[tuple[Skeleton, Skeleton]] = []
        for k, v in x.items():
            if not is_plain(k):
                raise UnsupportedOutputType(f"{path} key {k!r}", type(k))
            items.append((k, walk(v, on_leaf, f"{path}[{k!r}]", d)))
        factory = x.default_factory if isinstance(x, collections.defaultdict) else None
        return PackedMap(cls, tuple(items), factory)
    if isinstance(x, (list, tuple)) and (
        cls is list or cls is tuple or (isinstance(x, tuple) and hasattr(cls, "_fields"))
    ):
        return PackedSeq(cls, tuple(walk(v, on_leaf, f"{path}[{i}]", d) for i, v in enumerate(x)))
    if isinstance(x, dict):
        return _walk_dict_object(x, on_leaf, path, d)
    names = _field_names(x)
    if names is None:
        raise UnsupportedOutputType(path, cls)
    base = _builtin_base(cls)
    if base is not object:
        # object.__new__ cannot make it, and its own constructor may want anything:
        # refuse here, on the worker, rather than fail to unpack on the consumer.
        raise UnsupportedOutputType(path, cls, _unbuildable(cls, base))
    # An attribute never set (``field(init=False)`` without a default) stays unset.
    values = [(name, getattr(x, name, _UNSET)) for name in names]
    return PackedObject(
        cls, tuple((name, walk(v, on_leaf, f"{path}.{name}", d)) for name, v in values if v is not _UNSET)
    )


def _field_names(x: object) -> list[str] | None:
    """The fields of an attrs or dataclass instance; None for anything else."""
    cls = type(x)
    if attrs.has(cls):
        return [f.name for f in attrs.fields(cls)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [f.name for f in dataclasses.fields(x)]
    return None


def dict_base(cls: type) -> type[dict[object, object]] | None:
    """The builtin dict type (``dict``, ``OrderedDict``, ``defaultdict``) that makes the
    instances of ``cls``, a dict subclass; None when another builtin does."""
    found = _builtin_base(cls)
    return next((b for b in _DICT_BASES if b is found), None)


def attribute_names(x: object) -> list[str]:
    """The attributes a rebuilt ``x`` needs: its fields (attrs class or dataclass), then
    whatever else its ``__dict__`` holds."""
    names = _field_names(x) or []
    return names + [n for n in getattr(x, "__dict__", {}) if n not in names]


def _builtin_base(cls: type) -> type:
    """The builtin type ``cls``'s instances are made by (as ``copyreg`` finds it)."""
    for base in cls.__mro__:
        if not base.__flags__ & _HEAPTYPE:
            return base
    return object


def _unbuildable(cls: type, base: type) -> str:
    return (
        f"its instances are built on {base.__module__}.{base.__qualname__}, which the consumer cannot rebuild "
        f"without calling {cls.__qualname__}'s constructor; return the value in a dict, a list, or a field of "
        "an attrs class or dataclass instead"
    )


def _walk_dict_object(x: dict[object, object], on_leaf: OnLeaf, path: str, d: int) -> PackedDictObject:
    """An instance of a dict subclass: its items, and its attributes (its fields if it is
    an attrs class or dataclass, and whatever else its ``__dict__`` holds)."""
    cls = type(x)
    base = dict_base(cls)
    if base is None:
        raise UnsupportedOutputType(path, cls, _unbuildable(cls, _builtin_base(cls)))
    items: list[tuple[Skeleton, Skeleton]] = []
    # dict's own iteration: a subclass may override items() or __getitem__ (BaseOutput's
    # __getitem__ takes an int to mean a position).
    for k, v in dict.items(x):
        if not is_plain(k):
            raise UnsupportedOutputType(f"{path} key {k!r}", type(k))
        items.append((k, walk(v, on_leaf, f"{path}[{k!r}]", d)))
    names = attribute_names(x)
    fields: list[tuple[str, Skeleton]] = []
    aliases: list[str] = []
    for name in names:
        v = getattr(x, name, _UNSET)
        if v is _UNSET:
            continue
        if dict.__contains__(x, name) and dict.__getitem__(x, name) is v and not is_plain(v):
            aliases.append(name)
        else:
            fields.append((name, walk(v, on_leaf, f"{path}.{name}", d)))
    factory = x.default_factory if isinstance(x, collections.defaultdict) else None
    return PackedDictObject(cls, base, tuple(items), tuple(fields), tuple(aliases), factory)
