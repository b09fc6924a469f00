"""Owned copies of an unpacked output: what the engine returns without a host stage.

An unpacked output's tensors view a shared-memory segment of the executor's budget;
a result that kept them would hold that budget for as long as the caller keeps the
result.  So without a host stage the engine copies every tensor, array and
bytearray out and releases the segment before the result reaches the caller.

The copy goes through numpy's allocator: numpy asks the kernel for transparent huge
pages on large allocations, so copying into fresh memory costs far fewer page faults
than ``Tensor.clone()`` (measured on the 2-core CPU machine, 64 MB float32: 49 ms
through numpy against 172 ms for ``clone`` and 157 ms for ``copy.deepcopy``; bf16:
23 ms against 112 ms; see ``bench/engine_copy.py``).  The tensor returned wraps the
numpy copy (``torch.from_numpy``): an ordinary CPU tensor that owns its memory.

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
from typing import Any, TypeVar

import attrs
import numpy as np
import torch

from omni_async.transport.pack_walk import attribute_names, dict_base

__all__ = ["Guarded", "guard_input", "owned_copy", "written"]

T = TypeVar("T")

_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def owned_copy(value: T) -> T:
    """``value`` with every tensor, array and bytearray copied into memory it owns."""
    return _walk(value)  # type: ignore[no-any-return]  # same structure, same types


def _tensor(t: torch.Tensor) -> torch.Tensor:
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
    return torch.from_numpy(raw.copy()).view(t.dtype).view(t.shape)


def _walk(x: Any) -> Any:
    if isinstance(x, _IMMUTABLE):
        return x
    if isinstance(x, torch.Tensor):
        return _tensor(x)
    if isinstance(x, np.ndarray):
        return np.array(x, copy=True)
    if isinstance(x, bytearray):
        return bytearray(x)
    if isinstance(x, list):
        return [_walk(v) for v in x]
    if isinstance(x, tuple):
        items = [_walk(v) for v in x]
        if type(x) is tuple:
            return tuple(items)
        if hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*items)
        return copy.deepcopy(x)
    if type(x) is collections.defaultdict:
        return collections.defaultdict(x.default_factory, ((k, _walk(v)) for k, v in x.items()))
    if type(x) in (dict, collections.OrderedDict):
        return type(x)((k, _walk(v)) for k, v in x.items())
    if isinstance(x, dict):
        return _dict_object(x)
    if attrs.has(type(x)) or (dataclasses.is_dataclass(x) and not isinstance(x, type)):
        names = (
            [f.name for f in attrs.fields(type(x))] if attrs.has(type(x)) else [f.name for f in dataclasses.fields(x)]
        )
        obj: Any = object.__new__(type(x))
        for name in names:
            object.__setattr__(obj, name, _walk(getattr(x, name)))
        return obj
    return copy.deepcopy(x)


_UNSET = object()


def _dict_object(x: Any) -> Any:
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
        copies[id(v)] = c = _walk(v)
        base.__setitem__(obj, k, c)
    if isinstance(x, collections.defaultdict):
        obj.default_factory = x.default_factory
    for name in attribute_names(x):
        v = getattr(x, name, _UNSET)
        if v is not _UNSET:
            object.__setattr__(obj, name, copies[id(v)] if id(v) in copies else _walk(v))
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
