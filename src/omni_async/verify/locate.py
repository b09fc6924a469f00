"""Where the TLA+ modules are: shipped inside the package, or in a source checkout.

A wheel carries ``tla/`` as package data (``omni_async/verify/tla``, copied there by
``setup.py``'s build step); an editable install or a bare checkout reads the
repository's ``tla/``.  ``OMNI_ASYNC_TLA_DIR`` overrides both.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from pathlib import Path

__all__ = ["TlaModulesMissing", "source_root", "tla_dir"]

_MARKER = "AsyncOutput.tla"
_ENV = "OMNI_ASYNC_TLA_DIR"


class TlaModulesMissing(FileNotFoundError):
    """The TLA+ modules cannot be found: neither packaged, nor in a checkout, nor at $OMNI_ASYNC_TLA_DIR."""


def _checkout_root() -> Path | None:
    # src/omni_async/verify/locate.py -> the repository root, when run from a checkout.
    root = Path(__file__).resolve().parents[3]
    return root if (root / "tla" / _MARKER).is_file() and (root / "pyproject.toml").is_file() else None


@functools.cache
def tla_dir() -> Path:
    """The folder holding ``AsyncOutput.tla``, its models (``*.cfg``, ``buggy/``) and ``README.md``."""
    env = os.environ.get(_ENV)
    if env:
        if not (Path(env) / _MARKER).is_file():
            raise TlaModulesMissing(f"${_ENV} is {env!r}, which holds no {_MARKER}")
        return Path(env)
    packaged = Path(str(importlib.resources.files("omni_async.verify") / "tla"))
    if (packaged / _MARKER).is_file():
        return packaged
    root = _checkout_root()
    if root is not None:
        return root / "tla"
    raise TlaModulesMissing(
        f"the TLA+ modules are not installed ({packaged} has no {_MARKER}) and this is not a source "
        f"checkout: reinstall omni_async from a wheel built by `pip install .`, or set ${_ENV} to a tla/ folder"
    )


def source_root() -> Path:
    """The repository root; only a source checkout has one (``tla_gen`` writes into it)."""
    root = _checkout_root()
    if root is None:
        raise TlaModulesMissing(
            "regenerating the TLA+ table needs a source checkout of omni_async (with tla/ and spec/); "
            "pass --root to point at one"
        )
    return root
