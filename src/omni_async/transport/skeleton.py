"""The packed skeleton: what ``DiffusionOutput.output`` holds between packing and unpacking.

A packed output is the output's own shape (``PackedSeq``, ``PackedMap``, ``PackedObject``,
``PackedDictObject``) with every tensor, array or bytes leaf replaced by where its bytes went: inline in the message (``InlineTensor``, small bytes and array copies) or at an
offset in the output's one shared-memory segment (``ShmTensor``, ``ShmArray``,
``ShmBytes``).  Plain values (``is_plain``) travel as themselves.  Everything here is
small and picklable: it crosses the result channel.  See ``packing`` for the protocol.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
import torch

from omni_async.core.messages import DiffusionOutput
from omni_async.transport.shm import Lease

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_MAX_INLINE_BYTES",
    "MAX_DEPTH",
    "Array",
    "InlineTensor",
    "Leaf",
    "PackedDictObject",
    "PackedMap",
    "PackedObject",
    "PackedPayload",
    "PackedSeq",
    "ShmArray",
    "ShmBytes",
    "ShmTensor",
    "Skeleton",
    "StoredPayload",
    "align",
    "is_packed",
    "is_plain",
    "output_id",
    "packed_lease",
    "tensor_nbytes",
]

DEFAULT_INLINE_THRESHOLD: Final = 64 << 10
DEFAULT_MAX_INLINE_BYTES: Final = 1 << 20
# Offsets within a segment: a multiple of every element size and of the DMA engines'
# preferred alignment.
_ALIGN: Final = 512
MAX_DEPTH: Final = 64

# A numpy array of any dtype (an output's leaf, or a view handed back).
Array: TypeAlias = npt.NDArray[np.generic]
# A tensor, array or bytes-like value: where a walk stops, and what the packer copies.
Leaf: TypeAlias = "torch.Tensor | Array | bytes | bytearray | memoryview"
# A node of a packed tree.  ``object`` on purpose: a plain value (``is_plain``: an enum
# member, a numpy scalar, a slice...) travels as itself, so the union is open; the walks
# match the classes below and pass anything else through.
Skeleton: TypeAlias = object

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
    dtype: np.dtype[np.generic]
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
    items: tuple[Skeleton, ...]


@attrs.frozen
class PackedMap:
    cls: type
    items: tuple[tuple[Skeleton, Skeleton], ...]
    default_factory: Callable[[], object] | None = None


@attrs.frozen
class PackedObject:
    cls: type
    fields: tuple[tuple[str, Skeleton], ...]


@attrs.frozen
class PackedDictObject:
    """An instance of a dict subclass (diffusers' ``BaseOutput``: a dataclass over
    ``OrderedDict``; a ``Counter``; a user's own), rebuilt as pickle rebuilds it without
    running its ``__init__``: ``base`` (the builtin dict type it is built on) makes the
    instance and takes its items; then its attributes are set.  ``aliases``: attributes
    whose value IS the item of the same key (``BaseOutput`` keeps each field both ways):
    packed once, as the item, so a tensor's bytes travel once and both names see one
    tensor again after unpacking."""

    cls: type[dict[object, object]]
    base: type[dict[object, object]]
    items: tuple[tuple[Skeleton, Skeleton], ...]
    fields: tuple[tuple[str, Skeleton], ...]
    aliases: tuple[str, ...] = ()
    default_factory: Callable[[], object] | None = None


@attrs.frozen
class PackedPayload:
    """What ``DiffusionOutput.output`` holds between packing and unpacking."""

    tree: Skeleton
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

    tree: Skeleton
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


def is_plain(x: object) -> bool:
    if isinstance(x, _PLAIN):
        return True
    if isinstance(x, (frozenset, set)):
        return all(is_plain(v) for v in x)
    return False


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def output_id(output: DiffusionOutput) -> str:
    return output.async_output_id or output.request_id


def is_packed(output: DiffusionOutput) -> bool:
    return isinstance(output.output, PackedPayload)


def packed_lease(output: DiffusionOutput) -> Lease | None:
    payload = output.output
    return payload.lease if isinstance(payload, PackedPayload) else None
