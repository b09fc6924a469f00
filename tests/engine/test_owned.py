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
from omni_async.engine.owned import POOLED_FROM_BYTES, HostBuffers, owned_copy, parallel_copy


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


def test_large_copies_reuse_a_buffer_only_once_nothing_made_of_it_is_left() -> None:
    """Issue 31: the engine's owned copies go into buffers it reuses (a copy into fresh
    memory faults in every page).  A buffer is reused only when every tensor and array
    made of it is gone: a result the caller keeps, or any view of it, never changes
    under them, whatever later requests copy."""
    buffers = HostBuffers()
    n = POOLED_FROM_BYTES // 4  # float32 elements: a pooled copy

    def copied(a: float, b: float) -> dict[str, Any]:
        return owned_copy({"image": torch.full((n,), a), "array": np.full(n, b, np.float32)}, buffers)

    first = copied(1.0, 2.0)
    kept_view = first["image"][7:].view(torch.int32)  # a view of a view: the loan is all that links it
    kept_array = first["array"][3:].view(np.uint8)
    image_ptr, array_ptr = first["image"].data_ptr(), first["array"].ctypes.data
    del first
    second = copied(5.0, 6.0)
    assert (buffers.reused, buffers.fresh) == (0, 4)  # both first buffers are still viewed
    assert torch.equal(kept_view.view(torch.float32), torch.full((n - 7,), 1.0))
    assert np.array_equal(kept_array.view(np.float32), np.full(n - 3, 2.0, np.float32))
    del kept_view, kept_array
    third = copied(8.0, 9.0)
    assert (buffers.reused, buffers.fresh) == (2, 4)  # the first two came back, and are taken again
    assert {third["image"].data_ptr(), third["array"].ctypes.data} == {image_ptr, array_ptr}
    assert float(second["image"].sum()) == 5.0 * n and float(third["image"].sum()) == 8.0 * n
    assert third["array"].dtype == np.float32 and third["array"].shape == (n,) and third["array"].flags.writeable
    del second, third
    assert buffers.idle_bytes() >= 4 * 4 * n
    assert HostBuffers(max_idle_bytes=0).take(POOLED_FROM_BYTES).nbytes == POOLED_FROM_BYTES
    tight = HostBuffers(max_idle_bytes=0)
    tight.take(POOLED_FROM_BYTES)  # dropped at once: nothing idle may be kept
    assert tight.idle_bytes() == 0


def test_a_large_copy_split_over_threads_is_the_whole_copy() -> None:
    n = 3 * (32 << 20) + 12345  # three parts and a ragged end
    src = np.resize(np.arange(251, dtype=np.uint8), n)  # a period prime to the parts: no part equals another
    dst = np.zeros(n, np.uint8)
    parallel_copy(dst, src, threads=3)
    assert np.array_equal(dst, src)
    frames = torch.from_numpy(src[: n // 4 * 4].view(np.float32))
    copied = owned_copy({"frames": frames}, HostBuffers(copy_threads=4))["frames"]
    assert torch.equal(copied.view(torch.int32), frames.view(torch.int32))


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
