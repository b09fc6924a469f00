"""Every output shape docs/models.md promises round-trips through pack and unpack: dicts and
dict subclasses (diffusers' ``BaseOutput``, a dataclass over ``OrderedDict``, among
them), named tuples, attrs classes and dataclasses (``field(init=False)`` included).

Before the fix a ``BaseOutput`` packed, then failed to unpack on the consumer
(``object.__new__(ImagePipelineOutput) is not safe``), and even a working constructor
would have lost its items.  A shape that truly cannot be rebuilt is refused at pack
time, naming the class and what to do.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from helpers.output_shapes import (
    BIG,
    SHAPES,
    ImagePipelineOutput,
    OverList,
    assert_same,
    make_shape,
)
from helpers.shm_fixtures import no_shm_leak, segment_pool
from omni_async.core.messages import DiffusionOutput
from omni_async.transport.errors import UnsupportedOutputType
from omni_async.transport.packing import (
    pack_diffusion_output_shm,
    packed_nbytes,
    release_unpacked_output,
    unpack_diffusion_output_shm,
)
from omni_async.transport.shm import SegmentPool

__all__ = ["no_shm_leak", "segment_pool"]


@pytest.mark.parametrize("copy", [False, True], ids=["views", "copies"])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_promised_shape_round_trips(segment_pool: SegmentPool, shape: str, copy: bool) -> None:
    want = make_shape(shape, seed=3)
    packed = pack_diffusion_output_shm(DiffusionOutput("r", want), pool=segment_pool)
    # The skeleton crosses a process boundary: it must pickle.
    got = unpack_diffusion_output_shm(pickle.loads(pickle.dumps(packed)), copy=copy)
    assert_same(got.output, want)
    assert release_unpacked_output(got) == (0 if copy else 1)


def test_a_base_output_unpacks_with_its_items_its_fields_and_one_tensor(segment_pool: SegmentPool) -> None:
    want = make_shape("base_output", seed=5)
    assert isinstance(want, ImagePipelineOutput)
    out = DiffusionOutput("r", want)
    # The field and the item are one tensor: its bytes travel once.
    assert packed_nbytes(out) == BIG * 4
    got = unpack_diffusion_output_shm(pack_diffusion_output_shm(out, pool=segment_pool), copy=True).output
    assert type(got) is ImagePipelineOutput
    assert list(got.keys()) == ["images"] and got.nsfw is None
    assert got.images is got["images"] and got[0] is got.images  # BaseOutput's positional access too
    assert torch.equal(got.images, want.images)
    assert got.to_tuple()[0] is got.images
    with pytest.raises(Exception, match="cannot use ``update``"):
        got.update(x=1)  # still its own class, refusals included


def test_a_class_built_on_another_builtin_is_refused_at_pack_time_with_what_to_do(segment_pool: SegmentPool) -> None:
    with pytest.raises(UnsupportedOutputType) as info:
        pack_diffusion_output_shm(DiffusionOutput("r", {"x": OverList()}), pool=segment_pool)
    text = str(info.value)
    assert "OverList" in text and "output['x']" in text and "builtins.list" in text
    assert "return the value in a dict, a list, or a field of an attrs class or dataclass" in text
    assert segment_pool.stats().outstanding == 0
