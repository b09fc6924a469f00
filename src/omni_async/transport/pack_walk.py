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
from typing import TypeAlias

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

__all__ = ["OnLeaf", "Plan", "walk"]

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
    if isinstance(x, (list, tuple)) and (cls is list or cls is tuple or (isinstance(x, tuple) and hasattr(cls, "_fields"))):
        return PackedSeq(cls, tuple(walk(v, on_leaf, f"{path}[{i}]", d) for i, v in enumerate(x)))
    if attrs.has(cls):
        names = [f.name for f in attrs.fields(cls)]
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in dataclasses.fields(x)]
    else:
        raise UnsupportedOutputType(path, cls)
    return PackedObject(cls, tuple((name, walk(getattr(x, name), on_leaf, f"{path}.{name}", d)) for name in names))
