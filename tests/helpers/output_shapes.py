"""Output shapes the packer promises to carry (docs/models.md: any nesting of dicts, lists,
tuples, named tuples, attrs classes and dataclasses), dict subclasses included, and a
worker that returns each of them (``ShapesWorker``), for the pack/unpack tests and the
same through real worker processes.

``BaseOutput`` copies what diffusers' ``diffusers.utils.BaseOutput`` does (diffusers is
not installed here): a dataclass base over ``OrderedDict`` whose ``__post_init__`` puts
every field that is not None into the dict too, whose ``__setitem__`` and ``__setattr__``
mirror each other, which refuses ``update``/``pop``/``setdefault``/``__delitem__``, and
whose ``__getitem__`` takes an int to mean a position.  Its output classes
(``ImagePipelineOutput``) are dataclasses over it: what every diffusers pipeline returns.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import attrs
import torch

from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput, DiffusionRequest

# 256 KiB: over the inline threshold, so it travels in a pooled segment.
BIG = 1 << 16


class BaseOutput(collections.OrderedDict[str, object]):
    def __post_init__(self) -> None:
        class_fields = dataclasses.fields(self)  # type: ignore[arg-type]  # every subclass is a dataclass
        first = getattr(self, class_fields[0].name)
        others_none = all(getattr(self, f.name) is None for f in class_fields[1:])
        if others_none and isinstance(first, dict):
            for key, value in first.items():
                self[key] = value
        else:
            for f in class_fields:
                v = getattr(self, f.name)
                if v is not None:
                    self[f.name] = v

    def __delitem__(self, *args: object, **kwargs: object) -> None:
        raise Exception(f"You cannot use ``__delitem__`` on a {self.__class__.__name__} instance.")

    def setdefault(self, *args: object, **kwargs: object) -> object:
        raise Exception(f"You cannot use ``setdefault`` on a {self.__class__.__name__} instance.")

    def pop(self, *args: object, **kwargs: object) -> object:
        raise Exception(f"You cannot use ``pop`` on a {self.__class__.__name__} instance.")

    def update(self, *args: object, **kwargs: object) -> None:
        raise Exception(f"You cannot use ``update`` on a {self.__class__.__name__} instance.")

    def __getitem__(self, k: object) -> object:
        if isinstance(k, str):
            return dict(self.items())[k]
        assert isinstance(k, int)
        return self.to_tuple()[k]

    def __setattr__(self, name: str, value: object) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __setitem__(self, key: str, value: object) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def to_tuple(self) -> tuple[object, ...]:
        return tuple(self[k] for k in self.keys())


@dataclasses.dataclass
class ImagePipelineOutput(BaseOutput):
    images: torch.Tensor
    nsfw: list[bool] | None = None


class PlainDict(dict[str, object]):
    """A dict subclass that is not a dataclass, with an attribute of its own."""


class OrderedNotes(collections.OrderedDict[str, object]):
    pass


class Counts(collections.defaultdict[str, list[int]]):
    pass


@dataclasses.dataclass
class DictDataclass(dict[str, object]):
    """A dataclass over dict whose fields are not its items, one of them ``init=False``."""

    name: str
    image: torch.Tensor
    derived: torch.Tensor = dataclasses.field(init=False)
    unset: int = dataclasses.field(init=False)  # never set: stays unset

    def __post_init__(self) -> None:
        self.derived = self.image[:4] * 2


@dataclasses.dataclass(frozen=True)
class WithInitFalse:
    image: torch.Tensor
    total: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", float(self.image.float().sum()))


@attrs.frozen
class AttrsOutput:
    image: torch.Tensor
    steps: int = attrs.field(validator=attrs.validators.gt(0))


class Named(NamedTuple):
    image: torch.Tensor
    label: str


@dataclasses.dataclass
class OverList(list[int]):
    """Cannot be rebuilt without its constructor: refused at pack time, on the worker."""

    note: str = "x"


def image(seed: int, n: int = BIG) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def make_shape(name: str, seed: int) -> object:
    img = image(seed)
    if name == "base_output":
        return ImagePipelineOutput(images=img)
    if name == "base_output_dict_first":
        out = ImagePipelineOutput(images={"a": img, "b": image(seed + 1, 8)})  # type: ignore[arg-type]
        return out
    if name == "dict_subclass":
        d = PlainDict(image=img, label="p")
        d.origin = "worker"  # type: ignore[attr-defined]
        return d
    if name == "ordered_dict_subclass":
        return OrderedNotes([("z", img), ("a", 1)])
    if name == "defaultdict_subclass":
        c = Counts(list)
        c["k"].append(seed)
        return {"counts": c, "image": img}
    if name == "counter":
        return {"counter": collections.Counter("abracadabra"), "image": img}
    if name == "dict_dataclass":
        dd = DictDataclass("n", img)
        dd["item"] = img[:8]
        return dd
    if name == "init_false":
        return WithInitFalse(img)
    if name == "attrs":
        return AttrsOutput(img, 3)
    if name == "namedtuple":
        return Named(img, "n")
    if name == "dataclass":
        return {"nested": [WithInitFalse(img), (Named(image(seed + 2, 4), "small"),)]}
    if name == "over_list":
        return OverList()
    raise ValueError(name)


SHAPES = (
    "base_output",
    "base_output_dict_first",
    "dict_subclass",
    "ordered_dict_subclass",
    "defaultdict_subclass",
    "counter",
    "dict_dataclass",
    "init_false",
    "attrs",
    "namedtuple",
    "dataclass",
)


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def assert_same(got: object, want: object, path: str = "output") -> None:
    """``got`` is ``want`` rebuilt: the same class, items, fields and attributes, down to
    every tensor's bytes."""
    assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
    if isinstance(want, torch.Tensor):
        assert _same_value(got, want), path
        return
    if isinstance(want, dict):
        assert isinstance(got, dict)
        # dict's own views: a subclass may override keys() or __getitem__ (BaseOutput does).
        keys: list[object] = list(dict.keys(want))
        assert list(dict.keys(got)) == keys, path
        for k in keys:
            assert_same(dict.__getitem__(got, k), dict.__getitem__(want, k), f"{path}[{k!r}]")
        if isinstance(want, collections.defaultdict):
            assert isinstance(got, collections.defaultdict) and got.default_factory is want.default_factory
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    names: list[str] = []
    if dataclasses.is_dataclass(want):
        names = [f.name for f in dataclasses.fields(want)]
    elif attrs.has(type(want)):
        names = [f.name for f in attrs.fields(type(want))]  # type: ignore[arg-type]  # attrs.has narrows nothing
    names += [n for n in getattr(want, "__dict__", {}) if n not in names]
    for name in names:
        if not hasattr(want, name):
            assert not hasattr(got, name), f"{path}.{name} was never set, yet it is"
            continue
        assert_same(getattr(got, name), getattr(want, name), f"{path}.{name}")
    if not (isinstance(want, (dict, list, tuple)) or names):
        assert _same_value(got, want), path


class ShapesWorker:
    """Returns the shape its request's ``shape`` param names (``make_shape``)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        p = request.params
        seed = p.get("seed", 0)
        assert isinstance(seed, int)
        return DiffusionOutput(request.request_id, make_shape(str(p["shape"]), seed))

    def execute_model_batch(self, requests: list[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self.execute_model(r) for r in requests))
