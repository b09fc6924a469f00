"""``SyntheticForwardWorker``'s picture output (``"picture": True``), which
``bench/encoded_images.py`` encodes: an image of the asked shape, a function of the
request, smooth (so PNG compresses it as it does a generated image), and refused with
a shape an encoder cannot take."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from omni_async.core.errors import InvalidRequest
from omni_async.core.messages import DiffusionRequest
from omni_async.models.synthetic import SyntheticForwardWorker, synthetic_picture, to_uint8


def test_a_picture_is_an_image_of_the_asked_shape_and_a_function_of_the_request() -> None:
    worker = SyntheticForwardWorker()
    params = {"shape": [96, 128, 3], "dtype": "bfloat16", "picture": True, "seed": 5}
    out = worker.execute_model(DiffusionRequest("r", params))
    image = out.output["image"]
    assert set(out.output) == {"image"} and image.shape == (96, 128, 3) and image.dtype == torch.bfloat16
    assert torch.equal(image, synthetic_picture((96, 128, 3), torch.bfloat16, 5, "cpu"))
    assert float(image.min()) >= -1.0 and float(image.max()) <= 1.0
    assert not torch.equal(image, synthetic_picture((96, 128, 3), torch.bfloat16, 6, "cpu"))


def test_a_picture_compresses_like_a_generated_image_not_like_noise_nor_a_constant() -> None:
    out = to_uint8(SyntheticForwardWorker().execute_model(
        DiffusionRequest("r", {"shape": [256, 256, 3], "picture": True, "seed": 1})))  # fmt: skip
    pixels = out.output["image"].numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    ratio = len(buf.getvalue()) / pixels.nbytes
    # Noise would not compress (ratio about 1), a constant image to almost nothing.
    assert 0.2 < ratio < 0.9 and len(np.unique(pixels)) > 64 and pixels.std() > 20


@pytest.mark.parametrize(
    "params",
    [
        {"picture": "yes"},
        {"picture": True, "shape": [3, 64, 64]},
        {"picture": True, "shape": [64, 64]},
        {"picture": True, "shape": [64, 64, 3], "dtype": "uint8"},
    ],
)
def test_a_picture_that_no_encoder_takes_is_refused_naming_the_parameter(params: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest, match="picture"):
        SyntheticForwardWorker.validate_request(DiffusionRequest("r", params))
