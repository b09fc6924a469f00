"""Request bodies to checked requests, without a server: every OpenAI field's rule, and how
the fields map onto the model's parameters (``omni_async.serve.parsing``, ``models``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omni_async.serve.errors import ApiError
from omni_async.serve.models import ServedModel, served_model
from omni_async.serve.parsing import form_value, parse_image_body, parse_video_body, quality_of

TINY = served_model("tiny")


def _refused(fn: Callable[..., object], *args: object) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(*args)
    assert err.value.status == 400
    return err.value


def test_an_image_body_becomes_one_request_per_image_with_consecutive_seeds() -> None:
    gen = parse_image_body({"prompt": "p", "n": 3, "size": "64x32", "seed": 5, "steps": 2}, TINY)
    assert [p["seed"] for p in gen.params] == [5, 6, 7]
    assert all(p == {"steps": 2, "width": 64, "height": 32, "seed": p["seed"]} for p in gen.params)
    assert (gen.size, gen.output_format, gen.quality, gen.response_format) == ("64x32", "png", None, "b64_json")


def test_defaults_and_auto_size() -> None:
    gen = parse_image_body({"prompt": "p", "size": "auto"}, TINY)
    assert gen.n == 1 and gen.size == "64x64" and not gen.stream and gen.partial_images == 0


def test_partial_images_spread_previews_over_the_steps_only_when_streaming() -> None:
    streamed = parse_image_body({"prompt": "p", "stream": True, "partial_images": 2, "steps": 9}, TINY)
    assert streamed.params[0]["preview_every"] == 3 and streamed.partial_images == 2
    plain = parse_image_body({"prompt": "p", "partial_images": 2}, TINY)
    assert "preview_every" not in plain.params[0] and plain.partial_images == 0


@pytest.mark.parametrize(
    ("fmt", "compression", "quality"),
    [("jpeg", None, None), ("jpeg", 80, 80), ("jpeg", 0, 1), ("webp", None, None), ("webp", 50, 50), ("png", 10, None)],
)
def test_output_compression_is_the_lossy_formats_quality(
    fmt: str, compression: int | None, quality: int | None
) -> None:
    assert quality_of(fmt, compression) == quality


def test_reserved_parameters_name_the_field_that_sets_them() -> None:
    err = _refused(parse_image_body, {"prompt": "p", "width": 64}, TINY)
    assert err.param == "width" and "'size'" in err.message
    assert _refused(parse_video_body, {"prompt": "p", "num_frames": 3}, TINY).param == "num_frames"


def test_sizes_the_model_cannot_make_are_refused_naming_size() -> None:
    dit = served_model("dit")
    assert dit.size_params("64x128") == {"width": 64, "height": 128}
    for size in ("60x64", "0x0", "64", "64x64x3", 64):
        assert _refused(dit.size_params, size).param == "size"
    one_size = ServedModel(name="m", spec=TINY.spec, default_size=(16, 16), sized=False, videos=False)
    assert one_size.size_params(None) == {} and one_size.size_params("auto") == {}
    assert _refused(one_size.size_params, "16x16").param == "size"
    assert _refused(parse_video_body, {"prompt": "p"}, one_size).param == "model"


def test_seconds_become_frames_at_the_models_rate() -> None:
    assert TINY.frames_for("4") == 16 and TINY.frames_for(2) == 8
    for seconds in ("0", "13", "1.5", True, None):
        assert _refused(TINY.frames_for, seconds).param == "seconds"
    creation = parse_video_body({"prompt": "p", "seconds": "2", "size": "64x32", "seed": 1, "steps": 3}, TINY)
    assert creation.params == {"steps": 3, "width": 64, "height": 32, "num_frames": 8, "seed": 1}
    assert (creation.seconds, creation.size) == ("2", "64x32")


def test_form_fields_are_json_where_they_parse() -> None:
    assert [form_value(t) for t in ("3", "true", "4.5", "waves", '{"a": 1}')] == [3, True, 4.5, "waves", {"a": 1}]


def test_the_prompt_goes_to_a_model_that_takes_text() -> None:
    texty = ServedModel(name="m", spec=TINY.spec, default_size=(64, 64), prompt_param="prompt")
    assert parse_image_body({"prompt": "a cat"}, texty).params[0]["prompt"] == "a cat"
    assert "prompt" not in parse_image_body({"prompt": "a cat"}, TINY).params[0]
