"""``PathStore``: the output store of an executor whose workers ship on an output path of their own.

``WorkerOptions.output_path`` other than ``"omni"`` names an ``OutputPath``
(``omni_async.worker.output_path``): the bench's comparison paths (``"sync"``,
``"reference"``, in ``omni_async.bench``) or any other given by import path.  The worker
packs with it, and this store hands the path what comes back: ``receive`` for an output
a waiter claimed, ``discard`` for one nobody reads; an output the path does not own is
the pool's, handled as ``PoolStore`` does.  An executor picks this store when its
``output_path`` resolves to an ``OutputPath``, so the pool's own path never asks.
"""

from __future__ import annotations

import logging

from omni_async.core.errors import OutputUnpackFailed
from omni_async.core.messages import DiffusionOutput
from omni_async.executor.pool_store import PoolStore
from omni_async.transport.shm import SegmentPool
from omni_async.worker.output_path import OutputPath

__all__ = ["PathStore"]

log = logging.getLogger(__name__)


class PathStore(PoolStore):
    """A ``PoolStore`` that gives the outputs ``path`` owns to ``path`` to read and to free."""

    def __init__(
        self,
        pool: SegmentPool,
        path: OutputPath,
        *,
        copy_outputs: bool,
        lease_timeout: float | None,
        owner: str,
    ) -> None:
        super().__init__(pool, copy_outputs=copy_outputs, lease_timeout=lease_timeout, owner=owner)
        self._path = path

    @property
    def lends_segments(self) -> bool:
        """An output path's segments are its own (made for each output): none to lend."""
        return False

    def receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        if not self._path.owns(packed):
            return super().receive(packed)
        try:
            return self._path.receive(packed)
        except Exception as exc:
            self._discard(packed)
            raise OutputUnpackFailed(packed.async_output_id, packed.request_id, exc) from exc

    def release_packed(self, packed: DiffusionOutput) -> None:
        if self._path.owns(packed):
            self._discard(packed)
        else:
            super().release_packed(packed)

    def give_back(self, packed: DiffusionOutput) -> None:
        if self._path.owns(packed):
            self._discard(packed)
        else:
            super().give_back(packed)

    def _discard(self, packed: DiffusionOutput) -> None:
        try:
            self._path.discard(packed)
        except Exception:
            log.exception("freeing output %s of its output path failed", packed.async_output_id)
