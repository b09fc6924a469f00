"""worker layer.

The model-facing names: ``cancel_requested`` and ``raise_if_cancelled`` (cooperative
cancellation between denoising steps, ``omni_async.worker.cancel``); ``emit_chunk`` and
``streaming_requested`` (intermediate outputs of a streaming request,
``omni_async.worker.stream``).
"""

from omni_async.worker.cancel import cancel_requested, raise_if_cancelled
from omni_async.worker.stream import emit_chunk, streaming_requested

__all__ = ["cancel_requested", "emit_chunk", "raise_if_cancelled", "streaming_requested"]
