"""The typed edge over ``diffusers``, which is untyped: everything else in this package
reaches a pipeline through ``PipelineHandle``, never through ``Any``.

``diffusers`` (and ``transformers``, which some of its pipelines import) is imported
here, on first use, and nowhere else in ``omni_async``: ``import omni_async`` and
building a ``WorkerSpec`` of this package stay light.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Protocol, cast

import attrs
import torch

from omni_async.core.errors import UsageError

__all__ = ["INSTALL", "PipelineHandle", "load_diffusers"]

#: How to get the ``diffusers`` extra (diffusers==0.42.1 and transformers).  omni_async is on no
#: package index, so ``pip install 'omni_async[diffusers]'`` finds nothing: the extra is
#: installed from a checkout, by path.
INSTALL = (
    "install the diffusers extra from a checkout of omni_async (it is on no package index): "
    "python3 -m pip install -e '.[diffusers]' in the repository's root, or "
    "python3 -m pip install '/path/to/omni_async[diffusers]' from elsewhere (diffusers==0.42.1 and transformers)"
)


def load_diffusers() -> ModuleType:
    """The ``diffusers`` module; ``UsageError`` saying how to install it when it is missing."""
    try:
        return importlib.import_module("diffusers")
    except ImportError as exc:
        raise UsageError(f"omni_async.integrations.diffusers needs diffusers ({exc}); {INSTALL}") from exc


def no_process_lock_for_progress_bars() -> None:
    """Keep tqdm from making its cross-process lock in this process (a worker's): a
    ``multiprocessing.RLock`` is a named semaphore, and a worker leaves by ``os._exit``,
    which skips its cleanup, so every worker that made a progress bar (diffusers makes one
    per call, shown or not) ended with "resource_tracker: There appear to be 1 leaked
    semaphore objects".  A worker shows no bars and shares none with another process;
    its thread lock stays.  A lock already made is left as it is."""
    try:
        std = importlib.import_module("tqdm.std")
    except ImportError:
        return
    lock_class = std.TqdmDefaultWriteLock
    if not hasattr(lock_class, "mp_lock"):
        lock_class.mp_lock = None  # create_mp_lock() makes one only where the attribute is missing


class Configurable(Protocol):
    """A diffusers model or scheduler class: built from a config, its config read from a folder."""

    def from_config(self, config: Mapping[str, object]) -> object: ...

    def load_config(self, path: str, *, subfolder: str) -> Mapping[str, object]: ...


class Stepper(Protocol):
    """A diffusers scheduler, as the step hook wraps it."""

    step: Callable[..., object]


def configurable(name: str, what: str) -> Configurable:
    """A diffusers model or scheduler class by name (``diffusers_class``)."""
    return cast("Configurable", diffusers_class(name, what))


def diffusers_class(name: str, what: str) -> type:
    """``diffusers.<name>`` (a pipeline, model or scheduler class); ``UsageError`` naming it when absent."""
    found = getattr(load_diffusers(), name, None)
    if not isinstance(found, type):
        raise UsageError(f"{what}: diffusers has no class {name!r} (diffusers {load_diffusers().__version__})")
    return found


@attrs.frozen
class PipelineHandle:
    """A ``diffusers.DiffusionPipeline``, reached through typed accessors."""

    pipeline: object

    @property
    def class_name(self) -> str:
        return type(self.pipeline).__name__

    def call_signature(self) -> inspect.Signature:
        """The signature of the pipeline's ``__call__``."""
        return inspect.signature(type(self.pipeline).__call__)

    def call_parameters(self) -> frozenset[str]:
        """The names ``__call__`` takes."""
        return frozenset(self.call_signature().parameters)

    def call_default(self, name: str) -> object | None:
        """The default of ``__call__``'s argument ``name`` (None when it has none)."""
        found = self.call_signature().parameters.get(name)
        if found is None or found.default is inspect.Parameter.empty:
            return None
        return cast("object", found.default)

    def call_source(self) -> str:
        """The source of ``__call__`` ('' when it cannot be read)."""
        return _source_of(type(self.pipeline).__call__)

    def module_source(self) -> str:
        """The source of the module that defines the pipeline's class ('' when it cannot be read)."""
        return _source_of(inspect.getmodule(type(self.pipeline)))

    def class_source(self, name: str) -> str:
        """The source of the pipeline class's attribute ``name`` (a method or property; ''
        when absent or unreadable)."""
        found = inspect.getattr_static(type(self.pipeline), name, None)
        return _source_of(found.fget if isinstance(found, property) else found)

    def __call__(self, **kwargs: object) -> object:
        return cast("Callable[..., object]", self.pipeline)(**kwargs)

    def component(self, name: str) -> object | None:
        """A component by name (``transformer``, ``vae``, ``scheduler``, ``text_encoder``...), or None."""
        components = getattr(self.pipeline, "components", None)
        if isinstance(components, Mapping):
            return cast("object | None", components.get(name))
        return cast("object | None", getattr(self.pipeline, name, None))

    def denoiser_name(self) -> str:
        """The denoiser's component name: ``transformer`` where the pipeline has one, else ``unet``."""
        return "transformer" if self.component("transformer") is not None else "unet"

    def module(self, name: str) -> torch.nn.Module | None:
        found = self.component(name)
        return found if isinstance(found, torch.nn.Module) else None

    def config(self, name: str) -> Mapping[str, object]:
        """The config of component ``name`` ({} when it has none)."""
        found = self.component(name)
        config = getattr(found, "config", None)
        return cast("Mapping[str, object]", config) if isinstance(config, Mapping) else {}

    def pipeline_config(self) -> Mapping[str, object]:
        """The pipeline's own config (its ``__init__`` options: ``force_zeros_for_empty_prompt``...)."""
        config = getattr(self.pipeline, "config", None)
        return cast("Mapping[str, object]", config) if isinstance(config, Mapping) else {}

    def attribute(self, name: str) -> object | None:
        return cast("object | None", getattr(self.pipeline, name, None))

    def to(self, device: torch.device | None = None, *, dtype: torch.dtype | None = None) -> None:
        """Move the pipeline's models (``DiffusionPipeline.to``)."""
        move = getattr(self.pipeline, "to", None)
        if callable(move):
            move(device, dtype=dtype) if device is not None else move(dtype=dtype)

    def schedulers_on_cpu(self) -> list[str]:
        """Make again, from its config and on the CPU, each scheduler whose tables are on
        another device (a builder ran under ``torch.device("cuda")``): diffusers keeps a
        scheduler's tables on the CPU and reads them there (DPMSolver's ``set_timesteps``
        calls ``.numpy()`` on them).  A scheduler is all config, so the new one is the same
        scheduler.  The names of the ones made again."""
        scheduler_type = diffusers_class("SchedulerMixin", "PipelineHandle")
        remade = []
        components = getattr(self.pipeline, "components", None)
        for name, found in components.items() if isinstance(components, Mapping) else ():
            if not isinstance(found, scheduler_type):
                continue
            tables = [v for v in vars(found).values() if isinstance(v, torch.Tensor)]
            if all(t.device.type == "cpu" for t in tables):
                continue
            with torch.device("cpu"):
                fresh = cast("Any", type(found)).from_config(cast("Any", found).config)
            cast("Any", self.pipeline).register_modules(**{name: fresh})
            remade.append(str(name))
        return remade

    def quiet(self) -> None:
        """No progress bars: a worker's log is not a terminal."""
        set_bar = getattr(self.pipeline, "set_progress_bar_config", None)
        if callable(set_bar):
            set_bar(disable=True)

    def slice_vae(self) -> bool:
        """Decode a batch one member at a time (the VAE's own slicing), so each member's pixels
        are those of its own call: a batched convolution on the CPU rounds differently from one
        at batch size 1.  True when the VAE has it."""
        vae = self.component("vae")
        enable = getattr(vae, "enable_slicing", None)
        if not callable(enable):
            return False
        enable()
        return True


def int_or_none(value: object) -> int | None:
    """A config's integer (or the last of a tuple, as ``patch_size`` is for video models)."""
    if isinstance(value, (list, tuple)) and value:
        value = value[-1]
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _source_of(obj: object) -> str:
    """``inspect.getsource(obj)``; '' for None or what has no readable source."""
    if obj is None:
        return ""
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""
