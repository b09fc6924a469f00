"""The engine side: an asyncio engine over any executor (``AsyncDiffusionEngine``), its
scheduler, post-processing off the event loop, metrics, and a synchronous facade
(``DiffusionEngine``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from omni_async.engine.errors import OutputFileGone

if TYPE_CHECKING:
    from omni_async.engine.sinks import OutputFile, OutputFiles, SegmentLease, SegmentTensor

# Loaded on first use (PEP 562): ``import omni_async`` reads ``omni_async.engine.encoders``
# through this package, and must not import torch for it.
_LAZY: dict[str, str] = {
    "OutputFile": "omni_async.engine.sinks",
    "OutputFiles": "omni_async.engine.sinks",
    "SegmentLease": "omni_async.engine.sinks",
    "SegmentTensor": "omni_async.engine.sinks",
}

__all__ = ["OutputFile", "OutputFileGone", "OutputFiles", "SegmentLease", "SegmentTensor"]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omni_async.engine' has no attribute {name!r}")
    value: object = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
