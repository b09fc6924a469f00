"""Names a package exports without importing them until first use (PEP 562).

``omni_async``, ``omni_async.engine``, ``omni_async.worker`` and ``omni_async.errors``
export names whose modules pull in heavy dependencies (torch's CUDA runtime, the
engine's threads): ``import omni_async`` stays light, and each name is imported on its
first use, then kept in the package's namespace.  Type checkers see the names through
the package's ``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, table: Mapping[str, str], namespace: MutableMapping[str, object]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The package's ``__getattr__`` and ``__dir__``: ``table`` maps each lazy name to the
    module that defines it; ``namespace`` is the package's ``globals()``."""

    def get(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value: object = getattr(importlib.import_module(module), name)
        namespace[name] = value  # the next use finds it without coming here
        return value

    def names() -> list[str]:
        return sorted({*namespace, *table})

    return get, names
