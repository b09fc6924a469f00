"""Where a worker's pipeline comes from: a picklable description, built in the worker.

``PipelineSource`` is what travels to a worker process: either a builder named
``"module:function"`` with keyword arguments (the function returns a
``DiffusionPipeline``), or a ``pretrained`` folder for ``DiffusionPipeline.from_pretrained``.
``random_pipeline`` is a builder that makes a pipeline from component configs with
random weights under a fixed seed -- nothing downloaded -- for tests, docs and
benchmarks.

The executor needs the pipeline's config, not its weights, to check requests before
they reach a worker (``PipelineSource.load_profile``): a builder runs under diffusers'
``no_init_weights`` (parameters allocated, never initialised: cheap even for billions
of them), a pretrained folder is read from its JSON configs alone.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Mapping
from typing import cast

import attrs
import torch

from omni_async.core.errors import UsageError
from omni_async.integrations.diffusers.edge import (
    PipelineHandle,
    configurable,
    diffusers_class,
    load_diffusers,
)

__all__ = ["ComponentConfig", "PipelineSource", "random_pipeline"]

#: A component of ``random_pipeline``: ``(diffusers class name, its config)``, or None for
#: an absent one (a text encoder the requests replace with ``prompt_embeds``).
ComponentConfig = tuple[str, Mapping[str, object]] | None

# diffusers' no_init_weights swaps torch.nn.init's functions for the whole process: one at a time.
_NO_INIT = threading.Lock()


def random_pipeline(
    pipeline: str,
    components: Mapping[str, ComponentConfig],
    seed: int = 0,
    dtype: str | None = None,
    options: Mapping[str, object] | None = None,
) -> object:
    """A ``diffusers`` pipeline from configs, with random weights drawn under ``seed``.

    ``pipeline``: the pipeline's class name (``"DiTPipeline"``, ``"WanPipeline"``);
    ``components``: each ``__init__`` argument as ``(class name, config)`` (models and
    schedulers, built with ``from_config``) or None.  The global RNG is left as it was.
    ``dtype``: a torch dtype name (``"bfloat16"``) for the models, or None (float32).
    ``options``: other ``__init__`` arguments (``requires_safety_checker=False``).
    The models are built on the current default device (a worker builds under its own,
    so random weights are drawn on the GPU there: fast for billions of parameters).
    """
    pipe_cls = diffusers_class(pipeline, "random_pipeline")
    parts: dict[str, object] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if torch.cuda.is_available() and torch.get_default_device().type == "cuda":
            torch.cuda.manual_seed(seed)  # random weights drawn there (the worker's device)
        for name, spec in components.items():
            if spec is None:
                parts[name] = None
                continue
            class_name, config = spec
            cls = configurable(class_name, f"random_pipeline {name}")
            # A scheduler's tables stay on the CPU whatever the default device: diffusers
            # reads them there (DPMSolver's set_timesteps calls .numpy() on them).
            module = isinstance(cls, type) and issubclass(cls, torch.nn.Module)
            with contextlib.nullcontext() if module else torch.device("cpu"):
                made = cls.from_config(dict(config))
            if isinstance(made, torch.nn.Module):
                made.eval()
            parts[name] = made
    built = pipe_cls(**parts, **(options or {}))
    if dtype is not None:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise UsageError(f"random_pipeline: dtype must name a torch dtype (e.g. 'bfloat16'), got {dtype!r}")
        PipelineHandle(built).to(dtype=torch_dtype)
    return built


@attrs.frozen
class PipelineSource:
    """How to get a pipeline: ``builder`` (``"module:function"``) plus ``builder_kwargs``,
    or ``pretrained`` (a folder, or a hub id already in the local cache) plus
    ``pretrained_kwargs`` for ``DiffusionPipeline.from_pretrained``.  Exactly one.

    diffusers loads a model that keeps modules in float32 (``WanTransformer3DModel``)
    from a folder only with ``accelerate`` installed (its ``low_cpu_mem_usage``); a
    builder has no such need."""

    builder: str | None = None
    builder_kwargs: Mapping[str, object] = attrs.field(factory=dict)
    pretrained: str | None = None
    pretrained_kwargs: Mapping[str, object] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if (self.builder is None) == (self.pretrained is None):
            raise UsageError(
                "DiffusersPipelineWorker: give exactly one of builder='module:function' (a function returning a "
                "DiffusionPipeline, e.g. 'omni_async.integrations.diffusers:random_pipeline') and pretrained="
                f"'path/to/pipeline'; got builder={self.builder!r}, pretrained={self.pretrained!r}"
            )
        if self.builder is not None:
            module, _, name = self.builder.partition(":")
            if not module or not name:
                raise UsageError(
                    f"DiffusersPipelineWorker: builder must be 'module:function', got {self.builder!r} "
                    "(e.g. 'omni_async.integrations.diffusers.tiny:tiny_dit')"
                )

    def resolve_builder(self) -> Callable[..., object]:
        assert self.builder is not None
        module_name, _, qualname = self.builder.partition(":")
        try:
            found: object = importlib.import_module(module_name)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError) as exc:
            raise UsageError(
                f"DiffusersPipelineWorker: builder {self.builder!r} cannot be found ({type(exc).__name__}: {exc}); "
                "name an importable 'module:function'"
            ) from exc
        if not callable(found):
            raise UsageError(
                f"DiffusersPipelineWorker: builder {self.builder!r} is a {type(found).__name__}, not a function"
            )
        return cast("Callable[..., object]", found)

    def load(self, device: torch.device) -> PipelineHandle:
        """Build (under ``device`` as the default device: random weights are drawn there;
        its schedulers are then made again on the CPU, where diffusers keeps them) or load
        the pipeline, then move it to ``device``."""
        if self.builder is not None:
            with torch.device(device):
                pipe = self.resolve_builder()(**self.builder_kwargs)
            PipelineHandle(pipe).schedulers_on_cpu()  # the builder made them on ``device``
        else:
            loader = cast("Callable[..., object]", load_diffusers().DiffusionPipeline.from_pretrained)
            pipe = loader(self.pretrained, **self.pretrained_kwargs)
        handle = _checked(pipe, self)
        handle.to(device)
        return handle

    def load_config_only(self) -> PipelineHandle:
        """The pipeline with its parameters allocated but never initialised, on the CPU: what
        its config says (for the executor's checks), at a fraction of a build's cost."""
        modeling = importlib.import_module("diffusers.models.modeling_utils")
        no_init = cast("Callable[[], contextlib.AbstractContextManager[None]]", modeling.no_init_weights)
        # no_init_weights swaps torch.nn.init's functions for no-ops in the whole process, and
        # transformers keeps those functions as it finds them when it is first imported: first
        # imported under the swap, every transformers model this process builds afterwards --
        # outside it too -- kept the no-ops (a text encoder of uninitialised weights, whose
        # prompts then gave other pixels than the worker's).  So it, and the builder's own
        # imports, are imported before the swap.
        _import_if_installed("transformers.initialization")
        builder = self.resolve_builder() if self.builder is not None else None
        with _NO_INIT, no_init(), torch.device("cpu"):
            if builder is not None:
                pipe = builder(**self.builder_kwargs)
            else:
                pipe = _pipeline_from_configs(str(self.pretrained))
        return _checked(pipe, self)


def _import_if_installed(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        pass


def _checked(pipe: object, source: PipelineSource) -> PipelineHandle:
    if not isinstance(pipe, load_diffusers().DiffusionPipeline):
        raise UsageError(
            f"DiffusersPipelineWorker: {source.builder or source.pretrained!r} gave a {type(pipe).__name__}, "
            "not a diffusers DiffusionPipeline"
        )
    handle = PipelineHandle(pipe)
    handle.quiet()
    return handle


def _pipeline_from_configs(path: str) -> object:
    """A pretrained folder's pipeline from its JSON configs alone: the diffusers components
    (models, schedulers) built from their configs, the others (text encoders, tokenizers)
    left out -- the checks need the transformer's and the VAE's config, not the text encoder."""
    diffusers = load_diffusers()
    try:
        index = cast("Mapping[str, object]", diffusers.DiffusionPipeline.load_config(path))
    except Exception as exc:
        raise UsageError(
            f"DiffusersPipelineWorker: cannot read the pipeline config (model_index.json) of {path!r} "
            f"({type(exc).__name__}: {exc}); pass a local folder (or a hub id already in the cache)"
        ) from exc
    pipe_cls = diffusers_class(str(index["_class_name"]), f"pretrained {path!r}")
    parts: dict[str, object] = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, (list, tuple)) or len(entry) != 2:
            continue
        library, class_name = entry
        if library != "diffusers" or class_name is None:
            parts[name] = None
            continue
        comp_cls = configurable(str(class_name), f"pretrained {path!r} component {name!r}")
        parts[name] = comp_cls.from_config(comp_cls.load_config(path, subfolder=name))
    return pipe_cls(**parts)
