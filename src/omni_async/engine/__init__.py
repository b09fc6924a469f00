"""The engine side: an asyncio engine over any executor (``AsyncDiffusionEngine``), its
scheduler, post-processing off the event loop, encoded outputs (images, and video encoded
while it decodes: ``generate_video``, ``VideoBytes``), output sinks (``OutputFiles``,
``SegmentLease``), metrics, and a synchronous facade (``DiffusionEngine``).  The names
below load on first use (PEP 562): ``import omni_async`` imports this package without
torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_async.core.lazy import lazy_exports
from omni_async.engine.errors import OutputFileGone

if TYPE_CHECKING:
    from omni_async.engine.config import EngineConfig
    from omni_async.engine.encoders import EncodedOutput, VideoBytes
    from omni_async.engine.engine import AsyncDiffusionEngine
    from omni_async.engine.errors import EncodeFailed
    from omni_async.engine.metrics import GenerationResult
    from omni_async.engine.sinks import OutputFile, OutputFiles, SegmentLease, SegmentTensor
    from omni_async.engine.sync import DiffusionEngine

_LAZY: dict[str, str] = {
    "AsyncDiffusionEngine": "omni_async.engine.engine",
    "DiffusionEngine": "omni_async.engine.sync",
    "EngineConfig": "omni_async.engine.config",
    "EncodedOutput": "omni_async.engine.encoders",
    "VideoBytes": "omni_async.engine.encoders",
    "EncodeFailed": "omni_async.engine.errors",
    "GenerationResult": "omni_async.engine.metrics",
    "OutputFile": "omni_async.engine.sinks",
    "OutputFiles": "omni_async.engine.sinks",
    "SegmentLease": "omni_async.engine.sinks",
    "SegmentTensor": "omni_async.engine.sinks",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = [
    "AsyncDiffusionEngine",
    "DiffusionEngine",
    "EncodeFailed",
    "EncodedOutput",
    "EngineConfig",
    "GenerationResult",
    "OutputFile",
    "OutputFileGone",
    "OutputFiles",
    "SegmentLease",
    "SegmentTensor",
    "VideoBytes",
]
