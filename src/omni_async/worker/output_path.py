"""``WorkerOptions.output_path``: how a worker ships its outputs, and the way in for other ways.

``"omni"`` (the default) is the runtime's own path: the packer copies each output into
the executor's segment pool (``omni_async.transport.packing``).  ``build_worker`` wires
it in directly; the name is compared once, when a rank is built, and nothing is looked
up per output.

Any other value names an ``OutputPath``: an object the worker calls to pack every
output instead (on the packer thread in request mode, on the main thread for step
mode's answers), and the executor to read what it packed and to give back what nobody
reads (``executor/path_store.py``).  The value is a registered name (``OUTPUT_PATH_NAMES``)
or an import path ``"package.module:OBJECT"``.  It is resolved when the options are
made, in the engine's process, so that a typo fails there (``InvalidOutputPath``), and
again in every worker process: the string travels, not the object.

The registered names are the comparison paths of ``omni-async bench`` (``"sync"``: the
seed's, ``"reference"``: the reference implementation's), which live in
``omni_async.bench``.  The runtime holds only their import paths: it never imports that
package (a contract in pyproject.toml), and a run on the default path never loads it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from omni_async.core.config import InvalidConfig, given
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput

if TYPE_CHECKING:
    from omni_async.transport.platform import CopyStream, DeviceEvent

__all__ = [
    "OMNI",
    "OUTPUT_PATH_NAMES",
    "REGISTERED_OUTPUT_PATHS",
    "InvalidOutputPath",
    "OutputPath",
    "check_output_path",
    "resolve_output_path",
]

OMNI: Final = "omni"
# Registered names and the objects they stand for.  Import paths, not imports: the
# bench's paths stay out of the runtime's import graph.
REGISTERED_OUTPUT_PATHS: Final[Mapping[str, str]] = MappingProxyType(
    {"sync": "omni_async.bench.paths:SYNC", "reference": "omni_async.bench.paths:REFERENCE"}
)
OUTPUT_PATH_NAMES: Final[tuple[str, ...]] = (OMNI, *REGISTERED_OUTPUT_PATHS)


@runtime_checkable
class OutputPath(Protocol):
    """A way to ship outputs other than the pool's (see the module docstring).

    ``step_mode``: the executor mode the path belongs to (True: step mode, the answer
    carries the output; False: request mode; None: either); an executor built in the
    other mode refuses it before anything starts.  ``pack`` runs in the worker, once per
    output, and returns what travels (``prefix``: the pool's, for any shared memory it
    names, so that shutdown and the sweep of dead executors find it; ``inline_threshold``:
    ``WorkerOptions.inline_threshold``).  ``owns`` says whether an output travelled on
    this path; ``receive`` turns one into the output the engine gets and frees what it
    held (also when it fails); ``discard`` frees what an output nobody reads holds and
    returns how many pieces that was.  Both run in the executor's process, ``discard``
    also in the worker's (an output its send could not deliver).
    """

    @property
    def step_mode(self) -> bool | None: ...

    def pack(
        self,
        output: DiffusionOutput,
        stream: CopyStream,
        event: DeviceEvent | None,
        *,
        prefix: str,
        inline_threshold: int,
    ) -> DiffusionOutput: ...

    def owns(self, packed: DiffusionOutput) -> bool: ...

    def receive(self, packed: DiffusionOutput) -> DiffusionOutput: ...

    def discard(self, packed: DiffusionOutput) -> int: ...


class InvalidOutputPath(UsageError, ValueError):
    """``WorkerOptions.output_path`` names no ``OutputPath``, or one that does not fit the executor's mode."""

    def __init__(self, value: object, problem: str) -> None:
        super().__init__(f"WorkerOptions.output_path={value!r}: {problem}")
        self.value = value


_CHOICES = f"must be one of {list(OUTPUT_PATH_NAMES)} or an import path 'package.module:OBJECT' of an OutputPath"


def resolve_output_path(value: object) -> OutputPath | None:
    """The ``OutputPath`` that ``value`` names (None: ``"omni"``, the pool's own path);
    ``InvalidConfig`` when it is not a string, ``InvalidOutputPath`` when it names none."""
    if not isinstance(value, str):
        raise InvalidConfig("WorkerOptions.output_path", f"{_CHOICES}, got {given(value)}")
    if value == OMNI:
        return None
    target = REGISTERED_OUTPUT_PATHS.get(value, value)
    module_name, colon, attr = target.partition(":")
    if not colon or not module_name or not attr:
        raise InvalidOutputPath(value, _CHOICES)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001  # any failure to import (a typo, a bad name, the module's own error)
        raise InvalidOutputPath(value, f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    obj = getattr(module, attr, None)
    # A class has the methods too: the path is an instance of one.
    if isinstance(obj, type) or not isinstance(obj, OutputPath):
        raise InvalidOutputPath(
            value,
            f"{target} is {given(obj)}, not an OutputPath (step_mode, pack, owns, receive, discard: "
            "omni_async.worker.output_path)",
        )
    if obj.step_mode not in (True, False, None):
        raise InvalidOutputPath(value, f"its step_mode must be True, False or None, got {given(obj.step_mode)}")
    return obj


def check_output_path(value: object, *, step_mode: bool | None = None) -> OutputPath | None:
    """``resolve_output_path(value)``, and with ``step_mode`` given (the executor's mode),
    ``InvalidOutputPath`` when the path belongs to the other one."""
    path = resolve_output_path(value)
    needs = None if path is None else path.step_mode
    if step_mode is not None and needs is not None and needs != step_mode:
        mode = "step mode (step_mode=True)" if needs else "request mode (step_mode=False)"
        raise InvalidOutputPath(value, f"this path ships outputs in {mode}; build the executor in that mode")
    return path
