"""owned_copy: every tensor, array and bytearray of an output copied into memory it
owns, the structure and types kept."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import attrs
import numpy as np
import pytest
import torch

from helpers.output_shapes import SHAPES, assert_same, make_shape
from omni_async.engine.owned import owned_copy


class Pair(NamedTuple):
    a: Any
    b: Any


@attrs.frozen
class Frame:
    pixels: torch.Tensor
    label: str


@dataclasses.dataclass
class Clip:
    frames: list[Frame]
    audio: np.ndarray[Any, Any]


def test_the_copy_keeps_structure_types_and_values_and_shares_no_memory() -> None:
    base = np.arange(64, dtype=np.float32)
    view = torch.from_numpy(base[8:40]).view(4, 8)  # a view into a larger buffer, as unpacked leaves are
    bf16 = torch.randn(3, 5).to(torch.bfloat16)
    source: dict[str, Any] = {
        "image": view,
        "bf16": bf16,
        "strided": torch.arange(12.0).view(3, 4).t(),
        "empty": torch.empty(0, 3),
        "flags": torch.tensor([True, False]),
        "array": base[:5],
        "raw": bytearray(b"abc"),
        "pair": Pair(torch.ones(2), "x"),
        "nested": collections.OrderedDict(k=[torch.zeros(1), (1, 2.5, None)]),
        "counts": collections.defaultdict(list, {"a": [torch.ones(1)]}),
        "clip": Clip([Frame(torch.ones(2, 2), "f0")], np.ones(3)),
        "dtype": torch.float16,
    }
    out = owned_copy(source)
    assert type(out["nested"]) is collections.OrderedDict and type(out["pair"]) is Pair
    assert isinstance(out["counts"], collections.defaultdict) and out["counts"].default_factory is list
    assert isinstance(out["clip"], Clip) and isinstance(out["clip"].frames[0], Frame)
    for key in ("image", "bf16", "strided", "empty", "flags"):
        assert out[key].dtype == source[key].dtype and torch.equal(out[key], source[key]), key
    assert out["dtype"] is torch.float16 and out["nested"]["k"][1] == (1, 2.5, None)
    # Nothing of the copy aliases the source: writing the source changes no copy.
    base[:] = -1
    view.fill_(7)
    source["raw"][0] = ord("z")
    source["clip"].frames[0].pixels.fill_(3)
    assert float(out["image"].sum()) == float(sum(range(8, 40)))
    assert out["array"].tolist() == [0, 1, 2, 3, 4]
    assert out["raw"] == bytearray(b"abc")
    assert torch.equal(out["clip"].frames[0].pixels, torch.ones(2, 2))
    assert out["image"].untyped_storage().nbytes() == 32 * 4  # only its own bytes, not the whole buffer


@pytest.mark.parametrize("shape", SHAPES)
def test_every_output_shape_the_transport_carries_is_copied_whole(shape: str) -> None:
    """The shapes of tests/helpers/output_shapes.py (dict subclasses such as diffusers'
    ``ImagePipelineOutput`` among them: ``object.__new__`` refuses to make those) come
    back the same class, items, fields and values, sharing no memory with the source."""
    source = make_shape(shape, seed=3)
    copied = owned_copy(source)
    assert_same(copied, source)
    mine = {id(t.untyped_storage()) for t in _tensors(source)}
    assert mine.isdisjoint(id(t.untyped_storage()) for t in _tensors(copied))
    for t in _tensors(source):
        t.add_(1)  # the source changes; the copy does not
    with pytest.raises(AssertionError):
        assert_same(copied, source)


def _tensors(x: object, depth: int = 0) -> list[torch.Tensor]:
    if depth > 8:
        return []
    if isinstance(x, torch.Tensor):
        return [x]
    found: list[torch.Tensor] = []
    if isinstance(x, dict):
        for v in dict.values(x):
            found += _tensors(v, depth + 1)
    elif isinstance(x, (list, tuple)):
        for v in x:
            found += _tensors(v, depth + 1)
    for v in getattr(x, "__dict__", {}).values():
        found += _tensors(v, depth + 1)
    for name in getattr(type(x), "__slots__", ()):
        found += _tensors(getattr(x, name, None), depth + 1)
    return found
