"""worker layer.

The model-facing names: ``cancel_requested`` and ``raise_if_cancelled`` (cooperative
cancellation between denoising steps, ``omni_async.worker.cancel``).
"""

from omni_async.worker.cancel import cancel_requested, raise_if_cancelled

__all__ = ["cancel_requested", "raise_if_cancelled"]
