"""What the server serves: a model's worker spec and how OpenAI's fields map onto its parameters.

A ``ServedModel`` is data: the ``WorkerSpec`` its worker processes build, the post-process
whose device stage makes uint8 pixels (the encoders take those), and what the HTTP fields
become: ``size`` ``"WxH"`` -> ``width``/``height`` (checked against the sizes it can make),
``seconds`` -> ``num_frames`` at its ``fps``, ``seed`` -> ``seed``, ``partial_images`` ->
``preview_every``.  Those parameter names are *reserved*: a client sets them through the
OpenAI field, and the same name among its own parameters (``extra_body``) is refused,
naming the field to use.  Every other field a client sends is a parameter of the model,
checked by the model's own ``validate_request`` (through the executor, in the server's
process: a bad one never reaches a worker).

``served_model(name, device)``: ``tiny`` (``TinyDiffusionWorker``: grey images 64 pixels
wide, short clips; fast on CPU), ``dit`` (the demo's ``DiTPipelineWorker``) and
``diffusers:MODULE:BUILDER`` (any diffusers pipeline through the integration, its
parameters published from the integration's schema).  Models are reached by import path, as
the worker processes reach them: the serving layer imports no model.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Final

import attrs

from omni_async.core.errors import UsageError
from omni_async.serve.errors import ApiError, bad_request
from omni_async.worker.host import WorkerSpec

__all__ = ["MODEL_CHOICES", "RESERVED", "ServedModel", "served_model"]

#: Model parameter -> the OpenAI field that sets it.
RESERVED: Final[Mapping[str, str]] = {
    "width": "size",
    "height": "size",
    "num_frames": "seconds",
    "seed": "seed",
    "preview_every": "partial_images",
}
MODEL_CHOICES: Final = ("tiny", "dit", "diffusers:MODULE:BUILDER")


@attrs.frozen(kw_only=True)
class ServedModel:
    """One model behind the server (see the module docstring).

    ``name``: the id ``/v1/models`` lists and requests name; ``spec``: its workers'
    ``WorkerSpec``; ``default_size``: ``(width, height)`` when a request leaves ``size``
    out (or says ``"auto"``); ``multiple``: width and height must be multiples of it;
    ``fixed_width``: the only width it makes (None: any); ``max_side``: the largest side;
    ``steps``: its default number of denoising steps (``partial_images`` spreads the
    previews over them); ``steps_param``: the parameter naming the steps; ``fps``: a
    video's frame rate (``seconds * fps`` frames); ``max_seconds``: the longest clip;
    ``parameters``: its own parameters, published by ``/v1/models`` (name -> type);
    ``previews``: it makes partial images; ``prompt_param``: the parameter the ``prompt``
    field goes to (None: the model takes no text, and the prompt is only echoed);
    ``sized``: it takes ``width``/``height`` (False: it makes one size, and ``size`` must be
    left out or ``"auto"``); ``videos``: it takes ``num_frames`` (False: no video jobs)."""

    name: str
    spec: WorkerSpec
    default_size: tuple[int, int]
    multiple: int = 1
    fixed_width: int | None = None
    max_side: int = 4096
    steps: int = 4
    steps_param: str = "steps"
    fps: int = 8
    max_seconds: int = 12
    parameters: Mapping[str, object] = attrs.field(factory=dict)
    previews: bool = True
    prompt_param: str | None = None
    sized: bool = True
    videos: bool = True

    def size_params(self, size: object, field: str = "size") -> dict[str, int]:
        """``width``/``height`` of a ``"WxH"`` size; a 400 naming ``field`` when it cannot be made."""
        if not self.sized:
            if size not in (None, "auto"):
                raise bad_request(field, f"model {self.name!r} makes one size: leave size out or send 'auto'")
            return {}
        if size is None or size == "auto":
            width, height = self.default_size
        else:
            if not isinstance(size, str):
                raise bad_request(field, f"size must be a string 'WIDTHxHEIGHT', got {size!r:.40}")
            w, sep, h = size.lower().partition("x")
            if not sep or not w.isdigit() or not h.isdigit():
                raise bad_request(field, f"size must be 'WIDTHxHEIGHT' (e.g. {self.size_text()!r}), got {size!r:.40}")
            width, height = int(w), int(h)
        if self.fixed_width is not None and width != self.fixed_width:
            raise bad_request(
                field, f"model {self.name!r} makes images {self.fixed_width} pixels wide; got size {width}x{height}"
            )
        for side, value in (("width", width), ("height", height)):
            if not self.multiple <= value <= self.max_side or value % self.multiple:
                raise bad_request(
                    field,
                    f"the {side} of size must be a multiple of {self.multiple} in {self.multiple}..{self.max_side} "
                    f"for model {self.name!r}, got {value}",
                )
        return {"width": width, "height": height}

    def size_text(self) -> str:
        return f"{self.default_size[0]}x{self.default_size[1]}"

    def frames_for(self, seconds: object) -> int:
        """``num_frames`` of a clip of ``seconds`` (OpenAI sends a string: ``"4"``)."""
        if not self.videos:
            raise bad_request("model", f"model {self.name!r} makes images, not videos", code="model_not_found")
        text = str(seconds) if isinstance(seconds, (str, int)) and not isinstance(seconds, bool) else ""
        if not text.isdigit() or not 1 <= int(text) <= self.max_seconds:
            raise bad_request(
                "seconds", f"seconds must be a whole number of seconds 1..{self.max_seconds}, got {seconds!r:.40}"
            )
        return int(text) * self.fps

    def preview_every(self, partial_images: int, params: Mapping[str, object]) -> int:
        """The ``preview_every`` that spreads ``partial_images`` previews over the steps."""
        if not self.previews:
            raise bad_request("partial_images", f"model {self.name!r} makes no partial images; send 0")
        steps = params.get(self.steps_param, self.steps)
        total = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else self.steps
        return max(1, total // (partial_images + 1))

    def describe(self) -> dict[str, object]:
        """The model as ``/v1/models`` lists it (OpenAI's model object, plus what it takes)."""
        return {
            "id": self.name,
            "object": "model",
            "created": 0,
            "owned_by": "omni_async",
            "default_size": self.size_text(),
            "parameters": dict(self.parameters),
            "reserved": dict(RESERVED),
        }


def _options(device: str) -> dict[str, object]:
    return {"device": device}


def served_model(name: str, *, device: str = "cpu", cuda_graphs: bool = False) -> ServedModel:
    """The model ``omni-async serve --model NAME`` serves (``UsageError`` for an unknown name).
    ``cuda_graphs``: a ``diffusers:`` model's denoiser replayed as CUDA graphs
    (``DiffusersPipelineWorker(cuda_graphs=True)``); refused for the others."""
    if cuda_graphs and not name.startswith("diffusers:"):
        raise UsageError(
            f"--cuda-graphs replays a diffusers pipeline's denoiser as CUDA graphs; model {name!r} is not a "
            "diffusers:MODULE:BUILDER model, leave it off"
        )
    if name == "tiny":
        return ServedModel(
            name="tiny",
            spec=WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker", kwargs=_options(device), postprocess="tiny"),
            default_size=(64, 64),
            multiple=2,
            fixed_width=64,
            max_side=1024,
            steps=4,
            fps=4,
            parameters={"steps": "int >= 1", "step_ms": "int >= 0 (a pause per step)", "raise": "bool"},
        )
    if name == "dit":
        return ServedModel(
            name="dit",
            spec=WorkerSpec("omni_async.models.dit:make_worker", kwargs=_options(device), postprocess="dit"),
            default_size=(256, 256),
            multiple=8,
            steps=8,
            fps=8,
            parameters={"steps": "int in 1..1000", "digest": "bool"},
        )
    if name.startswith("diffusers:"):
        return _diffusers(name.removeprefix("diffusers:"), device, cuda_graphs)
    raise UsageError(f"unknown model {name!r}; choose from {', '.join(MODEL_CHOICES)}")


def _diffusers(builder: str, device: str, cuda_graphs: bool) -> ServedModel:
    module, sep, attr = builder.partition(":")
    if not sep or not module or not attr:
        raise UsageError(f"--model diffusers:MODULE:BUILDER, e.g. diffusers:mypkg.pipes:build, got {builder!r}")
    # By import path, as the worker processes reach it (the serving layer imports no integration).
    worker = importlib.import_module("omni_async.integrations.diffusers").DiffusersPipelineWorker
    kwargs: dict[str, object] = {"builder": builder, "device": device}
    spec: WorkerSpec = worker.spec(postprocess="diffusers", cuda_graphs=cuda_graphs, **kwargs)
    schema = worker.parameter_schema(**kwargs)
    params = schema.get("parameters", {}) if isinstance(schema, Mapping) else {}
    published: dict[str, object] = dict(params) if isinstance(params, Mapping) else {}
    return ServedModel(
        name=f"diffusers:{builder}",
        spec=spec,
        default_size=(512, 512),
        multiple=8,
        steps=20,
        steps_param="num_inference_steps",
        fps=8,
        parameters=published,
        previews="preview_every" in published,
        prompt_param="prompt" if "prompt" in published else None,
        sized="height" in published and "width" in published,
        videos="num_frames" in published,
    )


def check_model_name(model: ServedModel, asked: object) -> None:
    """A request's ``model`` field: absent, or this server's model."""
    if asked is not None and asked != model.name:
        raise ApiError(
            400, f"this server serves model {model.name!r}, not {asked!r:.60}", param="model", code="model_not_found"
        )
