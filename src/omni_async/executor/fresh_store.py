"""``FreshStore``: the output store of the bench's comparison paths.

``omni-async bench`` (and ``omni-async demo``'s seed run) measures our output path
against two baselines, ``WorkerOptions.output_path="sync"`` and ``"reference"``
(``omni_async.worker.baselines``, where the worker packs them): each output travels in
shared-memory segments made for it alone, named under the pool's prefix.  This store
reads such an output into owned tensors and unlinks its segments (as the seed's
consumer did), and unlinks those of an output for nobody unread; anything else is an
output of the pool, handled as ``PoolStore`` does.  An executor picks it when its
``output_path`` names a baseline, so the pool's own path never looks for fresh payloads.
"""

from __future__ import annotations

import logging

from omni_async.core.errors import OutputUnpackFailed
from omni_async.core.messages import DiffusionOutput
from omni_async.executor.pool_store import PoolStore
from omni_async.worker.baselines import discard_fresh_output, is_fresh, receive_fresh_output

__all__ = ["FreshStore"]

log = logging.getLogger(__name__)


class FreshStore(PoolStore):
    """A ``PoolStore`` that also reads and unlinks the fresh segments of a baseline path."""

    def receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        if not is_fresh(packed):
            return super().receive(packed)
        try:
            return receive_fresh_output(packed)
        except Exception as exc:
            self._discard(packed)
            raise OutputUnpackFailed(packed.async_output_id, packed.request_id, exc) from exc

    def release_packed(self, packed: DiffusionOutput) -> None:
        if is_fresh(packed):
            self._discard(packed)
        else:
            super().release_packed(packed)

    def give_back(self, packed: DiffusionOutput) -> None:
        if is_fresh(packed):
            self._discard(packed)
        else:
            super().give_back(packed)

    @staticmethod
    def _discard(packed: DiffusionOutput) -> None:
        try:
            discard_fresh_output(packed)
        except Exception:
            log.exception("unlinking the fresh segments of %s failed", packed.async_output_id)
